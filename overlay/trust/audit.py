"""Audits of forwarded answers: the origin re-scores what a peer sent against the target model.

Rule: a share of the answers a peer serves for us is checked by ONE teacher-forced forward pass
of our own model over ``prompt + answer`` (``inference/scoring.py``), about the cost of a
prefill of that length, far less than generating it.

- Greedy (temperature 0): every answer token must be the target's argmax or within
  ``greedy_margin`` logits of it (``check_greedy``). Honest peers on other hardware, dtypes or
  batch shapes pick a token whose logit ties the argmax within float error; the margin is 0.5
  because the worst gap measured for a bf16 peer batching four requests against our fp32
  model was 0.17 logits over 200 answers (tests/overlay/test_audit.py), while a substituted token is
  typically 5+ logits below (10-19 seen).
- Sampled: the answer's likelihood under the target's sampling distribution (temperature and
  top-p, with the nucleus widened by ``nucleus_slack`` so a boundary token of another numeric
  path is not impossible) must be plausible (``check_sampled``). A token outside the widened
  nucleus fails at once; otherwise the summed surprisal ``S = sum(-log p_i(t_i))`` is compared
  with its mean and variance under honest sampling (``sum H_i``, ``sum Var_i``, both computed
  from the same logits): ``z = (S - sum H) / sqrt(sum Var)`` fails above ``sampled_z`` (4.0).
  By Cantelli's inequality the false-alarm rate is below 1 / (1 + z^2) = 5.9 % whatever the
  distribution; on honest samples of the real model (temperature 0.8, top-p 0.95, 16 tokens)
  ``bench/audit_bench.py`` measured 0 of 80 flagged, largest z 1.8 (a normal tail would give
  3e-5).
- Who is on probation (``Auditor.on_probation``): a member of a closed network (``is_member``;
  its membership is signed by the network) is trusted from its first answer, unless it was
  demoted once already; any other peer is on probation until it has ``probation_answers``
  passed audits (a new identity, or one readmitted after a demotion).
- A probation answer is *held*: not one token reaches the client until its audit passed, so a
  lie is re-served elsewhere before anyone sees it. Nothing releases it unchecked: an audit
  that cannot finish within ``max_hold_s`` (the wait already queued plus its own pass) or
  that the budget cannot pay for makes the peer unavailable to the router (``hold_s`` is
  infinite, the router skips it as ``no_audit``); an answer whose audit outlasts its hold is
  dropped and re-served (the audit still finishes and still counts).
- Trusted peers are audited after release: each answer at ``trusted_rate`` p, so a liar that
  turns after earning trust delivers (1 - p) / p wrong answers before its first audited lie
  demotes it (4 at the default 0.2), and at least every ``max_gap``-th answer of each peer
  whatever the budget (a busy origin still audits every peer it uses); only the sampled ones
  beyond that minimum may be ``skipped``.
- Who audits (``SecondAuditor``, optional): a trusted third peer that holds the prompt's
  prefix scores the answer for less than this node's own pass (``overlay/serve/audits.py``;
  never the serving peer); this node audits itself when nobody is cheaper or the call fails.
  Given ``score`` (``OwnScore``: the node's engine), this node's own pass runs on its cached
  prefix too, so an origin that holds a chat's system prompt pays for the rest only.
  A failed verdict from a third peer is checked by a second auditor (another peer, else this
  node) before anyone is demoted: if the second finds the answer right, the first auditor is
  the liar and loses trust (``observe_fault``), and the answer stands.
- Budget: sampled audits take at most ``budget_share`` of this node's time over
  ``budget_window_s``; past it they are skipped (counted ``skipped``). Background audits wait
  while the local engine has work, up to ``defer_max_s``: they run at low priority.
- A failed audit demotes the peer at once (``TrustBook.observe_audit``: the router skips it
  like any untrusted peer); a passed one repays debt and counts towards probation.
- Metrics (registry given): ``p2pnode_audits_total{mode,verdict}`` (mode held/background,
  verdict passed/failed/skipped), ``p2pnode_audit_reserved_total`` (answers re-served after a
  held audit failed), ``p2pnode_audit_seconds_total``.

Limits: only the origin audits, and only when it runs the model itself: a routing-only node
cannot, so it uses members and peers it trusts already, never a peer on probation
(``overlay/serve/service.py``). The sampled test sees lies that make an answer unlikely (substituted, random or
other-model tokens); a liar that samples plausible tokens from a slightly different
distribution is only caught in proportion to how much less likely its answers are.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import trio
from prometheus_client import CollectorRegistry, Counter

from p2pnode.inference.sampling import SamplingParams, TokenLogprob
from p2pnode.inference.scoring import LogitRows, Scorer
from p2pnode.overlay.trust.book import TrustBook

if TYPE_CHECKING:
    import torch

log = logging.getLogger("p2pnode.overlay.trust.audit")


@dataclass
class AuditConfig:
    probation_answers: int = 8  # passed audits before a peer leaves probation
    # Share of a trusted peer's answers audited: (1 - p) / p wrong answers expected before a
    # liar that turns after earning trust is demoted (4 at 0.2).
    trusted_rate: float = 0.2
    max_gap: int = 10  # at least every max_gap-th answer of a trusted peer, whatever the budget
    greedy_margin: float = 0.5  # logits (see the module contract for the measurement)
    sampled_z: float = 4.0
    nucleus_slack: float = 0.02
    budget_share: float = 0.25
    budget_window_s: float = 60.0
    max_hold_s: float = 10.0
    defer_max_s: float = 30.0
    queue: int = 64  # background audits waiting; more are skipped

    def __post_init__(self) -> None:
        if self.probation_answers < 0 or not 0 <= self.trusted_rate <= 1 or self.max_gap < 1:
            raise ValueError("need probation_answers >= 0, 0 <= trusted_rate <= 1, max_gap >= 1")
        if self.greedy_margin < 0 or self.sampled_z <= 0 or not 0 <= self.nucleus_slack < 1:
            raise ValueError("need greedy_margin >= 0, sampled_z > 0, 0 <= nucleus_slack < 1")
        if not 0 < self.budget_share <= 1 or self.budget_window_s <= 0 or self.max_hold_s <= 0:
            raise ValueError("need 0 < budget_share <= 1, budget_window_s > 0, max_hold_s > 0")


# --------------------------------------------------------------------------- verdict math


@dataclass(frozen=True)
class AuditVerdict:
    passed: bool
    checked: int  # answer tokens scored
    first_bad: int | None = None  # index of the first token that failed (greedy / impossible)
    statistic: float = 0.0  # greedy: worst logit gap; sampled: z
    detail: str = ""


def _shape_check(logits: torch.Tensor | LogitRows, tokens: Sequence[int]) -> AuditVerdict | None:
    """Raise on a row count that is not one per token; a failed verdict for a token outside the
    vocabulary (a lying peer can send one); None when the answer can be checked."""
    n = len(tokens)
    if logits.shape[0] != n:
        raise ValueError(f"{logits.shape[0]} rows of logits for {n} tokens")
    if n and (min(tokens) < 0 or max(tokens) >= logits.shape[1]):
        return AuditVerdict(False, n, 0, math.inf, "token outside the vocabulary")
    return None


def _greedy_verdict(gaps: Sequence[float], margin: float) -> AuditVerdict:
    n = len(gaps)
    worst = max(gaps) if n else 0.0
    for i, gap in enumerate(gaps):
        if gap > margin:
            return AuditVerdict(False, n, i, worst, f"token {i} is {gap:.2f} below argmax")
    return AuditVerdict(True, n, None, worst)


def _sampled_verdict(
    chosen: Sequence[float], entropy: float, var: float, z_max: float
) -> AuditVerdict:
    n = len(chosen)
    for i, lp in enumerate(chosen):
        if math.isinf(lp):
            return AuditVerdict(False, n, i, math.inf, f"token {i} is outside the nucleus")
    z = (-sum(chosen) - entropy) / math.sqrt(max(0.0, var) + 1e-6)
    if z > z_max:
        return AuditVerdict(False, n, None, z, f"answer too unlikely (z = {z:.1f})")
    return AuditVerdict(True, n, None, z)


def check_greedy(
    logits: torch.Tensor | LogitRows, tokens: Sequence[int], margin: float
) -> AuditVerdict:
    """Every ``tokens[i]`` within ``margin`` logits of the argmax of ``logits[i]``."""
    n = len(tokens)
    refused = _shape_check(logits, tokens)
    if refused is not None:
        return refused
    if isinstance(logits, LogitRows):  # rows that score themselves (no tensors when emulated)
        return _greedy_verdict(logits.greedy_gaps(tokens), margin)
    import torch

    ids = torch.tensor(list(tokens), dtype=torch.long)
    gaps = logits.max(dim=-1).values - logits[torch.arange(n), ids]
    bad = (gaps > margin).nonzero()
    worst = float(gaps.max()) if n else 0.0
    if len(bad):
        i = int(bad[0, 0])
        return AuditVerdict(False, n, i, worst, f"token {i} is {float(gaps[i]):.2f} below argmax")
    return AuditVerdict(True, n, None, worst)


def _nucleus_log_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Row-wise log-probabilities of the temperature + top-p distribution (-inf outside)."""
    import torch

    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_lp, order = logp.sort(dim=-1, descending=True)
    mass_before = sorted_lp.exp().cumsum(dim=-1) - sorted_lp.exp()
    keep = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before < top_p)
    kept = torch.where(keep, logp, torch.full_like(logp, -math.inf))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)


def check_sampled(
    logits: torch.Tensor | LogitRows,
    tokens: Sequence[int],
    *,
    temperature: float,
    top_p: float,
    z_max: float,
    nucleus_slack: float = 0.02,
) -> AuditVerdict:
    """The likelihood test of the module contract."""
    n = len(tokens)
    refused = _shape_check(logits, tokens)
    if refused is not None:
        return refused
    if isinstance(logits, LogitRows):  # the same test, scored by the rows themselves
        top = min(1.0, top_p + nucleus_slack)
        return _sampled_verdict(*logits.sampled_scores(tokens, temperature, top), z_max)
    import torch

    ids = torch.tensor(list(tokens), dtype=torch.long)
    logp = _nucleus_log_probs(logits, temperature, min(1.0, top_p + nucleus_slack))
    chosen = logp[torch.arange(n), ids]
    impossible = torch.isinf(chosen).nonzero()
    if len(impossible):
        i = int(impossible[0, 0])
        return AuditVerdict(False, n, i, math.inf, f"token {i} is outside the nucleus")
    p = logp.exp()
    finite = torch.where(torch.isinf(logp), torch.zeros_like(logp), logp)
    entropy = -(p * finite).sum(dim=-1)
    var = (p * finite.square()).sum(dim=-1) - entropy.square()
    surprisal = -chosen
    z = float((surprisal.sum() - entropy.sum()) / torch.sqrt(var.clamp(min=0).sum() + 1e-6))
    if z > z_max:
        return AuditVerdict(False, n, None, z, f"answer too unlikely (z = {z:.1f})")
    return AuditVerdict(True, n, None, z)


def check_answer(
    logits: torch.Tensor | LogitRows,
    tokens: Sequence[int],
    params: SamplingParams,
    config: AuditConfig,
) -> AuditVerdict:
    if params.temperature == 0.0:
        return check_greedy(logits, tokens, config.greedy_margin)
    return check_sampled(
        logits,
        tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        z_max=config.sampled_z,
        nucleus_slack=config.nucleus_slack,
    )


# --------------------------------------------------------------------------- policy


class OwnScore(Protocol):
    """This node's engine scoring an answer on its cached prefix (``Engine.score``): the
    uncached part of the prompt plus the answer, scheduled with the engine's other work."""

    async def __call__(self, prompt: list[int], answer: list[int]) -> torch.Tensor | LogitRows: ...


class SecondAuditor(Protocol):
    """Audits on other peers, none of ``not_by`` (``overlay/serve/audits.py``): ``(verdict,
    auditor)``, or None when nobody cheaper than this node could give one."""

    async def audit(
        self, prompt: list[int], answer: list[int], params: SamplingParams, *, not_by: set[str]
    ) -> tuple[AuditVerdict, str] | None: ...


@dataclass(frozen=True)
class AuditPlan:
    audit: bool
    hold: bool  # keep the answer from the client until the audit passed
    probation: bool
    forced: bool = False  # the per-peer minimum: never skipped for the budget


class HeldAnswer:
    """Token sink of one forward from a peer on probation: tokens are held back from ``emit``
    until ``release()`` (after the audit passed); a held answer that is never released is
    dropped. ``max_hold_s`` bounds the wait for the audit, counted from the first token."""

    def __init__(
        self,
        emit: Callable[[int], None],
        max_hold_s: float,
        *,
        emit_logprob: Callable[[TokenLogprob], None] | None = None,
    ) -> None:
        self.emit = emit
        self.emit_logprob = emit_logprob
        self.max_hold_s = max_hold_s
        self.tokens: list[int] = []
        # Log-probabilities travel with their tokens: held, released and dropped together.
        self.logprobs: list[TokenLogprob] = []
        self.released = False
        self._first: float | None = None

    def logprob(self, value: TokenLogprob) -> None:
        self.logprobs.append(value)

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        if self._first is None:
            self._first = time.monotonic()

    def remaining_s(self) -> float:
        if self._first is None:
            return self.max_hold_s
        return max(0.0, self.max_hold_s - (time.monotonic() - self._first))

    def release(self) -> None:
        if not self.released:
            self.released = True
            for i, t in enumerate(self.tokens):
                if self.emit_logprob is not None and i < len(self.logprobs):
                    self.emit_logprob(self.logprobs[i])
                self.emit(t)


class _Budget:
    """Seconds spent auditing over a sliding window, against ``share`` of that window."""

    def __init__(self, share: float, window_s: float, clock: Callable[[], float]) -> None:
        self.share, self.window_s, self._clock = share, window_s, clock
        self._spent: deque[tuple[float, float]] = deque()

    def _used(self) -> float:
        now = self._clock()
        while self._spent and self._spent[0][0] < now - self.window_s:
            self._spent.popleft()
        return sum(s for _, s in self._spent)

    def allows(self, cost_s: float) -> bool:
        used = self._used()
        return used == 0 or used + cost_s <= self.share * self.window_s

    def spend(self, seconds: float) -> None:
        self._spent.append((self._clock(), seconds))


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.audits = Counter(
            "p2pnode_audits", "Audits of forwarded answers", ["mode", "verdict"], registry=registry
        )
        self.reserved = Counter(
            "p2pnode_audit_reserved",
            "Answers re-served elsewhere after their held audit failed",
            registry=registry,
        )
        self.seconds = Counter(
            "p2pnode_audit_seconds", "Compute seconds spent on audits", registry=registry
        )
        self.by = Counter(
            "p2pnode_audits_by_auditor",
            "Audit verdicts by who computed them: this node (self) or a third peer (peer)",
            ["auditor"],
            registry=registry,
        )


class Auditor:
    """Plans and runs audits for one ``RoutedService`` (see the module contract).

    ``plan(peer, params)`` before a forward; after it, ``await check(...)`` for a held answer
    (returns the verdict, or None when the audit outlasted the hold: the answer is then
    dropped) or ``later(...)`` for a released one (queued for the background task ``run``).
    ``busy()`` says whether the local engine has work (background audits wait for it to drain).
    ``is_member(peer)``: the peer holds a valid membership of this closed network.
    """

    def __init__(
        self,
        scorer: Scorer,
        trust: TrustBook,
        config: AuditConfig | None = None,
        *,
        busy: Callable[[], bool] = lambda: False,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        is_member: Callable[[str], bool] | None = None,
        others: SecondAuditor | None = None,
        score: OwnScore | None = None,
    ) -> None:
        self.scorer = scorer
        self.score = score
        self.is_member = is_member
        self.others = others
        self.trust = trust
        self.config = config or AuditConfig()
        self.busy = busy
        self._rng = rng or random.Random()
        self._budget = _Budget(self.config.budget_share, self.config.budget_window_s, clock)
        self._lock = trio.Lock()  # one audit at a time: they share the CPU with the engine
        self._metrics = _Metrics(registry) if registry is not None else None
        self._send, self._recv = trio.open_memory_channel[tuple[Any, ...]](self.config.queue)
        self._nursery: trio.Nursery | None = None
        self.counts: dict[str, int] = {"passed": 0, "failed": 0, "skipped": 0}
        self.reserved = 0
        self.seconds = 0.0
        self._queued_s = 0.0  # expected seconds of the audits queued or running
        self._since: dict[str, int] = {}  # answers of a trusted peer since its last audit
        # Per peer: audits passed, failed and skipped, for /status.
        self.by_peer: dict[str, dict[str, int]] = {}
        self.by_auditor: dict[str, int] = {"self": 0, "peer": 0}

    def plan(self, peer: str, params: SamplingParams) -> AuditPlan:
        if self.on_probation(peer):
            return AuditPlan(audit=True, hold=True, probation=True)
        since = self._since.get(peer, 0) + 1
        forced = since >= self.config.max_gap
        audit = forced or self._rng.random() < self.config.trusted_rate
        self._since[peer] = 0 if audit else since
        return AuditPlan(audit, False, False, forced)

    def on_probation(self, peer: str) -> bool:
        if self.is_member is not None and self.is_member(peer) and not self.trust.demotions(peer):
            return False
        return self.trust.audited_ok(peer) < self.config.probation_answers

    def state(self, peer: str) -> str:
        """``member``, ``probation``, ``trusted`` or ``demoted`` (for /status)."""
        if not self.trust.usable(peer):
            return "demoted"
        if self.is_member is not None and self.is_member(peer) and not self.trust.demotions(peer):
            return "member"
        return "probation" if self.on_probation(peer) else "trusted"

    def hold_s(self, peer: str, tokens: int) -> float:
        """Seconds an answer of ``tokens`` (prompt + answer) from ``peer`` waits for its held
        audit before the client sees it: 0 for a trusted peer; for a peer on probation the
        audits already queued plus its own scoring pass, or infinity when that exceeds
        ``max_hold_s`` or the budget (the router then skips the peer: its answer could not be
        checked in time, and is never released unchecked)."""
        if not self.on_probation(peer):
            return 0.0
        cost = self.scorer.cost_s(tokens)
        # Audits run one at a time: a new one waits for those already queued.
        wait = self._queued_s + cost
        if wait > self.config.max_hold_s or not self._budget.allows(cost):
            return math.inf
        return wait

    async def check(
        self,
        peer: str,
        prompt: list[int],
        answer: list[int],
        params: SamplingParams,
        *,
        wait_s: float | None = None,
    ) -> AuditVerdict | None:
        """Audit a held answer now, whatever the budget (the router stops choosing probation
        peers once the budget is spent: ``hold_s``); None when the audit outlasted ``wait_s``
        (default ``max_hold_s``): the caller drops the answer, and the audit finishes in the
        background and still counts."""
        if not answer:
            return AuditVerdict(True, 0)
        done = trio.Event()
        box: list[AuditVerdict | None] = [None]

        async def run() -> None:
            box[0] = await self._audit(peer, prompt, answer, params, "held")
            done.set()

        assert self._nursery is not None, "start Auditor.run first"
        self._nursery.start_soon(run)
        with trio.move_on_after(self.config.max_hold_s if wait_s is None else wait_s):
            await done.wait()
        return box[0]

    def later(
        self,
        peer: str,
        prompt: list[int],
        answer: list[int],
        params: SamplingParams,
        *,
        forced: bool = False,
    ) -> None:
        """Queue a released answer for a background audit. A sampled one is skipped when the
        queue is full or the budget spent; a ``forced`` one (the per-peer minimum) only when
        the queue is full, and then the peer's next answer is forced again."""
        if not answer:
            return
        item = (peer, list(prompt), list(answer), params, time.monotonic(), forced)
        try:
            self._send.send_nowait(item)
        except trio.WouldBlock:
            self._count("background", "skipped", peer)
            if forced:
                self._since[peer] = self.config.max_gap

    def note_reserved(self) -> None:
        self.reserved += 1
        if self._metrics is not None:
            self._metrics.reserved.inc()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            async for peer, prompt, answer, params, queued, forced in self._recv:
                # Low priority: let the engine drain first (polled: it has no event to wait on).
                deadline = queued + self.config.defer_max_s
                while self.busy() and time.monotonic() < deadline:  # noqa: ASYNC110
                    await trio.sleep(0.05)
                cost = self.scorer.cost_s(len(prompt) + len(answer))
                if not forced and not self._budget.allows(cost):
                    self._count("background", "skipped", peer)
                    continue
                await self._audit(peer, prompt, answer, params, "background")

    async def _audit(
        self, peer: str, prompt: list[int], answer: list[int], params: SamplingParams, mode: str
    ) -> AuditVerdict:
        expected = self.scorer.cost_s(len(prompt) + len(answer))
        self._queued_s += expected
        try:
            return await self._run_audit(peer, prompt, answer, params, mode)
        finally:
            self._queued_s = max(0.0, self._queued_s - expected)

    async def _run_audit(
        self, peer: str, prompt: list[int], answer: list[int], params: SamplingParams, mode: str
    ) -> AuditVerdict:
        verdict, by = await self._verdict(peer, prompt, answer, params)
        self.trust.observe_audit(peer, verdict.passed)
        self._count(mode, "passed" if verdict.passed else "failed", peer, by)
        if not verdict.passed:
            log.warning("audit of %s failed (%s): demoted", peer, verdict.detail)
        return verdict

    async def _verdict(
        self, peer: str, prompt: list[int], answer: list[int], params: SamplingParams
    ) -> tuple[AuditVerdict, str]:
        """The verdict and who computed it (``self`` or ``peer``)."""
        others = self.others
        got = None if others is None else await others.audit(prompt, answer, params, not_by={peer})
        if got is None:
            return await self._own(prompt, answer, params), "self"
        verdict, auditor = got
        if verdict.passed:
            return verdict, "peer"
        assert others is not None
        second = await others.audit(prompt, answer, params, not_by={peer, auditor})
        again, by = (
            second if second is not None else (await self._own(prompt, answer, params), "self")
        )
        if again.passed:  # the first auditor called a right answer wrong
            log.warning("auditor %s failed a right answer of %s: it loses trust", auditor, peer)
            self.trust.observe_fault(auditor)
            return again, by if by == "self" else "peer"
        return verdict, "peer"

    async def _own(
        self, prompt: list[int], answer: list[int], params: SamplingParams
    ) -> AuditVerdict:
        async with self._lock:
            t0 = time.perf_counter()
            logits = None
            if self.score is not None:
                try:
                    logits = await self.score(prompt, answer)
                except ValueError:  # the engine refuses it (a token outside the vocabulary)
                    logits = None
            if logits is None:
                logits = await trio.to_thread.run_sync(self.scorer.logits, prompt, answer)
            verdict = check_answer(logits, answer, params, self.config)
            spent = time.perf_counter() - t0
        self._budget.spend(spent)
        self.seconds += spent
        if self._metrics is not None:
            self._metrics.seconds.inc(spent)
        return verdict

    def _count(self, mode: str, verdict: str, peer: str, by: str | None = None) -> None:
        self.counts[verdict] += 1
        mine = self.by_peer.setdefault(peer, {"passed": 0, "failed": 0, "skipped": 0})
        mine[verdict] += 1
        if by is not None:
            self.by_auditor[by] += 1
            mine[f"by_{by}"] = mine.get(f"by_{by}", 0) + 1
            if self._metrics is not None:
                self._metrics.by.labels(by).inc()
        if self._metrics is not None:
            self._metrics.audits.labels(mode, verdict).inc()
