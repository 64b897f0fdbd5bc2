"""The verifier's prompt-lookup guesses (``speculation/_lookup.py``)."""

from __future__ import annotations

import pytest

from p2pnode.speculation._lookup import NgramIndex


def test_guesses_follow_the_most_recent_earlier_occurrence() -> None:
    idx = NgramIndex(2)
    idx.extend([1, 2, 3, 4, 1, 2, 5, 6, 1, 2])
    assert idx.guess(3) == (5, 6, 1)  # (1, 2) was last followed by 5, not by 3
    assert idx.guess(1) == (5,)
    idx.extend([7])
    assert idx.guess(4) == ()  # (2, 7) never occurred before
    assert idx.guess(0) == ()


def test_a_guess_may_run_into_the_present_and_stops_at_the_end() -> None:
    idx = NgramIndex(1)
    idx.extend([4, 4])
    assert idx.guess(5) == (4,)  # 4 was followed by 4; only one token exists after it


def test_extending_piece_by_piece_equals_extending_at_once() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 2, 3]
    whole, pieces = NgramIndex(2), NgramIndex(2)
    whole.extend(tokens)
    for i in range(0, len(tokens), 3):
        pieces.extend(tokens[i : i + 3])
    assert whole.tokens == pieces.tokens and whole._after == pieces._after
    assert whole.guess(4) == pieces.guess(4) == (8, 4, 6, 2)  # what followed the earlier (2, 3)


def test_too_short_a_history_and_a_bad_length() -> None:
    idx = NgramIndex(3)
    idx.extend([1, 2])
    assert idx.guess(2) == ()
    with pytest.raises(ValueError, match="n-gram"):
        NgramIndex(0)
