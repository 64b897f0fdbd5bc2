"""Router decisions (overlay/routing/router.py): forward or serve locally by cached prefix, RTT, queue and
push-back; rendezvous placement of misses; what this node forwarded; a digest's queue less this
router's forwards that finished after it; push-back hysteresis."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from p2pnode.identity import NodeKey
from p2pnode.inference.blockhash import BlockStored
from p2pnode.inference.lengths import OutputLengths
from p2pnode.overlay.cache.digest import DigestBuilder
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.routing.router import (
    LOCAL,
    LocalState,
    PushBack,
    Router,
    RouterConfig,
    request_bytes,
)

from testkit.clock import FakeClock
from testkit.routing import DECODE, KEY_A, KEY_B, MODEL, PREFILL, hashes_of, load, prompt


def router_with_peer(
    rtt_s: float, cached_tokens: list[int], *, load_kw: dict | None = None, registry=None
):
    views = PeerViews()
    b = DigestBuilder(KEY_B.peer_id, MODEL, load_fn=lambda: load(**(load_kw or {})))
    b.on_event(BlockStored(tuple(hashes_of(cached_tokens)), None))
    views.apply(b.full())
    router = Router(views, rtt_s=lambda peer: rtt_s, registry=registry)
    return router, views


def decide(
    router: Router, tokens: list[int], max_tokens: int, *, local_cached: int = 0, wait: float = 0.0
):
    return router.decide(
        model_id=MODEL,
        prompt_block_hashes=hashes_of(tokens),
        prompt_tokens=len(tokens),
        max_tokens=max_tokens,
        local=LocalState(
            cached_tokens=local_cached,
            wait_s=wait,
            prefill_s_per_token=PREFILL,
            decode_s_per_token=DECODE,
        ),
    )


# Prompt of 272 tokens, the peer holds the first 256 (16 blocks); 8 new tokens.
# Saving from the peer's cache: 255 tokens * 2.4 ms = 0.61 s of prefill (the last prompt token
# is always computed). Break-even RTT ~ 0.61 s - margin (5 % of ~1.13 s = 0.057 s) - transfer.
SHARED = prompt(256, seed=7)
LONG_PROMPT = SHARED + prompt(16, seed=8)


def test_lan_forwards_to_cache_holder() -> None:
    registry = CollectorRegistry()
    router, _ = router_with_peer(0.002, SHARED, registry=registry)
    d = decide(router, LONG_PROMPT, 8)
    assert d.chosen == KEY_B.peer_id and d.reason == "remote_faster"
    assert d.attempts == (KEY_B.peer_id, LOCAL)
    remote = d.estimate_for(KEY_B.peer_id)
    assert remote.cached_tokens == 256 and remote.rtt_s == 0.002
    assert d.local_total_s - remote.total_s > 0.5
    assert (
        registry.get_sample_value(
            "p2pnode_routing_decisions_total", {"target": "remote", "reason": "remote_faster"}
        )
        == 1
    )


def test_200ms_forwards_only_when_saving_exceeds_round_trip() -> None:
    # Before any forward was measured, one costs 3 round trips (overlay/routing/netcost.py's prior):
    # 0.6 s at 200 ms RTT.
    big_shared = prompt(512, seed=13)  # saves 511 * 2.4 ms = 1.23 s > 0.6 s + margin
    router, _ = router_with_peer(0.2, big_shared)
    assert decide(router, big_shared + prompt(16, seed=14), 8).chosen == KEY_B.peer_id
    router, _ = router_with_peer(0.2, SHARED)  # saves 0.61 s: about the forward's 0.6 s
    d = decide(router, LONG_PROMPT, 8)
    assert d.chosen == LOCAL and d.reason == "remote_saving_below_margin"
    short_shared = SHARED[:64]  # saves only 64 * 2.4 ms = 0.15 s
    router2, _ = router_with_peer(0.2, short_shared)
    d = decide(router2, short_shared + prompt(16, seed=9), 8)
    assert d.chosen == LOCAL and d.reason == "remote_saving_below_margin"


def test_1s_rtt_stays_local_unless_huge_saving() -> None:
    router, _ = router_with_peer(1.0, SHARED)
    assert decide(router, LONG_PROMPT, 8).chosen == LOCAL  # 0.61 s saving < 3 s forward
    big_shared = prompt(1024, seed=11)  # 2.46 s of prefill saved < 3 s: still local
    router2, _ = router_with_peer(1.0, big_shared)
    assert decide(router2, big_shared + prompt(16, seed=12), 8).chosen == LOCAL
    huge_shared = prompt(2048, seed=15)  # 4.9 s saved > 3 s + margin: worth the trip
    router3, _ = router_with_peer(1.0, huge_shared)
    assert decide(router3, huge_shared + prompt(16, seed=16), 8).chosen == KEY_B.peer_id


def test_tie_stays_local_and_local_cache_counts() -> None:
    router, _ = router_with_peer(0.002, SHARED)
    d = decide(router, LONG_PROMPT, 8, local_cached=256)  # both hold it: no reason to move
    assert d.chosen == LOCAL
    d = decide(router, prompt(40, seed=3), 8)  # nobody holds it: equal cost but for the RTT
    assert d.chosen == LOCAL


def test_push_back_queue_and_unknown_rtt_are_respected() -> None:
    router, _ = router_with_peer(0.002, SHARED, load_kw={"push_back": True})
    d = decide(router, LONG_PROMPT, 8)
    assert d.chosen == LOCAL and d.estimate_for(KEY_B.peer_id).skipped == "push_back"
    router, _ = router_with_peer(0.002, SHARED, load_kw={"est_wait_s": 2.0})
    assert decide(router, LONG_PROMPT, 8).chosen == LOCAL  # its queue eats the saving
    router, _ = router_with_peer(0.002, SHARED)
    assert decide(router, LONG_PROMPT, 8, wait=2.0).chosen == KEY_B.peer_id  # ours is busy
    views = router.views
    blind = Router(views, rtt_s=lambda peer: None, config=RouterConfig(default_rtt_s=1.0))
    assert decide(blind, LONG_PROMPT, 8).chosen == LOCAL  # unmeasured peer looks 1 s away


def test_confidence_and_inflight_feedback() -> None:
    router, _ = router_with_peer(0.002, SHARED)
    for _ in range(10):  # the peer repeatedly served with 0 cached despite its digest
        router.observe_served(KEY_B.peer_id, estimated_cached=256, real_cached=0)
    assert router.confidence(KEY_B.peer_id) < 0.1
    assert decide(router, LONG_PROMPT, 8).chosen == LOCAL
    router2, _ = router_with_peer(0.002, SHARED)
    for _ in range(3):
        router2.note_sent(KEY_B.peer_id, 1.0)  # three requests already on their way there
    assert decide(router2, LONG_PROMPT, 8).chosen == LOCAL


def test_chat_without_max_tokens_forwards_a_cached_system_prompt() -> None:
    # A chat call carries max_tokens=1024 by default: 61 s of decode at 60 ms a token, which
    # both candidates pay. The margin covers what differs (queue, prefill), so the 0.72 s a
    # cached 300-token system prompt saves is still worth a LAN forward.
    system = prompt(304, seed=41)
    router, _ = router_with_peer(0.002, system)
    d = decide(router, system + prompt(20, seed=42), 1024)
    assert d.chosen == KEY_B.peer_id and d.reason == "remote_faster", d.to_log()
    assert d.margin_s < 0.1
    # With a history of short answers the decode term shrinks to the expected length.
    lengths = OutputLengths()
    for n in (30, 42, 38, 50):
        lengths.observe(n, hit_limit=False)
    d = router.decide(
        model_id=MODEL,
        prompt_block_hashes=hashes_of(system + prompt(20, seed=42)),
        prompt_tokens=324,
        max_tokens=1024,
        local=LocalState(0, 0.0, PREFILL, DECODE),
        expected_tokens=lengths.predict(1024),
    )
    assert d.chosen == KEY_B.peer_id and d.expected_tokens == pytest.approx(40.0)
    assert d.estimate_for(LOCAL).decode_s == pytest.approx(40 * DECODE)


def placement_routers(n: int, *, rtt_s: float = 0.005, push_back: set[str] = frozenset()):
    """``n`` entry nodes that each see the other ``n - 1`` (empty caches) at ``rtt_s``."""
    keys = [NodeKey.from_seed(bytes([k + 50] * 32)) for k in range(n)]
    routers = []
    for me in keys:
        views = PeerViews()
        for other in keys:
            if other is not me:
                kw = {"push_back": other.peer_id in push_back}
                b = DigestBuilder(other.peer_id, MODEL, load_fn=lambda kw=kw: load(**kw))
                views.apply(b.full())
        routers.append(Router(views, rtt_s=lambda _p: rtt_s, self_id=me.peer_id))
    return keys, routers


def home_of(router: Router, tokens: list[int], **local_kw) -> str:
    d = decide(router, tokens, 8, **local_kw)
    return router.self_id if d.chosen == LOCAL else d.chosen


def test_a_miss_goes_to_its_rendezvous_home_from_every_entry_node() -> None:
    keys, routers = placement_routers(4)
    homes = []
    for seed in range(12):
        tokens = prompt(200, seed=100 + seed)
        seen = {home_of(r, tokens) for r in routers}
        assert len(seen) == 1, f"entry nodes disagree on the home of prompt {seed}: {seen}"
        homes.append(seen.pop())
        # A later prompt sharing the key (first 4 blocks) has the same home.
        assert home_of(routers[0], tokens[:64] + prompt(50, seed=seed)) == homes[-1]
    assert len(set(homes)) >= 3  # 12 prefixes spread over the 4 nodes
    d = decide(routers[1], prompt(200, seed=100), 8)
    assert d.reason == "placement_home" and d.placement_home is not None


def test_placement_skips_a_home_in_push_back_and_far_peers() -> None:
    keys, routers = placement_routers(4)
    tokens = prompt(200, seed=100)
    home = home_of(routers[0], tokens)
    # The home is overloaded: every other entry node picks the same second home.
    keys, routers = placement_routers(4, push_back={home})
    second = {home_of(r, tokens) for r, k in zip(routers, keys, strict=True) if k.peer_id != home}
    assert len(second) == 1 and home not in second
    # 200 ms away a forward costs more than the share of a prefill a home may add: local.
    _, far = placement_routers(4, rtt_s=0.2)
    assert all(decide(r, tokens, 8).chosen == LOCAL for r in far)
    # Somebody holds the key: ordinary cost routing, no placement.
    router, _ = router_with_peer(0.002, tokens[:96])
    assert decide(router, tokens, 8).placement_home is None


def test_a_chat_turn_with_later_turns_is_not_placed_away_from_its_entry() -> None:
    # One-shot misses go to their home; a session's first turn stays at its entry (its later
    # turns would follow the history to the home), whichever entry it arrives at.
    keys, routers = placement_routers(4)
    tokens = prompt(200, seed=100)
    home = home_of(routers[0], tokens)
    entries = [r for r, k in zip(routers, keys, strict=True) if k.peer_id != home]
    for r in entries:
        assert decide(r, tokens, 8).chosen != LOCAL  # one-shot: to the home
        d = r.decide(
            model_id=MODEL,
            prompt_block_hashes=hashes_of(tokens),
            prompt_tokens=len(tokens),
            max_tokens=8,
            local=LocalState(
                cached_tokens=0, wait_s=0.0, prefill_s_per_token=PREFILL, decode_s_per_token=DECODE
            ),
            future_turns=3.0,
        )
        assert d.chosen == LOCAL and d.placement_home is None, d.to_log()


def test_what_this_node_forwarded_counts_as_cached_there() -> None:
    # A chat's history is used once: never advertised. The node that forwarded the previous
    # turn still knows where it lives, and sends the next turn after it.
    router, _ = router_with_peer(0.002, [])
    history = prompt(400, seed=61)
    assert decide(router, history + prompt(30, seed=62), 32).chosen != KEY_B.peer_id
    router.note_forwarded(KEY_B.peer_id, hashes_of(history))
    d = decide(router, history + prompt(30, seed=62), 32)
    assert d.chosen == KEY_B.peer_id and d.estimate_for(KEY_B.peer_id).cached_tokens == 400
    small = Router(router.views, rtt_s=lambda _p: 0.002, config=RouterConfig(sent_memory_blocks=5))
    small.note_forwarded(KEY_B.peer_id, hashes_of(history))  # keeps the newest 5 blocks only
    assert (
        decide(small, history + prompt(30, seed=62), 32)
        .estimate_for(KEY_B.peer_id)
        .view_cached_tokens
        == 0
    )


def test_a_digest_stops_counting_forwards_that_finished_after_it() -> None:
    # A light node (no local engine) between the holder of a prompt's prefix and an idle peer.
    clock = FakeClock(1000.0)
    views = PeerViews(clock=clock, wall_clock=clock)
    holder_load = {"queue_depth": 0, "est_wait_s": 0.0}
    holder = DigestBuilder(KEY_B.peer_id, MODEL, load_fn=lambda: load(**holder_load))
    holder.on_event(BlockStored(tuple(hashes_of(SHARED)), None))
    idle = DigestBuilder(KEY_A.peer_id, MODEL, load_fn=load)

    def publish(builder: DigestBuilder) -> None:  # a digest stamped now, as a sealed one is
        views.apply(replace(builder.full(), timestamp=clock.now))

    publish(holder)
    publish(idle)
    router = Router(views, rtt_s=lambda _p: 0.002)
    light = LocalState(0, 0.0, PREFILL, DECODE, available=False)

    def holder_wait() -> tuple[str, float]:
        d = router.decide(
            model_id=MODEL,
            prompt_block_hashes=hashes_of(LONG_PROMPT),
            prompt_tokens=len(LONG_PROMPT),
            max_tokens=8,
            local=light,
        )
        return d.chosen, d.estimate_for(KEY_B.peer_id).wait_s

    assert holder_wait() == (KEY_B.peer_id, 0.0)
    clock.now += 1
    sent = router.note_sent(KEY_B.peer_id, 48.7, 48.7)
    clock.now += 1  # the holder's digest: that forward is its whole queue
    holder_load.update(queue_depth=1, est_wait_s=48.7)
    publish(holder)
    clock.now += 9
    router.note_done(KEY_B.peer_id, 48.7, sent)  # done; the holder has sent no digest since
    clock.now += 1
    assert holder_wait() == (KEY_B.peer_id, 0.0)  # was 48.7 s: the idle peer got the prefix

    # Another node's request queued there too: ours takes away only what it could have had
    # left when the digest was stamped (it ran 5 s after), the rest of the queue stays.
    sent = router.note_sent(KEY_B.peer_id, 30.0, 30.0)
    clock.now += 1
    holder_load.update(queue_depth=2, est_wait_s=60.0)
    publish(holder)
    clock.now += 5
    router.note_done(KEY_B.peer_id, 30.0, sent)
    clock.now += 1
    assert holder_wait() == (KEY_A.peer_id, pytest.approx(55.0))
    # A forward sent after the digest was stamped: the digest never counted it.
    sent = router.note_sent(KEY_B.peer_id, 10.0, 10.0)
    clock.now += 2
    router.note_done(KEY_B.peer_id, 10.0, sent)
    assert holder_wait() == (KEY_A.peer_id, pytest.approx(55.0))


def test_push_back_hysteresis() -> None:
    pb = PushBack(8, 4)
    assert [pb.update(q) for q in (3, 8, 6, 5, 4, 7, 9)] == [
        False,
        True,
        True,
        True,
        False,
        False,
        True,
    ]
    with pytest.raises(ValueError):
        PushBack(4, 4)


def test_a_forward_costs_what_its_whole_answer_took_beyond_the_engine() -> None:
    # First token 0.03 s after the engine's; the last 0.12 s after the engine's whole run:
    # frames streamed through both hosts cost the difference, and the router learns it.
    router, _ = router_with_peer(0.005, SHARED)
    for _ in range(30):
        router.observe_forward(KEY_B.peer_id, 272, 0.33, 0.30, 1.12, 1.00)
    whole = router.netcost.estimate(KEY_B.peer_id, 0.005, request_bytes(272))
    assert whole == pytest.approx(0.12, abs=0.01)
    first_only, _ = router_with_peer(0.005, SHARED)
    for _ in range(30):
        first_only.observe_forward(KEY_B.peer_id, 272, 0.33, 0.30)
    assert first_only.netcost.estimate(KEY_B.peer_id, 0.005, request_bytes(272)) == pytest.approx(
        0.03, abs=0.01
    )
