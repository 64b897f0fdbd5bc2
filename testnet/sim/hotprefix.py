"""Hot prefixes: a bounded, mergeable summary of the most served long prefixes and who holds them.

Why: with scoped views (``overlay/cache/scope.py``) a node sees its nearest peers only; a far holder of
a prompt's leading blocks is found by a DHT lookup, which costs hops at the region's or the
world's RTT. The lookup runs beside the request, so its answer often comes after the request has
started elsewhere, and at the world level it is often not worth making at all. A summary naming
the prefixes served most across the swarm, with a few holders of each per zone, lets any node
pull a holder's digest at once (one round trip) instead of looking the key up.

Contract:
- An entry is a prefix key (``scope.prefix_key``: the DHT key of the prompt's leading blocks),
  a count of requests served under it, and holders ``(peer id, zone, heard_at)``; the zone is
  the holder's region, the one whose DHT it announces in.
- ``note_served(key, peer, zone, at)``: this node served a request under ``key`` and holds it
  (a full table counts as Space-Saving does: a new key replaces the least counted and starts
  from its count). ``merge(other)``: counts add; holders are united, newest first, per zone at most
  ``holders_per_zone``. ``decay()`` multiplies every count by ``decay`` (once per round, so the
  summary follows what is hot now) and drops keys whose count fell below ``min_count``.
- Bound: after every update at most ``max_keys`` keys (highest counts; ties by key bytes, so
  every node keeps the same ones) and at most ``max_zones * holders_per_zone`` holders each:
  memory and the encoded summary are O(max_keys * max_zones * holders_per_zone) whatever the
  swarm's size. ``decode`` refuses anything over the bound.
- ``holders(key, zone)``: the holders in ``zone`` first, then the others, newest first.
- Transport: once per gossip interval a node merges its own table into what its children in an
  aggregation tree over the DHT sent it, sends that up, and takes the merged summary that comes
  down (as SDIMS or Astrolabe aggregate); per node that is ``fanout + 1`` summaries received per
  interval. The simulator (``testnet/sim/``) simulates that tree; nodes do not run it yet.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

import cbor2

from p2pnode.errors import P2PNodeError

KEY_BYTES = 8  # a truncated key: 2**-64 collisions are as harmless as a fingerprint's
MAX_PEER_ID_LEN = 64
MAX_ZONE_LEN = 16


class HotPrefixError(P2PNodeError):
    """Raised by ``decode`` for a summary that is malformed or over its bound."""

    reason = "bad_hot_summary"


@dataclass(frozen=True, slots=True)
class Holder:
    peer_id: str
    zone: str
    heard_at: float


@dataclass(slots=True)
class _Entry:
    count: float = 0.0
    holders: list[Holder] = field(default_factory=list)


@dataclass(frozen=True)
class HotPolicy:
    max_keys: int = 32
    holders_per_zone: int = 2
    max_zones: int = 8
    decay: float = 0.5  # per round: a prefix nobody served for ~6 rounds is out
    min_count: float = 0.01
    fanout: int = 2  # children per node in the aggregation tree (bytes received per round)

    def __post_init__(self) -> None:
        if min(self.max_keys, self.holders_per_zone, self.max_zones, self.fanout) < 1:
            raise ValueError("max_keys, holders_per_zone, max_zones and fanout must be >= 1")
        if not 0 < self.decay <= 1 or self.min_count < 0:
            raise ValueError("need 0 < decay <= 1 and min_count >= 0")


class HotPrefixes:
    """One node's copy of the summary (see the module doc)."""

    def __init__(self, policy: HotPolicy | None = None) -> None:
        self.policy = policy or HotPolicy()
        self._entries: dict[bytes, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def entries(self) -> list[tuple[bytes, float, list[Holder]]]:
        """``(key, count, holders)`` per key, for reports and sizes."""
        return [(k, e.count, list(e.holders)) for k, e in self._entries.items()]

    def count(self, key: bytes) -> float:
        e = self._entries.get(key[:KEY_BYTES])
        return 0.0 if e is None else e.count

    def note_served(self, key: bytes, peer_id: str, zone: str, at: float) -> None:
        key = key[:KEY_BYTES]
        e = self._entries.get(key)
        if e is None:
            # Space-Saving: a new key takes the place, and the count, of the least counted,
            # so a prefix turning hot can enter a full table (its count is then an overestimate
            # by at most that of the key it replaced).
            floor = 0.0
            if len(self._entries) >= self.policy.max_keys:
                least = min(self._entries, key=lambda k: (self._entries[k].count, k))
                floor = self._entries.pop(least).count
            e = self._entries[key] = _Entry(floor)
        e.count += 1.0
        e.holders = self._cap_holders([Holder(peer_id, zone, at), *e.holders])

    def merge(self, other: HotPrefixes) -> None:
        for key, theirs in other._entries.items():
            e = self._entries.setdefault(key, _Entry())
            e.count += theirs.count
            e.holders = self._cap_holders([*e.holders, *theirs.holders])
        self._cap_keys()

    def decay(self) -> None:
        p = self.policy
        for e in self._entries.values():
            e.count *= p.decay
        self._entries = {k: e for k, e in self._entries.items() if e.count >= p.min_count}

    def holders(self, key: bytes, zone: str) -> list[Holder]:
        e = self._entries.get(key[:KEY_BYTES])
        if e is None:
            return []
        return sorted(e.holders, key=lambda h: (h.zone != zone, -h.heard_at, h.peer_id))

    def copy(self) -> HotPrefixes:
        out = HotPrefixes(self.policy)
        out._entries = {k: _Entry(e.count, list(e.holders)) for k, e in self._entries.items()}
        return out

    def _cap_holders(self, holders: Iterable[Holder]) -> list[Holder]:
        p = self.policy
        best: dict[str, Holder] = {}
        for h in holders:  # one per peer: its newest
            if h.peer_id not in best or h.heard_at > best[h.peer_id].heard_at:
                best[h.peer_id] = h
        per_zone: dict[str, int] = {}
        kept = []
        for h in sorted(best.values(), key=lambda h: (-h.heard_at, h.peer_id)):
            n = per_zone.get(h.zone, 0)
            if n < p.holders_per_zone and (n or len(per_zone) < p.max_zones):
                per_zone[h.zone] = n + 1
                kept.append(h)
        return kept

    def _cap_keys(self) -> None:
        if len(self._entries) > self.policy.max_keys:
            top = heapq.nlargest(
                self.policy.max_keys, self._entries.items(), key=lambda kv: (kv[1].count, kv[0])
            )
            self._entries = dict(top)

    # -- wire -------------------------------------------------------------------------------

    def encode(self) -> bytes:
        """CBOR: ``[[key, count, [[peer, zone, heard_at], ...]], ...]``."""
        return cbor2.dumps(
            [
                [
                    k,
                    round(e.count, 3),
                    [[h.peer_id, h.zone, round(h.heard_at, 3)] for h in e.holders],
                ]
                for k, e in self._entries.items()
            ]
        )

    @classmethod
    def decode(cls, data: bytes, policy: HotPolicy | None = None) -> HotPrefixes:
        out = cls(policy)
        p = out.policy
        limit = p.max_keys * (KEY_BYTES + 16 + p.max_zones * p.holders_per_zone * 100)
        if len(data) > limit:
            raise HotPrefixError(f"summary of {len(data)} bytes over its bound of {limit}")
        try:
            rows = cbor2.loads(data)
            if not isinstance(rows, list) or len(rows) > p.max_keys:
                raise HotPrefixError("not a list of at most max_keys entries")
            for key, count, holders in rows:
                ok = isinstance(key, bytes) and len(key) == KEY_BYTES and count >= 0
                if not ok or len(holders) > p.max_zones * p.holders_per_zone:
                    raise HotPrefixError("bad key, count or too many holders")
                hs = []
                for peer, zone, at in holders:
                    if len(peer) > MAX_PEER_ID_LEN or len(zone) > MAX_ZONE_LEN:
                        raise HotPrefixError("peer id or zone too long")
                    hs.append(Holder(str(peer), str(zone), float(at)))
                out._entries[key] = _Entry(float(count), out._cap_holders(hs))
        except (ValueError, TypeError, cbor2.CBORDecodeError) as exc:
            if isinstance(exc, HotPrefixError):
                raise
            raise HotPrefixError(f"malformed summary: {exc}") from exc
        return out
