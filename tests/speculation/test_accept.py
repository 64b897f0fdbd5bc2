"""Verification math (speculation/_accept.py): greedy acceptance and rejection sampling, exact in
distribution.

Real parts only: the default SmolLM2 target (fp32) and its W4A16 draft, real loopback libp2p nodes.
"""

from __future__ import annotations

from collections import Counter

import torch

from p2pnode.speculation import (
    verify_greedy,
    verify_sampling,
)


def test_verify_greedy_accepts_longest_matching_prefix() -> None:
    logits = torch.full((4, 10), -1.0)
    for i, best in enumerate([3, 5, 7, 9]):
        logits[i, best] = 1.0
    assert verify_greedy(logits, [3, 5, 7]) == (3, 9)
    assert verify_greedy(logits, [3, 6, 7]) == (1, 5)
    assert verify_greedy(logits, [0, 5, 7]) == (0, 3)
    assert verify_greedy(logits[:1], []) == (0, 3)


# Synthetic target distributions over 5 tokens at 3 positions (2 drafts + the bonus).
_P = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1], [0.05, 0.05, 0.3, 0.3, 0.3], [0.2] * 5])


def _emitted_frequencies(q, draw, n: int, gen) -> tuple[list[float], list[float], int]:
    """Frequencies of the first and (where the first draft was accepted) the second emitted
    token over ``n`` verifications of ``draw()``'s drafts against ``_P``; and that count."""
    first, second = Counter(), Counter()
    for _ in range(n):
        draft = draw()
        acc, nxt = verify_sampling(_P, q, draft, gen)
        emitted = [*draft[:acc], nxt]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    m = sum(second.values())
    return [first[t] / n for t in range(5)], [second[t] / m for t in range(5)], m


def test_rejection_sampling_reproduces_target_distribution() -> None:
    # 2 draft tokens per block, drawn from q. The emitted pair must follow p0 x p1 exactly.
    # n = 6000: each cell's frequency has std <= 0.0065, so a max deviation of 0.025 (~4 sigma)
    # is a safe bound that a wrong rule (e.g. taking draft tokens as is) breaks by far (q
    # differs from p by >= 0.15 in some cells).
    q = torch.tensor([[0.1, 0.1, 0.6, 0.1, 0.1], [0.25, 0.25, 0.1, 0.2, 0.2]])
    gen = torch.Generator().manual_seed(1)

    def draw() -> list[int]:
        return [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]

    first, second, m = _emitted_frequencies(q, draw, 6000, gen)
    assert max(abs(first[t] - float(_P[0, t])) for t in range(5)) < 0.025
    assert m >= 2000  # the second token exists when the first was accepted
    assert max(abs(second[t] - float(_P[1, t])) for t in range(5)) < 0.04


def test_rejection_sampling_of_fixed_guesses_reproduces_target_distribution() -> None:
    # Prompt-lookup guesses are not drawn from any q: the same two guesses every time, checked
    # against a one-hot proposal (q None). The emitted tokens must still follow p exactly (bounds
    # as above; taking the guesses as they are would put all the first token's mass on 1).
    gen = torch.Generator().manual_seed(2)
    first, second, m = _emitted_frequencies(None, lambda: [1, 3], 6000, gen)
    assert max(abs(first[t] - float(_P[0, t])) for t in range(5)) < 0.025
    assert m >= 1000  # the first guess is taken with p0[1] = 0.2: m ~ 1200
    assert max(abs(second[t] - float(_P[1, t])) for t in range(5)) < 0.06
