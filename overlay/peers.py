"""Our own view of peer liveness and metadata (the DHT keeps dead peers for hours).

Contract:
- `PeerTable` holds one `PeerEntry` per known peer: its newest `NodeRecord` (or None), state
  (`up`, `suspect`, `down`), smoothed RTT and RTT variance in milliseconds (RFC 6298: EWMA
  with gain `alpha` for the mean and `beta` for the mean deviation), last_seen (wall clock of
  the last successful contact), failure count and last error.
- `rto(peer_id, floor, ceiling)` is the probe timeout TCP would use for that peer:
  srtt + 4 * rttvar, clamped to [floor, ceiling] (floor alone while nothing is measured).
- Transitions: `observe`/`record_rtt` -> up (a peer that comes back is up again);
  `record_failure` -> suspect after `suspect_after` consecutive failures, down after
  `down_after`; `mark_down` (connection lost) -> down at once.
- `prune()` forgets peers that stayed down longer than `grace_period` seconds.
- `set_record` keeps only the newest record per peer (higher seq); older ones are ignored.
- `snapshot()` returns plain dicts (JSON-ready) for status output; `add_listener(fn)`
  calls `fn(peer_id, old_state, new_state)` on every state change.
The table does no I/O; the node's ping and discovery loops feed it. Single trio thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from p2pnode.identity import NodeRecord

__all__ = ["PeerEntry", "PeerState", "PeerTable"]

Listener = Callable[[str, "PeerState | None", "PeerState"], None]


class PeerState(StrEnum):
    UP = "up"
    SUSPECT = "suspect"
    DOWN = "down"


@dataclass
class PeerEntry:
    peer_id: str
    state: PeerState = PeerState.UP
    record: NodeRecord | None = None
    rtt_ms: float | None = None
    rttvar_ms: float | None = None  # mean deviation of the RTT samples (RFC 6298)
    last_seen: float = 0.0  # wall clock (time.time) of the last successful contact
    failures: int = 0
    last_error: str = ""
    changed_at: float = field(default=0.0)  # monotonic time of the last state change

    def as_dict(self, now_wall: float) -> dict[str, Any]:
        record = self.record
        return {
            "peer_id": self.peer_id,
            "state": str(self.state),
            "rtt_ms": None if self.rtt_ms is None else round(self.rtt_ms, 3),
            "rttvar_ms": None if self.rttvar_ms is None else round(self.rttvar_ms, 3),
            "last_seen": self.last_seen,
            "seen_ago_s": round(now_wall - self.last_seen, 3) if self.last_seen else None,
            "failures": self.failures,
            "last_error": self.last_error,
            "addrs": list(record.addrs) if record else [],
            "models": list(record.models) if record else [],
            "roles": sorted(record.roles) if record else [],
            "capacity": dict(record.capacity) if record else {},
            "version": record.version if record else None,
            "record_seq": record.seq if record else None,
        }


class PeerTable:
    """Liveness, RTT and node records of the peers this node knows (see module docstring)."""

    def __init__(
        self,
        *,
        alpha: float = 0.2,
        beta: float = 0.25,
        suspect_after: int = 1,
        down_after: int = 2,
        grace_period: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"beta must be in (0, 1], got {beta}")
        if not 1 <= suspect_after <= down_after:
            raise ValueError("need 1 <= suspect_after <= down_after")
        self.alpha = alpha
        self.beta = beta
        self.suspect_after = suspect_after
        self.down_after = down_after
        self.grace_period = grace_period
        self._clock = clock
        self._wall = wall_clock
        self._entries: dict[str, PeerEntry] = {}
        self._listeners: list[Listener] = []

    # -- queries ------------------------------------------------------------------------

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, peer_id: str) -> PeerEntry | None:
        return self._entries.get(peer_id)

    def state(self, peer_id: str) -> PeerState | None:
        entry = self._entries.get(peer_id)
        return entry.state if entry else None

    def is_up(self, peer_id: str) -> bool:
        return self.state(peer_id) is PeerState.UP

    def peer_ids(self, *states: PeerState) -> list[str]:
        """Peers in any of `states` (all peers when none given), sorted by id."""
        wanted = set(states) or set(PeerState)
        return sorted(p for p, e in self._entries.items() if e.state in wanted)

    def up_peers(self) -> list[str]:
        return self.peer_ids(PeerState.UP)

    def rto(self, peer_id: str, floor: float, ceiling: float) -> float:
        """Probe timeout in seconds: srtt + 4 * rttvar within [floor, ceiling] (RFC 6298)."""
        entry = self._entries.get(peer_id)
        if entry is None or entry.rtt_ms is None or entry.rttvar_ms is None:
            return floor
        estimate = (entry.rtt_ms + 4.0 * entry.rttvar_ms) / 1000.0
        return min(max(estimate, floor), max(floor, ceiling))

    def snapshot(self) -> list[dict[str, Any]]:
        now = self._wall()
        return [self._entries[p].as_dict(now) for p in sorted(self._entries)]

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    # -- updates ------------------------------------------------------------------------

    def observe(self, peer_id: str) -> PeerEntry:
        """The peer is reachable right now (connected, answered a request)."""
        entry = self._entry(peer_id)
        entry.failures = 0
        entry.last_seen = self._wall()
        self._set_state(entry, PeerState.UP)
        return entry

    def record_rtt(self, peer_id: str, rtt_s: float) -> PeerEntry:
        """A ping answered in `rtt_s` seconds: update srtt/rttvar and mark the peer up."""
        entry = self.observe(peer_id)
        rtt_ms = rtt_s * 1000.0
        if entry.rtt_ms is None or entry.rttvar_ms is None:
            entry.rtt_ms, entry.rttvar_ms = rtt_ms, rtt_ms / 2.0
        else:
            # The deviation uses the old mean (RFC 6298 order).
            entry.rttvar_ms += self.beta * (abs(entry.rtt_ms - rtt_ms) - entry.rttvar_ms)
            entry.rtt_ms += self.alpha * (rtt_ms - entry.rtt_ms)
        return entry

    def record_failure(self, peer_id: str, reason: str) -> PeerEntry:
        """A ping or request failed or timed out."""
        entry = self._entry(peer_id)
        entry.failures += 1
        entry.last_error = reason
        if entry.failures >= self.down_after:
            self._set_state(entry, PeerState.DOWN)
        elif entry.failures >= self.suspect_after and entry.state is PeerState.UP:
            self._set_state(entry, PeerState.SUSPECT)
        return entry

    def mark_down(self, peer_id: str, reason: str) -> None:
        """The connection is gone (reset, closed, health check failed)."""
        entry = self._entries.get(peer_id)
        if entry is None:
            return
        entry.last_error = reason
        entry.failures = max(entry.failures, self.down_after)
        self._set_state(entry, PeerState.DOWN)

    def set_record(self, record: NodeRecord) -> bool:
        """Store `record` unless an equal or newer seq is known; True when stored."""
        entry = self._entry(record.peer_id)
        if entry.record is not None and entry.record.seq >= record.seq:
            return False
        entry.record = record
        return True

    def prune(self) -> list[str]:
        """Forget peers down for longer than the grace period; returns their ids."""
        now = self._clock()
        gone = [
            p
            for p, e in self._entries.items()
            if e.state is PeerState.DOWN and now - e.changed_at > self.grace_period
        ]
        for peer_id in gone:
            del self._entries[peer_id]
        return gone

    def _entry(self, peer_id: str) -> PeerEntry:
        entry = self._entries.get(peer_id)
        if entry is None:
            entry = PeerEntry(peer_id=peer_id, changed_at=self._clock())
            self._entries[peer_id] = entry
            self._notify(peer_id, None, entry.state)
        return entry

    def _set_state(self, entry: PeerEntry, state: PeerState) -> None:
        if entry.state is state:
            return
        old = entry.state
        entry.state = state
        entry.changed_at = self._clock()
        self._notify(entry.peer_id, old, state)

    def _notify(self, peer_id: str, old: PeerState | None, new: PeerState) -> None:
        for listener in self._listeners:
            listener(peer_id, old, new)
