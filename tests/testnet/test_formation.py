"""The trial's rule for a formed overlay (testnet/formation.py), on made-up statuses."""

from __future__ import annotations

from p2pnode.testnet.formation import formation_missing


def test_the_trial_waits_for_wanted_peers_one_graph_and_views_of_up_peers() -> None:
    ids = ["a", "b", "c", "d"]
    bounded = {"enabled": True, "low": 3, "high": 4}

    def status(up: list[str], views: list[str], conns: dict | None = None) -> dict:
        return {
            "peers": [{"peer_id": p, "state": "up"} for p in up],
            "routing": {"views": {v: {} for v in views}},
            "connections": conns or {"enabled": False},
        }

    def missing(statuses: list[dict], need_views: bool = True) -> list[str]:
        names = [f"node{i}" for i in range(len(ids))]
        return formation_missing(names, ids, statuses, need_views)

    full = [status([p for p in ids if p != me], [p for p in ids if p != me]) for me in ids]
    assert missing(full) == []
    # Bounded: two peers up each (low 3 less the bootstrap) is enough, in one graph ...
    ring = {"a": ["b", "d"], "b": ["a", "c"], "c": ["b", "d"], "d": ["c", "a"]}
    ok = [status(ring[p], ring[p], bounded) for p in ids]
    assert missing(ok) == []
    # ... but not two separate pairs, nor a view missing of an up peer.
    pairs = {"a": ["b"], "b": ["a"], "c": ["d"], "d": ["c"]}
    low2 = {"enabled": True, "low": 2, "high": 4}
    split = [status(pairs[p], pairs[p], low2) for p in ids]
    assert missing(split) == ["the up links make 2 separate parts, not one overlay"]
    no_view = [status(ring[p], ring[p][:1], bounded) for p in ids]
    assert all("cache view" in m for m in missing(no_view))
    assert missing(no_view, need_views=False) == []
    lonely = [status(ring[p][:1], ring[p][:1], bounded) for p in ids]
    assert any("sees 1 of 2 wanted" in m for m in missing(lonely))
