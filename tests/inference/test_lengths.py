"""Expected output lengths (inference/lengths.py), which the router uses for the decode term."""

from __future__ import annotations

import pytest

from p2pnode.inference.lengths import OutputLengths


def test_output_lengths_predict_bounded_means_and_treat_limits_as_censored() -> None:
    lengths = OutputLengths(window=8)
    assert lengths.predict(256) == 256  # no history: the old, conservative full limit
    for n in (10, 20, 30):
        lengths.observe(n, hit_limit=False)
    assert lengths.predict(256) == pytest.approx(20.0)
    assert lengths.predict(15) == pytest.approx((10 + 15 + 15) / 3)  # bounded by max_tokens
    assert lengths.remaining(25, 256) == pytest.approx(5.0)  # only the 30-token one ran longer
    assert lengths.remaining(40, 256) == 40  # in the tail: about as long again
    lengths.observe(64, hit_limit=True)  # stopped at its limit: could have gone on
    assert lengths.remaining(40, 256) == pytest.approx(256 - 40)
