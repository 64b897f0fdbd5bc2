"""py-libp2p 0.8.1's DCUtR (``libp2p/relay/circuit_v2/dcutr.py``) made to punch holes here.

Its machinery is right: ``TCPTransport.dial_with_source`` binds the outbound socket to the
listen port (the listeners carry SO_REUSEPORT), and ``DCUtRProtocol`` exchanges addresses over
the relayed connection and dials both ways at once (TCP simultaneous open, the initiator
upgrading as responder). What kept two NAT'd overlay nodes relayed:

1. The source port. ``_local_tcp_listen_addrs`` takes the first of ``host.get_addrs()``, the
   ADVERTISED addresses (ours come from ``overlay/net/addrs.py`` and may start with an
   announced or confirmed public address that is on no interface): binding it fails and the
   dial silently falls back to an ephemeral port, which no NAT mapping matches.
   ``_bound_tcp_listen_addrs`` answers with the addresses the listeners are bound to.
2. The addresses offered. Without an identify observation ``_get_observed_addrs`` offers the
   listen addresses, i.e. ``192.168.1.2:4101`` behind every home router; the peer then dials
   that from ITS own ``192.168.1.2:4101``, a TCP self-connect. ``OverlayDCUtR`` offers our
   public IP as dial-back servers saw it (``public_ips``) with our bound ports, and drops from
   the addresses it receives every IP of our own interfaces, loopback and unspecified ones.
3. Initiation. Its auto-drive loop makes BOTH ends initiate every 2 s, up to 3 times each,
   then never again; concurrent sessions cross. Here one side (``overlay/net/holepunch.py``)
   initiates, with backoff and without the lifetime cap.
4. Migration. After a punch it closes the relayed connection 60 s later whatever runs on it,
   and the swarm's per-peer trim (``max_connections_per_peer=1``) closes whichever of the two
   connections is older and idlest, streams and all: the relayed one at once, or later the
   new direct one. ``_trim_preferring_direct`` keeps a peer's direct connection and closes
   only idle relayed ones; a busy relayed one drains and ``holepunch.py`` closes it when idle.
5. The testbed's routers answered a stray SYN with a RST, which no home router does (that
   one is ``testnet/netns/namespaces.py``'s business; it is why the simultaneous open failed
   even with 1-4 fixed).

On a libp2p upgrade, recheck: ``dcutr._perform_hole_punch`` still calls the module-level
``_local_tcp_listen_addrs`` for its source and still merges peerstore addresses (filtered by
``overlay/net/addrs.py``); ``DCUtRProtocol`` still has ``_auto_drive_loop``,
``_get_observed_addrs``, ``_decode_observed_addrs``, ``_schedule_relay_close``,
``_hole_punch_attempts``; ``Swarm._trim_connections(peer_id)`` is still the per-peer trim;
then run ``tests/overlay/test_dcutr_patch.py`` and ``tests/system/test_holepunch_netns.py``.

Contract: ``install()`` (idempotent, process-wide) replaces the two module-level functions;
``OverlayDCUtR(host, public_ips=callable)`` is the service; its ``outcomes`` maps a peer id
to the last result of a punch this side took part in (``True`` or the reason it failed).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from libp2p.network import swarm as _swarm_mod
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2 import dcutr as _dcutr_mod
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from multiaddr import Multiaddr

from p2pnode.overlay.net.addrs import interface_ips, ip_port
from p2pnode.overlay.net.liveness import PING_PROTOCOL

__all__ = [
    "OverlayDCUtR",
    "conns_to_close",
    "in_flight",
    "install",
    "is_relayed_conn",
    "usable_punch_addrs",
]

logger = logging.getLogger(__name__)

_installed = False


class _Conn(Protocol):
    def get_transport_addresses(self) -> list[Multiaddr]: ...

    def get_streams(self) -> Sequence[Any]: ...


def is_relayed_conn(conn: Any) -> bool:
    """A circuit-relay connection (its secured session says so, or its addresses do)."""
    secured = getattr(getattr(conn, "muxed_conn", None), "secured_conn", None)
    kind = getattr(secured, "get_connection_type", None)
    if kind is not None:
        t = kind()
        if str(getattr(t, "name", t)).upper() == "RELAYED":
            return True
    try:
        return any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses())
    except Exception:
        return False


def conns_to_close(
    conns: Sequence[_Conn], relayed: Callable[[_Conn], bool], busy: Callable[[_Conn], object]
) -> list[_Conn] | None:
    """A peer's connections above the per-peer limit: which to close now. None: not a
    direct-and-relayed pair, libp2p's own rule applies. Else the idle relayed ones (a busy
    relayed one drains first); never a direct one."""
    direct = [c for c in conns if not relayed(c)]
    circuits = [c for c in conns if relayed(c)]
    if not direct or not circuits:
        return None
    return [c for c in circuits if not busy(c)]


# Streams that end only with their connection, and that their owners reopen on the peer's
# remaining one: gossipsub's, and our liveness's ping stream (overlay/net/liveness.py).
LONG_LIVED = ("/meshsub/", "/floodsub/", PING_PROTOCOL)


def in_flight(conn: Any) -> int:
    """Streams on a connection that would be lost with it: all but the ``LONG_LIVED`` ones."""
    count = 0
    for stream in conn.get_streams():
        try:
            protocol = str(stream.get_protocol() or "")
        except Exception:
            protocol = ""
        count += not protocol.startswith(LONG_LIVED)
    return count


def _bound_tcp_listen_addrs(host: Any) -> list[tuple[int, str, int]]:
    """(family, ip, port) of the TCP listeners as bound (0.0.0.0 included): the source of a
    hole-punch dial must be a port our listener shares, on an address we have."""
    out: list[tuple[int, str, int]] = []
    try:
        addrs = host.get_transport_addrs()
    except Exception:
        addrs = []
    for addr in addrs:
        if "/p2p-circuit" in str(addr):
            continue
        parsed = ip_port(addr)
        if parsed is not None and "/tcp/" in str(addr):
            ip, port = parsed
            out.append((6 if ":" in ip else 4, ip, port))
    return out


def _trim_preferring_direct(original: Callable[[Any, ID], None]) -> Callable[[Any, ID], None]:
    def trim(self: Any, peer_id: ID) -> None:
        conns = self.connections.get(peer_id, [])
        if len(conns) <= self.connection_config.max_connections_per_peer:
            return
        close = conns_to_close(conns, is_relayed_conn, in_flight)
        if close is None:
            original(self, peer_id)
            return
        for conn in close:
            self.cleanup_connection_health(peer_id, conn)
            self.manager.run_task(self._close_connection_async, conn)
        gone = {id(c) for c in close}
        self.connections[peer_id] = [c for c in conns if id(c) not in gone]

    trim.__wrapped__ = original  # type: ignore[attr-defined]
    return trim


def install() -> None:
    """Replace 0.8.1's source-address choice and per-peer trim (module doc, 1 and 4)."""
    global _installed
    if _installed:
        return
    _dcutr_mod._local_tcp_listen_addrs = _bound_tcp_listen_addrs
    swarm_cls = _swarm_mod.Swarm
    swarm_cls._trim_connections = _trim_preferring_direct(swarm_cls._trim_connections)  # type: ignore[method-assign]
    _installed = True


def usable_punch_addrs(addrs: Sequence[Multiaddr], own_ips: set[str]) -> list[Multiaddr]:
    """Of the addresses a peer offered: TCP/UDP ones on an IP that is not ours, not loopback,
    not unspecified, not a circuit (module doc, 2)."""
    out = []
    for addr in addrs:
        parsed = ip_port(addr)
        if parsed is None or "/p2p-circuit" in str(addr):
            continue
        ip = ipaddress.ip_address(parsed[0])
        if ip.is_loopback or ip.is_unspecified or str(ip) in own_ips:
            continue
        out.append(addr)
    return out


class OverlayDCUtR(DCUtRProtocol):
    """DCUtR with the fixes of the module doc; initiation is the caller's (no auto-drive)."""

    def __init__(self, host: Any, public_ips: Callable[[], Sequence[str]], **kwargs: Any):
        install()
        super().__init__(host, **kwargs)
        self._public_ips = public_ips
        self.outcomes: dict[str, bool | str] = {}
        # called with the peer id as soon as a punch verified a direct connection
        self.on_punched: Callable[[str], None] | None = None

    async def _auto_drive_loop(self) -> None:
        return None  # one side initiates, with backoff: overlay/net/holepunch.py

    def _schedule_relay_close(self, peer_id: ID) -> None:
        return None  # the relayed connection drains, then closes (holepunch.py)

    def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list[Multiaddr]:
        own = {str(ip) for ip, _net in interface_ips()}
        return usable_punch_addrs(super()._decode_observed_addrs(addr_bytes), own)

    async def _get_observed_addrs(self) -> list[bytes]:
        ports = [port for family, _ip, port in _bound_tcp_listen_addrs(self.host) if family == 4]
        predicted: list[str] = []
        for ip in self._public_ips():
            if ":" in ip:
                continue
            predicted += [f"/ip4/{ip}/tcp/{port}" for port in ports]
        if not predicted:
            return await super()._get_observed_addrs()
        own = [a for a in await super()._get_observed_addrs()]
        return [Multiaddr(a).to_bytes() for a in dict.fromkeys(predicted)] + own

    async def _perform_hole_punch(
        self, peer_id: ID, addrs: list[Multiaddr], as_responder: bool = False
    ) -> bool:
        pid = peer_id.to_base58()
        if not addrs:
            self.outcomes[pid] = (
                "the peer offered no address outside our own networks "
                "(its public IP not yet seen by a dial-back)"
            )
            return False
        ok = await super()._perform_hole_punch(peer_id, addrs, as_responder)
        if ok and self.on_punched is not None:
            self.outcomes[pid] = True
            self.on_punched(pid)
        self.outcomes[pid] = (
            True
            if ok
            else (
                f"no simultaneous open at {', '.join(dict.fromkeys(map(str, addrs[:3])))} "
                "in 3 rounds: "
                "a NAT on the path maps each destination to another port "
                "(port-randomizing or symmetric)"
            )
        )
        return ok
