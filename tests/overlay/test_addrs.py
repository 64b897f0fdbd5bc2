"""What a node advertises and dials (overlay/net/addrs.py), invites, and the network check."""

from __future__ import annotations

import ipaddress

import pytest
import trio
from multiaddr import Multiaddr

from p2pnode.bootstrap.invite import InviteError, make_invite, parse_invite
from p2pnode.identity import NodeKey
from p2pnode.overlay.net.addrs import AddressBook, classify, dial_order, interface_ips
from p2pnode.overlay.net.hello import (
    MAX_REFERRALS,
    Hello,
    NetworkMismatch,
    check_network_id,
    mismatch,
)
from p2pnode.overlay.net.node import VERSION, OverlayConfig, open_overlay_node
from p2pnode.overlay.wire import SchemaError, to_wire

LAN = [
    (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_network("127.0.0.0/8")),
    (ipaddress.ip_address("192.168.1.7"), ipaddress.ip_network("192.168.1.0/24")),
    (ipaddress.ip_address("10.0.0.5"), ipaddress.ip_network("10.0.0.0/8")),
]
PEER = "12D3KooWLDSqyhV1aS8jicrHXtfHtVuynj42Y1Jpp7FHtpAN2mnH"


def test_unspecified_listen_address_becomes_the_interface_addresses():
    book = AddressBook(interfaces=LAN)
    out = [str(a) for a in book.advertise([Multiaddr("/ip4/0.0.0.0/tcp/4101")])]
    assert out == ["/ip4/192.168.1.7/tcp/4101", "/ip4/10.0.0.5/tcp/4101"]  # no loopback


def test_loopback_only_when_there_is_nothing_else_or_it_was_asked_for():
    lone = AddressBook(interfaces=LAN[:1])
    assert [str(a) for a in lone.advertise([Multiaddr("/ip4/0.0.0.0/tcp/1")])] == [
        "/ip4/127.0.0.1/tcp/1"
    ]
    book = AddressBook(interfaces=LAN)
    assert [str(a) for a in book.advertise([Multiaddr("/ip4/127.0.0.1/tcp/9")])] == [
        "/ip4/127.0.0.1/tcp/9"
    ]


def test_announce_and_confirmed_addresses_come_first_and_observed_ones_wait_for_a_verdict():
    book = AddressBook(announce=[f"/ip4/203.0.113.9/tcp/4101/p2p/{PEER}"], interfaces=LAN)
    book.confirm("/ip4/198.51.100.2/tcp/4101")
    book.confirm("/ip4/0.0.0.0/tcp/4101")  # never: unspecified
    observed = Multiaddr("/ip4/198.51.100.77/tcp/55555")  # not one of our interfaces
    out = [str(a) for a in book.advertise([Multiaddr("/ip4/0.0.0.0/tcp/4101"), observed])]
    assert out[:2] == ["/ip4/203.0.113.9/tcp/4101", "/ip4/198.51.100.2/tcp/4101"]
    assert str(observed) in out
    book.reachability = "private"  # a dial-back showed we cannot be reached at observed ones
    assert str(observed) not in [str(a) for a in book.advertise([observed])]


def test_dial_order_drops_unspecified_own_and_circuit_addresses_and_ranks_the_rest():
    own = ["/ip4/192.168.1.2/tcp/4101"]  # a NAT'd twin has the same private address
    addrs = [
        Multiaddr(a)
        for a in (
            "/ip4/0.0.0.0/tcp/4101",
            "/ip4/192.168.1.2/tcp/4101",
            "/ip4/127.0.0.1/tcp/4102",
            "/ip4/8.8.8.8/tcp/4101",
            f"/ip4/8.8.4.4/tcp/4101/p2p/{PEER}/p2p-circuit",
        )
    ]
    assert [str(a) for a in dial_order(addrs, own)] == [
        "/ip4/8.8.8.8/tcp/4101",
        "/ip4/127.0.0.1/tcp/4102",
    ]
    assert classify("/ip4/0.0.0.0/tcp/1") == "unspecified"
    assert classify("/ip6/::1/tcp/1") == "loopback"
    assert classify("/ip4/10.1.2.3/tcp/1") == "private"
    assert classify("/ip4/8.8.8.8/tcp/1") == "public"
    assert classify(f"/ip4/8.8.8.8/tcp/1/p2p/{PEER}/p2p-circuit") == "circuit"
    assert any(ip.is_loopback for ip, _ in interface_ips())  # this machine's real table


def test_invite_round_trip_and_clear_errors():
    addrs = [f"/ip4/10.77.0.2/tcp/4101/p2p/{PEER}"]
    invite = make_invite("main", VERSION, addrs)
    parsed = parse_invite(invite)
    assert parsed.network == "main" and list(parsed.bootstrap) == addrs
    with pytest.raises(InviteError, match="cut short"):
        parse_invite(invite[:-7])
    with pytest.raises(InviteError, match="starts with"):
        parse_invite("hello")
    with pytest.raises(InviteError, match="protocol 'p2pnode/9'"):
        parse_invite(make_invite("main", "p2pnode/9", addrs))
    with pytest.raises(InviteError, match="no address"):
        make_invite("main", VERSION, ["/ip4/10.77.0.2/tcp/4101"])
    with pytest.raises(ValueError, match="network id"):
        check_network_id("Main Net")


def test_mismatch_names_what_differs():
    ours = Hello(network="main", version=VERSION)
    assert mismatch(ours, Hello(network="main", version=VERSION)) is None
    assert "network 'lab'" in mismatch(ours, Hello(network="lab", version=VERSION))
    assert "protocol 'p2pnode/9'" in mismatch(ours, Hello(network="main", version="p2pnode/9"))


async def test_a_node_of_another_network_is_refused_with_a_message_naming_both():
    async with open_overlay_node(OverlayConfig(key=NodeKey.generate())) as main:
        config = OverlayConfig(key=NodeKey.generate(), network="lab", bootstrap=main.addrs)
        with pytest.raises(NetworkMismatch, match="network 'main', this node to 'lab'"):
            async with open_overlay_node(config):
                pass
        with trio.fail_after(10):
            # the refusal and the disconnect run in main's own tasks
            while not main.refused or main.host.get_connected_peers():  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert "network 'lab'" in next(iter(main.refused.values()))


def test_a_hello_names_at_most_a_few_peers():
    addrs = tuple(f"/ip4/10.0.0.{i}/tcp/4001/p2p/{PEER}" for i in range(MAX_REFERRALS + 1))
    to_wire(Hello(network="main", version=VERSION, peers=addrs[:MAX_REFERRALS]))
    with pytest.raises(SchemaError, match="over the maximum"):
        to_wire(Hello(network="main", version=VERSION, peers=addrs))


async def test_a_joiner_learns_peers_from_its_bootstraps_hello_answer():
    """A joiner's first answer names peers to dial: a DHT lookup at a busy bootstrap is one
    more negotiated stream to it, and on starved cores many were never answered."""
    async with (
        open_overlay_node(OverlayConfig(key=NodeKey.generate())) as boot,
        open_overlay_node(OverlayConfig(key=NodeKey.generate(), bootstrap=boot.addrs)) as b,
    ):
        with trio.fail_after(15):  # the bootstrap needs b's signed record to name it
            while (entry := boot.peers.get(b.peer_id)) is None or entry.record is None:  # noqa: ASYNC110
                await trio.sleep(0.05)
        config = OverlayConfig(key=NodeKey.generate(), bootstrap=boot.addrs)
        async with open_overlay_node(config) as c:
            with trio.fail_after(10):
                while not c.counters["referrals_received"]:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            assert c.discovery.referred_peers() == [b.peer_id]  # never c itself
            with trio.fail_after(15):
                while not c.peers.is_up(b.peer_id):  # noqa: ASYNC110
                    await trio.sleep(0.05)


async def test_announced_address_is_in_the_signed_record_others_read():
    announce = "/ip4/203.0.113.7/tcp/4101"
    async with (
        open_overlay_node(OverlayConfig(key=NodeKey.generate(), announce=[announce])) as a,
        open_overlay_node(OverlayConfig(key=NodeKey.generate(), bootstrap=a.addrs[-1:])) as b,
    ):
        await a.wait_announced()
        with trio.fail_after(10):
            record = await b.get_node_record(a.peer_id)
        assert record is not None and f"{announce}/p2p/{a.peer_id}" in record.addrs
