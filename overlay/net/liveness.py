"""Liveness of connected peers: frames received count as signs of life, silence gets a probe.

Contract:
- `Liveness(host, peers, config, counters, connection_kind, keep_open)` is owned by the node;
  the node calls `stamp_reads(conn)` on every new connection, `forget(peer)` when a peer's
  last connection closes, and runs `run()` for as long as it lives. Verdicts go to the
  `PeerTable` (`observe`, `record_rtt`, `record_failure`, `mark_down`); cost figures to
  `counters` (probes, probe_misses, probe_misses_excused, probe_stream_opens,
  probe_closes_withheld); `status()` gives the node-wide lag figures (``starvation.py``).
- Any frame received on a peer's connection counts as a sign of life (stamped on the
  secured connection's reads), so busy peers are never probed. A peer silent for
  `ping_interval` (or longer with many peers: at most `PROBE_BUDGET_PER_S` probes per second
  in all, so the interval is at least connected peers / that budget) gets one 32-byte echo
  probe on a persistent /p2pnode/ping/1 stream (opened once per connection; a late echo is
  still used, never a reason to reopen). A probe missed is one with no echo AND no frame at
  all from the peer within the RTO = srtt + 4 * rttvar of that peer (RFC 6298), clamped to
  [floor, `RTO_CEILING` * floor]; the floor is `ping_timeout` on a healthy machine and grows
  with the node-wide lag (our own loop lag, most peers' echo delays: ``starvation.py``); the
  next probe follows at once; a miss while our own loop lagged more than RTO/2 is excused
  (silence proves nothing when we did not run). 1 missed probe -> suspect, 2 -> down; after
  `CLOSE_AFTER_EXTRA_MISSES` more the connection is closed (frees a hung peer; discovery
  redials it later; a wrongly demoted peer is up again with its next frame, no redial) --
  but never the link to a `keep_open()` peer (the bootstrap: a node cut from it may have no
  other way back), nor while our own loop is starved or most peers miss at once (then the CPU
  is the problem, not the peers). So a hung (SIGSTOP) peer on an idle link of a quiet
  machine is down within ~ping_interval + 2 * RTO (~3.5 s with the defaults) and a closed or
  killed one at once (its connection drops).
- `serve_ping(stream, limiter)` is the other side: it echoes 32-byte pings (`PING_LENGTH`)
  on `PING_PROTOCOL`.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import trio
from libp2p.abc import IHost, INetConn, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from p2pnode.overlay._streams import close_quietly, reset_quietly
from p2pnode.overlay.limits import PeerLimiter, remote_peer
from p2pnode.overlay.net.config import BACKGROUND_TIMEOUT_FACTOR, OverlayConfig
from p2pnode.overlay.net.starvation import Starvation
from p2pnode.overlay.peers import PeerState, PeerTable

__all__ = ["PING_LENGTH", "PING_PROTOCOL", "Liveness", "serve_ping"]

logger = logging.getLogger(__name__)

# Our own echo protocol: libp2p's /ipfs/ping handler refuses a third concurrent stream per peer,
# which collides with its health monitor's probes and then aborts healthy connections.
PING_PROTOCOL = "/p2pnode/ping/1"
PING_LENGTH = 32
# The probe timeout never exceeds this many `ping_timeout`s, however bad the measured RTT.
RTO_CEILING = 4.0
# A peer declared down by probes keeps its connection for this many more missed probes (a
# false verdict then costs no redial: its next frame brings it back up), then it is closed.
CLOSE_AFTER_EXTRA_MISSES = 4
# Probe timeouts over a relayed connection start this many times higher (a third node's
# event loop and two more hops sit on the path).
RELAYED_TIMEOUT_FACTOR = 3.0
# Idle peers get an RTT sample at least this many ping intervals apart (the router uses it).
RTT_REFRESH_INTERVALS = 10
# Probes of idle links a node sends per second at most, all peers together: the silence that
# triggers a probe grows past `ping_interval` to (connected peers / this) seconds. At 63 peers
# and 1 s, probes were the largest single cost of 64 nodes on 2 cores (4,000 probes/s in all),
# and starved nodes then missed real frames; at 16/s, once idle gossip went quiet, they were
# again the largest idle cost of a node (16 nodes: 13 probes a second each). Detection of a hung
# peer slows in proportion (~2.5 s + 2 RTO at 15 peers, 4 s + 2 RTO at 24); a closed or killed
# one is still seen at once, and a forward to a hung peer fails over on its own timeout.
PROBE_BUDGET_PER_S = 6.0
# A connection's kind (direct or relayed) is looked up again this often while probing it.
KIND_REFRESH_S = 30.0


@dataclass
class _Probe:
    """Liveness probing of one connected peer (see the module docstring)."""

    stream: INetStream | None = None
    pending: int = 0  # nonce of the probe awaiting its echo; 0 = none
    sent: dict[int, float] = field(default_factory=dict)  # recent nonces -> send time
    answered: trio.Event = field(default_factory=trio.Event)
    sent_at: float = -math.inf  # monotonic time of the last probe sent
    last_sample: float = -math.inf  # monotonic time of the last RTT sample
    misses: int = 0
    relayed: bool = False  # how the connection runs, looked up again every KIND_REFRESH_S
    kind_at: float = -math.inf


class _RxStamp:
    """Wraps a secured connection's `read`: each frame received stamps its peer as heard."""

    def __init__(self, read: Callable[..., Awaitable[bytes]], peer: ID, stamps: dict) -> None:
        self._read = read
        self._peer = peer
        self._stamps = stamps

    async def __call__(self, n: int | None = None) -> bytes:
        data = await self._read(n)
        self._stamps[self._peer] = time.monotonic()
        return data


class Liveness:
    """Probes of the connected peers of one node (see the module contract)."""

    def __init__(
        self,
        host: IHost,
        peers: PeerTable,
        config: OverlayConfig,
        counters: Counter[str],
        connection_kind: Callable[[str], str | None],
        keep_open: Callable[[], Iterable[str]] = frozenset,
    ) -> None:
        self._host = host
        self._peers = peers
        self._config = config
        self._counters = counters
        self._connection_kind = connection_kind  # "relayed" links get longer probe timeouts
        self._keep_open = keep_open  # peers never disconnected on probe misses (bootstrap)
        self._probes: dict[ID, _Probe] = {}
        self.starvation = Starvation(config.ping_timeout)
        self._last_rx: dict[ID, float] = {}  # monotonic time of the last frame per peer
        self._observed_rx: dict[ID, float] = {}
        self._probe_salt = secrets.token_bytes(PING_LENGTH - 8)
        self._next_nonce = 1

    def stamp_reads(self, conn: INetConn) -> None:
        peer = conn.muxed_conn.peer_id
        secured = getattr(conn.muxed_conn, "secured_conn", None)
        read = getattr(secured, "read", None)
        if read is not None and not isinstance(read, _RxStamp):
            secured.read = _RxStamp(read, peer, self._last_rx)  # type: ignore[union-attr]
        self._last_rx[peer] = time.monotonic()

    def forget(self, peer: ID) -> None:
        """The peer's last connection closed: its prober stops, its stamps go."""
        self._probes.pop(peer, None)
        self._last_rx.pop(peer, None)
        self._observed_rx.pop(peer, None)
        self.starvation.forget(peer)

    def status(self) -> dict[str, object]:
        return self.starvation.status()

    async def run(self) -> None:
        """Start a prober per connected peer; turn received frames into `observe` calls."""
        tick = min(0.25, self._config.ping_interval / 4)
        async with trio.open_nursery() as nursery:
            while True:
                now = time.monotonic()
                connected = self._host.get_connected_peers()
                # A lost disconnect notification must not leave a vanished peer "up".
                live = {p.to_base58() for p in connected}
                for pid in self._peers.peer_ids(PeerState.UP, PeerState.SUSPECT):
                    if pid not in live:
                        self._peers.mark_down(pid, "connection closed")
                for peer in connected:
                    if peer not in self._probes:
                        probe = self._probes[peer] = _Probe()
                        nursery.start_soon(self._probe_peer, peer, probe)
                    heard = self._last_rx.get(peer)
                    if heard is not None and heard > self._observed_rx.get(peer, -math.inf):
                        self._observed_rx[peer] = heard
                        self._peers.observe(peer.to_base58())
                await trio.sleep(tick)
                self.starvation.note_loop_lag(time.monotonic() - now - tick)

    def _probing(self, peer: ID, probe: _Probe) -> bool:
        return self._probes.get(peer) is probe and peer in self._host.get_connected_peers()

    async def _probe_peer(self, peer: ID, probe: _Probe) -> None:
        """Probe `peer` whenever it falls silent, until it disconnects or is declared down."""
        async with trio.open_nursery() as nursery:
            try:
                await self._probe_rounds(peer, probe, nursery)
            finally:
                nursery.cancel_scope.cancel()

    async def _probe_rounds(self, peer: ID, probe: _Probe, nursery: trio.Nursery) -> None:
        cfg = self._config
        pid = peer.to_base58()
        nursery.start_soon(self._keep_probe_stream, peer, probe)
        while self._probing(peer, probe):
            now = time.monotonic()
            interval = max(cfg.ping_interval, len(self._probes) / PROBE_BUDGET_PER_S)
            due = min(
                max(self._last_rx.get(peer, -math.inf), probe.sent_at) + interval,
                probe.last_sample + RTT_REFRESH_INTERVALS * interval,
            )
            if probe.misses == 0 and now < due:
                await trio.sleep(due - now)
                continue
            # A relayed link crosses a third node's event loop and two more hops.
            if now - probe.kind_at > KIND_REFRESH_S:
                probe.relayed = self._connection_kind(pid) == "relayed"
                probe.kind_at = now
            floor = self.starvation.floor() * (RELAYED_TIMEOUT_FACTOR if probe.relayed else 1.0)
            rto = self._peers.rto(pid, floor, RTO_CEILING * floor)
            started = time.monotonic()
            if probe.stream is not None:
                answered = await self._send_probe(probe, rto)
            else:  # stream still opening: silence alone decides
                probe.sent_at = started
                await trio.sleep(rto)
                answered = False
            if answered or self._last_rx.get(peer, -math.inf) > started:
                probe.misses = 0  # an echo or any other frame: alive, maybe just slow
                continue
            # Woken far past the deadline, or the loop lagged meanwhile: we were starved.
            late = time.monotonic() - started > 1.5 * rto
            if late or self.starvation.stalled(started, rto / 2):
                self._counters["probe_misses_excused"] += 1
                continue  # we were starved ourselves: probe again instead of blaming it
            probe.misses += 1
            self._counters["probe_misses"] += 1
            self._peers.record_failure(pid, f"no frame within {rto:.2f}s of a ping")
            if probe.misses >= self._peers.down_after + CLOSE_AFTER_EXTRA_MISSES:
                if self._close_withheld(pid):
                    continue  # keep probing: its next frame or echo brings it back up
                # Still silent long after being declared down: free the connection (a hung
                # peer would hold it forever); discovery redials it later.
                with trio.move_on_after(2):
                    await self._host.disconnect(peer)
                return

    def _close_withheld(self, pid: str) -> bool:
        """Must probe misses leave this peer's connection open? (see the module contract)"""
        if pid in set(self._keep_open()):
            why = "bootstrap peer"
        else:
            missing = sum(1 for p in self._probes.values() if p.misses > 0)
            why = self.starvation.close_withheld(missing, len(self._probes))
        if why is None:
            return False
        self._counters["probe_closes_withheld"] += 1
        logger.debug("not closing the silent link to %s: %s", pid, why)
        return True

    async def _keep_probe_stream(self, peer: ID, probe: _Probe) -> None:
        """Open the ping stream (never cut short: an open is the costly part), read echoes,
        reopen with backoff when it ends."""
        cfg = self._config
        delay = cfg.ping_interval
        while self._probing(peer, probe):
            self._counters["probe_stream_opens"] += 1
            try:
                with trio.fail_after(BACKGROUND_TIMEOUT_FACTOR * cfg.connect_timeout):
                    stream = await self._host.new_stream(peer, [TProtocol(PING_PROTOCOL)])
            except (Exception, trio.TooSlowError) as exc:
                logger.debug("ping stream to %s not opened: %r", peer, exc)
                await trio.sleep(delay)
                delay = min(2 * delay, RTT_REFRESH_INTERVALS * cfg.ping_interval)
                continue
            probe.stream = stream
            try:
                await self._read_echoes(peer, probe, stream)
            finally:
                probe.stream = None
                with trio.move_on_after(0.5) as cleanup:
                    cleanup.shield = True
                    await reset_quietly(stream)
            await trio.sleep(delay)

    async def _send_probe(self, probe: _Probe, rto: float) -> bool:
        """Send one echo probe; True when its echo came back within `rto` of sending."""
        stream = probe.stream
        assert stream is not None
        nonce = self._next_nonce
        self._next_nonce += 1
        probe.pending, probe.answered = nonce, trio.Event()
        probe.sent_at = time.monotonic()
        probe.sent[nonce] = probe.sent_at
        while len(probe.sent) > 8:  # keep the few whose late echoes may still come
            del probe.sent[min(probe.sent)]
        self._counters["probes"] += 1
        with trio.move_on_after(rto):
            try:
                await stream.write(nonce.to_bytes(8, "big") + self._probe_salt)
            except Exception as exc:  # broken stream: the keeper reopens it
                logger.debug("ping write failed: %r", exc)
                await reset_quietly(stream)
                return False
            await probe.answered.wait()
            return True
        return False

    async def _read_echoes(self, peer: ID, probe: _Probe, stream: INetStream) -> None:
        """Match echoes to probes by nonce; late echoes still give a valid RTT sample."""
        buffer = b""
        try:
            while True:
                chunk = await stream.read(PING_LENGTH)
                if not chunk:
                    return
                buffer += chunk
                while len(buffer) >= PING_LENGTH:
                    echo, buffer = buffer[:PING_LENGTH], buffer[PING_LENGTH:]
                    nonce = int.from_bytes(echo[:8], "big")
                    sent = probe.sent.pop(nonce, None)
                    if sent is None or echo[8:] != self._probe_salt:
                        continue  # not one of ours, or already too old to matter
                    now = time.monotonic()
                    probe.last_sample = now
                    self._peers.record_rtt(peer.to_base58(), now - sent)
                    self.starvation.note_echo(peer, now - sent)
                    if nonce == probe.pending:
                        probe.pending = 0
                        probe.answered.set()
        except Exception as exc:
            logger.debug("ping stream to %s ended: %r", peer, exc)


async def serve_ping(stream: INetStream, limiter: PeerLimiter) -> None:
    """Echo 32-byte pings until the peer closes; a silent peer is dropped after a minute. A peer
    over its ``ping`` streams or ``ping_echo`` rate (``overlay/limits.py``) is reset."""
    peer = remote_peer(stream)
    try:
        with limiter.admit(peer, "ping"):
            while True:
                with trio.fail_after(60):
                    payload = b""
                    while len(payload) < PING_LENGTH:
                        chunk = await stream.read(PING_LENGTH - len(payload))
                        if not chunk:
                            return
                        payload += chunk
                limiter.charge(peer, "ping_echo")
                await stream.write(payload)
    except (Exception, trio.TooSlowError):
        await reset_quietly(stream)
    finally:
        await close_quietly(stream)
