"""Audits of speculative results: second opinions on greedy ones, a likelihood test of sampled ones.

The edge checks each verdict for impossibilities (``overlay.trust.verdict_problem``), but a
careful liar answers plausibly: it rejects good drafts or names a valid but wrong token, and
those tokens are committed. For greedy decoding every committed token has one right answer, the
target's argmax, so any honest verifier accepts a window of committed tokens sent as a draft
block in full. ``audit_result`` does that:

- window: ``window`` tokens (at most ``MAX_WINDOW``, the verifier's block limit) of
  ``result.tokens`` from ``start`` (random when not given), sent as one block after the prompt and
  the committed tokens before it, on a fresh session (lead off) at a verifier that produced none
  of the result;
- all accepted: "agreed", the producers gain trust;
- rejected at position i: a third verifier (again not a producer) arbitrates. If it accepts
  the whole window the second opinion was wrong ("auditor-wrong", that auditor is blamed); if
  it stops at the same i the producer of token i was wrong ("producer-wrong", blamed);
  otherwise, or without a third verifier, "disputed" and nobody is blamed.
- Blame is ``TrustBook.observe_fault``: a demoted verifier leaves ``find_verifiers``.

Sampled results (``audit_sampled``): a sampled token has no one right answer, but an honest
result is a sample of the target's distribution (speculative sampling's output is distributed
exactly as the target's), so its likelihood under the target must be plausible. The test is
``overlay.audit.check_sampled``, the one the origin applies to sampled forwarded answers: the
target's logits at every position of the result (ONE teacher-forced pass, ``Scorer``), a token
outside the (slightly widened) top-p nucleus fails at once, otherwise the summed surprisal is
compared with its mean and variance under the target's own sampling distribution,
``z = (S - sum H) / sqrt(sum Var)``, failing above ``z_max`` (4.0). False alarms: by
Cantelli's inequality at most 1 / (1 + z_max^2) = 5.9 % for any distribution, and measured
(tests/speculation/test_audit.py, real model) far lower, as the sum is close to normal. Each producer's
share of a failed-over result is tested on its own, so blame lands on the verifier whose
tokens are implausible (``TrustBook.observe_fault``); a pass credits it (``observe_ok``). The
scorer must run the target (``inference.scoring.ModelScorer``): the edge's own draft is a
different distribution and would bias the test. Limits: it catches answers the target finds
unlikely (random, another model's, tokens from a far other temperature); a liar sampling from
a slightly different distribution is caught only in proportion to how much less likely its
tokens are, and a segment of few tokens says little.

Limits (greedy): only greedy results (a sampled token has no single right answer); one window per call,
so a liar that lies rarely is caught in proportion to how often the app audits; honest
verifiers on different hardware can disagree where two logits tie within float error, which is
why one disagreement alone blames nobody.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from p2pnode.inference.scoring import Scorer
from p2pnode.overlay.trust.audit import AuditVerdict, check_sampled
from p2pnode.speculation._blocks import Block, Lead, SamplingOptions
from p2pnode.speculation._errors import BadRequest, BadVerdict, NoVerifier
from p2pnode.speculation.protocol import P2PVerifierTransport

MAX_WINDOW = 16
log = logging.getLogger(__name__)


@dataclass
class Audit:
    start: int  # index in result.tokens of the window's first token
    checked: int  # tokens in the window
    verdict: str  # "agreed" | "producer-wrong" | "auditor-wrong" | "disputed"
    opinions: dict[str, int] = field(default_factory=dict)  # auditor -> tokens it accepted
    blamed: list[str] = field(default_factory=list)


async def accepted_by(edge, peer: str, context: list[int], window: list[int]) -> int:
    """How many tokens of ``window`` (after ``context``) the verifier ``peer`` accepts."""
    t = P2PVerifierTransport(edge.node, peer, edge.model_id, result_timeout_s=edge.result_timeout_s)
    try:
        await t.open(context, SamplingOptions())
        await t.send_block(Block(0, len(context), context[-1], tuple(window)))
        res = await t.receive_result()
    finally:
        await t.close()
    if isinstance(res, Lead) or res.stale or not 0 <= res.accepted <= len(window):
        raise BadVerdict(f"auditor {peer[-8:]} answered {res} to a fresh session's block")
    return res.accepted


async def audit_result(
    edge,
    result,
    *,
    window: int = MAX_WINDOW,
    start: int | None = None,
    auditors: list[str] | None = None,
    rng: random.Random | None = None,
) -> Audit:
    if not result.greedy:
        raise BadRequest("only greedy results can be audited: a sampled token has no one answer")
    out = result.tokens
    k = min(window, MAX_WINDOW, len(out))
    if k < 1:
        raise BadRequest("nothing to audit: the result has no tokens")
    if start is None:
        start = (rng or random.Random()).randrange(len(out) - k + 1)
    if not 0 <= start <= len(out) - k:
        raise BadRequest(f"start must be in [0, {len(out) - k}], got {start}")
    context, win = result.prompt_ids + out[:start], out[start : start + k]
    candidates = auditors if auditors is not None else await edge.find_verifiers()
    audit = Audit(start, k, "disputed")
    for peer in [p for p in candidates if p not in result.verifiers]:
        try:
            audit.opinions[peer] = await accepted_by(edge, peer, context, win)
        except Exception as exc:  # unreachable, dead, refusing or nonsensical: ask the next one
            log.info("auditor %s failed (%r); asking the next one", peer, exc)
            continue
        if len(audit.opinions) == 2 or next(iter(audit.opinions.values())) == k:
            break
    if not audit.opinions:
        raise NoVerifier("no verifier other than the result's own could audit it")
    (second, a2), *rest = audit.opinions.items()
    if a2 == k:
        audit.verdict = "agreed"
        for peer in result.verifiers:
            edge.trust.observe_ok(peer)
    elif rest:
        third, a3 = rest[0]
        if a3 == k:
            audit.verdict, audit.blamed = "auditor-wrong", [second]
        elif a3 == a2:
            audit.verdict, audit.blamed = "producer-wrong", [result.producer_of(start + a2)]
    for peer in audit.blamed:
        edge.trust.observe_fault(peer)
    return audit


SAMPLED_Z_MAX = 4.0  # false alarms <= 1 / (1 + 4^2) = 5.9 % (Cantelli), measured far below
NUCLEUS_SLACK = 0.02  # as overlay.audit: another numeric path's boundary token stays possible


@dataclass
class SampledAudit:
    verdict: str  # "plausible" | "implausible"
    checked: int  # tokens scored
    segments: dict[str, AuditVerdict] = field(default_factory=dict)  # producer -> its verdict
    blamed: list[str] = field(default_factory=list)


def audit_sampled(
    trust,
    result,
    scorer: Scorer,
    *,
    z_max: float = SAMPLED_Z_MAX,
    nucleus_slack: float = NUCLEUS_SLACK,
) -> SampledAudit:
    """The likelihood test of a sampled result (module contract); blames in ``trust``.

    Synchronous and CPU-bound (one forward pass of the target): from trio, call it through
    ``trio.to_thread.run_sync`` (``EdgeClient.audit`` does)."""
    if result.greedy:
        raise BadRequest("a greedy result has one right answer: audit it with audit_result")
    out = list(result.tokens)
    if not out:
        raise BadRequest("nothing to audit: the result has no tokens")
    logits = scorer.logits(result.prompt_ids, out)
    bounds = [*result.starts, len(out)] if result.starts else [0, len(out)]
    producers = result.verifiers or ["?"]
    audit = SampledAudit("plausible", len(out))
    for k, peer in enumerate(producers):
        lo, hi = bounds[k], bounds[k + 1]
        if hi <= lo:
            continue
        verdict = check_sampled(
            logits[lo:hi],
            out[lo:hi],
            temperature=result.temperature,
            top_p=result.top_p,
            z_max=z_max,
            nucleus_slack=nucleus_slack,
        )
        audit.segments[peer] = verdict
        if verdict.passed:
            trust.observe_ok(peer)
        else:
            audit.verdict = "implausible"
            audit.blamed.append(peer)
            trust.observe_fault(peer)
            log.warning("sampled result of %s implausible: %s", peer, verdict.detail)
    return audit
