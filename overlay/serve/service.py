"""Routing one request: the router's choice, the forward to it, fallback, audit and trust.

The one composition root of a served model (``RoutedService``). The forward protocol, its
server and its client call live in ``overlay/serve/forward.py``. One file (~750 lines) on
purpose: the fallback loop, the local run and the audit and trust bookkeeping share one
request's state (``_Request``: tokens delivered, attempts, the decision); what it composes lives
in its own modules (``router.py``, ``forward.py``, ``audit.py``, ``trust.py``, ``failover.py``).

Fallback (``RoutedService.generate``: attempt, then hold and audit, then the result): the router's
``attempts`` are tried in order (the chosen peer, maybe one more peer, then local). A peer that
refuses, cannot be reached, or is silent past its timeout (derived from its own estimate, see
``ForwardConfig``) is abandoned for the next target. Tokens already delivered are kept and never
repeated: the next target continues the generation from ``prompt + delivered`` for the remaining
``max_tokens`` (``failover.py``'s ``Continuation``, which the speculation edge client shares). With
greedy decoding (temperature 0) the answer equals an uninterrupted run; with sampling the
continuation is a valid sample of the same distribution but uses a fresh RNG stream (a seeded
request is then not bit-reproducible across a failure; documented trade-off, never duplicated or
lost tokens).
Every gap in the token stream (``start`` not equal to the tokens received) fails the attempt.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CollectorRegistry, Counter

from p2pnode.inference.blockhash import block_hashes, model_salt
from p2pnode.inference.lengths import OutputLengths
from p2pnode.inference.sampling import SamplingParams, TokenLogprob
from p2pnode.inference.scoring import scorer_for
from p2pnode.inference.serving import ServingEngine
from p2pnode.overlay.cache.antientropy import AntiEntropy, AntiEntropyConfig
from p2pnode.overlay.cache.digest import DigestBuilder, LoadInfo
from p2pnode.overlay.cache.privacy import AdvertiseGate
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.limits import PeerLimiter
from p2pnode.overlay.peers import PeerState
from p2pnode.overlay.routing.router import (
    DEFAULT_PUSHBACK_HIGH,
    LOCAL,
    CandidateEstimate,
    LocalState,
    PushBack,
    Router,
    RouterConfig,
    RoutingDecision,
    rtt_from_peer_table,
)
from p2pnode.overlay.routing.sessions import SessionTurns
from p2pnode.overlay.serve.audits import AUDIT_PROTOCOL, AuditServer, ThirdPeerAudits
from p2pnode.overlay.serve.failover import Continuation
from p2pnode.overlay.serve.forward import (
    FORWARD_PROTOCOL,
    ForwardConfig,
    ForwardFailed,
    ForwardOutcome,
    ForwardRequest,
    ForwardServer,
    NoRouteError,
    forward_request,
)
from p2pnode.overlay.serve.probation import FREE_SLOT_WAIT_S, ProbationChallenges
from p2pnode.overlay.trust.audit import AuditConfig, Auditor, AuditPlan, HeldAnswer
from p2pnode.overlay.trust.book import TrustBook
from p2pnode.overlay.trust.challenge import ChallengeConfig

if TYPE_CHECKING:
    from p2pnode.identity import NodeKey
    from p2pnode.inference.engine import GenerationResult
    from p2pnode.overlay.seams import OverlayHost

log = logging.getLogger("p2pnode.overlay.serve.service")


@dataclass
class Attempt:
    target: str  # peer id or LOCAL
    outcome: str  # "ok" or the failure reason
    tokens: int
    seconds: float

    def as_dict(self) -> dict[str, str | int | float]:
        """As the API's routing summary and the console show it."""
        return {
            "target": self.target,
            "outcome": self.outcome,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 4),
        }


@dataclass
class RoutedResult:
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    served_by: str  # peer id of the node that produced the last tokens (ours when local)
    served_locally: bool
    cached_tokens: int  # real cached prompt tokens reported by the node that served
    decision: RoutingDecision
    attempts: list[Attempt]
    total_s: float

    @property
    def fell_back(self) -> bool:
        return len(self.attempts) > 1


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.attempts = Counter(
            "p2pnode_forward_attempts",
            "Forwarding attempts by outcome",
            ["outcome"],
            registry=registry,
        )
        self.served = Counter(
            "p2pnode_forward_served", "Forwarded requests served for peers", registry=registry
        )


class RoutedService:
    """Engine + digests + views + router + forwarding for one model on one overlay node.

    ``engine`` may be None on a routing-only node (then it forwards only). Start the background
    parts (anti-entropy, forward handler) with ``await nursery.start(service.run)``.
    ``await generate(prompt_ids, params, on_token=None) -> RoutedResult`` routes and runs one
    request; ``decide(prompt_ids, params) -> RoutingDecision`` is the same choice as a dry run
    (neither logged nor counted). Bad input raises the engine's ``EngineError`` subclasses
    before anything leaves the node. ``trust`` (``overlay/trust/book.py``; a default ``TrustBook``
    when None) checks every forwarded request's claims; the router skips peers it demotes.
    ``audit`` (default on, when the engine's model can score answers): forwarded answers are
    audited against the local model as ``overlay/trust/audit.py`` says (``audit_config``); a peer on
    probation has its answer held until the audit passes, and re-served by the next attempt
    when it fails. ``generate(..., private=True)`` never leaves this node; ``generate(...,
    turn=t)`` marks a chat request with t earlier answers, so the router weighs where the
    session's later turns will run (``overlay/routing/sessions.py``).
    """

    def __init__(
        self,
        node: OverlayHost,
        key: NodeKey,
        engine: ServingEngine | None,
        *,
        model_id: str | None = None,
        views: PeerViews | None = None,
        router_config: RouterConfig | None = None,
        antientropy_config: AntiEntropyConfig | None = None,
        forward_config: ForwardConfig | None = None,
        pushback_high: int = DEFAULT_PUSHBACK_HIGH,
        pushback_low: int | None = None,
        registry: CollectorRegistry | None = None,
        drop_filter: Callable[[str, bytes], bool] | None = None,
        trust: TrustBook | None = None,
        limiter: PeerLimiter | None = None,
        audit: bool = True,
        audit_config: AuditConfig | None = None,
        challenge_config: ChallengeConfig | None = None,
        advertise_min_uses: int = 1,
        is_member: Callable[[str], bool] | None = None,
        antientropy: AntiEntropy | None = None,
    ) -> None:
        if engine is None and model_id is None:
            raise ValueError("a routing-only service needs model_id")
        self.node = node
        self.key = key
        self.engine = engine
        self.model_id = model_id or engine.model_id
        self.salt = model_salt(self.model_id)
        self.is_member = is_member  # a valid membership of this closed network (None: open)
        self.views = views if views is not None else PeerViews()  # an empty one is falsy
        self.pushback = PushBack(pushback_high, pushback_low)
        # Trust hook (overlay/trust/book.py): claims checked after each forward; untrusted peers
        # are skipped by the router.
        self.trust = trust if trust is not None else TrustBook(registry=registry)
        # Per-peer limits (overlay/limits.py), shared by the forward server and anti-entropy.
        self.limiter = limiter if limiter is not None else PeerLimiter()
        self.router = Router(
            self.views,
            rtt_s=rtt_from_peer_table(node.peers),
            is_up=lambda peer: node.peers.state(peer) not in (PeerState.DOWN, PeerState.SUSPECT),
            config=router_config,
            registry=registry,
            trust=self.trust,
            self_id=node.peer_id,
        )
        # Completion lengths: the engine's own record (it also feeds its queue estimate), or,
        # on a routing-only node, one kept here from the answers it relayed.
        self.lengths: OutputLengths = engine.lengths if engine is not None else OutputLengths()
        # Chat sessions' turn counts: how many more turns follow one (overlay/routing/sessions.py).
        self.sessions = SessionTurns()
        self.forward_config = forward_config or ForwardConfig()
        self.metrics = _Metrics(registry) if registry is not None else None
        builders = {}
        self.builder: DigestBuilder | None = None
        self.server: ForwardServer | None = None
        self.gate: AdvertiseGate | None = None  # overlay/cache/privacy.py: what the digest may show
        if engine is not None:
            self.builder = DigestBuilder(node.peer_id, self.model_id, load_fn=self.local_load)
            self.gate = AdvertiseGate(self.builder, advertise_min_uses)
            self.gate.sync(engine.cached_block_hashes())
            engine.add_block_listener(self.gate.on_event)
            builders[self.model_id] = self.builder
            self.server = ForwardServer(
                engine,
                admit=self._admit,
                on_served=self._on_served,
                limiter=self.limiter,
                on_request=self._note_use,
            )
        self.auditor: Auditor | None = None
        self.audit_server: AuditServer | None = None
        scorer = scorer_for(engine) if engine is not None and audit else None
        if scorer is not None:
            # Audits on a trusted third peer that holds the prefix, when cheaper than our own
            # pass (overlay/serve/audits.py); and we serve them for others.
            third = ThirdPeerAudits(
                node,
                self.views,
                model_id=self.model_id,
                salt=self.salt,
                trusted=self._may_audit,
                local_cost_s=scorer.cost_s,
                rtt_s=lambda peer: self.router.rtt_s(peer),  # the router's, as it changes
                own_cost_s=self._own_audit_cost_s,
            )
            self.auditor = Auditor(
                scorer,
                self.trust,
                audit_config,
                busy=lambda: engine.queue_depth > 0,
                registry=registry,
                is_member=is_member,
                others=third,
                # Our own audits run on the engine's cached prefix, not a fresh full pass.
                score=engine.score,
            )
            self.audit_server = AuditServer(engine, key, self.auditor.config, idle=self._slot_free)
            # A probation answer waits for its audit: the router counts that wait.
            self.router.hold_s = self.auditor.hold_s
        else:
            # Nothing here can audit an answer, so only members (never demoted) are candidates.
            self.router.hold_s = self._unaudited_hold
        # Known-answer challenges take new peers through probation without client traffic
        # (none when this node never forwards: it would never use what they earn).
        self.probation: ProbationChallenges | None = None
        challenge_config = challenge_config or ChallengeConfig()
        forwards = self.router.config.max_remote_attempts > 0 or engine is None
        if self.auditor is not None and challenge_config.enabled and forwards:
            self.probation = ProbationChallenges(
                node=node,
                model_id=self.model_id,
                salt=self.salt,
                views=self.views,
                router=self.router,
                auditor=self.auditor,
                trust=self.trust,
                forward_config=self.forward_config,
                answer=self._own_answer if engine is not None else None,
                idle=self._slot_free,
                challenge_config=challenge_config,
                registry=registry,
            )
        # Another model's service on this node shares its anti-entropy (one handler for digest
        # pulls per node) and only follows this model's topic (``overlay/serve/swarm.py``).
        self._owns_antientropy = antientropy is None
        self.antientropy = antientropy or AntiEntropy(
            node,
            key,
            self.views,
            builders=builders,
            models=[self.model_id],
            config=antientropy_config,
            registry=registry,
            drop_filter=drop_filter,
            limiter=self.limiter,
        )

    def _may_audit(self, peer: str) -> bool:
        """A peer whose verdicts this node takes: usable and past probation (or a member)."""
        auditor = self.auditor
        return auditor is not None and self.trust.usable(peer) and not auditor.on_probation(peer)

    def _own_audit_cost_s(self, prompt: list[int], answer_len: int) -> float:
        e = self.engine
        assert e is not None  # only nodes with an engine audit
        cached = min(e.cached_prefix_len(prompt), len(prompt) - 1)
        return e.cost.estimate(len(prompt) + answer_len, cached, 0)

    def _unaudited_hold(self, peer: str, tokens: int) -> float:
        member = self.is_member is not None and self.is_member(peer)
        return 0.0 if member and not self.trust.demotions(peer) else math.inf

    def advertise(self, builder: DigestBuilder) -> None:
        """Publish one more digest (a verifier's) with this node's anti-entropy; call before
        ``run``."""
        ae = self.antientropy
        ae.builders[builder.model_id] = builder
        ae.models = sorted(set(ae.models) | {builder.model_id})

    # -- local state --------------------------------------------------------------------------

    def local_load(self) -> LoadInfo:
        e = self.engine
        depth = e.queue_depth
        return LoadInfo(
            queue_depth=depth,
            est_wait_s=e.estimated_wait_s(),
            push_back=self.pushback.update(depth),
            prefill_s_per_token=e.cost.prefill_s_per_token,
            decode_s_per_token=e.cost.decode_s_per_token,
        )

    def _admit(self) -> bool:
        # Refuse only far over the threshold: a stale view may still send us a few requests.
        return self.engine.queue_depth < 2 * self.pushback.high

    def _on_served(self, request_id: str, cached: int) -> None:
        if self.metrics is not None:
            self.metrics.served.inc()

    def _local_state(self, prompt: list[int]) -> LocalState:
        e = self.engine
        if e is None:
            return LocalState(0, 0.0, 0.0, 0.0, available=False)
        cached = e.cached_prefix_len(prompt)
        return LocalState(
            cached_tokens=cached,
            # This request's own wait: behind a long prefill a short one shares the steps.
            wait_s=e.estimated_wait_s(max(1, len(prompt) - cached)),
            prefill_s_per_token=e.cost.prefill_s_per_token,
            decode_s_per_token=e.cost.decode_s_per_token,
            overhead_s=e.cost.overhead_s,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.server is not None:
            self.node.set_stream_handler(FORWARD_PROTOCOL, self.server.handle)
        if self.audit_server is not None:
            self.node.set_stream_handler(AUDIT_PROTOCOL, self.audit_server.handle)
        async with trio.open_nursery() as nursery:
            if self._owns_antientropy:
                await nursery.start(self.antientropy.run)
            else:
                await self.antientropy.follow(self.model_id)
            if self.auditor is not None:
                await nursery.start(self.auditor.run)
            if self.probation is not None:
                await nursery.start(self.probation.run)
            task_status.started()

    # -- requests -----------------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        on_token: Callable[[int], None] | None = None,
        on_logprob: Callable[[TokenLogprob], None] | None = None,
        private: bool = False,
        turn: int | None = None,
    ) -> RoutedResult:
        started = time.perf_counter()
        prompt, params = self._check(prompt_ids, params)
        if private and self.engine is None:
            raise NoRouteError("a private request never leaves the node: this one runs no engine")
        future = 0.0
        if turn is not None:  # a chat turn: where it runs, its session's next turns follow
            self.sessions.observe(turn)
            future = self.sessions.future_turns(turn)
        decision = self._decide(prompt, params, record=True, private=private, future_turns=future)
        if self.probation is not None:
            self.probation.note_wanted(decision)
        run = _Request(prompt, params, decision, started, on_token, on_logprob)
        for target in decision.attempts:
            if target == LOCAL:
                return await self._serve_here(run, private)
            result = await self._serve_by(run, target)
            if result is not None:
                return result
        raise NoRouteError(
            f"no node could serve the request for {self.model_id}: attempts "
            f"{[(a.target, a.outcome) for a in run.attempts]}; this node runs no engine for it"
        )

    async def _serve_here(self, run: _Request, private: bool) -> RoutedResult:
        """The last attempt: this node's engine continues the answer."""
        t0 = time.perf_counter()
        known = not private and not run.answer.delivered  # the whole answer computed here
        result = await self._run_local(
            run.answer.context, run.rest_params(), run.emit, run.on_logprob, private
        )
        run.attempt(LOCAL, "ok", len(result.tokens), t0)
        if known and self.probation is not None:
            self.probation.know(run.prompt, run.params, result.tokens)
        return run.result(result.finish_reason, self.node.peer_id, True, result.cached_tokens)

    async def _serve_by(self, run: _Request, target: str) -> RoutedResult | None:
        """One forward to a peer: attempt, then (hold, audit), then the result; None fails over
        to the next attempt."""
        t0 = time.perf_counter()
        est = run.decision.estimate_for(target)
        assert est is not None
        request = ForwardRequest.of(
            self.model_id,
            run.answer.context,
            run.rest_params(),
            deadline_s=self.forward_config.default_deadline_s,
            request_id=run.decision.request_id,
        )
        plan = self.auditor.plan(target, run.params) if self.auditor is not None else None
        # A held answer reaches the client once its audit passed, or never.
        held = (
            HeldAnswer(run.emit, self.auditor.config.max_hold_s, emit_logprob=run.on_logprob)
            if plan and plan.hold
            else None
        )
        try:
            outcome = await self._forward(run, target, est, request, held)
        except ForwardFailed as exc:
            return self._forward_failed(run, target, exc, t0)
        checked = (
            "ok" if plan is None else await self._audited(plan, target, request, outcome, held)
        )
        run.attempt(target, checked, len(outcome.tokens), t0)
        self._count(checked)
        if checked != "ok":  # dropped unseen: re-served by the next attempt
            return None
        self._learn(run, target, est, request, outcome)
        done = outcome.done
        return run.result(done.finish_reason, target, False, done.cached_tokens)

    async def _forward(
        self,
        run: _Request,
        target: str,
        est: CandidateEstimate,
        request: ForwardRequest,
        held: HeldAnswer | None,
    ) -> ForwardOutcome:
        """The forward itself, with timeouts from the peer's own estimate (``ForwardConfig``);
        the router counts it in flight meanwhile."""
        cfg = self.forward_config
        service_s = est.wait_s + est.prefill_s + est.decode_s
        expected_tokens = max(1.0, run.decision.expected_tokens or 1)
        sent = self.router.note_sent(target, service_s, est.prefill_s + est.decode_s)
        try:
            return await forward_request(
                self.node,
                target,
                request,
                accept_timeout_s=2 * est.rtt_s + cfg.accept_slack_s,
                first_token_timeout_s=cfg.first_token_factor
                * (est.rtt_s + est.wait_s + est.prefill_s)
                + cfg.first_token_slack_s,
                idle_timeout_s=max(
                    cfg.idle_min_s, cfg.idle_factor * est.decode_s / expected_tokens
                ),
                on_token=held if held is not None else run.emit,
                on_logprob=held.logprob if held is not None else run.on_logprob,
            )
        finally:
            self.router.note_done(target, service_s, sent)

    def _forward_failed(
        self, run: _Request, target: str, exc: ForwardFailed, t0: float
    ) -> RoutedResult | None:
        """A failed forward: the answer when the tokens it delivered already complete it, else
        None (the next attempt continues from them)."""
        run.attempt(target, exc.reason, len(exc.tokens), t0)
        self._count(exc.reason)
        log.info("forward to %s failed after %d tokens: %s", target, len(exc.tokens), exc)
        if exc.reason in {"timeout", "unreachable", "eof"}:
            self.node.peers.record_failure(target, f"forward: {exc}")
        delivered = run.answer.delivered
        if not _finished(delivered, run.params, self.engine):
            return None
        reason = "stop" if len(delivered) < run.params.max_tokens else "length"
        return run.result(reason, target, False, 0)

    def _learn(
        self,
        run: _Request,
        target: str,
        est: CandidateEstimate,
        request: ForwardRequest,
        outcome: ForwardOutcome,
    ) -> None:
        """What a served forward teaches: the router's view of the peer's cache and speed, the
        completion lengths (on a routing-only node) and the peer's trust."""
        self.router.observe_served(target, est.cached_tokens, outcome.done.cached_tokens)
        self.router.note_forwarded(
            target, block_hashes(request.prompt + outcome.tokens[:-1], self.salt)
        )
        if outcome.first_token_s is not None:
            self.router.observe_forward(
                target,
                len(request.prompt),
                outcome.first_token_s,
                outcome.done.ttft_s,
                outcome.last_token_s,
                outcome.done.total_s,
            )
            expected = est.network_s + est.wait_s + est.overhead_s + est.prefill_s
            if self.router.observe_first_token(target, expected, outcome.first_token_s):
                self.trust.note_digest_ignored(target)
                log.warning(
                    "ignoring the cache claims of %s: its first tokens contradict them", target
                )
        if self.engine is None:
            self.lengths.observe(
                len(run.answer.delivered), hit_limit=outcome.done.finish_reason == "length"
            )
        self._observe_trust(target, est, run.decision, outcome)

    def decide(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | Mapping[str, Any] | None = None,
    ) -> RoutingDecision:
        """The decision ``generate`` would take right now, without running it (not counted)."""
        prompt, params = self._check(prompt_ids, params)
        return self._decide(prompt, params, record=False)

    def _check(
        self, prompt_ids: Sequence[int], params: SamplingParams | Mapping[str, Any] | None
    ) -> tuple[list[int], SamplingParams]:
        if self.engine is not None:
            return self.engine.validate(prompt_ids, params)  # bad input fails before any network
        if params is None:
            params = SamplingParams()
        elif isinstance(params, Mapping):
            params = SamplingParams.from_dict(params)
        return list(prompt_ids), params

    def _decide(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        record: bool,
        private: bool = False,
        future_turns: float = 0.0,
    ) -> RoutingDecision:
        if private:  # not even estimated against peers: it stays here whatever they hold
            return RoutingDecision(
                request_id=uuid.uuid4().hex[:16],
                model_id=self.model_id,
                prompt_tokens=len(prompt),
                max_tokens=params.max_tokens,
                chosen=LOCAL,
                reason="private",
                margin_s=0.0,
                candidates=(),
                attempts=(LOCAL,),
            )
        return self.router.decide(
            model_id=self.model_id,
            prompt_block_hashes=block_hashes(prompt, self.salt),
            prompt_tokens=len(prompt),
            max_tokens=params.max_tokens,
            local=self._local_state(prompt),
            record=record,
            expected_tokens=self.lengths.predict(params.max_tokens),
            future_turns=future_turns,
        )

    async def _audited(
        self,
        plan: AuditPlan,
        peer: str,
        request: ForwardRequest,
        outcome: ForwardOutcome,
        held: HeldAnswer | None,
    ) -> str:
        """``ok`` when the answer may reach the client (a held one passed its audit; a released
        one is queued for a background audit when the plan says so), ``audit_failed`` or
        ``audit_late`` (its audit outlasted the hold) when a held answer is dropped unseen."""
        assert self.auditor is not None
        params = SamplingParams(
            max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p
        )
        if held is None:
            if plan.audit:
                self.auditor.later(peer, request.prompt, outcome.tokens, params, forced=plan.forced)
            return "ok"
        verdict = await self.auditor.check(
            peer, request.prompt, held.tokens, params, wait_s=held.remaining_s()
        )
        if verdict is None:
            return "audit_late"
        if not verdict.passed:
            self.auditor.note_reserved()
            return "audit_failed"
        held.release()
        return "ok"

    def _note_use(self, prompt: list[int]) -> None:
        if self.gate is not None:
            self.gate.note_request(block_hashes(prompt, self.salt))

    def _slot_free(self) -> bool:
        """A new request would start here at once (the only time a challenge takes work)."""
        return self.engine is not None and self.engine.estimated_wait_s() <= FREE_SLOT_WAIT_S

    async def _own_answer(self, prompt: list[int], max_tokens: int) -> list[int] | None:
        """This node's greedy answer to a prefix challenge, or None while a new request would
        wait for a slot here (a challenge never makes a client's request wait)."""
        e = self.engine
        if e is None or not self._slot_free():
            return None
        tokens: list[int] = []
        stream = e.stream(prompt, SamplingParams(max_tokens=max_tokens))
        try:
            async for t in stream:
                tokens.append(t)
        finally:
            if stream.result is None:
                await stream.aclose()
        return tokens

    async def _run_local(
        self,
        prompt: list[int],
        params: SamplingParams,
        emit: Callable[[int], None],
        on_logprob: Callable[[TokenLogprob], None] | None = None,
        private: bool = False,
    ) -> GenerationResult:
        if not private or self.gate is None:
            self._note_use(prompt)
            return await self._stream_local(prompt, params, emit, on_logprob)
        answer: list[int] = []

        def keep(t: int) -> None:
            answer.append(t)
            emit(t)

        with self.gate.private():  # its blocks stay out of the digest, also after it
            try:
                return await self._stream_local(prompt, params, keep, on_logprob)
            finally:
                self.gate.mark_private(block_hashes(prompt + answer, self.salt))

    async def _stream_local(
        self,
        prompt: list[int],
        params: SamplingParams,
        emit: Callable[[int], None],
        on_logprob: Callable[[TokenLogprob], None] | None = None,
    ) -> GenerationResult:
        stream = self.engine.stream(prompt, params)
        try:
            n = 0
            async for t in stream:
                if on_logprob is not None and params.logprobs is not None:
                    on_logprob(stream.logprobs[n])
                n += 1
                emit(t)
        finally:
            if stream.result is None:
                await stream.aclose()
        return stream.result

    def _observe_trust(
        self,
        peer: str,
        est: CandidateEstimate,
        decision: RoutingDecision,
        outcome: ForwardOutcome,
    ) -> None:
        """Check the peer's claims (digest prefix, advertised wait and speeds) against what we
        observed serving this request (see ``overlay/trust/book.py``)."""
        self.trust.observe_claim(
            peer,
            est.view_cached_tokens,
            outcome.done.cached_tokens,
            prompt_tokens=decision.prompt_tokens,
            view_age_s=est.info_age_s,
        )
        if outcome.last_token_s is not None:
            per_token = est.decode_s / max(1, decision.max_tokens)
            expected = est.total_s - est.decode_s + per_token * (len(outcome.tokens) - 1)
            self.trust.observe_timing(peer, expected, outcome.last_token_s)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.attempts.labels(outcome).inc()


class _Request:
    """One request's state across its attempts, and its result.

    The tokens delivered so far (``answer``, a ``Continuation``: each attempt continues from
    them for what is left of ``max_tokens``) and the attempts made; ``result`` builds the
    ``RoutedResult`` whichever attempt ends the request."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        decision: RoutingDecision,
        started: float,
        on_token: Callable[[int], None] | None,
        on_logprob: Callable[[TokenLogprob], None] | None,
    ) -> None:
        self.prompt = prompt
        self.params = params
        self.decision = decision
        self.started = started
        self.on_token = on_token
        self.on_logprob = on_logprob
        self.answer = Continuation(prompt, params.max_tokens)
        self.attempts: list[Attempt] = []

    def emit(self, token: int) -> None:
        self.answer.add((token,))
        if self.on_token is not None:
            self.on_token(token)

    def rest_params(self) -> SamplingParams:
        """The request's sampling for what is left of its budget."""
        return _with_max_tokens(self.params, self.answer.remaining)

    def attempt(self, target: str, outcome: str, tokens: int, t0: float) -> None:
        self.attempts.append(Attempt(target, outcome, tokens, time.perf_counter() - t0))

    def result(self, finish_reason: str, served_by: str, local: bool, cached: int) -> RoutedResult:
        return RoutedResult(
            tokens=list(self.answer.delivered),
            finish_reason=finish_reason,
            prompt_tokens=len(self.prompt),
            served_by=served_by,
            served_locally=local,
            cached_tokens=cached,
            decision=self.decision,
            attempts=self.attempts,
            total_s=time.perf_counter() - self.started,
        )


def _with_max_tokens(params: SamplingParams, n: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, max_tokens=max(1, n))


def _finished(delivered: list[int], params: SamplingParams, engine: ServingEngine | None) -> bool:
    """The tokens received before a failure already form a complete answer."""
    if len(delivered) >= params.max_tokens:
        return True
    if not delivered:
        return False
    stops = set(params.stop_token_ids) | set(getattr(engine, "eos_token_ids", ()) or ())
    return delivered[-1] in stops
