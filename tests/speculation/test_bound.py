"""The speculation bound's simulations (``bench/speculation_bound.py``) on cases whose times can be
worked out by hand: a draft that is always right, one that is always wrong, and a round trip
longer than the whole generation."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "speculation_bound.py"
_SPEC = importlib.util.spec_from_file_location("speculation_bound", _PATH)
bound = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = bound  # dataclasses look their module up there
_SPEC.loader.exec_module(bound)


def flat(k: int) -> float:
    return 10.0  # a target step costs 10 ms whatever its positions


def test_a_draft_always_right_commits_a_full_block_each_step_after_the_first() -> None:
    # Step 1 finds no guess (none is drafted before it starts) and decodes one token alone; by
    # step 2 the edge has drafted far ahead, so every later step verifies 4 guesses and commits
    # them plus its own token: 1 + 10 x 5 = 51 tokens in 11 steps.
    t = bound.simulate_ideal([1] * 51, 0.0, flat, 0.01, max_block=4)
    assert t == pytest.approx(110.0)


@pytest.mark.parametrize("rtt", [0.0, 100.0])
def test_a_draft_always_wrong_leaves_the_verifier_decoding_alone(rtt: float) -> None:
    # Every guess is contradicted by the token before it, so no step ever has a usable guess.
    assert bound.simulate_ideal([0] * 40, rtt, flat, 3.0) == bound.simulate_remote(40, flat)


def test_guesses_that_arrive_after_the_end_change_nothing() -> None:
    agree = [int(random.Random(1).random() < 0.8) for _ in range(50)]
    far = bound.simulate_ideal(agree, 1e6, flat, 1.0)
    assert far == bound.simulate_remote(50, flat)
    assert bound.simulate_ideal(agree, 0.0, flat, 1.0) < far  # and near, they help


def test_sync_pays_drafting_a_round_trip_and_a_verify_per_block() -> None:
    # gamma 4 all accepted: 5 tokens per (4 x 10 ms drafting + 100 ms + one 20 ms verify).
    assert bound.simulate_sync([1] * 50, 100.0, lambda k: 20.0, 10.0, 4) == pytest.approx(1600.0)
    # all rejected: 1 token per block, the last blocks shorter where few tokens are left
    t = bound.simulate_sync([0] * 5, 100.0, lambda k: 20.0, 10.0, 4)
    assert t == pytest.approx(160 + 160 + 150 + 140 + 130)


def test_linear_cost_passes_through_the_measured_points() -> None:
    cost = bound.linear_cost(30.0, 42.0)
    assert (cost(1), cost(5), cost(9)) == (30.0, 42.0, 54.0)


def test_second_choice_leaves_are_verified_as_positions_of_their_own() -> None:
    # The always-right draft of the first test: 11 steps, 10 of them over 4 guesses, which
    # with a leaf each cost 2 x 4 + 1 positions instead of 4 + 1; no right leaf changes nothing.
    right, none = [1] * 51, [0] * 51
    per_position = lambda k: float(k)  # noqa: E731
    plain = bound.simulate_ideal(right, 0.0, per_position, 0.01, max_block=4)
    leaves = bound.simulate_ideal(right, 0.0, per_position, 0.01, max_block=4, second=none)
    assert (plain, leaves) == (pytest.approx(1 + 10 * 5), pytest.approx(1 + 10 * 9))


def test_a_right_leaf_saves_the_round_trip_of_a_wrong_guess() -> None:
    rng = random.Random(3)
    agree = [int(rng.random() < 0.75) for _ in range(200)]
    second = [int(not a and rng.random() < 0.5) for a in agree]
    for rtt in (0.0, 20.0):  # (at 10 round trips a step hardly any guess is used at all)
        chain = bound.simulate_ideal(agree, rtt, flat, 1.0)
        assert bound.simulate_ideal(agree, rtt, flat, 1.0, second=[0] * 200) == chain
        assert bound.simulate_ideal(agree, rtt, flat, 1.0, second=second) < chain


@pytest.mark.parametrize("rtt", [0.0, 37.0, 100.0])
def test_hedging_at_depth_zero_is_the_plain_pipeline(rtt: float) -> None:
    rng = random.Random(5)
    agree = [int(rng.random() < 0.75) for _ in range(120)]
    second = [int(not a and rng.random() < 0.5) for a in agree]
    cost = bound.linear_cost(40.0, 42.0)
    plain = bound.simulate_ideal(agree, rtt, cost, 10.0)
    assert bound.simulate_hedged(agree, second, rtt, cost, 10.0, depth=0) == pytest.approx(plain)


def test_free_branches_at_the_right_second_choices_beat_the_chain_and_costly_ones_do_not() -> None:
    # Every wrong first choice has a right second: a free branch there spares the verifier the
    # round trip the chain pays. Branches that cost a draft step each delay the chain instead,
    # and with a draft a quarter of the target's step that costs more than it saves here.
    rng = random.Random(7)
    agree = [int(rng.random() < 0.75) for _ in range(200)]
    second = [1 - a for a in agree]
    cost = bound.linear_cost(40.0, 42.0)
    chain = bound.simulate_ideal(agree, 100.0, cost, 10.0)
    free = bound.simulate_hedged(agree, second, 100.0, cost, 10.0, depth=3, branch_cost=0.0)
    costly = bound.simulate_hedged(agree, second, 100.0, cost, 10.0, depth=3, branch_cost=1.0)
    assert free < chain < costly
