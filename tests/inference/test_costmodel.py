"""The prefill chunk fit of ``CostModel``: a fixed part per chunk plus a part per token."""

import random

import pytest

from p2pnode.inference.costmodel import CostModel


def test_mixed_chunks_recover_the_fixed_and_per_token_parts() -> None:
    rng = random.Random(7)
    cost = CostModel(prefill_s_per_token=0.004, overhead_s=0.01)  # a wrong start
    for _ in range(60):
        n = rng.choice([20, 30, 40, 375, 400])
        cost.observe_prefill(n, 0.075 + 0.0019 * n + rng.gauss(0, 0.005))
    assert cost.prefill_s_per_token == pytest.approx(0.0019, rel=0.1)
    assert cost.overhead_s == pytest.approx(0.075, rel=0.15)
    # What the old per-chunk ratio believed after short chunks: (0.075 + 40 * 0.0019) / 40.
    assert cost.estimate(440, 400, 0) < 0.075 + 40 * 0.0019 + 0.01


def test_chunks_of_one_size_predict_that_size_and_keep_a_plausible_slope() -> None:
    cost = CostModel(prefill_s_per_token=0.0022, overhead_s=0.03)
    for _ in range(50):
        cost.observe_prefill(40, 0.15)
    assert cost.overhead_s + 40 * cost.prefill_s_per_token == pytest.approx(0.15, rel=0.05)
    assert 0.0015 < cost.prefill_s_per_token < 0.003  # the prior holds the slope


def test_figures_set_from_outside_restart_the_fit() -> None:
    cost = CostModel(prefill_s_per_token=0.002, overhead_s=0.05)
    for _ in range(30):
        cost.observe_prefill(300, 3.0)  # a very slow spell
    cost.prefill_s_per_token, cost.overhead_s = 0.002, 0.05  # a calibration
    cost.observe_prefill(300, 0.05 + 300 * 0.002)
    assert cost.prefill_s_per_token == pytest.approx(0.002, rel=0.01)
    assert cost.overhead_s == pytest.approx(0.05, rel=0.02)


def test_nonsense_timings_are_ignored() -> None:
    cost = CostModel(prefill_s_per_token=0.002, overhead_s=0.05)
    cost.observe_prefill(0, 1.0)
    cost.observe_prefill(10, 0.0)
    cost.observe_prefill(10, float("nan"))
    assert (cost.prefill_s_per_token, cost.overhead_s, cost.observations) == (0.002, 0.05, 0)


def test_a_slow_decode_step_moves_the_figure_less_than_a_fast_one() -> None:
    slow, fast = CostModel(decode_s_per_token=0.05), CostModel(decode_s_per_token=0.05)
    slow.observe_decode(0.10)  # a neighbour's prefill on the cores
    fast.observe_decode(0.04)
    assert 0.05 < slow.decode_s_per_token < 0.0511
    assert fast.decode_s_per_token == pytest.approx(0.048)
    for _ in range(100):  # a lasting slowdown still shows
        slow.observe_decode(0.10)
    assert slow.decode_s_per_token > 0.09
