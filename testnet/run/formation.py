"""Has a trial's overlay formed? A judgement on the serving nodes' ``GET /status`` documents.

Contract: ``formation_missing(names, peer_ids, statuses, need_views)`` lists what is still
missing (empty: formed). ``formation_state`` (same arguments) returns that list with the
figures a trial records when it starts before the overlay formed (``FormationState``): the
deficit (links short of each node's wanted count, plus cache views missing of up peers: it
falls as the overlay forms, so a launcher can tell progress from a plateau), how many nodes
are short, and how many separate parts the up links make. Pure, so the trial launcher
(``launch.py``) and the join benchmark (``bench/overlay_join_processes.py``) judge formation
by one rule, and a test can hand it made-up statuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["FormationState", "describe", "formation_missing", "formation_state"]


@dataclass(frozen=True)
class FormationState:
    missing: list[str]  # empty: formed
    deficit: int  # links short of the wanted counts + cache views missing of up peers
    nodes: int
    nodes_short: int  # nodes with any shortfall (or no answer)
    silent: int  # nodes whose /status did not answer
    parts: int  # separate parts of the graph of up links (1: one overlay)

    def to_json(self) -> dict[str, Any]:
        return {
            "formed": not self.missing,
            "deficit": self.deficit,
            "nodes": self.nodes,
            "nodes_short": self.nodes_short,
            "silent": self.silent,
            "parts": self.parts,
            "missing": self.missing[:40],
        }


def describe(formation: dict[str, Any]) -> str:
    """One line for a recorded ``FormationState.to_json()`` (logs, warnings, the results page)."""
    f = formation
    return (
        f"{f['nodes'] - f['nodes_short']}/{f['nodes']} nodes formed, deficit {f['deficit']}, "
        f"{f['parts']} part(s)"
    )


def _wanted_up(status: dict[str, Any], others: int) -> int:
    """Serving peers a node must see up for the overlay to count as formed: all of them, or
    with bounded connections (``overlay/net/connmgr.py``) its low watermark less one (a trim keeps
    that many, its bootstrap among them)."""
    conns = status.get("connections") or {}
    if not conns.get("enabled"):
        return others
    return min(others, max(1, int(conns.get("low", 0)) - 1))


def _components(links: dict[str, set[str]]) -> int:
    """Connected parts of the graph of up links among serving nodes (one: gossip can reach
    every node; the bootstrap serves no model, so it forwards no digest and does not count)."""
    seen: set[str] = set()
    parts = 0
    for start in links:
        if start in seen:
            continue
        parts += 1
        todo = [start]
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo += [p for p in links.get(node, ()) if p not in seen]
    return parts


def formation_missing(
    names: Sequence[str],
    peer_ids: Sequence[str],
    statuses: Sequence[dict[str, Any] | None],
    need_views: bool,
) -> list[str]:
    """What is still missing for the overlay of these serving nodes (their ``GET /status``)
    to count as formed (empty list: formed): every node sees the peers it should up
    (``_wanted_up``), the up links make one graph, and with ``need_views`` each node holds a
    cache view of every peer it sees up (those its router can send work to; with all peers
    connected: of every other node)."""
    return formation_state(names, peer_ids, statuses, need_views).missing


def formation_state(
    names: Sequence[str],
    peer_ids: Sequence[str],
    statuses: Sequence[dict[str, Any] | None],
    need_views: bool,
) -> FormationState:
    """``formation_missing``'s judgement with the figures behind it (module doc)."""
    ids = set(peer_ids)
    missing = []
    links: dict[str, set[str]] = {}
    deficit = short = silent = 0
    for name, pid, status in zip(names, peer_ids, statuses, strict=True):
        if status is None:
            missing.append(f"{name}: /status does not answer")
            silent += 1
            short += 1
            deficit += 1
            continue
        others = ids - {pid}
        up = {p.get("peer_id") for p in status.get("peers", []) if p.get("state") == "up"}
        up &= others
        links[pid] = up
        want = _wanted_up(status, len(others))
        node_short = 0
        if len(up) < want:
            missing.append(f"{name} sees {len(up)} of {want} wanted peer(s) up")
            node_short += want - len(up)
        views = (status.get("routing") or {}).get("views")
        if need_views and isinstance(views, dict) and not up <= set(views):
            missing.append(f"{name} holds no cache view of {len(up - set(views))}")
            node_short += len(up - set(views))
        deficit += node_short
        short += node_short > 0
    for pid, up in list(links.items()):  # links are symmetric; a status may lag one side
        for other in up:
            links.setdefault(other, set()).add(pid)
    parts = _components(links)
    if not missing and parts > 1:
        missing.append(f"the up links make {parts} separate parts, not one overlay")
    deficit += max(0, parts - 1)
    return FormationState(missing, deficit, len(names), short, silent, parts)
