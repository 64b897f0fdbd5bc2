"""The connection manager's choices (overlay/net/connmgr.py): what a trim keeps and what
discovery may dial, on a fake clock (the policy is pure; the node wiring is tested with real
nodes in tests/overlay/test_node.py)."""

from __future__ import annotations

import pytest
import trio

from p2pnode.overlay.net.connmgr import (
    EXPLORE_EVERY_S,
    Candidate,
    ConnLimits,
    ConnManager,
    pair_rank,
    select_keep,
)

from testkit import FakeClock, wait_until


def test_limits_are_checked() -> None:
    assert not ConnLimits().enabled
    with pytest.raises(ValueError, match="low <= high"):
        ConnLimits(low=9, high=8)
    with pytest.raises(ValueError, match="long_links"):
        ConnLimits(low=2, high=4, long_links=2)


def test_pair_rank_is_the_same_from_either_end() -> None:
    assert pair_rank("a", "b") == pair_rank("b", "a")
    assert pair_rank("a", "b") != pair_rank("a", "c")


def test_trim_keeps_protected_busy_young_long_links_then_the_nearest() -> None:
    limits = ConnLimits(low=5, high=8, grace_s=30.0, long_links=1)
    # One peer clearly nearer than the rest (RTTs rank by class, a factor of 4 wide).
    peers = [
        Candidate(f"p{i:02d}", rtt_ms=2.0 if i == 0 else 40.0 + i, age_s=100.0) for i in range(10)
    ]
    peers += [
        Candidate("boot", rtt_ms=500.0, age_s=100.0, protected=True),
        Candidate("fwd", rtt_ms=400.0, age_s=100.0, busy=True),
        Candidate("new", rtt_ms=None, age_s=5.0),
        Candidate("far", rtt_ms=300.0, age_s=100.0),
    ]
    keep = select_keep(peers, limits, "me")
    assert {"boot", "fwd", "new"} <= keep
    rest = [p for p in peers if p.peer_id not in {"boot", "fwd", "new"}]
    longest = max(rest, key=lambda p: pair_rank("me", p.peer_id)).peer_id
    assert longest in keep
    # What is left of `low` goes to the nearest by RTT.
    nearest = sorted((p for p in rest if p.peer_id != longest), key=lambda p: p.rtt_ms)
    assert len(keep) == 5 and nearest[0].peer_id in keep
    assert all(p.peer_id not in keep for p in nearest[1:])


def test_within_an_rtt_class_both_ends_rank_a_link_alike() -> None:
    """Ties in RTT class go by the pair hash, the same from either end: a link one end keeps
    is one the other end ranks the same way (exact, noisy RTTs made each end keep others)."""
    limits = ConnLimits(low=3, high=4, grace_s=0.0, long_links=1)
    ids = [f"n{i}" for i in range(8)]
    keeps = {}
    for me in ids:
        # every RTT in one class, jittered differently at each end
        peers = [Candidate(p, rtt_ms=4.0 + (hash((me, p)) % 7), age_s=60.0) for p in ids if p != me]
        keeps[me] = select_keep(peers, limits, me)
    mutual = sum(1 for a in ids for b in keeps[a] if a in keeps[b])
    assert mutual >= len(ids) * 2  # most kept links are kept at both ends


def test_nothing_is_trimmed_at_or_below_high_and_trimmed_peers_are_remembered() -> None:
    clock = FakeClock()
    mgr = ConnManager(ConnLimits(low=3, high=4, grace_s=10.0, long_links=1), clock=clock)
    mgr.protect(lambda: {"p0"})
    ids = [f"p{i}" for i in range(6)]
    for pid in ids:
        mgr.note_connected(pid)
    clock.now += 60
    rtt = {pid: float(i) for i, pid in enumerate(ids)}
    assert mgr.plan_trim("me", ids[:4], rtt.get, lambda _p: False) == []
    drop = mgr.plan_trim("me", ids, rtt.get, lambda _p: False)
    assert len(drop) == 3 and "p0" not in drop
    assert all(mgr.was_pruned(p) for p in drop)
    assert mgr.status(3)["pruned"] == 3
    clock.now += 3600
    assert not any(mgr.was_pruned(p) for p in drop)  # forgotten after a while


def test_discovery_fills_to_low_then_explores_one_at_a_time_below_high() -> None:
    clock = FakeClock()
    mgr = ConnManager(ConnLimits(low=4, high=6, long_links=1), clock=clock)
    assert mgr.dial_budget(1) == 3
    assert mgr.may_redial(3) and not mgr.may_redial(4)
    assert mgr.dial_budget(4) == 1  # one exploratory dial
    assert mgr.dial_budget(4) == 0  # and the next only after EXPLORE_EVERY_S
    clock.now += EXPLORE_EVERY_S
    assert mgr.dial_budget(6) == 0  # never at or above high
    assert mgr.dial_budget(5) == 1
    off = ConnManager(ConnLimits())
    assert off.dial_budget(500) == -1 and off.may_redial(500)
    assert off.plan_trim("me", [f"p{i}" for i in range(500)], lambda _p: 1.0, bool) == []


def _one_component(nodes) -> bool:
    ids = {n.host.get_id(): n for n in nodes}
    seen, todo = set(), [nodes[0].host.get_id()]
    while todo:
        peer = todo.pop()
        if peer in seen:
            continue
        seen.add(peer)
        todo += [p for p in ids[peer].host.get_connected_peers() if p in ids]
    return len(seen) == len(nodes)


@pytest.mark.slow
async def test_bounded_nodes_trim_and_gossip_still_reaches_every_node(overlay_network) -> None:
    """Real nodes with low=3/high=4 out of 7: each ends with at most `high` connections, the
    overlay stays one graph, and a message published at one node reaches all of them."""
    limits = {"conn_low": 3, "conn_high": 4, "conn_grace": 0.0}
    async with overlay_network(7, **limits) as nodes:
        await wait_until(
            lambda: sum(n.connmgr.pruned_total for n in nodes) > 0, 60, "some trim ran"
        )
        await wait_until(
            lambda: (
                all(len(n.host.get_connected_peers()) <= 4 for n in nodes) and _one_component(nodes)
            ),
            60,
            "every node within high, one connected overlay",
        )
        subs = [await n.pubsub.subscribe("connmgr-test") for n in nodes]
        got: set[int] = set()

        async def receive(i: int, sub) -> None:
            await sub.get()
            got.add(i)

        async with trio.open_nursery() as nursery:
            for i, sub in enumerate(subs[:-1]):
                nursery.start_soon(receive, i, sub)
            with trio.move_on_after(30):
                for k in range(60):  # until the mesh over the bounded links carried one
                    await nodes[-1].pubsub.publish("connmgr-test", b"digest %d" % k)
                    await trio.sleep(0.5)
                    if len(got) == len(nodes) - 1:
                        break
            nursery.cancel_scope.cancel()
        assert got == set(range(len(nodes) - 1))
        status = nodes[0].status()["connections"]
        assert status["enabled"] and status["low"] == 3 and status["high"] == 4


async def test_a_natd_node_dials_public_peers_at_once_and_they_wait_for_it(overlay_network) -> None:
    """A NAT'd node reaches a public one directly; the public one could only open a circuit.
    So discovery's tie-break gives way across a NAT (the NAT test's "NAT'd-public: direct")."""
    from multiaddr import Multiaddr

    from p2pnode.overlay.net.discovery import PRIVATE_PEER_WAIT_S, TIE_BREAK_WAIT_S

    async with overlay_network(1) as (node,):
        direct = [Multiaddr("/ip4/10.77.0.3/tcp/4101")]
        circuit = [Multiaddr(f"/ip4/10.77.0.2/tcp/4101/p2p/{node.peer_id}/p2p-circuit")]
        smaller = "1" * len(node.peer_id)  # sorts before any base58 peer id
        node.address_book.reachability = "private"
        assert node.discovery.dial_wait(smaller, direct) == 0.0
        node.address_book.reachability = "public"
        assert node.discovery.dial_wait(smaller, circuit) == PRIVATE_PEER_WAIT_S
        assert node.discovery.dial_wait(smaller, direct) == TIE_BREAK_WAIT_S
        assert node.discovery.dial_wait("z" * len(node.peer_id), direct) == 0.0
