"""The ``Logits`` and ``LogitRows`` seams: the sampler, the log-probabilities and the audits read
a model's tensors and the emulated closed form alike, and any other row that speaks them.

Real parts: the model path's ``TensorLogits``, the emulated rows, the audits' checks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from p2pnode.inference.emulated import EmulatedLogits, EmulatedRows
from p2pnode.inference.sampling import (
    Logits,
    SamplingParams,
    TensorLogits,
    as_logits,
    sample_token,
    token_logprob,
)
from p2pnode.inference.scoring import LogitRows
from p2pnode.overlay.trust.audit import check_greedy, check_sampled


class OneHot:
    """A row no product module knows of: all its mass on ``pick``."""

    def __init__(self, pick: int) -> None:
        self.pick = pick

    def argmax(self) -> int:
        return self.pick

    def sample(self, params: SamplingParams, generator: object) -> int:
        return self.pick

    def raw_log_softmax(self, token: int) -> float:
        return 0.0 if token == self.pick else -math.inf

    def top(self, n: int) -> list[int]:
        return [self.pick][:n]


def test_both_kinds_of_row_speak_logits_and_a_bare_tensor_is_wrapped() -> None:
    dense = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert isinstance(as_logits(dense), TensorLogits)
    row = EmulatedLogits(8, 5)
    assert as_logits(row) is row and isinstance(row, Logits)
    assert as_logits(OneHot(2)).argmax() == 2
    assert sample_token(dense, SamplingParams()) == 1  # greedy: ties to the lowest id
    assert sample_token(OneHot(6), SamplingParams(temperature=1.0)) == 6
    lp = token_logprob(dense, 2, 2)
    ref = torch.log_softmax(dense, dim=-1)
    assert lp.logprob == float(ref[2]) and [i for i, _ in lp.top] == [1, 3]
    assert token_logprob(dense, 2, 0).top == ()
    assert token_logprob(OneHot(3), 3, 5).top == ((3, 0.0),)


def test_a_seeded_tensor_sample_is_reproducible() -> None:
    dense = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.8, top_p=0.9)

    def draw() -> list[int]:
        gen = torch.Generator().manual_seed(7)
        return [sample_token(dense, params, gen) for _ in range(20)]

    assert draw() == draw() and len(set(draw())) > 1


class Rows:
    """Rows that score an answer themselves, unknown to the audits."""

    def __init__(self, gaps: list[float]) -> None:
        self.gaps = gaps
        self.shape = (len(gaps), 10)

    def greedy_gaps(self, tokens: Sequence[int]) -> list[float]:
        return list(self.gaps)

    def sampled_scores(
        self, tokens: Sequence[int], temperature: float, top_p: float
    ) -> tuple[list[float], float, float]:
        return [-1.0] * len(tokens), float(len(tokens)), 1.0


def test_the_audits_read_rows_through_the_protocol() -> None:
    assert isinstance(EmulatedRows([EmulatedLogits(8, 1)], 8), LogitRows)
    assert not isinstance(torch.zeros(2, 8), LogitRows)  # a tensor takes the audits' torch path
    verdict = check_greedy(Rows([0.0, 0.7, 0.1]), [1, 2, 3], 0.5)
    assert not verdict.passed and verdict.first_bad == 1 and verdict.statistic == 0.7
    sampled = check_sampled(Rows([0.0, 0.0]), [1, 2], temperature=1.0, top_p=1.0, z_max=4.0)
    assert sampled.passed and math.isclose(sampled.statistic, 0.0, abs_tol=1e-3)
    rows = [EmulatedLogits.after(10 + i, i, 64, 2) for i in range(4)]
    tokens = [
        r.sample(SamplingParams(temperature=1.0), random.Random(i)) for i, r in enumerate(rows)
    ]
    closed = EmulatedRows(rows, 64).sampled_scores(tokens, 1.0, 1.0)
    assert closed[0] == [r.log_prob(t, 1.0, 1.0) for r, t in zip(rows, tokens, strict=True)]
