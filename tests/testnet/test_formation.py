"""The trial's rule for a formed overlay (testnet/run/formation.py), on made-up statuses."""

from __future__ import annotations

import tomllib

import pytest

from p2pnode.testnet.run import launch
from p2pnode.testnet.run.formation import formation_missing, formation_state
from p2pnode.testnet.spec import parse_spec


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


def _ring_statuses(ids: list[str], links: dict[str, list[str]], low: int = 3) -> list[dict]:
    conns = {"enabled": True, "low": low, "high": low + 1}
    return [
        {
            "peers": [{"peer_id": p, "state": "up"} for p in links[me]],
            "routing": {"views": {v: {} for v in links[me]}},
            "connections": conns,
        }
        for me in ids
    ]


def test_the_deficit_falls_as_links_and_views_arrive() -> None:
    ids = ["a", "b", "c", "d"]
    names = [f"node{i}" for i in range(4)]
    alone = _ring_statuses(ids, {p: [] for p in ids})
    half = _ring_statuses(ids, {"a": ["b"], "b": ["a"], "c": ["d"], "d": ["c"]})
    ring = _ring_statuses(ids, {"a": ["b", "d"], "b": ["a", "c"], "c": ["b", "d"], "d": ["c", "a"]})
    states = [formation_state(names, ids, s, True) for s in (alone, half, ring)]
    assert [s.deficit for s in states] == [8 + 3, 4 + 1, 0]
    assert [s.nodes_short for s in states] == [4, 4, 0]
    assert [s.parts for s in states] == [4, 2, 1]
    assert states[2].to_json()["formed"] and not states[1].to_json()["formed"]
    silent = formation_state(names, ids, [None, *ring[1:]], True)
    assert silent.silent == 1 and "node0: /status does not answer" in silent.missing


class _Trial:
    """What ``launch._wait_mesh`` reads of a running trial, with statuses from a script."""

    def __init__(self, spec, script: list[list[dict]]) -> None:
        self.spec, self.arm, self.script = spec, "routing", script
        self.peer_ids = ["a", "b", "c", "d"]
        self.nodes = [_Alive(f"node{i}") for i in range(4)]
        self.warnings: list[str] = []
        self.formation: dict = {}
        self.polls = 0

    def statuses(self) -> list[dict]:
        self.polls += 1
        return self.script[min(self.polls, len(self.script)) - 1]


class _Alive:
    def __init__(self, name: str) -> None:
        self.name = name

    def alive(self) -> bool:
        return True


def _spec(formation: str, settle_s: float = 5.0):
    text = f"""
name = "t"
[network]
regions = ["eu"]
[nodes]
count = 4
formation = "{formation}"
formation_settle_s = {settle_s}
[workload]
requests = 4
"""
    return parse_spec(tomllib.loads(text))


def test_a_settled_trial_starts_on_a_plateau_and_records_how_far_it_got(monkeypatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(launch.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(launch.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    ids = ["a", "b", "c", "d"]
    stuck = _ring_statuses(ids, {"a": ["b"], "b": ["a"], "c": ["d"], "d": ["c"]})
    trial = _Trial(_spec("settled", settle_s=5.0), [stuck])
    launch._wait_mesh(trial, deadline=600.0, limit_s=600.0)
    assert 5.0 < clock[0] < 7.0  # the settle time, not the start limit
    assert trial.formation["formed"] is False and trial.formation["parts"] == 2
    assert any(
        "started before the overlay formed (no progress for 5 s)" in w for w in trial.warnings
    )


def test_progress_keeps_a_settled_trial_waiting_and_a_full_one_fails_at_its_limit(
    monkeypatch,
) -> None:
    clock = [0.0]
    monkeypatch.setattr(launch.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(launch.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    ids = ["a", "b", "c", "d"]
    stuck = _ring_statuses(ids, {"a": ["b"], "b": ["a"], "c": ["d"], "d": ["c"]})
    ring = _ring_statuses(ids, {"a": ["b", "d"], "b": ["a", "c"], "c": ["b", "d"], "d": ["c", "a"]})
    # Stuck for 4 s (under the 5 s settle time), then formed: it waits and starts formed.
    trial = _Trial(_spec("settled"), [stuck] * 8 + [ring])
    launch._wait_mesh(trial, deadline=600.0, limit_s=600.0)
    assert trial.formation["formed"] is True and not trial.warnings
    clock[0] = 0.0
    full = _Trial(_spec("full"), [stuck])
    with pytest.raises(launch.LaunchError, match="did not form within 30 s"):
        launch._wait_mesh(full, deadline=30.0, limit_s=30.0)
