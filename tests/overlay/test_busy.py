"""overlay/net/patches/busy.py: a node takes on a bounded amount of inbound work, and turns
the rest away at once (no clock: in-flight work is held open by the test itself), for as long
as it runs; over its bound its hello answers "busy, retry after N s", and the joiner leaves it
alone that long while it joins through the peers named (overlay/net/admission.py,
dialing.py, discovery.py); a joiner tells a busy issuer from an absent one
(overlay/net/redemption.py); and a bootstrap names admitted joiners to the next ones."""

from __future__ import annotations

import socket
from collections import Counter
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from libp2p.peer.id import ID

from p2pnode.identity import NodeKey
from p2pnode.overlay._errors import PeerBusy
from p2pnode.overlay.net.admission import Admission
from p2pnode.overlay.net.config import BOOTSTRAP_TIMEOUT_FACTOR, OverlayConfig
from p2pnode.overlay.net.dialing import Dialer, parse_peer_addr
from p2pnode.overlay.net.hello import Hello
from p2pnode.overlay.net.host import (
    UPGRADE_TIMEOUT_S,
    connection_config,
    make_host,
    parse_multiaddr,
)
from p2pnode.overlay.net.node import OverlayNode, open_overlay_node
from p2pnode.overlay.net.patches.busy import (
    BUSY_GREETING,
    BUSY_MEMORY_S,
    BUSY_PROTOCOL,
    RETRY_AFTER_DEFAULT_S,
    RETRY_AFTER_S,
    AdmissionLoad,
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


async def _until(condition: object, limit_s: float = 60.0) -> None:
    """Wait (bounded) until ``condition()`` holds."""
    with trio.fail_after(limit_s):
        while not condition():  # type: ignore[operator]  # noqa: ASYNC110
            await trio.sleep(0.05)


def _up(node: OverlayNode, other: OverlayNode) -> bool:
    return node.peers.is_up(other.peer_id)


async def test_a_busy_bootstrap_answers_retry_after_and_the_joiner_joins_through_the_peers_named() -> (
    None
):
    """Real nodes: a bootstrap whose negotiations are held at its busy mark (a bare host opens
    that many raw streams and never negotiates them) answers a joiner's hello "busy, retry
    after N s" with the peers it knows; the joiner closes, leaves the bootstrap alone, and
    joins through the peer named. Once the streams are gone, the two link up."""
    async with open_overlay_node(OverlayConfig(key=NodeKey.generate())) as boot:
        # The held negotiations must outlive the test, however slow the machine.
        boot.host.get_network().connection_config.inbound_stream_protocol_negotiation_timeout = 600  # type: ignore[attr-defined]
        first = OverlayConfig(key=NodeKey.generate(), bootstrap=boot.addrs)
        async with open_overlay_node(first) as peer:
            await _until(lambda: _up(boot, peer) and _up(peer, boot))
            holder = make_host(NodeKey.generate(), ["/ip4/127.0.0.1/tcp/0"])
            async with holder.run(listen_addrs=[parse_multiaddr("/ip4/127.0.0.1/tcp/0")]):
                info = parse_peer_addr(boot.addrs[0])
                await holder.connect(info)
                conn = holder.get_network().get_connections(info.peer_id)[0]  # type: ignore[attr-defined]
                assert boot.load is not None
                bound = boot.load.busy_at
                held = [await conn.muxed_conn.open_stream() for _ in range(bound)]
                await _until(lambda: boot.load.negotiations >= bound)  # type: ignore[union-attr]
                assert boot.load.retry_after_s() is not None
                admitted = boot.counters["admitted"]

                joiner = OverlayConfig(key=NodeKey.generate(), bootstrap=boot.addrs)
                async with open_overlay_node(joiner) as node:
                    await _until(lambda: _up(node, peer))
                    assert node.counters["busy_answers"] >= 1
                    await _until(
                        lambda: boot.counters["busy_answered"] == node.counters["busy_answers"]
                    )
                    # Never admitted while busy: each connection it made got the busy answer.
                    assert boot.counters["admitted"] == admitted
                    assert node.peer_id not in boot.admission.introduced

                    for stream in held:
                        await stream.reset()
                    # The bootstrap drains; after its retry-after the two link up.
                    await _until(lambda: _up(node, boot) and _up(boot, node))


async def test_a_busy_answer_keeps_the_dialer_off_that_peer_for_the_retry_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The joiner's side, on trio's mock clock: after "busy, retry after 4 s" a dial of that
    peer fails at once with ``PeerBusy`` for 4-6 s (jittered up, never down), then dials."""
    peer_key = NodeKey.generate()
    peer = ID.from_base58(peer_key.peer_id)
    dialed: list[object] = []

    async def connect(info: object) -> None:
        dialed.append(info)

    host = SimpleNamespace(connect=connect, get_connected_peers=lambda: [])
    admission = Admission(host, PeerTable(), Hello(network="main", version="v"), lambda *_: False)
    added: list[object] = []

    async def add_peer(info: object) -> None:
        added.append(info)

    dht = SimpleNamespace(kad=SimpleNamespace(routing_table=SimpleNamespace(add_peer=add_peer)))
    dialer = Dialer(host, dht, OverlayConfig(key=NodeKey.generate()), admission)  # type: ignore[arg-type]
    info = parse_peer_addr(f"/ip4/127.0.0.1/tcp/4101/p2p/{peer_key.peer_id}")
    admission._busy(peer, 4.0)
    assert admission.counters["busy_answers"] == 1
    left = admission.busy_left(peer_key.peer_id)
    assert 4.0 <= left <= 6.0
    with pytest.raises(PeerBusy, match="answered busy"):
        await dialer.dial(info)
    assert dialer.bootstrap_busy_s() == 0.0  # not a bootstrap peer of this dialer
    dialer.bootstrap_infos = [info]
    assert dialer.bootstrap_busy_s() == pytest.approx(left)
    await trio.sleep(left - 0.01)
    with pytest.raises(PeerBusy):
        await dialer.dial(info)
    assert dialed == []
    await trio.sleep(0.02)
    await dialer.dial(info)
    assert dialed == [info] and dialer.bootstrap_busy_s() == 0.0


async def test_the_retry_after_is_the_time_the_negotiations_in_flight_take_to_drain(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``AdmissionLoad`` on trio's mock clock: not busy under its bound; busy at it, and for
    ``BUSY_MEMORY_S`` after turning a stream away; N from the measured finish rate, clamped."""
    load = AdmissionLoad(BusyLimits(negotiations=10))
    assert load.retry_after_s() is None
    load.negotiations = load.busy_at - 1
    assert load.retry_after_s() is None
    load.negotiations = 10
    assert load.retry_after_s() == RETRY_AFTER_DEFAULT_S  # nothing finished yet: no rate
    for _ in range(5):  # one negotiation finished every 0.5 s: 2 a second
        load.finished()
        await trio.sleep(0.5)
    assert load.retry_after_s() == pytest.approx(10 / 2.0, abs=0.1)
    load.negotiations = 1
    assert load.retry_after_s() is None
    load.turned_away()
    assert load.retry_after_s() == RETRY_AFTER_S[0]  # 1 / 2 a second, at least the floor
    await trio.sleep(BUSY_MEMORY_S + 0.01)
    assert load.retry_after_s() is None
    load.negotiations = 10_000
    assert load.retry_after_s() == RETRY_AFTER_S[1]


def test_handshakes_may_take_as_long_as_a_loaded_machine_needs() -> None:
    """libp2p cut every handshake at 10 s; at 128 processes on 2 cores one took ~20 s, so a
    bootstrap's handshake slots held only doomed ones. A bootstrap dial that keeps timing out
    may wait as long as the handshake may take."""
    config = connection_config()
    assert config.inbound_upgrade_timeout == config.outbound_upgrade_timeout == UPGRADE_TIMEOUT_S
    assert UPGRADE_TIMEOUT_S >= 30.0
    assert BOOTSTRAP_TIMEOUT_FACTOR * OverlayConfig(key=NodeKey.generate()).connect_timeout == (
        pytest.approx(UPGRADE_TIMEOUT_S)
    )
