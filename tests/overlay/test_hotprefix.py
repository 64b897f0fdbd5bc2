"""The hot-prefix summary: counts merge, holders and keys stay within their bounds, the wire
form round-trips and refuses what is over the bound."""

from __future__ import annotations

import cbor2
import pytest

from p2pnode.testnet.sim.hotprefix import KEY_BYTES, HotPolicy, HotPrefixError, HotPrefixes


def _key(i: int) -> bytes:
    return bytes([i]) * 32  # a prefix_key is 32 bytes; the summary keeps KEY_BYTES of it


def test_merge_adds_counts_and_keeps_the_newest_holders_per_zone() -> None:
    policy = HotPolicy(max_keys=4, holders_per_zone=2, max_zones=2)
    a, b = HotPrefixes(policy), HotPrefixes(policy)
    for t, (peer, zone) in enumerate([("p1", "eu"), ("p2", "eu"), ("p3", "eu"), ("p4", "us")]):
        a.note_served(_key(1), peer, zone, float(t))
    b.note_served(_key(1), "p5", "ap", 10.0)  # a third zone: over max_zones
    b.note_served(_key(1), "p1", "eu", 11.0)  # p1 again, newer
    a.merge(b)
    assert a.count(_key(1)) == 6
    holders = a.holders(_key(1), "us")
    # per zone the two newest (p2 is out), and the zones of the newest holders, at most two
    # (us is out); in its own zone first, newest next
    assert [h.peer_id for h in holders] == ["p1", "p5", "p3"]
    assert [h.peer_id for h in a.holders(_key(1), "ap")] == ["p5", "p1", "p3"]
    assert a.holders(_key(9), "eu") == []


def test_keys_are_capped_by_count_and_fade_with_decay() -> None:
    policy = HotPolicy(max_keys=3, decay=0.5, min_count=0.2)
    hot = HotPrefixes(policy)
    for i in range(1, 6):
        for _ in range(i):
            hot.note_served(_key(i), "p", "eu", 0.0)
    # Space-Saving: 4 and 5 each took the place of the least counted, so the newest hot keys
    # are in although the table was full when they came
    assert len(hot) == 3 and sorted(hot.keys()) == [_key(i)[:KEY_BYTES] for i in (3, 4, 5)]
    for _ in range(4):
        hot.decay()
    # 3 * 0.5**4 < 0.2 <= 4 * 0.5**4
    assert sorted(hot.keys()) == [_key(i)[:KEY_BYTES] for i in (4, 5)]


def test_a_merge_keeps_the_same_keys_whatever_the_order() -> None:
    policy = HotPolicy(max_keys=2)
    tables = []
    for i in range(1, 5):
        t = HotPrefixes(policy)
        t.note_served(_key(i), f"p{i}", "eu", 0.0)  # every count ties at 1
        tables.append(t)
    kept = []
    for order in (tables, tables[::-1]):
        merged = HotPrefixes(policy)
        for t in order:
            merged.merge(t)
        kept.append(sorted(merged.keys()))
    assert kept[0] == kept[1] and len(kept[0]) == 2


def test_the_wire_form_round_trips_and_refuses_what_is_over_the_bound() -> None:
    policy = HotPolicy(max_keys=2, holders_per_zone=1, max_zones=2)
    hot = HotPrefixes(policy)
    hot.note_served(_key(1), "p1", "eu", 1.5)
    hot.note_served(_key(2), "p2", "us", 2.5)
    back = HotPrefixes.decode(hot.encode(), policy)
    assert back.entries() == hot.entries()
    too_many = cbor2.dumps([[_key(i)[:KEY_BYTES], 1.0, []] for i in range(3)])
    with pytest.raises(HotPrefixError):
        HotPrefixes.decode(too_many, policy)
    crowded = cbor2.dumps([[_key(1)[:KEY_BYTES], 1.0, [["p", "eu", 0.0]] * 3]])
    with pytest.raises(HotPrefixError):
        HotPrefixes.decode(crowded, policy)
    for bad in (b"\xff", cbor2.dumps([[b"short", 1.0, []]]), cbor2.dumps({"a": 1})):
        with pytest.raises(HotPrefixError):
            HotPrefixes.decode(bad, policy)
    with pytest.raises(ValueError):
        HotPolicy(max_keys=0)
