"""Routing core: digests, peer views, router decisions, anti-entropy and forwarding.

The pure tests come first; the loopback tests at the end run real overlay nodes (libp2p on
127.0.0.1) and a real engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random

import pytest
import trio
from prometheus_client import CollectorRegistry

from p2pnode.identity import NodeKey, seal
from p2pnode.inference.blockhash import (
    BLOCK_SIZE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_hashes,
    model_salt,
)
from p2pnode.inference.lengths import OutputLengths
from p2pnode.overlay.antientropy import AntiEntropy, AntiEntropyConfig
from p2pnode.overlay.audit import AuditConfig
from p2pnode.overlay.digest import (
    MAX_DIGEST_BYTES,
    DigestBuilder,
    DigestError,
    LoadInfo,
    decode_fingerprints,
    digest_to_payload,
    encode_fingerprints,
    fingerprint,
    open_digest,
    seal_digest,
)
from p2pnode.overlay.forward import ForwardConfig
from p2pnode.overlay.netcost import ForwardCost, NetCostConfig
from p2pnode.overlay.node import OverlayConfig, open_overlay_node
from p2pnode.overlay.router import LOCAL, LocalState, PushBack, Router, RouterConfig
from p2pnode.overlay.service import RoutedService
from p2pnode.overlay.views import ApplyResult, PeerViews

MODEL = "smollm2-test-model"
# Realistic SmolLM2-135M CPU rates (measured on 2 cores): ~2.4 ms/token prefill, ~60 ms/token decode.
PREFILL = 0.0024
DECODE = 0.060
KEY_A = NodeKey.from_seed(bytes(range(32)))
KEY_B = NodeKey.from_seed(bytes(range(1, 33)))


def rand_hashes(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def prompt(n_tokens: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 49152) for _ in range(n_tokens)]


def hashes_of(tokens: list[int]) -> list[int]:
    return block_hashes(tokens, model_salt(MODEL))


# --------------------------------------------------------------------------- fingerprint sets


@pytest.mark.parametrize("bits", [16, 24, 32, 64])
@pytest.mark.parametrize("n", [0, 1, 2, 100, 3000])
def test_fingerprint_set_round_trip(bits: int, n: int) -> None:
    values = {fingerprint(h, bits) for h in rand_hashes(n, seed=n + bits)}
    count, k, data = encode_fingerprints(values, bits)
    assert count == len(values)
    assert decode_fingerprints(count, k, data, bits) == sorted(values)


def test_fingerprint_set_edge_values() -> None:
    values = {0, 1, 2, (1 << 32) - 1}
    assert decode_fingerprints(*encode_fingerprints(values, 32), 32) == sorted(values)
    with pytest.raises(ValueError):
        encode_fingerprints({1 << 32}, 32)


def test_fingerprint_set_rejects_corrupt_data() -> None:
    count, k, data = encode_fingerprints({fingerprint(h) for h in rand_hashes(200)}, 32)
    bad_inputs = [
        (count + 1, k, data),  # more items than encoded
        (count, k, data[:-5]),  # truncated
        (count, k, data + b"\x01"),  # trailing garbage
        (count, 70, data),  # impossible Rice parameter
        (10**9, k, data),  # absurd count
        (1, 0, b"\xff" * 64),  # unary run past the 32-bit range
        (0, 0, b"\x00"),
    ]
    for args in bad_inputs:
        with pytest.raises(DigestError) as info:
            decode_fingerprints(*args, 32)
        assert info.value.reason == "malformed"


# --------------------------------------------------------------------------- digests


def load(**kw: object) -> LoadInfo:
    base = dict(
        queue_depth=0,
        est_wait_s=0.0,
        push_back=False,
        prefill_s_per_token=PREFILL,
        decode_s_per_token=DECODE,
    )
    base.update(kw)
    return LoadInfo(**base)  # type: ignore[arg-type]


def builder_for(key: NodeKey, **kw: object) -> DigestBuilder:
    return DigestBuilder(key.peer_id, MODEL, load_fn=load, **kw)  # type: ignore[arg-type]


def test_sealed_digest_round_trip() -> None:
    b = builder_for(KEY_A)
    b.on_event(BlockStored(tuple(rand_hashes(500)), None))
    full = b.full()
    opened = open_digest(seal_digest(KEY_A, full))
    assert opened.peer_id == KEY_A.peer_id and opened.is_full
    assert (opened.epoch, opened.version, opened.added) == (full.epoch, full.version, full.added)
    assert opened.load == full.load and opened.timestamp > 0


def test_digest_rejections_are_counted_by_reason() -> None:
    b = builder_for(KEY_A)
    b.on_event(BlockStored(tuple(rand_hashes(10)), None))
    good = seal_digest(KEY_A, b.full())
    payload = digest_to_payload(b.full())
    tampered = bytearray(good)
    tampered[-70] ^= 0x01  # inside the signed body or the signature
    cases = {
        "oversized": b"\x00" * (MAX_DIGEST_BYTES + 1),
        "malformed": b"\xff\x00garbage",
        "bad_signature": bytes(tampered),
        "expired": seal_digest(KEY_A, b.full(), now=1000.0),
    }
    # Signed as another kind: the domain tag differs, so the signature cannot verify as a digest.
    cases_other_kind = seal(KEY_A, "node-record", payload)
    for reason, data in cases.items():
        with pytest.raises(DigestError) as info:
            open_digest(data)
        assert info.value.reason == reason, (reason, info.value)
    with pytest.raises(DigestError) as info:
        open_digest(cases_other_kind)
    assert info.value.reason in {"bad_signature", "malformed"}
    with pytest.raises(DigestError) as info:
        open_digest(good, expected_peer=KEY_B.peer_id)
    assert info.value.reason == "wrong_signer"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p.update(n=-1),
        lambda p: p.update(n=True),
        lambda p: p.update(extra=1),
        lambda p: p.pop("m"),
        lambda p: p.update(b=5, n=3),  # base after version
        lambda p: p.update(c=True),  # a full digest cannot clear
        lambda p: p.update(w=float("nan")),
        lambda p: p.update(a=[1, 2]),
        lambda p: p.update(fb=8),
        lambda p: p.update(f=2),
    ],
)
def test_malformed_payloads_are_refused(mutate) -> None:
    b = builder_for(KEY_A)
    b.on_event(BlockStored(tuple(rand_hashes(5)), None))
    payload = digest_to_payload(b.full())
    mutate(payload)
    with pytest.raises(DigestError) as info:
        open_digest(seal(KEY_A, "digest", payload))
    assert info.value.reason in {"malformed", "unsupported"}


def test_builder_versions_deltas_and_refcounts() -> None:
    b = builder_for(KEY_A)
    h = rand_hashes(6)
    assert b.cut() == 0
    b.on_event(BlockStored(tuple(h[:4]), None))
    v1 = b.cut()
    b.on_event(BlockRemoved((h[0],)))
    b.on_event(BlockStored((h[4],), h[3]))
    b.on_event(BlockStored((h[4],), h[3]))  # repeated event: no change
    b.on_event(BlockRemoved((h[5],)))  # never stored: ignored
    d = b.delta_since(v1)
    assert d.base_version == v1 and d.version == v1 + 1
    assert d.added == {fingerprint(h[4])} and d.removed == {fingerprint(h[0])}
    assert b.delta_since(b.version).added == frozenset()  # heartbeat delta
    # Add then remove within one delta window: the last operation wins.
    b.on_event(BlockStored((h[5],), None))
    b.on_event(BlockRemoved((h[5],)))
    d2 = b.delta_since(v1)
    assert fingerprint(h[5]) not in d2.added
    b.on_event(AllBlocksCleared())
    b.on_event(BlockStored((h[1],), None))
    d3 = b.delta_since(v1)
    assert d3.cleared and d3.added == {fingerprint(h[1])}


def test_builder_shared_fingerprint_is_refcounted() -> None:
    b = DigestBuilder(KEY_A.peer_id, MODEL, fp_bits=16)
    x = 0xABCD_0000_0000_0001
    y = 0xABCD_0000_0000_0002  # same top 16 bits
    b.on_event(BlockStored((x, y), None))
    v = b.cut()
    b.on_event(BlockRemoved((x,)))
    assert b.delta_since(v).removed == frozenset()  # y still holds the fingerprint
    b.on_event(BlockRemoved((y,)))
    assert b.delta_since(v).removed == {fingerprint(x, 16)}


def test_builder_log_floor_falls_back_to_full() -> None:
    b = builder_for(KEY_A, max_log=3)
    for i, h in enumerate(rand_hashes(10)):
        b.on_event(BlockStored((h,), None))
        assert b.cut() == i + 1
    assert b.delta_since(1).is_full  # older than the 3 kept changes
    assert not b.delta_since(8).is_full
    assert b.delta_since(99).is_full  # a base from the future (another epoch): full


def test_builder_sync_reconciles_with_engine_set() -> None:
    b = builder_for(KEY_A)
    h = rand_hashes(5)
    b.on_event(BlockStored(tuple(h[:3]), None))
    b.sync(h[2:])
    assert b.fingerprints == {fingerprint(x) for x in h[2:]}


# --------------------------------------------------------------------------- views


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_views_apply_full_delta_gap_and_stale() -> None:
    clock = Clock()
    views = PeerViews(expire_after_s=10, clock=clock)
    b = builder_for(KEY_A)
    toks = prompt(64)
    hs = hashes_of(toks)
    b.on_event(BlockStored(tuple(hs[:2]), None))
    assert views.apply(b.delta_since(0)) is ApplyResult.GAP  # no view yet: pull needed
    full = open_digest(seal_digest(KEY_A, b.full()))
    assert views.apply(full) is ApplyResult.APPLIED
    assert views.cached_prefix_tokens(KEY_A.peer_id, hs, MODEL) == 2 * BLOCK_SIZE
    assert views.cached_prefix_tokens(KEY_A.peer_id, hs) == 2 * BLOCK_SIZE
    v = b.version
    b.on_event(BlockStored((hs[2],), hs[1]))
    d1 = b.delta_since(v)
    b.on_event(BlockStored((hs[3],), hs[2]))
    d2 = b.delta_since(b.version)  # base = version after d1 was cut
    assert views.apply(d2) is ApplyResult.GAP  # d1 was lost
    assert views.apply(d1) is ApplyResult.APPLIED
    assert views.apply(d2) is ApplyResult.APPLIED
    assert views.cached_prefix_tokens(KEY_A.peer_id, hs, MODEL) == 4 * BLOCK_SIZE
    assert views.apply(d1) is ApplyResult.STALE  # replayed old delta
    assert views.apply(full) is ApplyResult.STALE  # replayed old full
    # A delta overlapping the view's version applies (last op per fingerprint).
    b.on_event(BlockRemoved((hs[0],)))
    assert views.apply(b.delta_since(v)) is ApplyResult.APPLIED
    assert views.cached_prefix_tokens(KEY_A.peer_id, hs, MODEL) == 0  # chain broken at block 0


def test_views_restart_epoch_and_expiry_and_down() -> None:
    clock = Clock()
    views = PeerViews(expire_after_s=10, clock=clock)
    old = builder_for(KEY_A, epoch=5)
    old.on_event(BlockStored(tuple(rand_hashes(3)), None))
    assert views.apply(old.full()) is ApplyResult.APPLIED
    new = builder_for(KEY_A, epoch=6)  # the peer restarted with an empty cache
    assert views.apply(new.delta_since(0)) is ApplyResult.GAP
    assert views.apply(new.full()) is ApplyResult.APPLIED
    assert views.get(KEY_A.peer_id, MODEL).fingerprints == set()
    assert views.apply(old.full()) is ApplyResult.STALE  # older epoch
    clock.t += 11
    assert views.peers(MODEL) == []
    assert views.expire() == [(KEY_A.peer_id, MODEL)]
    views.apply(new.full())
    assert views.prune(lambda peer: peer != KEY_A.peer_id) == [(KEY_A.peer_id, MODEL)]
    assert len(views) == 0


def test_replayed_digests_do_not_keep_a_departed_peer_alive() -> None:
    # A departed peer's old digests keep arriving for a while (gossip caches, relays, late pull
    # answers); only a newer version or a later signed time counts as hearing from it.
    clock = Clock()
    views = PeerViews(expire_after_s=10, clock=clock)
    b = builder_for(KEY_A)
    b.on_event(BlockStored(tuple(rand_hashes(3)), None))
    b.cut()
    full = dataclasses.replace(b.full(), timestamp=100.0)
    delta = dataclasses.replace(b.delta_since(0), timestamp=100.0)
    assert views.apply(full) is ApplyResult.APPLIED
    clock.t += 6
    assert views.apply(full) is ApplyResult.STALE  # the same full digest, replayed
    views.apply(delta)  # a delta of the same version and time: nothing new either
    assert views.silent_s(KEY_A.peer_id, MODEL) == 6
    clock.t += 5
    assert views.expire() == [(KEY_A.peer_id, MODEL)]  # 11 s after it was last really heard
    assert views.apply(full) is ApplyResult.APPLIED  # no view left: taken as new information
    assert views.apply(dataclasses.replace(full, timestamp=101.0)) is ApplyResult.APPLIED
    assert views.silent_s(KEY_A.peer_id, MODEL) == 0


def test_views_take_fresh_load_even_on_gap() -> None:
    views = PeerViews()
    state = {"q": 0}
    b = DigestBuilder(
        KEY_A.peer_id, MODEL, load_fn=lambda: load(queue_depth=state["q"], push_back=state["q"] > 5)
    )
    views.apply(b.full())
    b.on_event(BlockStored(tuple(rand_hashes(2)), None))
    b.cut()
    state["q"] = 9
    # A delta from the version after the one the view holds: the cache part is a gap, but its
    # load figures are newer than the view's and must be used at once.
    gap = dataclasses.replace(b.delta_since(b.version), timestamp=1.0)
    assert views.apply(gap) is ApplyResult.GAP
    assert views.get(KEY_A.peer_id, MODEL).load.push_back


# --------------------------------------------------------------------------- router


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
    # Before any forward was measured, one costs 3 round trips (overlay/netcost.py's prior):
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


# --------------------------------------------------------------------------- loopback: real nodes


logging.getLogger("libp2p").setLevel(logging.ERROR)
TRUSTED = AuditConfig(probation_answers=0)  # no probation hold


class Lossy:
    """Drops a fixed fraction of received gossip (seeded), to prove repair does not need it."""

    def __init__(self, fraction: float, seed: int) -> None:
        self.rng = random.Random(seed)
        self.fraction = fraction
        self.seen = 0
        self.dropped = 0

    def __call__(self, topic: str, data: bytes) -> bool:
        self.seen += 1
        drop = self.rng.random() < self.fraction
        self.dropped += drop
        return drop


@contextlib.asynccontextmanager
async def overlay_nodes(n: int):
    """``n`` real overlay nodes on 127.0.0.1, all bootstrapped from the first."""
    keys = [NodeKey.generate() for _ in range(n)]
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(open_overlay_node(OverlayConfig(key=keys[0])))
        nodes = [first]
        for key in keys[1:]:
            cfg = OverlayConfig(key=key, bootstrap=[first.addrs[0]])
            nodes.append(await stack.enter_async_context(open_overlay_node(cfg)))
        with trio.fail_after(10):  # full mesh of connections and first RTTs within 10 s
            while not all(len(nd.peers.up_peers()) == n - 1 for nd in nodes):  # noqa: ASYNC110
                await trio.sleep(0.05)
        yield keys, nodes


async def wait_until(predicate, limit_s: float, step: float = 0.05) -> None:
    # Polling on purpose: the states waited for (views, peer tables) have no events to wait on.
    with trio.fail_after(limit_s):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(step)


async def test_digests_converge_over_gossip_despite_dropped_messages() -> None:
    # Every node drops 60 % of the gossip it receives and full states are never gossiped
    # (full_every is huge): views can only converge through deltas plus direct pulls on gaps.
    config = AntiEntropyConfig(interval_s=0.2, full_every=10**6, pull_min_interval_s=0.3)
    async with overlay_nodes(3) as (keys, nodes), trio.open_nursery() as nursery:
        builders, aes, lossy = [], [], []
        for i, (key, node) in enumerate(zip(keys, nodes, strict=True)):
            b = DigestBuilder(node.peer_id, MODEL, load_fn=lambda i=i: load(queue_depth=i))
            filt = Lossy(0.6, seed=i)
            ae = AntiEntropy(
                node, key, PeerViews(), builders={MODEL: b}, config=config, drop_filter=filt
            )
            await nursery.start(ae.run)
            builders.append(b)
            aes.append(ae)
            lossy.append(filt)
        rng = random.Random(5)
        for round_ in range(8):  # caches change while gossip runs
            for b in builders:
                stored = tuple(rng.getrandbits(64) for _ in range(20))
                b.on_event(BlockStored(stored, None))
                if round_ % 3 == 2:
                    b.on_event(BlockRemoved(stored[:5]))
            await trio.sleep(0.1)

        def converged() -> bool:
            for i, ae in enumerate(aes):
                for j, b in enumerate(builders):
                    if i == j:
                        continue
                    view = ae.views.get(nodes[j].peer_id, MODEL)
                    if (
                        view is None
                        or view.fingerprints != set(b.fingerprints)
                        or view.load.queue_depth != j
                    ):
                        return False
            return True

        await wait_until(converged, limit_s=15)
        assert sum(f.dropped for f in lossy) > 10  # the loss really happened
        assert sum(ae.pulls.get("ok", 0) for ae in aes) >= 1  # and was repaired by pulls
        assert all(ae.results.get("gap", 0) >= 1 for ae in aes)
        nursery.cancel_scope.cancel()


async def test_cache_change_is_published_before_the_next_round() -> None:
    # Rounds every 5 s, yet a change must reach the peer well before: it is published within
    # change_poll_s from the token bucket (burst 2: the first round leaves one token).
    config = AntiEntropyConfig(interval_s=5.0, change_poll_s=0.05)
    async with overlay_nodes(2) as (keys, nodes), trio.open_nursery() as nursery:
        builders = [DigestBuilder(n.peer_id, MODEL, load_fn=load) for n in nodes]
        aes = [
            AntiEntropy(n, k, PeerViews(), builders={MODEL: b}, config=config)
            for n, k, b in zip(nodes, keys, builders, strict=True)
        ]
        for ae in aes:
            await nursery.start(ae.run)
        a_id = nodes[0].peer_id
        await wait_until(lambda: aes[1].views.get(a_id, MODEL) is not None, 10)
        assert not aes[0].has_news()
        hs = hashes_of(prompt(64, seed=41))
        builders[0].on_event(BlockStored(tuple(hs), None))
        assert builders[0].pending and aes[0].has_news()
        t0 = trio.current_time()
        # 2.5 s: half the round interval, ample for one gossip hop on a loaded machine.
        await wait_until(lambda: aes[1].views.cached_prefix_tokens(a_id, hs, MODEL) == 64, 2.5)
        assert trio.current_time() - t0 < 2.5 and not aes[0].has_news()
        nursery.cancel_scope.cancel()


@pytest.fixture(scope="module")
def loaded_model():
    from p2pnode.inference.models import load_model

    return load_model(None)


@contextlib.asynccontextmanager
async def routed_nodes(
    loaded,
    n: int,
    nursery: trio.Nursery,
    backend: str = "emulated",
    forward: ForwardConfig | None = None,
):
    """``n`` nodes, each with an engine and a service. The emulated backend keeps the real radix
    tree and block events but sleeps the cost model's compute time, so 3 engines fit on 2
    shared cores; ``backend="hf"`` runs the real model (all engines share its weights)."""
    from p2pnode.inference.engine import open_engine

    ae_config = AntiEntropyConfig(interval_s=0.2, pull_min_interval_s=0.3)
    async with overlay_nodes(n) as (keys, nodes), contextlib.AsyncExitStack() as stack:
        services = []
        for key, node in zip(keys, nodes, strict=True):
            engine = await stack.enter_async_context(
                open_engine(loaded, backend=backend, calibrate_cost=False, torch_threads=None)
            )
            svc = RoutedService(
                node,
                key,
                engine,
                antientropy_config=ae_config,
                forward_config=forward,
                registry=CollectorRegistry(),
                # Peers start trusted: these tests stream tokens as they arrive, and a peer on
                # probation has its answer held for audit (tested in test_audit.py).
                audit_config=TRUSTED,
            )
            await nursery.start(svc.run)
            services.append(svc)
        yield nodes, services


async def test_prompt_is_routed_to_the_node_holding_its_prefix(loaded_model) -> None:
    async with (
        trio.open_nursery() as nursery,
        routed_nodes(loaded_model, 3, nursery) as (nodes, services),
    ):
        a, b, c = services
        # 640 cached tokens save ~1.5 s of prefill: the forward (3 round trips) stays worth it
        # even when pings on 2 starved cores read a few hundred ms.
        shared = prompt(640, seed=21)
        warm = await b.engine.generate(shared, {"max_tokens": 1})
        assert warm.cached_tokens == 0
        hs = block_hashes(shared + [1] * 16, a.salt)
        # A's view of B must learn the 40 blocks B just cached (gossip delta or pull).
        await wait_until(
            lambda: a.views.cached_prefix_tokens(b.node.peer_id, hs, a.model_id) >= 640, 10
        )
        request = shared + prompt(24, seed=22)
        res = await a.generate(request, {"max_tokens": 6})
        assert res.served_by == b.node.peer_id and not res.served_locally, res.decision.to_log()
        assert res.cached_tokens >= 640  # B reports its real cached length
        assert len(res.tokens) == 6 and res.attempts[0].outcome == "ok"
        reference = await c.engine.generate(request, {"max_tokens": 6})
        assert res.tokens == reference.tokens
        # A prompt nobody holds goes to its rendezvous home (which entry nodes agree on is
        # tested on the router alone); the next request with that prefix finds it there.
        # 640 tokens again, so the forward stays worth it when pings on starved cores are slow.
        fresh = prompt(640, seed=23)
        res2 = await a.generate(fresh, {"max_tokens": 2})
        assert res2.decision.reason == "placement_home", res2.decision.to_log()
        home = res2.served_by
        if home != c.node.peer_id:
            key = block_hashes(fresh, c.salt)
            await wait_until(lambda: c.views.cached_prefix_tokens(home, key, c.model_id) >= 624, 10)
        res3 = await c.generate(fresh + prompt(16, seed=24), {"max_tokens": 2})
        assert res3.served_by == home, json.dumps(res3.decision.to_log())
        assert res3.cached_tokens >= 624
        nursery.cancel_scope.cancel()


async def test_peer_dying_mid_stream_falls_back_without_duplicates(loaded_model) -> None:
    async with (
        trio.open_nursery() as nursery,
        routed_nodes(loaded_model, 2, nursery) as (nodes, services),
    ):
        a, b = services
        shared = prompt(320, seed=31)
        await b.engine.generate(shared, {"max_tokens": 1})
        hs = block_hashes(shared, a.salt)
        await wait_until(
            lambda: a.views.cached_prefix_tokens(b.node.peer_id, hs, a.model_id) >= 320, 10
        )
        request = shared + prompt(24, seed=32)
        reference = await b.engine.generate(request, {"max_tokens": 12})
        received: list[int] = []

        def on_token(t: int) -> None:
            received.append(t)
            if len(received) == 3:
                # B dies: its host goes away with the stream open.
                nursery.start_soon(b.node.host.close)

        res = await a.generate(request, {"max_tokens": 12}, on_token=on_token)
        assert res.attempts[0].target == b.node.peer_id and res.attempts[0].outcome != "ok"
        assert res.attempts[-1].target == "local" and res.served_locally
        assert 3 <= res.attempts[0].tokens < 12
        assert res.tokens == received == reference.tokens  # complete, nothing repeated

        # The peer table sees B down: the router skips it from now on (its view is kept until
        # it expires, so a link that only flapped needs no full re-pull).
        def b_skipped() -> bool:
            d = a.decide(request, {"max_tokens": 12})
            est = d.estimate_for(b.node.peer_id)
            return est is not None and est.skipped == "down" and d.attempts == ("local",)

        await wait_until(b_skipped, 10)
        nursery.cancel_scope.cancel()


async def test_forward_with_the_real_model_matches_local_generation(loaded_model) -> None:
    async with (
        trio.open_nursery() as nursery,
        # Timeouts are scaled from estimates; this shared 2-core machine can be 10x slower than
        # the estimate when other suites run, so the slack is generous: this test is about
        # forwarding a real model's output, the fallback on timeouts is tested with a dead peer.
        routed_nodes(
            loaded_model,
            2,
            nursery,
            backend="hf",
            forward=ForwardConfig(accept_slack_s=30, first_token_slack_s=60, idle_min_s=30),
        ) as (nodes, services),
    ):
        a, b = services
        chat = [
            {"role": "system", "content": "You are a terse assistant. " * 12},
            {"role": "user", "content": "Name one prime number."},
        ]
        request = b.engine.encode_chat(chat)
        system = request[:-16]  # the system turn and more: what B already served before
        await b.engine.generate(system, {"max_tokens": 1})
        # The engines' cost models learn from real timings; on 2 shared cores a cold first
        # forward can look 10x slower than it is. The routing formulas are tested above: here
        # both nodes get the same nominal speeds so the test checks forwarding, not CPU noise.
        for svc in services:
            svc.engine.cost.prefill_s_per_token = 1 / 430
            svc.engine.cost.decode_s_per_token = 1 / 16
            # In one process on busy cores a ping's RTT is mostly event-loop lag (up to 0.3 s
            # seen), not a network: give the router a LAN RTT, as the speeds are pinned above.
            svc.router.rtt_s = lambda peer: 0.002
        hs = block_hashes(system, a.salt)
        full_blocks = len(system) // BLOCK_SIZE * BLOCK_SIZE

        def view_ready() -> bool:
            view = a.views.get(b.node.peer_id, a.model_id)
            return (
                view is not None
                and view.load.prefill_s_per_token == 1 / 430
                and a.views.cached_prefix_tokens(b.node.peer_id, hs, a.model_id) >= full_blocks
            )

        await wait_until(view_ready, 10)
        res = await a.generate(request, {"max_tokens": 4})
        assert len(res.tokens) >= 2  # a real answer, not an immediate end of turn
        assert res.served_by == b.node.peer_id, (res.attempts, json.dumps(res.decision.to_log()))
        assert res.cached_tokens >= full_blocks - BLOCK_SIZE
        reference = await a.engine.generate(request, {"max_tokens": 4})  # greedy, on A itself
        assert res.tokens == reference.tokens
        nursery.cancel_scope.cancel()
