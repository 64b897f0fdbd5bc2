"""Peer views (overlay/cache/views.py): full digests, deltas, gaps, replays, epochs and expiry, on a
fake clock."""

from __future__ import annotations

import dataclasses

from p2pnode.inference.blockhash import BLOCK_SIZE, BlockRemoved, BlockStored
from p2pnode.overlay.cache.digest import DigestBuilder, open_digest, seal_digest
from p2pnode.overlay.cache.views import ApplyResult, PeerViews

from testkit import FakeClock
from testkit.routing import KEY_A, MODEL, builder_for, hashes_of, load, prompt, rand_hashes


def test_views_apply_full_delta_gap_and_stale() -> None:
    clock = FakeClock()
    views = PeerViews(expire_after_s=10, clock=clock)
    b = builder_for(KEY_A)
    toks = prompt(64)
    hs = hashes_of(toks)
    b.on_event(BlockStored(tuple(hs[:2]), None))
    b.on_event(BlockStored((hs[2],), hs[1]))
    w = b.cut()
    b.on_event(BlockRemoved((hs[2],)))  # not in a delta's added: it went again
    b.on_event(BlockStored((hs[3],), hs[2]))
    assert views.apply(b.delta_since(w)) is ApplyResult.GAP  # no view yet: pull needed
    # From version 0 (the epoch's empty start) a delta is the whole state.
    whole = b.delta_since(0)
    assert whole.base_version == 0 and whole.removed
    assert views.apply(whole) is ApplyResult.APPLIED
    assert views.get(KEY_A.peer_id, MODEL).fingerprints == b.fingerprints
    views = PeerViews(expire_after_s=10, clock=clock)
    b = builder_for(KEY_A)
    b.on_event(BlockStored(tuple(hs[:2]), None))
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
    clock = FakeClock()
    views = PeerViews(expire_after_s=10, clock=clock)
    old = builder_for(KEY_A, epoch=5)
    old.on_event(BlockStored(tuple(rand_hashes(3)), None))
    assert views.apply(old.full()) is ApplyResult.APPLIED
    new = builder_for(KEY_A, epoch=6)  # the peer restarted with an empty cache
    new.on_event(BlockStored(tuple(rand_hashes(1)), None))
    new.cut()
    new.on_event(BlockStored(tuple(rand_hashes(1)), None))
    assert views.apply(new.delta_since(1)) is ApplyResult.GAP  # another epoch
    assert views.apply(new.delta_since(0)) is ApplyResult.APPLIED  # the whole new state
    new = builder_for(KEY_A, epoch=7)
    assert views.apply(new.full()) is ApplyResult.APPLIED
    assert views.get(KEY_A.peer_id, MODEL).fingerprints == set()
    assert views.apply(old.full()) is ApplyResult.STALE  # older epoch
    clock.now += 11
    assert views.peers(MODEL) == []
    assert views.expire() == [(KEY_A.peer_id, MODEL)]
    views.apply(new.full())
    assert views.prune(lambda peer: peer != KEY_A.peer_id) == [(KEY_A.peer_id, MODEL)]
    assert len(views) == 0


def test_replayed_digests_do_not_keep_a_departed_peer_alive() -> None:
    # A departed peer's old digests keep arriving for a while (gossip caches, relays, late pull
    # answers); only a newer version or a later signed time counts as hearing from it.
    clock = FakeClock()
    views = PeerViews(expire_after_s=10, clock=clock)
    b = builder_for(KEY_A)
    b.on_event(BlockStored(tuple(rand_hashes(3)), None))
    b.cut()
    full = dataclasses.replace(b.full(), timestamp=100.0)
    delta = dataclasses.replace(b.delta_since(0), timestamp=100.0)
    assert views.apply(full) is ApplyResult.APPLIED
    clock.now += 6
    assert views.apply(full) is ApplyResult.STALE  # the same full digest, replayed
    views.apply(delta)  # a delta of the same version and time: nothing new either
    assert views.silent_s(KEY_A.peer_id, MODEL) == 6
    clock.now += 5
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


def test_expiry_stretches_with_the_publish_interval_but_never_shrinks_below_the_base() -> None:
    # In a large swarm each origin publishes once per (publishers / topic budget) seconds, which
    # can exceed the configured horizon: views must outlive a few of those rounds.
    clock = FakeClock()
    views = PeerViews(expire_after_s=10, clock=clock)
    b = builder_for(KEY_A)
    b.on_event(BlockStored(tuple(rand_hashes(3)), None))
    assert views.apply(b.full()) is ApplyResult.APPLIED
    views.stretch_expiry(6 * 8.0)  # rounds of 8 s: 48 s
    clock.now += 40
    assert views.expire() == [] and views.peers(MODEL) == [KEY_A.peer_id]
    clock.now += 9
    assert views.expire() == [(KEY_A.peer_id, MODEL)]
    views.stretch_expiry(1.0)  # a small swarm again: back to the configured 10 s, not 1 s
    assert views.apply(b.full()) is ApplyResult.APPLIED
    clock.now += 5
    assert views.expire() == []
    clock.now += 6
    assert views.expire() == [(KEY_A.peer_id, MODEL)]
