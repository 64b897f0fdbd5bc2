"""Each fix of overlay/net/patches/dcutr.py to py-libp2p 0.8.1's DCUtR, pinned (the hole punch
they make work end to end runs in tests/system/test_holepunch_netns.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from libp2p.network import swarm as swarm_mod
from libp2p.relay.circuit_v2 import dcutr as dcutr_mod
from multiaddr import Multiaddr

from p2pnode.identity import NodeKey
from p2pnode.overlay.net.config import OverlayConfig
from p2pnode.overlay.net.node import open_overlay_node
from p2pnode.overlay.net.patches import dcutr


def test_install_replaces_source_choice_and_per_peer_trim_once() -> None:
    dcutr.install()
    trim = swarm_mod.Swarm._trim_connections
    assert dcutr_mod._local_tcp_listen_addrs is dcutr._bound_tcp_listen_addrs
    assert hasattr(trim, "__wrapped__")
    dcutr.install()
    assert swarm_mod.Swarm._trim_connections is trim  # not wrapped twice


async def test_hole_punch_source_is_the_bound_listen_port_not_the_first_advertised() -> None:
    """0.8.1 binds the first ADVERTISED address; an announced public address (on no
    interface) makes that bind fail and the dial leave from an ephemeral port."""
    dcutr.install()  # as a node's hole puncher does when it starts
    announced = "/ip4/203.0.113.7/tcp/4101"
    config = OverlayConfig(
        key=NodeKey.generate(), listen_addrs=["/ip4/0.0.0.0/tcp/0"], announce=[announced]
    )
    async with open_overlay_node(config) as node:
        assert node.addrs[0].startswith(announced)  # what 0.8.1 would have bound
        bound = dcutr_mod._local_tcp_listen_addrs(node.host)
        ports = {str(a).split("/tcp/")[1].split("/")[0] for a in node.host.get_transport_addrs()}
        assert [(f, ip) for f, ip, _ in bound] == [(4, "0.0.0.0")]
        assert str(bound[0][2]) in ports and bound[0][2] != 4101


def test_offered_addresses_on_our_own_networks_are_never_dialed() -> None:
    """Behind every home router the host is 192.168.1.2: the peer's LAN address is ours, and
    dialing it from our listen port is a TCP self-connect."""
    offered = [
        Multiaddr("/ip4/192.168.1.2/tcp/4101"),  # one of our own interfaces
        Multiaddr("/ip4/127.0.0.1/tcp/4101"),
        Multiaddr("/ip4/0.0.0.0/tcp/4101"),
        Multiaddr("/ip4/10.77.0.4/tcp/4101/p2p-circuit"),
        Multiaddr("/ip4/10.77.0.4/tcp/4101"),  # the peer's router: the one to punch
        Multiaddr("/ip4/192.168.7.9/tcp/4101"),  # another private network: may be a LAN peer
    ]
    kept = dcutr.usable_punch_addrs(offered, own_ips={"192.168.1.2"})
    assert [str(a) for a in kept] == ["/ip4/10.77.0.4/tcp/4101", "/ip4/192.168.7.9/tcp/4101"]


@dataclass
class _Stream:
    protocol: str

    def get_protocol(self) -> str:
        return self.protocol


@dataclass(eq=False)
class _Link:
    """A connection as the trim sees it: relayed or not, streams open on it."""

    relayed: bool
    streams: list[object] = field(default_factory=list)

    def get_transport_addresses(self) -> list[Multiaddr]:
        return []

    def get_streams(self) -> list[object]:
        return self.streams


def test_per_peer_trim_keeps_the_direct_connection_and_lets_a_busy_circuit_drain() -> None:
    """0.8.1 trims the older, idler one of a peer's two connections: the relayed one with its
    streams in flight, or later the new direct one."""
    relayed = lambda c: c.relayed  # noqa: E731
    busy = dcutr.in_flight
    request = _Stream("/p2pnode/forward/1")
    direct, idle_circuit, busy_circuit = _Link(False), _Link(True), _Link(True, [request])
    gossip_only = _Link(True, [_Stream("/meshsub/1.2.0")])  # pubsub reopens it elsewhere
    assert dcutr.conns_to_close([idle_circuit, direct], relayed, busy) == [idle_circuit]
    assert dcutr.conns_to_close([busy_circuit, direct], relayed, busy) == []  # drains first
    assert dcutr.conns_to_close([gossip_only, direct], relayed, busy) == [gossip_only]
    assert dcutr.conns_to_close([direct, _Link(False)], relayed, busy) is None  # libp2p's rule
    assert dcutr.conns_to_close([idle_circuit, busy_circuit], relayed, busy) is None
