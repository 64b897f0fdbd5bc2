"""Connection manager: a bounded number of connections per node, the ones the router can use.

Why: every connection costs both of its ends CPU while idle (liveness probes, gossipsub
heartbeats and IHAVE gossip, DHT traffic): ~0.5 % of a core per directed link on the 2-core
development machine (``testnet/run/capacity.py``), so a full mesh of 64 node processes needs ~20
cores idle and never formed there. Digests do not need a full mesh: gossipsub spreads them over
its own mesh (degree 6) on whatever connections exist. A node needs connections to the peers its
router would send work to (the nearest: far peers never win at WAN delays), to its bootstrap and
relays, and a few random ones that keep the overlay one connected graph across regions.

libp2p 0.8.1 has a pruner of its own (``ConnectionConfig`` watermarks), but it never closes a
connection with an open stream, and every overlay connection holds its gossipsub and ping
streams for good; nor does it rank peers by latency. So it stays off (``overlay/net/host.py``) and
this module decides.

Contract:
- ``ConnLimits(low, high, grace_s, long_links)``: ``high == 0`` turns the manager off (every
  discovered peer is dialed, up to ``OverlayConfig.max_peers``); else ``1 <= low <= high``.
- ``select_keep(peers, limits, self_id)`` (pure): which connected peers to keep when trimming:
  every protected, busy or young one (connected for less than ``grace_s``: its RTT is not
  measured yet, its hello may still run); then the ``long_links`` peers whose pair hash
  (``pair_rank``, the same seen from either end, so both ends tend to keep the same long links)
  ranks highest; then the nearest by smoothed RTT class (a factor of ``RTT_CLASS_BASE``;
  unmeasured last), ties by the pair hash, until ``low`` are kept.
- ``ConnManager(limits)`` holds the node's side: ``note_connected``/``note_disconnected`` (the
  node's connection events), ``protect(fn)`` adds a source of peers never to trim (bootstrap,
  relays), ``dial_budget(connected)`` (new peers discovery may dial now: up to ``low`` at
  once, then one untried candidate at most every ``EXPLORE_EVERY_S`` while below ``high``,
  so the nearest peers are found, not only the first ones dialed), ``may_redial(connected)``
  (a lost or trimmed peer: only below ``low``, so a peer that trimmed us is not dialed back at
  once and a trim is not undone by the next discovery round), ``plan_trim(...)``
  -> the peers to close (only when more than ``high`` are connected) and ``status()``.
  The node's trimmer (``overlay/net/trimming.py``) runs the trim every ``TRIM_EVERY_S``, closes
  those connections and marks the peers down with the reason ``pruned``.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EXPLORE_EVERY_S",
    "TRIM_EVERY_S",
    "Candidate",
    "ConnLimits",
    "ConnManager",
    "pair_rank",
    "select_keep",
]

# How often the node compares its connection count with the high watermark.
TRIM_EVERY_S = 5.0
# One dial of a never-tried candidate at most this often per node while below the high
# watermark: 64 nodes exploring at once must not cost more than their handshakes' worth.
EXPLORE_EVERY_S = 20.0
# Trimmed peers remembered (not redialed while the node holds `low` connections) this long.
PRUNED_MEMORY_S = 600.0
MAX_REMEMBERED = 4096
# RTTs within a factor of this rank as equally near (2 ms and 6 ms links alike; 2 ms and 40 ms
# not): see select_keep.
RTT_CLASS_BASE = 4.0


@dataclass(frozen=True)
class ConnLimits:
    low: int = 0
    high: int = 0  # 0: no limit (every discovered peer is dialed)
    grace_s: float = 30.0
    long_links: int = 2

    def __post_init__(self) -> None:
        if self.high < 0 or self.low < 0 or self.long_links < 0 or self.grace_s < 0:
            raise ValueError("connection limits must be >= 0")
        if self.high and not 1 <= self.low <= self.high:
            raise ValueError(
                f"connection limits need 1 <= low <= high, got low={self.low} high={self.high}"
            )
        if self.high and self.long_links >= self.low:
            raise ValueError(
                f"long_links ({self.long_links}) must leave room for the nearest peers "
                f"below low ({self.low})"
            )

    @property
    def enabled(self) -> bool:
        return self.high > 0


@dataclass(frozen=True)
class Candidate:
    """One connected peer, as the trim sees it."""

    peer_id: str
    rtt_ms: float | None
    age_s: float  # since it connected
    protected: bool = False
    busy: bool = False  # a stream other than the persistent ones is open (a forward, a pull)


def pair_rank(a: str, b: str) -> int:
    """A pseudo-random rank of the pair {a, b}, the same from either end."""
    lo, hi = sorted((a, b))
    return int.from_bytes(hashlib.blake2b(f"{lo}|{hi}".encode(), digest_size=8).digest(), "big")


def _rtt_class(rtt_ms: float | None) -> float:
    if rtt_ms is None:
        return math.inf
    return math.floor(math.log(max(rtt_ms, 1.0), RTT_CLASS_BASE))


def select_keep(peers: Sequence[Candidate], limits: ConnLimits, self_id: str) -> set[str]:
    """The peers to keep of ``peers`` (see the module docstring)."""
    keep = {p.peer_id for p in peers if p.protected or p.busy or p.age_s < limits.grace_s}
    rest = [p for p in peers if p.peer_id not in keep]
    by_pair = sorted(rest, key=lambda p: pair_rank(self_id, p.peer_id), reverse=True)
    long_links = [p.peer_id for p in by_pair[: limits.long_links]]
    keep.update(long_links)
    # Nearest first by RTT class (a factor of RTT_CLASS_BASE wide), then by the pair hash: both
    # ends of a link rank it the same way within a class, so a link one end keeps is mostly one
    # the other end keeps too. Ranked by exact RTT (noisy on busy cores), each end kept its own
    # picks and closed the other's: a 64-node swarm trimmed itself to ~1 link per node.
    nearest = sorted(
        (p for p in rest if p.peer_id not in keep),
        key=lambda p: (_rtt_class(p.rtt_ms), -pair_rank(self_id, p.peer_id)),
    )
    room = max(0, limits.low - len(keep))
    keep.update(p.peer_id for p in nearest[:room])
    return keep


class ConnManager:
    """The bounded-connections state of one node (see the module docstring)."""

    def __init__(self, limits: ConnLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._connected_at: dict[str, float] = {}
        self._protectors: list[Callable[[], Iterable[str]]] = []
        self.pruned: OrderedDict[str, float] = OrderedDict()  # peer -> when we trimmed it
        self.tried: set[str] = set()  # peers we were ever connected to
        self._explored_at = -math.inf
        self.trims = 0
        self.pruned_total = 0

    @property
    def enabled(self) -> bool:
        return self.limits.enabled

    def protect(self, source: Callable[[], Iterable[str]]) -> None:
        """Peers ``source()`` names are never trimmed (asked at every trim)."""
        self._protectors.append(source)

    def protected(self) -> set[str]:
        out: set[str] = set()
        for source in self._protectors:
            out.update(source())
        return out

    def note_connected(self, peer_id: str) -> None:
        self._connected_at.setdefault(peer_id, self._clock())
        if len(self.tried) < MAX_REMEMBERED:
            self.tried.add(peer_id)

    def note_disconnected(self, peer_id: str) -> None:
        self._connected_at.pop(peer_id, None)

    def age_s(self, peer_id: str) -> float:
        at = self._connected_at.get(peer_id)
        return math.inf if at is None else self._clock() - at

    def was_pruned(self, peer_id: str) -> bool:
        at = self.pruned.get(peer_id)
        return at is not None and self._clock() - at < PRUNED_MEMORY_S

    def may_redial(self, connected: int) -> bool:
        """A peer we lost or trimmed: dialed again only while below ``low``."""
        return not self.enabled or connected < self.limits.low

    def dial_budget(self, connected: int) -> int:
        """New peers discovery may dial now: up to ``low`` at once; above it, one untried
        candidate every ``EXPLORE_EVERY_S`` (``explore_due``) while below ``high``."""
        if not self.enabled:
            return -1  # no limit here (OverlayConfig.max_peers still applies)
        if connected < self.limits.low:
            return self.limits.low - connected
        return 1 if connected < self.limits.high and self._explore_due() else 0

    def _explore_due(self) -> bool:
        now = self._clock()
        if now - self._explored_at < EXPLORE_EVERY_S:
            return False
        self._explored_at = now
        return True

    def plan_trim(
        self,
        self_id: str,
        connected: Iterable[str],
        rtt_ms: Callable[[str], float | None],
        busy: Callable[[str], bool],
    ) -> list[str]:
        """The peers to close now: none unless more than ``high`` are connected."""
        peers = list(connected)
        if not self.enabled or len(peers) <= self.limits.high:
            return []
        protected = self.protected()
        candidates = [
            Candidate(
                peer_id=pid,
                rtt_ms=rtt_ms(pid),
                age_s=self.age_s(pid),
                protected=pid in protected,
                busy=busy(pid),
            )
            for pid in peers
        ]
        keep = select_keep(candidates, self.limits, self_id)
        drop = sorted(pid for pid in peers if pid not in keep)
        now = self._clock()
        for pid in drop:
            self.pruned[pid] = now
            self.pruned.move_to_end(pid)
        while len(self.pruned) > MAX_REMEMBERED:
            self.pruned.popitem(last=False)
        if drop:
            self.trims += 1
            self.pruned_total += len(drop)
        return drop

    def status(self, connected: int) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "low": self.limits.low,
            "high": self.limits.high,
            "connected": connected,
            "trims": self.trims,
            "pruned": self.pruned_total,
            "pruned_remembered": sum(1 for p in self.pruned if self.was_pruned(p)),
        }
