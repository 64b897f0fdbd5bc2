"""overlay/net/patches/busy.py: a node takes on a bounded amount of inbound work, and turns
the rest away at once (no clock: in-flight work is held open by the test itself), for as long
as it runs; a joiner tells a busy issuer from an absent one (overlay/net/redemption.py); and a
bootstrap names admitted joiners to the next ones (overlay/net/admission.py)."""

from __future__ import annotations

import socket
from collections import Counter
from types import SimpleNamespace

import pytest
import trio
from libp2p.peer.id import ID

from p2pnode.identity import NodeKey
from p2pnode.overlay.net.admission import Admission
from p2pnode.overlay.net.config import OverlayConfig
from p2pnode.overlay.net.hello import Hello
from p2pnode.overlay.net.host import make_host
from p2pnode.overlay.net.node import open_overlay_node
from p2pnode.overlay.net.patches.busy import (
    BUSY_GREETING,
    BUSY_PROTOCOL,
    BusyLimits,
    install_busy_limits,
)
from p2pnode.overlay.net.reachability import probe_listener
from p2pnode.overlay.net.redemption import RedemptionFailed, redeem_invite
from p2pnode.overlay.peers import PeerTable

NOISE = b"\x07/noise\n"


async def _greeted(stream: trio.SocketStream) -> bytes:
    """What a listener sends before we say anything (its multistream header)."""
    data = b""
    while len(data) < len(BUSY_GREETING):
        chunk = await stream.receive_some(64)
        if not chunk:
            break
        data += chunk
    return data


async def _accepted(port: int) -> bool:
    """Does the node start a handshake with one more connection? (it agrees to Noise)"""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        assert await _greeted(stream) == BUSY_GREETING
        await stream.send_all(BUSY_GREETING + NOISE)
        answer = b""
        while len(answer) < len(NOISE):
            chunk = await stream.receive_some(64)
            if not chunk:
                return False  # closed: turned away
            answer += chunk
        return answer == NOISE
    except trio.BrokenResourceError:
        return False  # turned away with our bytes unread: the kernel resets, not closes
    finally:
        await stream.aclose()


async def test_handshakes_beyond_the_bound_are_closed_after_the_greeting() -> None:
    """The node's default bound, on a real node and real sockets: connections that never
    finish their handshake hold it; one more is greeted and closed at once, and a dial-back
    probe still counts the node as reachable."""
    async with open_overlay_node(OverlayConfig(key=NodeKey.generate())) as node:
        # The held handshakes must outlive the test, however slow the machine.
        node.host.get_network().connection_config.inbound_upgrade_timeout = 600.0  # type: ignore[attr-defined]
        port = int(node.addrs[0].split("/tcp/")[1].split("/")[0])
        bound = BusyLimits().handshakes
        held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(bound)]
        try:
            for stream in held:  # greeted: each one's handshake is under way
                assert await _greeted(stream) == BUSY_GREETING
            one_more = await trio.open_tcp_stream("127.0.0.1", port)
            assert await _greeted(one_more) == BUSY_GREETING
            assert await one_more.receive_some(64) == b""  # closed before any handshake
            await one_more.aclose()
            assert node.counters["busy_conns"] == 1
            assert await probe_listener("127.0.0.1", port)
            assert node.counters["busy_conns"] == 2
        finally:
            for stream in held:
                await stream.aclose()
        # The held ones closed: their slots come back (the node notices each EOF).
        with trio.fail_after(30):
            while not await _accepted(port):  # noqa: ASYNC110
                await trio.sleep(0.05)


class _Negotiations:
    """Stands in for libp2p's negotiation: each call waits until the test releases it."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.started = 0

    async def __call__(self, communicator: object, *args: object) -> object:
        self.started += 1
        await self.release.wait()
        return "/test/1", self.handler

    async def handler(self, stream: object) -> None:
        stream.handled = True  # type: ignore[attr-defined]


class _Stream:
    def __init__(self, reset_received: bool = False) -> None:
        self.muxed_stream = SimpleNamespace(reset_received=reset_received)
        self.was_reset = False
        self.handled = False

    async def reset(self) -> None:
        self.was_reset = True


async def test_negotiations_beyond_the_bound_are_reset_and_abandoned_streams_skipped() -> None:
    host = make_host(NodeKey.generate(), ["/ip4/127.0.0.1/tcp/0"])
    fake = _Negotiations()
    host.multiselect.negotiate = fake  # type: ignore[attr-defined]
    counters: Counter[str] = Counter()
    install_busy_limits(host, counters, BusyLimits(negotiations=2))
    negotiate = host.multiselect.negotiate  # type: ignore[attr-defined]
    results: list[object] = []

    async def one() -> None:
        results.append(await negotiate(SimpleNamespace(read_writer=_Stream())))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
        with trio.fail_after(10):
            while fake.started < 2:  # noqa: ASYNC110
                await trio.sleep(0.01)
        # Two under way: the third is turned away without waiting.
        protocol, refuse = await negotiate(SimpleNamespace(read_writer=_Stream()))
        assert protocol == BUSY_PROTOCOL and counters["busy_streams"] == 1
        refused = _Stream()
        await refuse(refused)
        assert refused.was_reset and fake.started == 2
        fake.release.set()
    assert len(results) == 2
    # Slots free again: the next one negotiates; its handler runs unless the opener gave up.
    protocol, handler = await negotiate(SimpleNamespace(read_writer=_Stream()))
    assert protocol == "/test/1" and fake.started == 3
    live, abandoned = _Stream(), _Stream(reset_received=True)
    await handler(live)
    await handler(abandoned)
    assert live.handled and not abandoned.handled
    assert counters["abandoned_streams"] == 1


def test_limits_are_at_least_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BusyLimits(handshakes=0)


async def test_redeeming_at_an_address_where_nothing_listens_fails_after_a_few_rounds() -> None:
    """A busy issuer is retried for minutes; an absent one (the OS refuses the connection)
    is not: the joiner hears so after ``REDEEM_REFUSED_ROUNDS`` rounds."""
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    absent = NodeKey.generate().peer_id
    with pytest.raises(RedemptionFailed, match="is it running"):
        await redeem_invite(
            NodeKey.generate(), b"grant", [f"/ip4/127.0.0.1/tcp/{port}/p2p/{absent}"], b"k" * 32
        )


async def test_a_node_admits_more_inbound_connections_in_its_life_than_its_connection_cap() -> None:
    """py-libp2p held an inbound slot per connection until the node stopped: a node with room
    for 4 refused a 5th joiner although the first 4 had left. Joiners come and go here."""
    config = OverlayConfig(key=NodeKey.generate(), max_peers=4)
    async with open_overlay_node(config) as boot:
        admitted = 0
        for _ in range(6):
            joiner = OverlayConfig(key=NodeKey.generate(), bootstrap=boot.addrs)
            async with open_overlay_node(joiner) as node:
                with trio.fail_after(30):
                    while not node.peers.is_up(boot.peer_id):  # noqa: ASYNC110
                        await trio.sleep(0.05)
                admitted += 1
            with trio.fail_after(30):  # its connection closed at the bootstrap too
                while boot.host.get_connected_peers():  # noqa: ASYNC110
                    await trio.sleep(0.05)
        assert admitted == 6


def test_a_bootstrap_names_admitted_dialers_by_the_addresses_their_hello_gave() -> None:
    """Introductions (overlay/net/admission.py): kept only on the IP the connection came from
    and with the dialer's own id; named to others while connected and up, never to itself."""
    keys = [NodeKey.generate() for _ in range(3)]
    a, b, c = (k.peer_id for k in keys)
    peers = PeerTable()
    connected = [ID.from_base58(a), ID.from_base58(b)]
    host = SimpleNamespace(get_connected_peers=lambda: connected)
    admission = Admission(host, peers, Hello(network="main", version="v"), lambda *_: False)
    admission._introduce(
        a,
        (
            f"/ip4/10.0.0.9/tcp/4101/p2p/{a}",  # another IP than the connection's: a NAT's inside
            f"/ip4/127.0.0.1/tcp/4101/p2p/{c}",  # someone else's id
            f"/ip4/127.0.0.1/tcp/4101/p2p/{a}",
        ),
        "127.0.0.1",
    )
    admission._introduce(b, (f"/ip4/10.0.0.9/tcp/1/p2p/{b}",), "127.0.0.1")  # nothing kept
    assert admission.introduced == {a: (f"/ip4/127.0.0.1/tcp/4101/p2p/{a}",)}
    assert admission.referrals(c) == ()  # a is not up yet
    peers.observe(a)
    assert admission.referrals(c) == (f"/ip4/127.0.0.1/tcp/4101/p2p/{a}",)
    assert admission.referrals(a) == ()  # never itself
    connected.remove(ID.from_base58(a))
    assert admission.referrals(c) == ()  # gone
