"""Dial-backs (overlay/net/reachability.py) and who a relay serves (overlay/net/relay.py), on loopback.

The NAT'd side (a dial-back that fails, relays found without a flag) runs across real NAT
routers in tests/system/test_swarm_netns.py; here: the server's rules and a verdict of "public".
"""

from __future__ import annotations

import socket
from functools import partial

import trio

from p2pnode.identity import NodeKey
from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
from p2pnode.overlay.net.reachability import ReachabilityService, _dial_targets, probe_listener
from p2pnode.overlay.net.relay import open_relay


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_dial_back_targets_are_on_the_observed_ip_only():
    asked = (
        "/ip4/192.168.1.2/tcp/4101",  # a private address: not the one we saw
        "/ip4/198.51.100.9/tcp/4101",  # a third party: never dialed (no amplification)
        "/ip4/203.0.113.5/tcp/5000",
        "not a multiaddr",
    )
    targets = _dial_targets(asked, observed="203.0.113.5")
    assert {(ip, port) for _, ip, port in targets} == {
        ("203.0.113.5", 5000),
        ("203.0.113.5", 4101),  # the observed IP with a requested port (a port forward)
    }


async def test_probe_tells_a_libp2p_listener_from_a_closed_port():
    async with open_overlay_node(OverlayConfig(key=NodeKey.generate())) as node:
        port = int(node.addrs[0].split("/tcp/")[1].split("/")[0])
        assert await probe_listener("127.0.0.1", port)
        assert not await probe_listener("127.0.0.1", _closed_port())


async def test_a_listener_that_accepts_but_greets_late_counts_as_reached():
    """The kernel accepts for a starved process; a NAT without a mapping never completes
    the TCP handshake, and another service greets otherwise or hangs up."""

    async def serve(stream: trio.SocketStream, reply: bytes | None) -> None:
        async with stream:
            if reply is None:
                await trio.sleep(5)  # silent: a process too starved to greet in time
            else:
                await stream.send_all(reply)  # then closes

    async with trio.open_nursery() as nursery:
        ports = {}
        for name, reply in (
            ("silent", None),
            ("http", b"HTTP/1.1 400 Bad Request\r\n"),
            ("closes", b""),
        ):
            listeners = await nursery.start(
                partial(trio.serve_tcp, partial(serve, reply=reply), 0, host="127.0.0.1")
            )
            ports[name] = listeners[0].socket.getsockname()[1]
        assert await probe_listener("127.0.0.1", ports["silent"], limit_s=0.1)
        assert not await probe_listener("127.0.0.1", ports["http"], limit_s=0.1)
        assert not await probe_listener("127.0.0.1", ports["closes"], limit_s=0.1)
        nursery.cancel_scope.cancel()


async def test_a_node_a_peer_can_dial_back_is_public_with_that_address_confirmed():
    async with (
        open_overlay_node(OverlayConfig(key=NodeKey.generate())) as server,
        open_overlay_node(OverlayConfig(key=NodeKey.generate(), bootstrap=server.addrs)) as node,
    ):
        ReachabilityService(server)
        service = ReachabilityService(node)
        changes: list[str] = []

        async def record(verdict: str) -> None:
            changes.append(verdict)

        service.on_change.append(record)
        with trio.fail_after(20):
            assert await service.check_once() == "public"
        assert changes == ["public"]
        assert node.address_book.reachability == "public"
        mine = node.addrs[0].split("/p2p/")[0]
        assert mine in service.status()["confirmed"]
        assert service.status()["observed_ips"] == ["127.0.0.1"]


async def test_a_relay_serves_members_of_the_overlay_only():
    async with (
        open_overlay_node(OverlayConfig(key=NodeKey.generate())) as r,
        open_relay(r, hop="auto") as relay,
        open_overlay_node(OverlayConfig(key=NodeKey.generate(), bootstrap=r.addrs)) as member,
    ):
        await member.wait_announced()
        # "auto" relays only once a dial-back showed the relay reachable
        assert "does not relay" in (await relay.admit(member.peer_id, "relay_reserve") or "")
        r.address_book.reachability = "public"
        with trio.fail_after(20):
            while (reason := await relay.admit(member.peer_id, "relay_reserve")) is not None:
                assert "no signed node record" in reason
                await trio.sleep(0.2)
        stranger = NodeKey.generate().peer_id  # never joined: no record anywhere
        assert "members only" in (await relay.admit(stranger, "relay_reserve") or "")
        refusals = [await relay.admit(member.peer_id, "relay_reserve") for _ in range(10)]
        assert any(r is not None and "limit" in r for r in refusals), refusals  # per-peer rate
