"""``testnet/sim/simspec.py``: a figure divided by a baseline of 0 is a clear error or an empty
result, never a ZeroDivisionError (a calibration file with near-zero figures once crashed
``p2pnode simulate --spec paper-lan-zipf`` that way)."""

from __future__ import annotations

import pytest

from p2pnode.inference.costmodel import Calibration
from p2pnode.testnet.sim.simspec import _ratio, compare, simulate_spec
from p2pnode.testnet.spec import builtin_spec_path, load_spec


def _arms(routing: float | None, baseline: float | None) -> dict:
    return {"routing": {"mean_latency_s": routing}, "baseline": {"mean_latency_s": baseline}}


def test_ratio_to_a_zero_or_missing_baseline_says_why() -> None:
    assert _ratio(_arms(0.5, 2.0), "mean_latency_s", "unused") == 0.25
    for baseline in (0.0, None):
        with pytest.raises(ValueError, match="baseline arm's mean_latency_s .*: the reason"):
            _ratio(_arms(0.5, baseline), "mean_latency_s", "the reason")


def test_relative_difference_to_a_real_zero_is_none_and_not_within() -> None:
    figures = {"hit_rate": 0.1, "mean_latency_s": 1.0}
    sim = {"routing": figures, "baseline": figures, "latency_ratio": 1.0, "second_half_ratio": 1}
    real = {**sim, "baseline": {"hit_rate": 0.1, "mean_latency_s": 0.0}}
    rows = {r["figure"]: r for r in compare(sim, real)}
    assert rows["baseline.mean_latency_s"]["difference"] is None
    assert not rows["baseline.mean_latency_s"]["within"]
    assert rows["baseline.hit_rate"]["within"]  # the other figures are compared as before


def test_a_calibration_that_makes_requests_free_is_named_not_divided_by() -> None:
    """Figures that pass the calibration check (prefill > 0) but round every baseline latency
    to 0 s: the spec's baseline arm runs with no network, so nothing else adds time."""
    cal = Calibration(1e-9, 0.0, 0.0, source="near-zero.json")
    with pytest.raises(ValueError, match="calibration near-zero.json: prefill 1e-09 s/token"):
        simulate_spec(load_spec(builtin_spec_path("paper-lan-zipf")), calibration=cal)
