"""WAN-aware, cache-aware routing: pick the node (local included) that should serve a request.

Contract:
- For every candidate the router estimates the completion time of the request there:
  ``total = k * rtt + transfer + queue wait + overhead + prefill(prompt - cached) + decode(max_tokens)``
  (``k = forward_round_trips``: a forward opens a stream before its request/answer exchange)
  with, for a peer: the smoothed RTT of the peer table (``default_rtt_s`` while none is measured),
  the request's bytes over ``bandwidth_Bps``, the wait and the per-token speeds the peer advertises
  in its digests (our own speeds when it advertises none), plus the service time of requests this
  router already sent there and that the peer's digests cannot show yet (``inflight``); the cached
  prefix is the view's estimate times the peer's measured *confidence*: an EWMA of real / estimated
  cached tokens reported by the requests it served (stale views cost what they really cost). For
  the local node: RTT 0 and the engine's exact cached prefix, wait and calibrated speeds.
- A peer is chosen only when ``total_peer + margin < total_local`` where
  ``margin = max(abs_margin_s, rel_margin * total_local, rtt_margin * rtt_peer)``, so ties,
  noise and the round-trip-sized variance of a forward's cost stay local. Peers in
  push-back, down in the peer table, demoted by the ``trust`` book (``overlay/trust.py``:
  "untrusted"), or without a live view are skipped (the reason is recorded).
- ``decide`` returns a ``RoutingDecision``: every candidate's estimate, the choice, and
  ``attempts``: the order to try (the chosen peer, then other peers that also beat local, at most
  ``max_remote_attempts``, then local when the node serves the model). Each decision is logged as
  one JSON line on logger ``p2pnode.overlay.router`` (INFO; the ``log_candidates`` best
  candidates, chosen and local always included, and how many were left out) and counted in the
  prometheus registry passed in (never the global one). ``decide(record=False)`` is a dry run:
  neither logged nor counted.
- ``PushBack(high, low)``: hysteresis for the flag a node advertises: on at ``queue_depth >= high``,
  off again at ``queue_depth <= low``.
- Bound on what a node keeps (``overlay/scope.py``): the router reads only ``views.live()``; with
  ``ScopedViews`` that is the peers within ``rtt_budget_s = max_prompt_tokens *
  prefill_s_per_token / (forward_round_trips + rtt_margin)`` (farther ones cannot win by the
  rule above), at most ``max_views`` of them, plus the ``k_nearest`` always; far holders of a
  long prefix are found by a prefix-key lookup and admitted for the decision.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from p2pnode.overlay.views import PeerView, PeerViews, prefix_tokens

log = logging.getLogger("p2pnode.overlay.router")

LOCAL = "local"
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
    rtt_known: bool = True
    info_age_s: float | None = None
    confidence: float = 1.0
    skipped: str | None = None  # why it cannot be chosen (push_back, down, ...)


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


@dataclass
class _PeerStats:
    confidence: float = 1.0
    inflight_s: float = 0.0
    inflight: int = 0
    served: int = 0


@dataclass
class RouterConfig:
    rel_margin: float = 0.05
    abs_margin_s: float = 0.02
    bandwidth_Bps: float = 1.25e6  # 10 Mbit/s: a modest WAN uplink
    default_rtt_s: float = 1.0  # unmeasured peers look far away until pinged
    # A forward is not one round trip: it opens a new stream (yamux SYN + multistream-select
    # negotiation) before the request/answer exchange. Measured on the emulated WAN at 200 ms
    # one-way: a forward cost ~3 ping round trips more than serving locally.
    forward_round_trips: float = 3.0
    # A forward must also save this many round trips more than its estimated cost: its real
    # cost varies by about one round trip (stream setup, the peer's queue moving while the
    # request travels). On a LAN that is milliseconds; at 200 ms one-way, forwards whose
    # estimated saving was under one round trip lost on average (paper-wan-200-zipf).
    rtt_margin: float = 1.0
    max_remote_attempts: int = 2
    confidence_alpha: float = 0.3
    min_confidence: float = 0.05
    log_candidates: int = 16  # candidates written per decision log line (best first)
    # False: queues are ignored (every wait counts 0): the cache-only routing the paper starts
    # from, kept to measure what load awareness buys (bench/routing_bench.py).
    load_aware: bool = True

    def __post_init__(self) -> None:
        if not (0 <= self.rel_margin < 1 and self.abs_margin_s >= 0 and self.bandwidth_Bps > 0):
            raise ValueError("router margins must be >= 0 (rel < 1) and bandwidth > 0")
        if self.max_remote_attempts < 0 or self.default_rtt_s < 0 or self.rtt_margin < 0:
            raise ValueError("max_remote_attempts, default_rtt_s and rtt_margin must be >= 0")


def rtt_from_peer_table(table: Any) -> Callable[[str], float | None]:
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
        trust: Any = None,
    ) -> None:
        self.views = views
        self.rtt_s = rtt_s
        # Trust hook (overlay/trust.py): a TrustBook, or None. Peers it finds unusable are
        # skipped as "untrusted", so their (lying) digests no longer drive decisions.
        self.trust = trust
        self.is_up = is_up or (lambda _peer: True)
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

    def note_sent(self, peer_id: str, service_s: float) -> None:
        stats = self._stats.setdefault(peer_id, _PeerStats())
        stats.inflight += 1
        stats.inflight_s += service_s

    def note_done(self, peer_id: str, service_s: float) -> None:
        stats = self._stats.get(peer_id)
        if stats is not None and stats.inflight > 0:
            stats.inflight -= 1
            stats.inflight_s = max(0.0, stats.inflight_s - service_s) if stats.inflight else 0.0

    def forget_peer(self, peer_id: str) -> None:
        self._stats.pop(peer_id, None)

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
    ) -> RoutingDecision:
        cfg = self.config
        candidates: list[CandidateEstimate] = []
        local_est = None
        if local.available:
            local_est = self._local_estimate(local, prompt_tokens, max_tokens)
            candidates.append(local_est)
        # Per decision, not per peer: the prompt's fingerprints (per width), transfer, clock.
        fps_by_bits: dict[int, list[int]] = {}
        transfer = (
            REQUEST_OVERHEAD_BYTES + REQUEST_BYTES_PER_TOKEN * prompt_tokens
        ) / cfg.bandwidth_Bps
        now_wall = self.views.wall_now()
        for view in self.views.live(model_id):
            if view.peer_id in exclude:
                continue
            fps = fps_by_bits.get(view.fp_bits)
            if fps is None:
                shift = 64 - view.fp_bits
                fps = fps_by_bits[view.fp_bits] = [h >> shift for h in prompt_block_hashes]
            candidates.append(
                self._peer_estimate(view, fps, prompt_tokens, max_tokens, local, transfer, now_wall)
            )
        eligible = sorted(
            (c for c in candidates if not c.is_local and c.skipped is None),
            key=lambda c: c.total_s,
        )
        margin = cfg.abs_margin_s
        if local_est is not None:
            margin = max(cfg.abs_margin_s, cfg.rel_margin * local_est.total_s)
            better = [
                c
                for c in eligible
                if c.total_s + max(margin, cfg.rtt_margin * c.rtt_s) < local_est.total_s
            ]
            remote_order = [c.peer_id for c in better[: cfg.max_remote_attempts]]
            attempts = (*remote_order, LOCAL)
            if remote_order:
                chosen, reason = remote_order[0], "remote_faster"
            else:
                chosen = LOCAL
                if not eligible:
                    reason = "local_best"
                elif cfg.max_remote_attempts == 0:
                    reason = "forwarding_off"
                else:
                    reason = "remote_saving_below_margin"
        else:
            remote_order = [c.peer_id for c in eligible[: max(1, cfg.max_remote_attempts)]]
            attempts = tuple(remote_order)
            chosen = remote_order[0] if remote_order else LOCAL
            reason = "no_local_engine" if remote_order else "no_candidate"
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
        )
        if record:
            self._record(decision)
        return decision

    def _local_estimate(
        self, local: LocalState, prompt_tokens: int, max_tokens: int
    ) -> CandidateEstimate:
        cached = _usable_cached(local.cached_tokens, prompt_tokens)
        prefill = (prompt_tokens - cached) * local.prefill_s_per_token
        decode = max_tokens * local.decode_s_per_token
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
        prompt_tokens: int,
        max_tokens: int,
        local: LocalState,
        transfer: float,
        now_wall: float,
    ) -> CandidateEstimate:
        cfg = self.config
        peer = view.peer_id
        load = view.load
        view_cached = prefix_tokens(view, prompt_fps)
        stats = self._stats.get(peer)
        conf = 1.0 if stats is None else stats.confidence
        cached = _usable_cached(int(view_cached * conf), prompt_tokens)
        rtt = self.rtt_s(peer)
        rtt_known = rtt is not None
        rtt = cfg.default_rtt_s if rtt is None else rtt
        prefill_rate = load.prefill_s_per_token or local.prefill_s_per_token
        decode_rate = load.decode_s_per_token or local.decode_s_per_token
        wait = load.est_wait_s + (0.0 if stats is None else stats.inflight_s)
        if not cfg.load_aware:
            wait = 0.0
        prefill = (prompt_tokens - cached) * prefill_rate
        decode = max_tokens * decode_rate
        total = (
            cfg.forward_round_trips * rtt + transfer + wait + local.overhead_s + prefill + decode
        )
        skipped = None
        if load.push_back:
            skipped = "push_back"
        elif not self.is_up(peer):
            skipped = "down"
        elif self.trust is not None and not self.trust.usable(peer):
            skipped = "untrusted"
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
            rtt_known=rtt_known,
            info_age_s=max(0.0, now_wall - view.issued_at),
            confidence=conf,
            skipped=skipped,
        )

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


def _usable_cached(cached: int, prompt_tokens: int) -> int:
    # The last prompt token is always computed (its logits start decoding).
    return max(0, min(cached, prompt_tokens - 1))
