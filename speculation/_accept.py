"""The acceptance math of speculative decoding: pure functions, tensors in, tokens out.

Contract:
- ``verify_greedy(logits, draft)``: ``logits`` [k+1, V] are the target's at the positions of
  (last committed token, d_1..d_k). Accepts the longest prefix with argmax == d_i, then returns
  the target's own next token: ``(accepted, next_token)``. Output == the target's greedy decoding.
- ``verify_sampling(p, q, draft, generator)``: standard speculative rejection sampling. ``p``
  [k+1, V] target probabilities, ``q`` [k, V] the distribution each d_i was drawn from (``None``:
  one-hot, for an argmax draft). Accept d_i with probability min(1, p/q); on rejection draw from
  norm(max(0, p - q)); if all k are accepted draw a bonus token from p[k]. The emitted tokens are
  distributed exactly as the target's samples, whatever q is. The only state touched is
  ``generator``'s.
- ``accept_draft(options, logits, draft, q, generator)``: the one a session's options call for.
  Greedy runs where the logits are; sampling copies the few rows to the CPU and draws with the
  session's seeded CPU generator (device-independent).
- ``truncate_probs(probs, k)``: each row's ``k`` most likely tokens, renormalized: a valid
  proposal q that is cheap on the wire.
"""

from __future__ import annotations

import torch

from p2pnode.inference.sampling import probs_from_logits
from p2pnode.speculation._blocks import SamplingOptions
from p2pnode.speculation._errors import BadBlock

__all__ = ["accept_draft", "truncate_probs", "verify_greedy", "verify_sampling"]

Draft = list[int] | tuple[int, ...]


def verify_greedy(logits: torch.Tensor, draft: Draft) -> tuple[int, int]:
    best = logits.argmax(-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return n, best[n]


def verify_sampling(
    p: torch.Tensor, q: torch.Tensor | None, draft: Draft, generator: torch.Generator
) -> tuple[int, int]:
    for i, d in enumerate(draft):
        qd = 1.0 if q is None else float(q[i, d])
        if qd <= 0:
            raise BadBlock(
                f"draft token {i} ({d}) has draft probability 0: it was not drawn from q"
            )
        if float(torch.rand((), generator=generator)) * qd < float(p[i, d]):
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0
        else:
            residual = (p[i] - q[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q on the support: any draw from p is exact
            residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))


def accept_draft(
    options: SamplingOptions,
    logits: torch.Tensor,
    draft: Draft,
    q: torch.Tensor | None,
    generator: torch.Generator,
) -> tuple[int, int]:
    """``(accepted, next_token)`` for ``draft`` under ``options`` (see the module contract)."""
    if options.greedy:
        return verify_greedy(logits, draft)
    p = probs_from_logits(logits.float().cpu(), options.temperature, options.top_p)
    return verify_sampling(p, q, draft, generator)


def truncate_probs(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Keep each row's ``k`` most likely tokens, renormalized (a valid, wire-cheap proposal q)."""
    if k >= probs.shape[-1]:
        return probs
    vals, idx = probs.topk(k, dim=-1)
    out = torch.zeros_like(probs).scatter_(-1, idx, vals)
    return out / out.sum(-1, keepdim=True)
