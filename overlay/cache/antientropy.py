"""Anti-entropy: gossip of cache digests, and direct pulls that repair whatever gossip lost.

Contract:
- Topic per model: ``digest_topic(model_id) = "p2pnode/digest/<model_id>"``. Every node that
  routes for a model subscribes to its topic; every node that serves it also publishes there.
- Publishing (``publish_once``, run every round by ``run``): per served model one sealed digest
  per round: the delta since the version last published (empty deltas too: they carry fresh load
  figures and let receivers detect gaps), and the full state every ``full_every``-th round when
  it fits ``gossip_full_limit`` bytes. The round interval stretches to keep each topic well under
  gossipsub's spam cap of 10 msg/s per (forwarding peer, topic): a relay forwards every origin's
  digests, so the interval is at least ``publishers / topic_budget_msgs_per_s`` seconds. A round
  comes early (within ``change_poll_s``) when the cache changed or the push-back flag flipped,
  paid from a token bucket of ``publish_burst`` messages refilled at one per interval, so the
  average rate stays within the budget. A node whose cache and load figures are as last
  published skips up to ``quiet_rounds`` rounds in a row: an idle swarm's heartbeats were most
  of an idle node's CPU (each one is sent and received about D times): with them an idle node
  at 16 nodes used 4.65 % of a core, without them 2.39 % (``bench/overlay_join_processes.py``).
- Gossip past ``max_age_s`` is dropped by pubsub, never forwarded (``set_topic_expiry``,
  ``patches/safepubsub.py``); it still counts as dropped ``expired``, its publisher as heard.
- Receiving (``ingest``): open and verify the envelope (``overlay.digest.open_digest``), check the
  topic's model, apply to ``PeerViews``. A gossiped digest must be signed by the message's
  publisher (gossipsub's strict signing authenticates ``from_id``): a digest of B published by
  anyone else (a replay, or a forgery) is dropped as ``wrong_signer``; a pulled one must be
  signed by the peer it was pulled from. Every refusal is counted by reason (``drops``, plus the
  prometheus counter when a registry is given); STALE results are counted as ``stale``.
- Repair: a GAP (lost delta, restart, new peer) of a peer we hold a live link to (up or
  suspect in the peer table; for any other the next full digest repairs the view, since a
  pull would dial it) schedules a pull of that (peer, model) over the
  stream protocol ``/p2pnode/digest/1`` (one ``digest-pull`` frame -> one ``digest-reply`` frame
  with a sealed digest: a delta when the origin's log still covers our version, else full).
  Pulls are deduplicated and at most one per ``pull_min_interval`` per (peer, model). Convergence
  therefore needs only *some* later message from the origin to arrive, not every message.
- A new link's hello swaps the two sides' full digests once both passed the checks
  (``OverlayHost.swap_digests_on_hello``, ``overlay/net/hello.py``; taken through ``ingest``
  like a pulled one, counted in ``status()["hello"]``). A peer that comes up whose view we
  still lack is pulled at once for each of our models its signed record says it serves
  (waiting up to ``RECORD_WAIT_S`` for the record): with bounded connections a node links to
  peers whose gossip it has not heard yet, and the origin's publish interval grows with the
  number of publishers (64 nodes: ~16 s a round), so waiting for gossip left views missing
  for minutes while the links churned.
- A pull may take ``PULL_ROUND_TRIPS`` of the peer's retransmission timeout (``PeerTable.rto``)
  within [``pull_timeout_s``, ``MAX_PULL_TIMEOUT_S``]: at a 2.4 s loaded round trip (64
  processes on 2 cores) a fixed 5 s ended 2,472 of 2,795 pulls before their answer.
- A view silent for ``silent_pull_rounds`` publish intervals is pulled too (its origin's gossip
  does not reach us, so no gap would show). Pulls are jittered (``pull_jitter_s``) and at most
  ``max_concurrent_pulls`` run at once.
- Views of down peers are kept (the router skips them; a flapping link needs no re-pull);
  views silent for ``PeerViews.expire_after_s`` (or ``EXPIRE_ROUNDS`` intervals) expire.
- ``drop_filter(topic, data) -> bool`` lets tests discard received gossip on purpose.
- Per-peer limits (``overlay/limits.py``, one ``PeerLimiter`` shared with the node's other
  handlers): gossip is charged per publisher in messages and bytes before its signature is
  checked (over: dropped as ``rate_limited``); digests over ``max_digest_bytes`` /
  ``max_digest_fingerprints``, or growing a view past ``max_view_fingerprints``, are dropped as
  ``oversized``; pulls we serve take a ``digest_pull`` stream slot and rate token per peer (over:
  ``digest-unavailable`` with a reason starting ``limited:``, surfaced as ``PullFailed``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry

from p2pnode.errors import P2PNodeError
from p2pnode.identity import peek_timestamp
from p2pnode.overlay import wire
from p2pnode.overlay._streams import close_quietly
from p2pnode.overlay.cache.aeconfig import (
    EXPIRE_ROUNDS,
    MAX_PULL_TIMEOUT_S,
    PULL_ROUND_TRIPS,
    RECORD_WAIT_S,
    AntiEntropyConfig,
    GossipMetrics,
)
from p2pnode.overlay.cache.digest import (
    MAX_DIGEST_BYTES,
    MAX_MODEL_ID_LEN,
    DigestBuilder,
    DigestError,
    LoadInfo,
    open_digest,
    seal_digest,
)
from p2pnode.overlay.cache.views import ApplyResult, PeerViews
from p2pnode.overlay.limits import LimitExceeded, PeerLimiter, remote_peer
from p2pnode.overlay.peers import PeerState

if TYPE_CHECKING:
    from libp2p.abc import INetStream
    from libp2p.pubsub.pb import rpc_pb2

    from p2pnode.identity import NodeKey
    from p2pnode.overlay.seams import OverlayHost, Stream, Subscription

log = logging.getLogger("p2pnode.overlay.cache.antientropy")
# A pull refused by the peer's limits: ``digest-unavailable`` whose reason starts with this.
_LIMITED = f"{LimitExceeded.reason}:"

DIGEST_PROTOCOL = "/p2pnode/digest/1"
TOPIC_PREFIX = "p2pnode/digest/"


def digest_topic(model_id: str) -> str:
    return TOPIC_PREFIX + model_id


@wire.message("digest-pull")
@dataclass(frozen=True)
class DigestPull:
    model_id: str = field(metadata=wire.bounded(min_len=1, max_len=MAX_MODEL_ID_LEN))
    have_epoch: int | None = field(default=None, metadata=wire.bounded(ge=0, le=2**64 - 1))
    have_version: int | None = field(default=None, metadata=wire.bounded(ge=0, le=2**63 - 1))


@wire.message("digest-reply")
@dataclass(frozen=True)
class DigestReply:
    envelope: bytes = field(metadata=wire.bounded(max_len=MAX_DIGEST_BYTES))


@wire.message("digest-unavailable")
@dataclass(frozen=True)
class DigestUnavailable:
    model_id: str = field(metadata=wire.bounded(max_len=MAX_MODEL_ID_LEN))
    reason: str = field(metadata=wire.bounded(max_len=256))


class PullFailed(P2PNodeError):
    """A direct digest pull did not produce a usable digest; the message says why."""

    reason = "pull_failed"


class AntiEntropy:
    """Gossip and repair of digests for one node. Start with ``await nursery.start(ae.run)``."""

    def __init__(
        self,
        node: OverlayHost,
        key: NodeKey,
        views: PeerViews,
        *,
        builders: dict[str, DigestBuilder] | None = None,
        models: Iterable[str] = (),
        config: AntiEntropyConfig | None = None,
        registry: CollectorRegistry | None = None,
        drop_filter: Callable[[str, bytes], bool] | None = None,
        limiter: PeerLimiter | None = None,
    ) -> None:
        self.node = node
        self.key = key
        self.views = views
        self.builders = dict(builders or {})
        self.models = sorted(set(models) | set(self.builders))
        self.config = config or AntiEntropyConfig()
        self.metrics = GossipMetrics(registry) if registry is not None else None
        self.drop_filter = drop_filter
        self.limiter = limiter if limiter is not None else PeerLimiter()
        self.drops: dict[str, int] = {}
        self.results: dict[str, int] = {}
        self.pulls: dict[str, int] = {}
        self.hello: Counter[str] = Counter()  # digests swapped in hellos: sent, results taken
        self.round = 0
        self._published: dict[str, int] = {}  # model -> version last gossiped
        self._published_load: dict[str, LoadInfo] = {}
        self._quiet = 0  # rounds skipped in a row
        self.quiet_skipped = 0  # rounds skipped in all
        self._last_interval = self.config.interval_s
        self._last_pull: dict[tuple[str, str], float] = {}
        self._pending_pulls: set[tuple[str, str]] = set()
        self._publishers: dict[str, dict[str, float]] = {}  # topic -> origin -> last heard
        self._nursery: trio.Nursery | None = None
        self._pull_slots = trio.CapacityLimiter(self.config.max_concurrent_pulls)

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Subscribe, serve pulls, publish every round; runs until cancelled."""
        self.node.set_stream_handler(DIGEST_PROTOCOL, self._serve_pull)
        self.node.swap_digests_on_hello(self.hello_digests, self.take_hello_digests)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.node.peers.add_listener(self._on_peer_state)
                for model in self.models:
                    sub = await self._subscribe(model)
                    nursery.start_soon(self._receive_loop, model, sub)
                nursery.start_soon(self._publish_loop)
                task_status.started()
        finally:
            # Leave the topics so peers stop sending us digests nobody will read (and a node
            # shutting down does not receive gossip after its pubsub stopped).
            self._nursery = None
            self.node.swap_digests_on_hello(tuple, lambda _peer, _digests: None)
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                for model in self.models:
                    with contextlib.suppress(Exception):
                        await self.node.pubsub.unsubscribe(digest_topic(model))

    async def follow(self, model: str) -> None:
        """Also receive the digests of ``model`` from now on (a node that routes a model it
        does not run: the swarm's other models)."""
        if model in self.models:
            return
        self.models = sorted({*self.models, model})
        if self._nursery is not None:  # running: subscribe now (else run subscribes)
            sub = await self._subscribe(model)
            self._nursery.start_soon(self._receive_loop, model, sub)

    async def _subscribe(self, model: str) -> Subscription:
        topic, expired = digest_topic(model), functools.partial(self._expired, model)
        self.node.pubsub.set_topic_expiry(topic, peek_timestamp, self.config.max_age_s, expired)
        return await self.node.pubsub.subscribe(topic)

    def _expired(self, model: str, publisher: str) -> None:
        """Too old to apply; its publisher still counts (else rounds shrink when swarms are busy)."""
        self._count_drop("expired")
        self._publishers.setdefault(digest_topic(model), {})[publisher] = trio.current_time()

    # -- publishing -------------------------------------------------------------------------

    def effective_interval(self, model: str) -> float:
        now = trio.current_time()
        heard = self._publishers.get(digest_topic(model), {})
        memory = self._publisher_memory()
        publishers = 1 + sum(1 for t in heard.values() if now - t < memory)
        return max(self.config.interval_s, publishers / self.config.topic_budget_msgs_per_s)

    def status(self) -> dict[str, object]:
        """``GET /status``'s gossip: this node's round interval (it grows with the publishers
        heard), those publishers, rounds, and what came of digests, drops, pulls and hellos."""
        now, memory = trio.current_time(), self._publisher_memory()
        return {
            "interval_s": round(self.publish_interval(), 2),
            "publishers_heard": {
                m: sum(
                    1
                    for t in self._publishers.get(digest_topic(m), {}).values()
                    if now - t < memory
                )
                for m in self.models
            },
            "rounds": self.round,
            "quiet_skipped": self.quiet_skipped,
            "results": dict(self.results),
            "drops": dict(self.drops),
            "pulls": dict(self.pulls),
            "hello": dict(self.hello),
        }

    def _publisher_memory(self) -> float:
        # A quiet publisher is still one: remember it past its longest silence.
        rounds = self.config.quiet_rounds + 2
        return max(self.config.publisher_memory_s, rounds * self._last_interval)

    def publish_interval(self) -> float:
        return max([self.config.interval_s, *(self.effective_interval(m) for m in self.builders)])

    def has_news(self) -> bool:
        """A served model's cache changed, or its push-back flag flipped, since last published."""
        for model, builder in self.builders.items():
            if builder.pending or builder.version != self._published.get(model):
                return True
            if builder.load_fn().push_back != self._push_back(model):
                return True
        return False

    def _push_back(self, model: str) -> bool:
        load = self._published_load.get(model)
        return load is not None and load.push_back

    def _unchanged(self) -> bool:
        """Every served model's cache and load figures are as last published."""
        return all(
            not b.pending
            and b.version == self._published.get(m)
            and b.load_fn() == self._published_load.get(m)
            for m, b in self.builders.items()
        )

    async def _publish_loop(self) -> None:
        # A token bucket keeps the average rate at one message per interval (the topic budget);
        # its burst lets a change go out within change_poll_s instead of waiting for the next
        # round, and the following heartbeat then waits for a new token.
        tokens = float(self.config.publish_burst)
        last = trio.current_time()
        next_round = last
        while True:
            now = trio.current_time()
            interval = self._last_interval = self.publish_interval()
            tokens = min(float(self.config.publish_burst), tokens + (now - last) / interval)
            last = now
            due = now >= next_round
            if due and self._quiet < self.config.quiet_rounds and self._unchanged():
                self._quiet += 1
                self.quiet_skipped += 1
            elif tokens >= 1 and (due or self.has_news()):
                tokens -= 1
                self._quiet = 0
                await self.publish_once()
            else:
                await trio.sleep(self.config.change_poll_s)
                continue
            # Views of peers the table reports down are kept (the router skips down peers):
            # dropping them made every flap of a busy link cost a full re-pull, and on loaded
            # machines those pulls fed the lag that made links flap.
            self.views.stretch_expiry(EXPIRE_ROUNDS * interval)
            self.views.expire()
            self._pull_silent(interval)
            next_round = trio.current_time() + interval
            await trio.sleep(self.config.change_poll_s)

    def _pull_silent(self, interval: float) -> None:
        """Pull views that heard nothing for ``silent_pull_rounds`` intervals: their origin's
        gossip does not reach us (a broken mesh path), so no gap would ever be noticed."""
        limit = self.config.silent_pull_rounds * interval
        for model in self.models:
            for view in self.views.live(model):
                silent = self.views.silent_s(view.peer_id, model)
                if silent is not None and silent > limit:
                    self.request_pull(view.peer_id, model)

    async def publish_once(self) -> None:
        full_round = self.round % self.config.full_every == 0
        self.round += 1
        for model, builder in self.builders.items():
            data, kind = self._next_message(model, builder, full_round)
            try:
                await self.node.pubsub.publish(digest_topic(model), data)
            except Exception as exc:  # no peers yet, or pubsub shutting down: next round retries
                log.debug("digest publish on %s failed: %r", model, exc)
                continue
            self._published[model] = builder.version
            self._published_load[model] = builder.load_fn()
            if self.metrics is not None:
                self.metrics.published.labels(kind).inc()
                self.metrics.published_bytes.inc(len(data))

    def _next_message(
        self, model: str, builder: DigestBuilder, full_round: bool
    ) -> tuple[bytes, str]:
        base = self._published.get(model)
        if full_round or base is None:
            with contextlib.suppress(DigestError):  # too big for one message: deltas + pulls
                data = seal_digest(self.key, builder.full())
                if len(data) <= self.config.gossip_full_limit:
                    return data, "full"
        # Deltas from the version last published; receivers that missed one pull.
        digest = builder.delta_since(builder.version if base is None else base)
        try:
            return seal_digest(self.key, digest), "full" if digest.is_full else "delta"
        except DigestError:
            # A delta too large for one message: publish an empty delta from the current
            # version; receivers see the gap and pull the whole state directly.
            return seal_digest(self.key, builder.delta_since(builder.version)), "delta"

    # -- receiving --------------------------------------------------------------------------

    async def _receive_loop(self, model: str, sub: Subscription) -> None:
        topic = digest_topic(model)
        while True:
            msg = await sub.get()
            data = bytes(msg.data)
            if self.drop_filter is not None and self.drop_filter(topic, data):
                continue
            publisher = _publisher(msg)
            if publisher is None:
                self._count_drop("wrong_signer")
                continue
            self.ingest(data, model=model, source="gossip", expected_peer=publisher)

    def _count_drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.dropped.labels(reason).inc()

    def ingest(
        self, data: bytes, *, model: str | None, source: str, expected_peer: str | None = None
    ) -> ApplyResult | None:
        """Verify and apply one sealed digest received for ``model`` (None: any model we
        follow); None when dropped."""
        limits = self.limiter.config
        try:
            if source == "gossip" and expected_peer is not None:
                # Per-publisher rates, charged before the signature check costs us anything.
                self.limiter.charge(expected_peer, "digest_gossip")
                self.limiter.charge(expected_peer, "digest_gossip_bytes", len(data))
            digest = open_digest(
                data,
                max_age=self.config.max_age_s,
                expected_peer=expected_peer,
                max_size=limits.max_digest_bytes,
                max_fingerprints=limits.max_digest_fingerprints,
            )
        except LimitExceeded as exc:
            self._count_drop("rate_limited")
            log.debug("digest dropped: %s", exc)
            return None
        except DigestError as exc:
            log.debug("digest dropped (%s): %s", exc.reason, exc)
            if exc.reason == "expired" and source == "gossip" and expected_peer is not None:
                self._expired(model, expected_peer)
            else:
                self._count_drop(exc.reason)
            return None
        if digest.peer_id == self.node.peer_id:
            return None  # our own publication, echoed by gossipsub
        if model is None and digest.model_id in self.models:
            model = digest.model_id
        if digest.model_id != model:
            self._count_drop("wrong_model")
            return None
        view = self.views.get(digest.peer_id, model)
        held = 0 if view is None or digest.is_full or digest.cleared else len(view.fingerprints)
        try:
            self.limiter.check_view_growth(digest.peer_id, held, len(digest.added))
        except LimitExceeded as exc:
            self._count_drop("oversized")
            log.debug("digest dropped: %s", exc)
            return None
        topic = digest_topic(model)
        self._publishers.setdefault(topic, {})[digest.peer_id] = trio.current_time()
        result = self.views.apply(digest)
        self.results[result.value] = self.results.get(result.value, 0) + 1
        if self.metrics is not None:
            self.metrics.received.labels(result.value, source).inc()
        if result is ApplyResult.STALE:
            self._count_drop("stale")
        elif result is ApplyResult.GAP and source == "gossip":
            self.request_pull(digest.peer_id, model)
        return result

    def hello_digests(self) -> tuple[bytes, ...]:
        """Our full digest of each served model, sealed now, for a new link's hello."""
        out = []
        for builder in self.builders.values():
            with contextlib.suppress(DigestError):  # too big for one digest: pulled instead
                out.append(seal_digest(self.key, builder.full()))
        self.hello["sent"] += len(out)
        return tuple(out)

    def take_hello_digests(self, peer_id: str, digests: tuple[bytes, ...]) -> None:
        """The digests a checked peer's hello carried: applied as a pulled one would be."""
        for data in digests:
            result = self.ingest(data, model=None, source="hello", expected_peer=peer_id)
            self.hello["dropped" if result is None else result.value] += 1

    # -- pulls --------------------------------------------------------------------------------

    def _on_peer_state(self, peer_id: str, old: PeerState | None, new: PeerState) -> None:
        if new is PeerState.UP and old not in (PeerState.UP, PeerState.SUSPECT) and self._nursery:
            self._nursery.start_soon(self._pull_new_peer, peer_id)

    async def _pull_new_peer(self, peer_id: str) -> None:
        # Its signed record says which models it serves; it may arrive a moment after the
        # link. Without one (a bootstrap's, say, before its record came) nothing is pulled:
        # a pull of a model the peer does not serve is a stream for nothing, to the node
        # every joiner links to first.
        with trio.move_on_after(RECORD_WAIT_S):
            # The peer table has no record event to wait on; a few polls, bounded above.
            while (entry := self.node.peers.get(peer_id)) is None or entry.record is None:  # noqa: ASYNC110
                await trio.sleep(0.25)
        entry = self.node.peers.get(peer_id)
        if entry is None or entry.record is None or not self.node.peers.is_up(peer_id):
            return
        for model in self.models:
            if model in entry.record.models and self.views.get(peer_id, model) is None:
                self.pulls["on_up"] = self.pulls.get("on_up", 0) + 1
                self.request_pull(peer_id, model)

    def request_pull(self, peer_id: str, model: str) -> None:
        """Schedule a (deduplicated, rate-limited) pull of ``peer_id``'s digest for ``model``."""
        key = (peer_id, model)
        if key in self._pending_pulls or self._nursery is None:
            return
        if self.node.peers.state(peer_id) not in (PeerState.UP, PeerState.SUSPECT):
            # The pull would dial a peer we hold no link to. With bounded connections most
            # publishers are such peers, and those dials (32 node processes: ~260 a minute,
            # the most of any dialer) grew every node's links past its high mark, to be
            # trimmed and dialed again. The publisher's next full digest repairs the view.
            self.pulls["unconnected"] = self.pulls.get("unconnected", 0) + 1
            return
        self._pending_pulls.add(key)
        self._nursery.start_soon(self._pull_task, peer_id, model)

    async def _pull_task(self, peer_id: str, model: str) -> None:
        key = (peer_id, model)
        try:
            wait = (
                self._last_pull.get(key, -math.inf)
                + self.config.pull_min_interval_s
                - trio.current_time()
            )
            # Jitter and a few pulls at a time: a node joining (or a burst of lost gossip) makes
            # everyone pull at once otherwise, each pull a new negotiated stream.
            await trio.sleep(max(0.0, wait) + random.uniform(0.0, self.config.pull_jitter_s))
            async with self._pull_slots:
                self._last_pull[key] = trio.current_time()
                try:
                    await self.pull(peer_id, model)
                except PullFailed as exc:
                    log.info("digest pull from %s failed: %s", peer_id, exc)
        finally:
            self._pending_pulls.discard(key)

    def _count_pull(self, result: str) -> None:
        self.pulls[result] = self.pulls.get(result, 0) + 1
        if self.metrics is not None:
            self.metrics.pulls.labels(result).inc()

    def pull_timeout(self, peer_id: str) -> float:
        """How long a pull from ``peer_id`` may take (module contract)."""
        floor = self.config.pull_timeout_s / PULL_ROUND_TRIPS
        ceiling = max(floor, MAX_PULL_TIMEOUT_S / PULL_ROUND_TRIPS)
        return PULL_ROUND_TRIPS * self.node.peers.rto(peer_id, floor, ceiling)

    async def pull(self, peer_id: str, model: str) -> ApplyResult | None:
        """Fetch ``peer_id``'s digest for ``model`` over a direct stream and apply it."""
        have = self.views.version_of(peer_id, model)
        request = DigestPull(model, *(have or (None, None)))
        limit = wire.limit_for(DIGEST_PROTOCOL)
        timeout = self.pull_timeout(peer_id)
        try:
            with trio.fail_after(timeout):
                stream = await self.node.open_stream(peer_id, DIGEST_PROTOCOL, timeout=timeout)
                try:
                    await wire.write_frame(stream, wire.to_wire(request), limit=limit)
                    reply = wire.from_wire(
                        await wire.read_frame(stream, limit=limit), DigestReply, DigestUnavailable
                    )
                finally:
                    with trio.move_on_after(1):
                        await close_quietly(stream)
        except trio.TooSlowError:
            self._count_pull("timeout")
            raise PullFailed(f"no reply within {timeout:.1f} s") from None
        except Exception as exc:  # unreachable peer, reset stream, malformed frame
            self._count_pull("error")
            raise PullFailed(f"{type(exc).__name__}: {exc}") from None
        if isinstance(reply, DigestUnavailable) and reply.reason.startswith(_LIMITED):
            self._count_pull(LimitExceeded.reason)
            raise PullFailed(f"{peer_id} refused the pull: {reply.reason}")
        if isinstance(reply, DigestUnavailable):
            self._count_pull("unavailable")
            raise PullFailed(f"peer has no digest for {model}: {reply.reason}")
        result = self.ingest(reply.envelope, model=model, source="pull", expected_peer=peer_id)
        self._count_pull("ok" if result is ApplyResult.APPLIED else "not_applied")
        return result

    async def _serve_pull(self, stream: INetStream) -> None:
        """Per-peer limits (overlay/limits.py) around ``_answer_pull``."""
        peer = remote_peer(stream)
        try:
            with self.limiter.admit(peer, "digest_pull"):
                await self._answer_pull(stream)
        except LimitExceeded as exc:
            refusal = DigestUnavailable("", f"{exc.reason}: {exc}"[:256])
            with trio.move_on_after(1):
                limit = wire.limit_for(DIGEST_PROTOCOL)
                await wire.write_frame(stream, wire.to_wire(refusal), limit=limit)

    async def _answer_pull(self, stream: Stream) -> None:
        limit = wire.limit_for(DIGEST_PROTOCOL)
        with trio.fail_after(self.config.pull_timeout_s):
            request = wire.from_wire(await wire.read_frame(stream, limit=limit), DigestPull)
            builder = self.builders.get(request.model_id)
            if builder is None:
                reply: DigestReply | DigestUnavailable = DigestUnavailable(
                    request.model_id, "model not served here"
                )
            else:
                if request.have_epoch == builder.epoch and request.have_version is not None:
                    digest = builder.delta_since(request.have_version)
                else:
                    digest = builder.full()
                try:
                    reply = DigestReply(seal_digest(self.key, digest))
                except DigestError as exc:  # a cache too large for one digest at fp_bits
                    reply = DigestUnavailable(request.model_id, str(exc)[:256])
            await wire.write_frame(stream, wire.to_wire(reply), limit=limit)


def _publisher(msg: rpc_pb2.Message) -> str | None:
    """Peer id of a gossip message's original publisher (gossipsub verified its signature)."""
    from libp2p.peer.id import ID

    try:
        return ID(bytes(msg.from_id)).to_base58() if msg.from_id else None
    except Exception:  # unparsable id bytes: treat as unauthenticated
        return None
