"""Second opinions on a greedy result: re-verify a window of it on verifiers that did not make it.

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

Limits: only greedy results (a sampled token has no single right answer); one window per call,
so a liar that lies rarely is caught in proportion to how often the app audits; honest
verifiers on different hardware can disagree where two logits tie within float error, which is
why one disagreement alone blames nobody.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from p2pnode.speculation.client import BadVerdict
from p2pnode.speculation.protocol import P2PVerifierTransport
from p2pnode.speculation.verify import BadRequest, Block, Lead, SamplingOptions

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
        from p2pnode.speculation.edge import NoVerifier

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
