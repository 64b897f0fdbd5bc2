"""WAN-aware, cache-aware routing: pick the node (local included) that should serve a request.

One file (~750 lines) on purpose: the cost formula, its margin rule and every knob with the
measurement behind it read best beside the one class that applies them; what the router learns from
lives in its own modules (``netcost.py``, ``inference/lengths.py``, ``sessions.py``), and where a
miss is placed in ``placement.py``.

Contract:
- For every candidate the router estimates the completion time of the request there:
  ``total = network + queue wait + overhead + prefill(prompt - cached) + decode(expected tokens)
  + hold + lookahead``
  with, for a peer: the forward's network cost learned from earlier forwards (``overlay/routing/netcost.py``:
  ``round_trips * rtt + bytes / bandwidth`` plus a per-peer bias, fitted online; the smoothed RTT
  of the peer table, ``default_rtt_s`` while none is measured), the wait and the per-token speeds
  the peer advertises in its digests (our own speeds when it advertises none), plus the service
  time of requests this router already sent there and that the peer's digests cannot show yet
  (``inflight``), less the work of its forwards there that the digest still counts as queued
  but that have finished since it was issued (``note_done``: see ``_digest_wait``); the cached
  prefix is the view's estimate times the peer's measured
  *confidence*: an EWMA of real / estimated cached tokens reported by the requests it served
  (stale views cost what they really cost), and times its *digest credit*: first tokens this
  node measured itself against what the digest promised (``observe_first_token``); a peer
  whose first tokens keep arriving far later than its claimed cache and speeds allow has its
  digest's cache claims discounted, then ignored (a forged digest draws nothing for long). What this node itself forwarded to a peer counts as
  cached there too (``note_forwarded``): a chat's history is used once, so it is never advertised,
  yet its next turn should follow it. For the local node: no network, the engine's exact
  cached prefix and calibrated speeds, and its wait for this very request
  (``estimated_wait_s(uncached tokens)``: prefills share the engine's steps round robin, so a
  short one behind a long miss waits for a chunk of it, not all of it); a peer's digest can
  only carry the bound for any request, so a busy peer looks busier than it is for a short
  one, which errs towards serving here. ``expected_tokens`` is the predicted output length
  (``inference/lengths.py``), never more than ``max_tokens``. ``hold`` is how long the answer
  would wait here for its audit before release (``hold_s``; a peer on probation,
  ``overlay/trust/audit.py``: the origin's scoring pass over prompt and answer); it is what makes a
  forward to a fresh identity a loss on a fast link, and it ends once the peer has passed its
  probation (``overlay/trust/challenge.py`` gets it there without client traffic). A peer whose
  answer could not be audited in time (``hold_s`` infinite) is skipped as "no_audit": a
  probation answer is never released unchecked. ``lookahead`` is
  ``future_turns * network`` for a chat turn: the session's history stays where this turn
  runs, so its later turns (``overlay/routing/sessions.py`` predicts how many) pay that forward's
  network cost again; serving here pays it never.
- A peer is chosen only when ``total_peer + margin < total_local`` where
  ``margin = max(abs_margin_s, rel_margin * (wait_local + prefill_local), margin_sigmas * spread)``:
  the relative part applies to what differs between candidates (queue and prefill), not to a
  decode time every candidate pays; ``spread`` is the standard deviation of the network cost's
  residuals (one round trip before any forward was measured). Peers in push-back, down in the
  peer table, demoted by the ``trust`` book (``overlay/trust/book.py``: "untrusted"), or without a
  live view are skipped (the reason is recorded).
- **Placement on misses** (``overlay/routing/placement.py``): a prompt whose leading blocks no
  eligible candidate holds goes to its rendezvous home, so misses of one prefix converge on one
  node.
- ``decide`` returns a ``RoutingDecision``: every candidate's estimate, the choice, and
  ``attempts``: the order to try (the chosen peer, then other peers that also beat local, at most
  ``max_remote_attempts``, then local when the node serves the model). Each decision is logged as
  one JSON line on logger ``p2pnode.overlay.routing.router`` (INFO; the ``log_candidates`` best
  candidates, chosen and local always included, and how many were left out) and counted in the
  prometheus registry passed in (never the global one). ``decide(record=False)`` is a dry run:
  neither logged nor counted.
- ``PushBack(high, low)``: hysteresis for the flag a node advertises: on at ``queue_depth >= high``,
  off again at ``queue_depth <= low``.
- Bound on what a node keeps (``overlay/cache/scope.py``): the router reads only ``views.live()``; with
  ``ScopedViews`` that is the peers within ``rtt_budget_s = max_prompt_tokens *
  prefill_s_per_token / (forward_round_trips + rtt_margin)`` (farther ones cannot win by the
  margin rule above: the most a peer can save is a full prefill of the longest prompt, and a
  forward costs ``forward_round_trips`` RTTs plus a margin of one), at most ``max_views`` of
  them, nearest first, plus the ``k_nearest`` always (and, with cells, the node's whole cell):
  memory and digest traffic per node are O(max_views + k_nearest), whatever the swarm's size;
  the hot-prefix summary that names far holders of the most served prefixes
  (``testnet/sim/hotprefix.py``) adds O(max_keys * max_zones * holders_per_zone) to both.
  Placement and scope are one design: the home of a miss is ranked over the peers in scope (or
  the cell), the same leading blocks are the placement key and the key of the prefix lookup
  that finds far holders of a long prefix, and the holders a lookup finds are admitted to the
  views for the decision, where cost routing weighs them like any peer.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from p2pnode.inference.blockhash import BLOCK_SIZE
from p2pnode.overlay.cache.views import PeerView, PeerViews, prefix_tokens
from p2pnode.overlay.routing.netcost import ForwardCost
from p2pnode.overlay.routing.placement import LOCAL, placement_home

if TYPE_CHECKING:
    from p2pnode.overlay.peers import PeerTable
    from p2pnode.overlay.trust.book import TrustBook

log = logging.getLogger("p2pnode.overlay.routing.router")

# Bytes of a forward request: CBOR ints up to 65535 take 3 bytes, plus framing and parameters.
REQUEST_BYTES_PER_TOKEN = 3
REQUEST_OVERHEAD_BYTES = 256


@dataclass(frozen=True, slots=True)
class LocalState:
    """What the local engine says about this request right now."""

    cached_tokens: int
    wait_s: float
    prefill_s_per_token: float
    decode_s_per_token: float
    overhead_s: float = 0.0
    available: bool = True  # False on a node that serves no engine for this model


@dataclass(slots=True)
class CandidateEstimate:  # read-only by convention: not frozen, a frozen init costs 6x more
    peer_id: str
    is_local: bool
    cached_tokens: int  # expected cached tokens used in the estimate
    view_cached_tokens: int  # what the view says (before the confidence factor)
    rtt_s: float
    transfer_s: float
    wait_s: float
    prefill_s: float
    decode_s: float
    overhead_s: float
    total_s: float
    network_s: float = 0.0  # the forward's learned network cost (0 for local)
    rtt_known: bool = True
    info_age_s: float | None = None
    confidence: float = 1.0
    skipped: str | None = None  # why it cannot be chosen (push_back, down, ...)
    hold_s: float = 0.0  # the answer's wait for its probation audit at this node
    lookahead_s: float = 0.0  # network cost the session's later turns pay there (chat)


@dataclass(frozen=True)
class RoutingDecision:
    request_id: str
    model_id: str
    prompt_tokens: int
    max_tokens: int
    chosen: str  # peer id, or LOCAL
    reason: str
    margin_s: float
    candidates: tuple[CandidateEstimate, ...]
    attempts: tuple[str, ...]  # order to try; LOCAL last when the node serves the model
    local_total_s: float | None = None
    expected_tokens: float | None = None
    placement_home: str | None = None  # the rendezvous home on a miss (peer id or LOCAL)

    @property
    def chosen_is_local(self) -> bool:
        return self.chosen == LOCAL

    def estimate_for(self, peer_id: str) -> CandidateEstimate | None:
        return next((c for c in self.candidates if c.peer_id == peer_id), None)

    def to_log(self, max_candidates: int | None = None) -> dict[str, Any]:
        """Plain dict for the decision log: every field, candidates best first; with
        ``max_candidates`` only that many (the chosen one and local always kept) and the count
        of the others in ``candidates_omitted``."""
        kept = list(self.candidates)
        if max_candidates is not None and len(kept) > max_candidates:
            must = {self.chosen, LOCAL}
            best = kept[:max_candidates]
            best += [c for c in kept[max_candidates:] if c.peer_id in must]
            kept = best
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["candidates"] = [_candidate_log(c) for c in kept]
        out["candidates_omitted"] = len(self.candidates) - len(kept)
        out["attempts"] = list(self.attempts)
        return out


_CANDIDATE_FIELDS = tuple(f.name for f in fields(CandidateEstimate))


def _candidate_log(c: CandidateEstimate) -> dict[str, Any]:
    out = {}
    for name in _CANDIDATE_FIELDS:
        v = getattr(c, name)
        out[name] = round(v, 6) if isinstance(v, float) else v
    return out


# Queue depth that turns push-back on (a node's --pushback-threshold; the one definition).
DEFAULT_PUSHBACK_HIGH = 8


class PushBack:
    """Hysteresis for the push-back flag: on at ``depth >= high``, off at ``depth <= low``."""

    def __init__(self, high: int, low: int | None = None) -> None:
        low = high // 2 if low is None else low
        if not 0 <= low < high:
            raise ValueError(f"need 0 <= low < high for push-back, got low={low}, high={high}")
        self.high = high
        self.low = low
        self.active = False

    def update(self, queue_depth: int) -> bool:
        if queue_depth >= self.high:
            self.active = True
        elif queue_depth <= self.low:
            self.active = False
        return self.active


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "p2pnode_routing_decisions",
            "Routing decisions by target kind and reason",
            ["target", "reason"],
            registry=registry,
        )
        self.skipped = Counter(
            "p2pnode_routing_skipped_candidates",
            "Peers not eligible for a request, by reason",
            ["reason"],
            registry=registry,
        )
        self.saving = Histogram(
            "p2pnode_routing_estimated_saving_seconds",
            "Estimated local minus chosen completion time",
            buckets=(0, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, math.inf),
            registry=registry,
        )
        self.cache_error = Histogram(
            "p2pnode_routing_cache_estimate_error_tokens",
            "Estimated minus real cached tokens on forwarded requests",
            buckets=(-256, -64, -16, 0, 16, 64, 256, 1024, math.inf),
            registry=registry,
        )


@dataclass(slots=True)
class SentForward:
    """One forward in flight or done, as ``Router.note_sent`` returns it and ``note_done``
    takes it back: times on the views' wall clock, the clock digests are stamped with."""

    work_s: float  # its own prefill and decode at the peer, as estimated when it was sent
    sent_at: float
    done_at: float | None = None


# Forwards remembered per peer to correct its digests: a digest older than the last few dozen
# of this router's forwards there has been replaced long since.
_FORWARDS_KEPT = 64


@dataclass
class _PeerStats:
    confidence: float = 1.0
    # How far this node believes the peer's digest, from first-token times it measured itself
    # (``observe_first_token``): halved on each contradiction, regained slowly.
    digest_credit: float = 1.0
    inflight_s: float = 0.0
    inflight: int = 0
    forwards: deque[SentForward] = field(default_factory=lambda: deque(maxlen=_FORWARDS_KEPT))
    served: int = 0
    # Block hashes of what this node forwarded there (prompt and answer), newest last: the
    # peer caches them, but a block used once is never advertised (overlay/cache/privacy.py), so
    # only the origin knows a chat's history lives there.
    sent: OrderedDict[int, None] = field(default_factory=OrderedDict)


@dataclass
class RouterConfig:
    rel_margin: float = 0.05
    abs_margin_s: float = 0.02
    default_rtt_s: float = 1.0  # unmeasured peers look far away until pinged
    # A forward must beat local by this many standard deviations of its network cost: the
    # estimate's own uncertainty, learned with it (overlay/routing/netcost.py).
    margin_sigmas: float = 1.0
    max_remote_attempts: int = 2
    confidence_alpha: float = 0.3
    min_confidence: float = 0.05
    # A forward's first token contradicts the peer's digest when it arrives later than
    # ttft_factor x the estimate built on that digest (its cached prefix, speeds and queue) plus
    # ttft_slack_s; below digest_ignore_below the digest's cache claims are ignored.
    ttft_factor: float = 4.0
    ttft_slack_s: float = 1.0
    digest_regain: float = 0.1
    digest_ignore_below: float = 0.2
    log_candidates: int = 16  # candidates written per decision log line (best first)
    sent_memory_blocks: int = 4096  # per peer: ~64k tokens of forwarded prompts remembered
    # False: queues are ignored (every wait counts 0): the cache-only routing the paper starts
    # from, kept to measure what load awareness buys (bench/routing_bench.py).
    load_aware: bool = True
    # Placement on misses: the key is the prompt's first blocks (4 x 16 tokens: a system prompt
    # or a few-shot header, long enough to tell prefixes apart, short enough that requests
    # sharing a prefix share it); a home may cost at most this share of a full prefill more than
    # the best candidate, a bound below what a later hit there saves.
    placement: bool = True
    placement_blocks: int = 4
    placement_share: float = 0.5

    def __post_init__(self) -> None:
        if not (0 <= self.rel_margin < 1 and self.abs_margin_s >= 0):
            raise ValueError("router margins must be >= 0 (rel < 1)")
        if self.max_remote_attempts < 0 or self.default_rtt_s < 0 or self.margin_sigmas < 0:
            raise ValueError("max_remote_attempts, default_rtt_s and margin_sigmas must be >= 0")
        if self.placement_blocks < 1 or not 0 <= self.placement_share <= 1:
            raise ValueError("placement_blocks >= 1 and placement_share in [0, 1]")


def rtt_from_peer_table(table: PeerTable) -> Callable[[str], float | None]:
    """Adapter: the smoothed RTT in seconds from a ``peers.PeerTable`` (None if unmeasured)."""

    def rtt(peer_id: str) -> float | None:
        entry = table.get(peer_id)
        return None if entry is None or entry.rtt_ms is None else entry.rtt_ms / 1000.0

    return rtt


class Router:
    def __init__(
        self,
        views: PeerViews,
        *,
        rtt_s: Callable[[str], float | None],
        is_up: Callable[[str], bool] | None = None,
        config: RouterConfig | None = None,
        registry: CollectorRegistry | None = None,
        trust: TrustBook | None = None,
        self_id: str | None = None,
        netcost: ForwardCost | None = None,
        hold_s: Callable[[str, int], float] | None = None,
        placement_pool: Callable[[str], bool] | None = None,
    ) -> None:
        self.views = views
        # Peers that take part in the rendezvous of placement on misses (None: every eligible
        # candidate). With scoped views, the node's cell (overlay/cache/scope.py): a set every node
        # of the cell ranks alike, where each node's own nearest peers would differ.
        self.placement_pool = placement_pool
        # This node's peer id: it takes part in the rendezvous ranking under its real name, so
        # every node ranks the same set the same way.
        self.self_id = self_id
        self.netcost = netcost if netcost is not None else ForwardCost()
        self.rtt_s = rtt_s
        # Trust hook (overlay/trust/book.py): a TrustBook, or None. Peers it finds unusable are
        # skipped as "untrusted", so their (lying) digests no longer drive decisions.
        self.trust = trust
        self.is_up = is_up or (lambda _peer: True)
        # hold_s(peer, tokens): how long a forwarded answer of that many prompt + answer tokens
        # is held here before release (a peer on probation: overlay/trust/audit.py).
        self.hold_s = hold_s
        self.config = config or RouterConfig()
        self.metrics = RouterMetrics(registry) if registry is not None else None
        self._stats: dict[str, _PeerStats] = {}

    # -- feedback -------------------------------------------------------------------------

    def confidence(self, peer_id: str) -> float:
        stats = self._stats.get(peer_id)
        return 1.0 if stats is None else stats.confidence

    def observe_served(self, peer_id: str, estimated_cached: int, real_cached: int) -> None:
        """A forwarded request reported its real cached length: update the peer's confidence."""
        if self.metrics is not None:
            self.metrics.cache_error.observe(estimated_cached - real_cached)
        if estimated_cached <= 0:
            return
        stats = self._stats.setdefault(peer_id, _PeerStats())
        ratio = min(1.0, max(0.0, real_cached / estimated_cached))
        a = self.config.confidence_alpha
        stats.confidence = max(self.config.min_confidence, (1 - a) * stats.confidence + a * ratio)
        stats.served += 1

    def note_sent(self, peer_id: str, service_s: float, work_s: float | None = None) -> SentForward:
        """A forward leaves for ``peer_id``: it costs ``service_s`` there (its wait included)
        until ``note_done``, which takes back what this returns; ``work_s`` (default
        ``service_s``) is its own share of the peer's queue."""
        stats = self._stats.setdefault(peer_id, _PeerStats())
        stats.inflight += 1
        stats.inflight_s += service_s
        sent = SentForward(service_s if work_s is None else work_s, self.views.wall_now())
        stats.forwards.append(sent)
        return sent

    def inflight(self, peer_id: str) -> int:
        """Requests this router sent to ``peer_id`` that have not finished."""
        stats = self._stats.get(peer_id)
        return 0 if stats is None else stats.inflight

    def note_done(self, peer_id: str, service_s: float, sent: SentForward | None = None) -> None:
        stats = self._stats.get(peer_id)
        if sent is not None:
            sent.done_at = self.views.wall_now()
        if stats is not None and stats.inflight > 0:
            stats.inflight -= 1
            stats.inflight_s = max(0.0, stats.inflight_s - service_s) if stats.inflight else 0.0

    def observe_forward(
        self,
        peer_id: str,
        prompt_tokens: int,
        first_token_s: float,
        engine_s: float,
        last_token_s: float | None = None,
        engine_total_s: float | None = None,
    ) -> None:
        """A forward's first token arrived after ``first_token_s`` here, its last after
        ``last_token_s``; the serving engine took ``engine_s`` to its first and
        ``engine_total_s`` in all: learn the network cost from the larger difference.

        Why the whole answer too: what a forward adds is not only its first token's way. Each
        streamed token is a frame through both hosts' encryption and muxer, on the cores the
        engines use; on a 2-core machine a 16-token chat answer took ~0.1 s longer forwarded
        than served where it entered, while its first token's difference said 0.02-0.06 s."""
        rtt = self.rtt_s(peer_id)
        if rtt is None:
            return
        seen, spent = first_token_s, engine_s
        if (
            last_token_s is not None
            and engine_total_s is not None
            and last_token_s - engine_total_s > seen - spent
        ):
            seen, spent = last_token_s, engine_total_s
        self.netcost.observe(peer_id, rtt, request_bytes(prompt_tokens), seen, spent)

    def observe_first_token(self, peer_id: str, expected_s: float, observed_s: float) -> bool:
        """The estimate built on the peer's digest predicted its first token after
        ``expected_s``; it came after ``observed_s`` (measured here). Returns True when this
        observation made the router start ignoring the peer's digest claims."""
        cfg = self.config
        stats = self._stats.setdefault(peer_id, _PeerStats())
        before = stats.digest_credit >= cfg.digest_ignore_below
        if observed_s > cfg.ttft_factor * max(0.0, expected_s) + cfg.ttft_slack_s:
            stats.digest_credit *= 0.5
        else:
            stats.digest_credit = min(1.0, stats.digest_credit + cfg.digest_regain)
        return before and stats.digest_credit < cfg.digest_ignore_below

    def digest_credit(self, peer_id: str) -> float:
        stats = self._stats.get(peer_id)
        return 1.0 if stats is None else stats.digest_credit

    def note_forwarded(self, peer_id: str, block_hashes: Sequence[int]) -> None:
        """``peer_id`` served a request whose prompt and answer have these full blocks."""
        sent = self._stats.setdefault(peer_id, _PeerStats()).sent
        for h in block_hashes:
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > self.config.sent_memory_blocks:
            sent.popitem(last=False)

    def _sent_prefix_tokens(self, stats: _PeerStats | None, block_hashes: Sequence[int]) -> int:
        if stats is None or not stats.sent:
            return 0
        n = 0
        for h in block_hashes:
            if h not in stats.sent:
                break
            n += 1
        return n * BLOCK_SIZE

    def forget_peer(self, peer_id: str) -> None:
        self._stats.pop(peer_id, None)
        self.netcost.forget_peer(peer_id)

    def learned(self) -> dict[str, Any]:
        """What the router has learned, for ``/status``."""
        return {
            "network": self.netcost.as_dict(),
            "confidence": {p: round(s.confidence, 3) for p, s in self._stats.items()},
            "digest_credit": {p: round(s.digest_credit, 3) for p, s in self._stats.items()},
        }

    # -- decision -------------------------------------------------------------------------

    def decide(
        self,
        *,
        model_id: str,
        prompt_block_hashes: Sequence[int],
        prompt_tokens: int,
        max_tokens: int,
        local: LocalState,
        exclude: frozenset[str] = frozenset(),
        record: bool = True,
        expected_tokens: float | None = None,
        future_turns: float = 0.0,
    ) -> RoutingDecision:
        expected = max_tokens if expected_tokens is None else min(expected_tokens, max_tokens)
        local_est = (
            self._local_estimate(local, prompt_tokens, expected) if local.available else None
        )
        candidates = [] if local_est is None else [local_est]
        # Per decision, not per peer: the prompt's fingerprints (per width), bytes, clock.
        fps_by_bits: dict[int, list[int]] = {}
        nbytes = request_bytes(prompt_tokens)
        now_wall = self.views.wall_now()
        for view in self.views.live(model_id):
            if view.peer_id in exclude:
                continue
            fps = fps_by_bits.get(view.fp_bits)
            if fps is None:
                shift = 64 - view.fp_bits
                fps = fps_by_bits[view.fp_bits] = [h >> shift for h in prompt_block_hashes]
            candidates.append(
                self._peer_estimate(
                    view,
                    fps,
                    prompt_block_hashes,
                    prompt_tokens,
                    expected,
                    local,
                    nbytes,
                    now_wall,
                    future_turns,
                )
            )
        eligible = sorted(
            (c for c in candidates if not c.is_local and c.skipped is None),
            key=lambda c: c.total_s,
        )
        # A chat turn with later turns to come is not placed: the session follows its first
        # turn, so a home would pull every later turn over the network and stack sessions on
        # one node, while the entry that serves the miss becomes a holder others find anyway.
        home = None
        if future_turns <= 0:
            home = self._placement_home(
                candidates, prompt_block_hashes, prompt_tokens, local, eligible
            )
        if local_est is None:
            margin = self.config.abs_margin_s
            attempts, reason = self._order_without_local(eligible, home)
        else:
            margin, attempts, reason = self._order_with_local(local_est, eligible, home)
        chosen = attempts[0] if attempts else LOCAL
        decision = RoutingDecision(
            request_id=uuid.uuid4().hex[:16],
            model_id=model_id,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            chosen=chosen,
            reason=reason,
            margin_s=margin,
            candidates=tuple(sorted(candidates, key=lambda c: c.total_s)),
            attempts=attempts,
            local_total_s=None if local_est is None else local_est.total_s,
            expected_tokens=expected,
            placement_home=home,
        )
        if record:
            self._record(decision)
        return decision

    def _order_with_local(
        self,
        local_est: CandidateEstimate,
        eligible: list[CandidateEstimate],
        home: str | None,
    ) -> tuple[float, tuple[str, ...], str]:
        """(margin, attempts, reason) on a node that serves the model: the peers that beat
        local by the margin, best first (the home alone on a miss), then local."""
        cfg = self.config
        differing = local_est.wait_s + local_est.prefill_s
        margin = max(cfg.abs_margin_s, cfg.rel_margin * differing)
        better = [c for c in eligible if c.total_s + self._margin(c, margin) < local_est.total_s]
        remote = [c.peer_id for c in better[: cfg.max_remote_attempts]]
        if home is not None and cfg.max_remote_attempts > 0:
            remote = [] if home == LOCAL else [home]
        if remote:
            reason = "placement_home" if home is not None else "remote_faster"
        elif home == LOCAL:
            reason = "placement_home"
        elif not eligible:
            reason = "local_best"
        elif cfg.max_remote_attempts == 0:
            reason = "forwarding_off"
        else:
            reason = "remote_saving_below_margin"
        return margin, (*remote, LOCAL), reason

    def _order_without_local(
        self, eligible: list[CandidateEstimate], home: str | None
    ) -> tuple[tuple[str, ...], str]:
        """(attempts, reason) on a node with no engine for the model: the best peers, the
        home of a miss first; no margin, as there is nothing to beat."""
        n = max(1, self.config.max_remote_attempts)
        remote = [c.peer_id for c in eligible[:n]]
        if home is not None and home in remote:
            remote.remove(home)
            remote.insert(0, home)
        elif home is not None:
            remote = [home, *remote[: n - 1]]
        return tuple(remote), ("no_local_engine" if remote else "no_candidate")

    def _margin(self, c: CandidateEstimate, margin: float) -> float:
        return max(margin, self.config.margin_sigmas * self.netcost.spread_s(c.rtt_s))

    def _placement_home(
        self,
        candidates: list[CandidateEstimate],
        prompt_block_hashes: Sequence[int],
        prompt_tokens: int,
        local: LocalState,
        eligible: list[CandidateEstimate],
    ) -> str | None:
        cfg = self.config
        if not cfg.placement:
            return None
        rate = local.prefill_s_per_token or max(
            (c.prefill_s / max(1, prompt_tokens - c.cached_tokens) for c in eligible), default=0
        )
        return placement_home(
            candidates,
            prompt_block_hashes,
            prompt_tokens * rate,
            blocks=cfg.placement_blocks,
            share=cfg.placement_share,
            block_size=BLOCK_SIZE,
            pool=self.placement_pool,
            self_id=self.self_id,
        )

    def _local_estimate(
        self, local: LocalState, prompt_tokens: int, expected_tokens: float
    ) -> CandidateEstimate:
        cached = _usable_cached(local.cached_tokens, prompt_tokens)
        prefill = (prompt_tokens - cached) * local.prefill_s_per_token
        decode = expected_tokens * local.decode_s_per_token
        wait = local.wait_s if self.config.load_aware else 0.0
        total = wait + local.overhead_s + prefill + decode
        return CandidateEstimate(
            peer_id=LOCAL,
            is_local=True,
            cached_tokens=cached,
            view_cached_tokens=cached,
            rtt_s=0.0,
            transfer_s=0.0,
            wait_s=wait,
            prefill_s=prefill,
            decode_s=decode,
            overhead_s=local.overhead_s,
            total_s=total,
        )

    def _peer_estimate(
        self,
        view: PeerView,
        prompt_fps: list[int],
        prompt_block_hashes: Sequence[int],
        prompt_tokens: int,
        expected_tokens: float,
        local: LocalState,
        nbytes: int,
        now_wall: float,
        future_turns: float = 0.0,
    ) -> CandidateEstimate:
        cfg = self.config
        peer = view.peer_id
        load = view.load
        stats = self._stats.get(peer)
        claimed = prefix_tokens(view, prompt_fps)
        sent = self._sent_prefix_tokens(stats, prompt_block_hashes)  # known here, not claimed
        view_cached = max(claimed, sent)
        conf = 1.0 if stats is None else stats.confidence
        credit = 1.0 if stats is None else stats.digest_credit
        if credit < cfg.digest_ignore_below:
            credit = 0.0
        believed = max(int(claimed * credit), sent)
        cached = _usable_cached(int(believed * conf), prompt_tokens)
        rtt = self.rtt_s(peer)
        rtt_known = rtt is not None
        rtt = cfg.default_rtt_s if rtt is None else rtt
        prefill_rate = load.prefill_s_per_token or local.prefill_s_per_token
        decode_rate = load.decode_s_per_token or local.decode_s_per_token
        wait = self._digest_wait(view, stats) + (0.0 if stats is None else stats.inflight_s)
        if not cfg.load_aware:
            wait = 0.0
        prefill = (prompt_tokens - cached) * prefill_rate
        decode = expected_tokens * decode_rate
        network = self.netcost.estimate(peer, rtt, nbytes)
        transfer = nbytes / self.netcost.bandwidth_Bps
        hold = 0.0
        if self.hold_s is not None:
            hold = self.hold_s(peer, prompt_tokens + math.ceil(expected_tokens))
        unaudited = math.isinf(hold)
        if unaudited:  # its answer could not be checked in time: never a candidate
            hold = 0.0
        lookahead = future_turns * network
        total = network + wait + local.overhead_s + prefill + decode + hold + lookahead
        skipped = None
        if load.push_back:
            skipped = "push_back"
        elif not self.is_up(peer):
            skipped = "down"
        elif self.trust is not None and not self.trust.usable(peer):
            skipped = "untrusted"
        elif unaudited:
            skipped = "no_audit"
        return CandidateEstimate(
            peer_id=peer,
            is_local=False,
            cached_tokens=cached,
            view_cached_tokens=view_cached,
            rtt_s=rtt,
            transfer_s=transfer,
            wait_s=wait,
            prefill_s=prefill,
            decode_s=decode,
            overhead_s=local.overhead_s,
            total_s=total,
            network_s=network,
            rtt_known=rtt_known,
            info_age_s=max(0.0, now_wall - view.issued_at),
            confidence=conf,
            skipped=skipped,
            hold_s=hold,
            lookahead_s=lookahead,
        )

    @staticmethod
    def _digest_wait(view: PeerView, stats: _PeerStats | None) -> float:
        """The peer's advertised wait, less what this router knows has left its queue since.

        The digest was stamped ``load_issued_at`` (T, the peer's wall clock; this router's
        forwards carry its own, as a digest's age does): the peer's queue then held
        the forwards this router had sent by T that had not finished by T. Those that have
        finished since are gone, yet an older digest still counts them (a holder's digest
        showed 48.7 s of this router's finished work and the router sent the next request of
        that prefix elsewhere). When the digest's whole queue was such forwards, nothing of it
        is left; else each takes away at most its own work and at most the time it ran on
        after T (it could not have had more left at T), so the wait is never understated for
        what others queued there."""
        wait = view.load.est_wait_s
        if stats is None or wait <= 0.0:
            return wait
        t = view.load_issued_at
        at_t = [
            f for f in stats.forwards if f.sent_at <= t and (f.done_at is None or f.done_at > t)
        ]
        done = [f for f in at_t if f.done_at is not None]
        if not done:
            return wait
        if len(done) == len(at_t) >= view.load.queue_depth:
            return 0.0
        gone = sum(min(f.work_s, f.done_at - t) for f in done if f.done_at is not None)
        return max(0.0, wait - gone)

    def _record(self, decision: RoutingDecision) -> None:
        if log.isEnabledFor(logging.INFO):
            entry = decision.to_log(self.config.log_candidates)
            log.info(json.dumps({"event": "routing_decision", **entry}))
        if self.metrics is None:
            return
        target = "local" if decision.chosen_is_local else "remote"
        self.metrics.decisions.labels(target, decision.reason).inc()
        for c in decision.candidates:
            if c.skipped:
                self.metrics.skipped.labels(c.skipped).inc()
        chosen = decision.estimate_for(decision.chosen)
        if decision.local_total_s is not None and chosen is not None:
            self.metrics.saving.observe(max(0.0, decision.local_total_s - chosen.total_s))


def request_bytes(prompt_tokens: int) -> int:
    return REQUEST_OVERHEAD_BYTES + REQUEST_BYTES_PER_TOKEN * prompt_tokens


def _usable_cached(cached: int, prompt_tokens: int) -> int:
    # The last prompt token is always computed (its logits start decoding).
    return max(0, min(cached, prompt_tokens - 1))
