"""Per-peer resource limits: what one remote peer may make this node do.

Contract:
- One ``PeerLimiter`` per node, shared by the stream handlers (``/p2pnode/forward/1``,
  ``/p2pnode/verify/1``, ``/p2pnode/digest/1``) and digest gossip ingest. Limits are keyed by the
  Noise-authenticated remote peer id (``remote_peer(stream)``; gossip: the verified publisher).
- Every check REFUSES at once, it never queues: ``LimitExceeded`` (an ``OverlayError``) is raised
  and the handler turns it into its protocol's error frame with the message (forward:
  ``fwd-error`` code ``limited``; verify: ``PeerLimited``; digest pull: ``digest-unavailable``
  with a reason starting ``limited:``; gossip: dropped and counted as ``rate_limited``). So a
  flooding peer costs us one small frame per refused request, and other peers are still served.
- Kinds of limit (``LimitExceeded.kind``):
  ``streams``  concurrent streams of one scope per peer (and for all peers together, a bound
               against many identities), ``admit(peer, scope)``;
  ``rate``     token bucket per (peer, scope), ``charge(peer, scope, cost)``; ``admit`` takes one
               token too. ``LimitExceeded.retry_after_s`` says when a token will be there;
  ``sessions`` open speculation sessions per peer, ``session(peer)``;
  ``bytes``    request bytes read from a peer and not yet answered, across protocols:
               ``metered(peer, stream)`` counts every read (refusing once over the cap) until
               ``release()`` or the end of the block;
  ``digest``   digest size and fingerprint counts (``LimitsConfig.max_digest_*``, checked by
               anti-entropy).
- Scopes: ``forward``, ``verify`` (session streams/opens), ``verify_block``, ``verify_lead``
  (tokens a verifier decodes on its own for the peer), ``digest_pull``,
  ``digest_gossip`` (messages), ``digest_gossip_bytes``, ``ping`` (echo streams, held by the
  overlay node's own limiter) and ``ping_echo`` (echoes). Defaults (``LimitsConfig()``) sit well
  above what an honest node does (see the comments there) and are always on.
- The limiter's own memory is bounded: idle peers (nothing held) are forgotten oldest first past
  ``max_tracked_peers``; a forgotten peer comes back with full buckets.
- Not thread-safe: use from the node's trio thread. The clock is ``time.monotonic`` by default.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import trio

from p2pnode.overlay._errors import OverlayError

# Below the 256 KiB frame limit of /p2pnode/digest/1 so a pulled digest always fits in a reply.
MAX_DIGEST_BYTES = 240 * 1024

if TYPE_CHECKING:
    from libp2p.abc import INetStream

    from p2pnode.overlay.seams import Stream

KiB = 1024
MiB = 1024 * KiB
UNKNOWN_PEER = "unknown-peer"


class LimitExceeded(OverlayError):
    """A peer went over one of its limits; the request was refused, nothing was queued."""

    # The wire word of a refusal: forward's ``fwd-error`` code and the prefix of a digest
    # pull's ``digest-unavailable`` reason. Peers of every version read it: never change it.
    reason = "limited"

    def __init__(
        self, peer: str, kind: str, scope: str, message: str, retry_after_s: float | None = None
    ) -> None:
        hint = f"; retry after {retry_after_s:.2f} s" if retry_after_s is not None else ""
        super().__init__(f"peer {peer[:16]} over its {kind} limit for {scope}: {message}{hint}")
        self.peer = peer
        self.kind = kind
        self.scope = scope
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Budget:
    """Rate (token bucket) and concurrency of one scope. ``None`` concurrency: unbounded."""

    rate_per_s: float
    burst: float
    max_concurrent: int | None = None  # per peer
    max_concurrent_total: int | None = None  # all peers together

    def __post_init__(self) -> None:
        if not (self.rate_per_s > 0 and self.burst >= 1):
            raise ValueError(f"a budget needs rate_per_s > 0 and burst >= 1, got {self}")
        for n in (self.max_concurrent, self.max_concurrent_total):
            if n is not None and n < 1:
                raise ValueError(f"concurrency limits must be >= 1 or None, got {self}")


@dataclass(frozen=True)
class LimitsConfig:
    # An origin forwards what its own clients send; a 135M model on CPU serves ~10 tok/s, a GPU
    # node a few hundred: 20 requests/s and 8 at once per peer leave room for a busy gateway
    # while one peer can never fill the whole engine queue (admitted up to 2x push-back = 16).
    forward: Budget = Budget(rate_per_s=20.0, burst=40.0, max_concurrent=8, max_concurrent_total=64)
    # Each session open prefills its prompt on the verifier: a handful per second is plenty.
    verify: Budget = Budget(rate_per_s=4.0, burst=8.0, max_concurrent=8, max_concurrent_total=64)
    # One block in flight per session (SessionBusy); stale blocks cost nothing but a frame.
    verify_block: Budget = Budget(rate_per_s=200.0, burst=400.0)
    # Lead tokens are target decoding steps the peer asks for without sending drafts (blocks
    # refill the lead): 4 sessions streaming ~100 tok/s each from a GPU verifier fit in this.
    verify_lead: Budget = Budget(rate_per_s=500.0, burst=1000.0)
    # Honest pulls: at most one per pull_min_interval_s (2 s; 0.3 s in tests) per (peer, model).
    digest_pull: Budget = Budget(
        rate_per_s=5.0, burst=10.0, max_concurrent=2, max_concurrent_total=16
    )
    # Honest publishers send about one digest per interval_s (>= 0.05 s allowed, 1 s default)
    # plus a burst of 2; full digests go by gossip only up to 64 KiB, every 10th round.
    digest_gossip: Budget = Budget(rate_per_s=10.0, burst=30.0)
    # Bytes per publisher: decoding costs ~0.5 us per fingerprint, up to 8 per byte.
    digest_gossip_bytes: Budget = Budget(rate_per_s=64.0 * KiB, burst=512.0 * KiB)
    # Liveness keeps ONE persistent ping stream per peer (reopened with backoff after a failure)
    # and pings only after a silence of ping_interval (1 s; testnet specs go down to 0.05 s):
    # 2 streams, 5 opens/s and 100 echoes/s sit above that; a 32-byte echo costs next to nothing.
    ping: Budget = Budget(rate_per_s=5.0, burst=10.0, max_concurrent=2, max_concurrent_total=2048)
    ping_echo: Budget = Budget(rate_per_s=100.0, burst=200.0)
    # A dial-back (overlay/net/reachability.py) costs a few sockets; nodes ask every few minutes.
    dialback: Budget = Budget(rate_per_s=0.5, burst=3.0, max_concurrent=1, max_concurrent_total=16)
    # Relaying (overlay/net/relay.py): a reservation is renewed every ~10 min; circuits are
    # connections of overlay members to a NAT'd member, a few per minute per peer.
    relay_reserve: Budget = Budget(rate_per_s=0.2, burst=5.0)
    relay_circuit: Budget = Budget(
        rate_per_s=1.0, burst=10.0, max_concurrent=8, max_concurrent_total=128
    )
    max_sessions_per_peer: int = 4
    max_bytes_in_flight: int = 8 * MiB  # per peer: two maximal forward prompts
    max_digest_bytes: int = MAX_DIGEST_BYTES
    # An honest full digest holds <= ~115k 32-bit fingerprints (240 KiB at ~2.1 B each).
    max_digest_fingerprints: int = 200_000
    max_view_fingerprints: int = 400_000  # per (peer, model) view, deltas included
    max_tracked_peers: int = 10_000

    def budget(self, scope: str) -> Budget:
        value = getattr(self, scope, None) if scope in _SCOPES else None
        if not isinstance(value, Budget):
            raise ValueError(f"unknown limit scope {scope!r}; known: {sorted(_SCOPES)}")
        return value


_SCOPES = frozenset(f.name for f in fields(LimitsConfig) if f.type in ("Budget", Budget))


@dataclass
class _Bucket:
    tokens: float
    stamp: float


@dataclass
class _Peer:
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    active: dict[str, int] = field(default_factory=dict)
    sessions: int = 0
    bytes: int = 0

    def idle(self) -> bool:
        return not (self.sessions or self.bytes or any(self.active.values()))


def remote_peer(stream: INetStream) -> str:
    """Base58 id of the authenticated remote peer of a libp2p stream; ``UNKNOWN_PEER`` else."""
    with contextlib.suppress(Exception):
        return stream.muxed_conn.peer_id.to_base58()
    return str(getattr(stream, "remote_peer_id", UNKNOWN_PEER))


class PeerLimiter:
    """Per-peer token buckets and concurrency counters (see the module contract)."""

    def __init__(
        self, config: LimitsConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or LimitsConfig()
        self._clock = clock
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._total: dict[str, int] = {}
        self.refused: dict[str, int] = {}  # "<scope>:<kind>" -> count

    # -- checks -------------------------------------------------------------------------------

    def charge(self, peer: str, scope: str, cost: float = 1.0) -> None:
        """Take ``cost`` tokens from ``peer``'s bucket for ``scope`` or raise ``LimitExceeded``."""
        budget = self.config.budget(scope)
        state = self._peer(peer)
        now = self._clock()
        bucket = state.buckets.get(scope)
        if bucket is None:
            bucket = state.buckets[scope] = _Bucket(budget.burst, now)
        bucket.tokens = min(budget.burst, bucket.tokens + (now - bucket.stamp) * budget.rate_per_s)
        bucket.stamp = now
        if bucket.tokens < cost:
            if cost > budget.burst:
                self._refuse(
                    peer, "rate", scope, f"one request of {cost:g} > burst {budget.burst:g}"
                )
            wait = (cost - bucket.tokens) / budget.rate_per_s
            self._refuse(
                peer,
                "rate",
                scope,
                f"more than {budget.rate_per_s:g}/s (burst {budget.burst:g})",
                wait,
            )
        bucket.tokens -= cost

    @contextlib.contextmanager
    def admit(self, peer: str, scope: str) -> Iterator[None]:
        """One concurrent stream of ``scope`` for ``peer`` plus one rate token, for the block."""
        budget = self.config.budget(scope)
        state = self._peer(peer)
        mine, total = state.active.get(scope, 0), self._total.get(scope, 0)
        if budget.max_concurrent is not None and mine >= budget.max_concurrent:
            self._refuse(peer, "streams", scope, f"{mine} open, at most {budget.max_concurrent}")
        if budget.max_concurrent_total is not None and total >= budget.max_concurrent_total:
            self._refuse(
                peer,
                "streams",
                scope,
                f"all peers hold {total}: at most {budget.max_concurrent_total}",
            )
        self.charge(peer, scope)
        state.active[scope] = mine + 1
        self._total[scope] = total + 1
        try:
            yield
        finally:
            state.active[scope] -= 1
            self._total[scope] -= 1

    @contextlib.contextmanager
    def session(self, peer: str) -> Iterator[None]:
        """One open speculation session of ``peer`` for the block."""
        state = self._peer(peer)
        cap = self.config.max_sessions_per_peer
        if state.sessions >= cap:
            self._refuse(peer, "sessions", "verify", f"{state.sessions} open, at most {cap}")
        state.sessions += 1
        try:
            yield
        finally:
            state.sessions -= 1

    @contextlib.contextmanager
    def metered(self, peer: str, stream: Stream | trio.abc.Stream) -> Iterator[MeteredStream]:
        """``stream`` whose reads count toward ``peer``'s bytes in flight until the block ends."""
        metered = MeteredStream(self, peer, stream)
        try:
            yield metered
        finally:
            metered.release()

    def check_view_growth(self, peer: str, held: int, added: int) -> None:
        """Refuse a digest that would grow ``peer``'s view past ``max_view_fingerprints``."""
        cap = self.config.max_view_fingerprints
        if held + added > cap:
            self._refuse(
                peer, "digest", "digest_gossip", f"view of {held}+{added} > {cap} fingerprints"
            )

    # -- introspection ------------------------------------------------------------------------

    def usage(self, peer: str) -> dict[str, Any]:
        """What ``peer`` holds now: active streams per scope, sessions, bytes in flight."""
        state = self._peers.get(peer) or _Peer()
        return {"active": dict(state.active), "sessions": state.sessions, "bytes": state.bytes}

    def __len__(self) -> int:
        return len(self._peers)

    # -- internals ------------------------------------------------------------------------------

    def _add_bytes(self, peer: str, n: int) -> None:
        state = self._peer(peer)
        state.bytes += n
        cap = self.config.max_bytes_in_flight
        if state.bytes > cap:
            self._refuse(
                peer, "bytes", "bytes_in_flight", f"{state.bytes} bytes unanswered > {cap}"
            )

    def _sub_bytes(self, peer: str, n: int) -> None:
        state = self._peers.get(peer)
        if state is not None:
            state.bytes = max(0, state.bytes - n)

    def _peer(self, peer: str) -> _Peer:
        state = self._peers.get(peer)
        if state is None:
            state = self._peers[peer] = _Peer()
            self._forget_idle()
        else:
            self._peers.move_to_end(peer)
        return state

    def _forget_idle(self) -> None:
        excess = len(self._peers) - self.config.max_tracked_peers
        if excess <= 0:
            return
        for peer in [p for p, s in self._peers.items() if s.idle()][:excess]:
            del self._peers[peer]

    def _refuse(
        self, peer: str, kind: str, scope: str, message: str, retry_after_s: float | None = None
    ) -> None:
        key = f"{scope}:{kind}"
        self.refused[key] = self.refused.get(key, 0) + 1
        raise LimitExceeded(peer, kind, scope, message, retry_after_s)


class MeteredStream:
    """A stream proxy whose reads count toward one peer's bytes in flight (``PeerLimiter``).

    ``release()`` gives back what was counted so far (call it once a request is answered);
    everything else (write, close, reset, ``muxed_conn``) goes to the wrapped stream, a libp2p
    stream or a trio one (``read``/``write`` map to ``receive_some``/``send_all`` there).
    """

    def __init__(self, limiter: PeerLimiter, peer: str, stream: Stream | trio.abc.Stream) -> None:
        self._limiter = limiter
        self._peer = peer
        self._stream = stream
        self.held = 0

    async def read(self, n: int) -> bytes:
        s = self._stream
        if isinstance(s, trio.abc.ReceiveStream):
            data = bytes(await s.receive_some(n))  # trio may hand back a bytearray
        else:
            data = await s.read(n)
        self.held += len(data)
        self._limiter._add_bytes(self._peer, len(data))
        return data

    receive_some = read

    async def write(self, data: bytes) -> None:
        s = self._stream
        await (s.send_all(data) if isinstance(s, trio.abc.SendStream) else s.write(data))

    async def close(self) -> None:
        s = self._stream
        await (s.aclose() if isinstance(s, trio.abc.AsyncResource) else s.close())

    def release(self) -> None:
        self._limiter._sub_bytes(self._peer, self.held)
        self.held = 0

    def __getattr__(self, name: str) -> Any:  # a proxy: whatever the wrapped stream has
        return getattr(self._stream, name)
