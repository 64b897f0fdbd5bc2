"""The learned cost of a forward over the network (overlay/routing/netcost.py)."""

from __future__ import annotations

import random

import pytest

from p2pnode.overlay.routing.netcost import ForwardCost, NetCostConfig


def test_forward_cost_is_learned_from_observed_forwards() -> None:
    cost = ForwardCost()
    assert cost.estimate("p", 0.1, 4000) == pytest.approx(3 * 0.1 + 4000 / 1.25e6)
    assert cost.spread_s(0.1) == 0.1  # one round trip before anything was measured
    rng = random.Random(5)
    for _ in range(200):  # this network: 1.5 round trips and 1 MB/s
        rtt = rng.uniform(0.01, 0.3)
        nbytes = rng.uniform(500, 20000)
        engine_s = rng.uniform(0.0, 0.5)
        net = 1.5 * rtt + nbytes / 1e6
        cost.observe("p", rtt, nbytes, engine_s + net + rng.gauss(0, 0.002), engine_s)
    assert cost.round_trips == pytest.approx(1.5, abs=0.1)
    assert cost.bandwidth_Bps == pytest.approx(1e6, rel=0.3)
    assert cost.spread_s(0.1) < 0.01
    # A peer claiming a huge engine time cannot look closer than one round trip.
    cost.observe("liar", 0.1, 1000, 0.3, 10.0)
    assert cost.estimate("liar", 0.1, 1000) >= 0.1


def test_a_starved_first_token_is_not_taken_for_the_network_and_a_peer_bias_fades() -> None:
    now = [0.0]
    cost = ForwardCost(NetCostConfig(bias_half_life_s=60.0), clock=lambda: now[0])
    # A first token 10 s late on a 20 ms link: the origin's loop or the peer's CPU was
    # starved. It counts as at most 20 round trips plus the request at 80 kbit/s.
    cost.observe("p", 0.02, 4000, 10.2, 0.2)
    ceiling = 20 * 0.02 + 4000 / 1e4
    assert cost.estimate("p", 0.02, 4000) <= ceiling
    high = cost.estimate("p", 0.02, 4000)
    assert high > cost.estimate("q", 0.02, 4000)  # still above a peer never measured
    now[0] = 600.0  # ten half-lives with no forward there: back near the shared model
    assert cost.estimate("p", 0.02, 4000) - cost.estimate("q", 0.02, 4000) < 0.01 * (
        high - cost.estimate("q", 0.02, 4000)
    )
