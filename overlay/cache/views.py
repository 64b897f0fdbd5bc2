"""PeerViews: this node's read-only, approximate replica of every peer's prefix cache, per model.

Contract:
- ``apply(digest) -> ApplyResult``. A full digest replaces the view unless it is older (lower
  epoch, or same epoch and lower version): STALE. A delta ``base -> version`` applies when
  ``base <= view.version <= version`` in the same epoch (deltas hold the last operation per
  fingerprint, so overlap is harmless); a delta that starts after the view's version, from a
  newer epoch, or for a peer with no view yet is a GAP: the caller must pull a full digest from the
  origin. A delta from version 0 is the whole state and applies as a full digest: version 0 of
  an epoch is its empty start (``DigestBuilder``), and a node whose cache has not changed
  since it started (every node of a network that starts) publishes nothing else between its
  full digests, so its peers would otherwise wait for a pull or the next full round (64 node
  processes on 2 cores: 5,136 such GAPs, their pulls timing out, views minutes late). Load figures (queue, wait, push-back, speeds) are taken from any digest at least as new
  as the last one seen, GAPs included, so routing sees fresh load even while the cache view lags.
- ``cached_prefix_tokens(peer, prompt_block_hashes, model_id=None)``: the longest prefix of the
  prompt's chained block hashes whose fingerprints the view holds, times ``BLOCK_SIZE``;
  ``prefix_tokens(view, prompt_fingerprints)`` is the same from precomputed fingerprints (the
  router's per-decision fast path); ``live(model_id)`` lists the views the router considers.
- Ages: ``info_age_s`` is now minus the digest's signed issue time (sender clock, clamped at 0);
  ``silent_s`` is local monotonic time since a newer digest (version or signed time) arrived
  (replays of old digests don't count, so a departed peer's view expires on time). Views silent for more than
  ``expire_after_s`` are dropped by ``expire()``; ``remove_peer`` drops a peer the peer table
  reports down; ``prune(is_up)`` does both.
- Not thread-safe; use from the node's trio thread.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from p2pnode.inference.blockhash import BLOCK_SIZE
from p2pnode.overlay.cache.digest import Digest, LoadInfo, fingerprint


class ApplyResult(enum.Enum):
    APPLIED = "applied"
    STALE = "stale"
    GAP = "gap"


@dataclass
class PeerView:
    peer_id: str
    model_id: str
    epoch: int
    version: int
    fp_bits: int
    fingerprints: set[int]
    load: LoadInfo
    issued_at: float  # sender's wall clock, from the envelope
    heard_at: float  # local monotonic clock
    load_issued_at: float = 0.0
    gaps: int = field(default=0)


class PeerViews:
    def __init__(
        self,
        *,
        expire_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if expire_after_s <= 0:
            raise ValueError(f"expire_after_s must be > 0, got {expire_after_s}")
        self.expire_after_s = self.base_expire_after_s = expire_after_s
        self._clock = clock
        self._wall = wall_clock
        self._views: dict[tuple[str, str], PeerView] = {}

    # -- updates --------------------------------------------------------------------------

    def apply(self, d: Digest) -> ApplyResult:
        if d.base_version == 0:
            d = replace(d, base_version=None)  # from the empty start: the whole state
        key = (d.peer_id, d.model_id)
        view = self._views.get(key)
        now = self._clock()
        if d.is_full:
            if view is not None and (d.epoch, d.version) < (view.epoch, view.version):
                return ApplyResult.STALE
            same = view is not None and (d.epoch, d.version) == (view.epoch, view.version)
            if same and d.timestamp <= view.load_issued_at:
                # A replay (gossip caches, a late pull answer): nothing new, and it must not
                # make a departed peer look alive.
                return ApplyResult.STALE
            self._views[key] = PeerView(
                peer_id=d.peer_id,
                model_id=d.model_id,
                epoch=d.epoch,
                version=d.version,
                fp_bits=d.fp_bits,
                fingerprints=set(d.added),
                load=d.load,
                issued_at=d.timestamp,
                heard_at=now,
                load_issued_at=d.timestamp,
            )
            return ApplyResult.APPLIED
        if view is None:
            return ApplyResult.GAP
        if d.epoch < view.epoch or (d.epoch == view.epoch and d.version < view.version):
            return ApplyResult.STALE
        self._refresh_load(view, d, now, newer=(d.epoch, d.version) > (view.epoch, view.version))
        assert d.base_version is not None
        if d.epoch != view.epoch or d.base_version > view.version or d.fp_bits != view.fp_bits:
            view.gaps += 1
            return ApplyResult.GAP
        if d.cleared:
            view.fingerprints.clear()
        view.fingerprints -= d.removed
        view.fingerprints |= d.added
        view.version = d.version
        view.issued_at = max(view.issued_at, d.timestamp)
        return ApplyResult.APPLIED

    @staticmethod
    def _refresh_load(view: PeerView, d: Digest, now: float, *, newer: bool) -> None:
        # Only a digest signed later than anything seen counts as hearing from the peer: a
        # departed peer's old digests still circulate (gossip caches, relays) for a while.
        if newer or d.timestamp > view.load_issued_at:
            view.heard_at = now
        if d.timestamp >= view.load_issued_at:
            view.load = d.load
            view.load_issued_at = d.timestamp

    def remove_peer(self, peer_id: str) -> int:
        """Forget every view of ``peer_id`` (it went down); returns how many were dropped."""
        keys = [k for k in self._views if k[0] == peer_id]
        for k in keys:
            del self._views[k]
        return len(keys)

    def stretch_expiry(self, at_least_s: float) -> None:
        """Keep views at least this long (never below the configured ``expire_after_s``).

        Anti-entropy calls it with a few of its publish intervals: each origin publishes once per
        interval, and the interval grows with the number of publishers (publishers / topic
        budget), so a fixed horizon would drop every view of a large swarm between two of its
        origin's rounds."""
        self.expire_after_s = max(self.base_expire_after_s, at_least_s)

    def expire(self) -> list[tuple[str, str]]:
        """Drop views silent for longer than ``expire_after_s``; returns their (peer, model)."""
        now = self._clock()
        old = [k for k, v in self._views.items() if now - v.heard_at > self.expire_after_s]
        for k in old:
            del self._views[k]
        return old

    def prune(self, is_up: Callable[[str], bool]) -> list[tuple[str, str]]:
        """``expire()`` plus removal of peers for which ``is_up(peer_id)`` is False."""
        gone = self.expire()
        for peer in {k[0] for k in self._views}:
            if not is_up(peer):
                gone.extend(k for k in self._views if k[0] == peer)
                self.remove_peer(peer)
        return gone

    # -- queries --------------------------------------------------------------------------

    def get(self, peer_id: str, model_id: str) -> PeerView | None:
        return self._views.get((peer_id, model_id))

    def peers(self, model_id: str) -> list[str]:
        """Peers with a live view of ``model_id``."""
        now = self._clock()
        return sorted(
            p
            for (p, m), v in self._views.items()
            if m == model_id and now - v.heard_at <= self.expire_after_s
        )

    def live(self, model_id: str) -> list[PeerView]:
        """Live views of ``model_id`` (heard within ``expire_after_s``), sorted by peer id."""
        now = self._clock()
        limit = self.expire_after_s
        return sorted(
            (v for (_, m), v in self._views.items() if m == model_id and now - v.heard_at <= limit),
            key=lambda v: v.peer_id,
        )

    def wall_now(self) -> float:
        """The wall clock ``info_age_s`` uses (``now - view.issued_at``)."""
        return self._wall()

    def views(self) -> Iterable[PeerView]:
        return list(self._views.values())

    def cached_prefix_tokens(
        self, peer_id: str, prompt_block_hashes: Sequence[int], model_id: str | None = None
    ) -> int:
        if model_id is not None:
            view = self._views.get((peer_id, model_id))
            return _prefix(view, prompt_block_hashes) if view is not None else 0
        # Block hashes are salted per model, so only the right model's view can match.
        return max(
            (_prefix(v, prompt_block_hashes) for (p, _), v in self._views.items() if p == peer_id),
            default=0,
        )

    def info_age_s(self, peer_id: str, model_id: str) -> float | None:
        view = self._views.get((peer_id, model_id))
        return None if view is None else max(0.0, self._wall() - view.issued_at)

    def silent_s(self, peer_id: str, model_id: str) -> float | None:
        view = self._views.get((peer_id, model_id))
        return None if view is None else self._clock() - view.heard_at

    def version_of(self, peer_id: str, model_id: str) -> tuple[int, int] | None:
        view = self._views.get((peer_id, model_id))
        return None if view is None else (view.epoch, view.version)

    def __len__(self) -> int:
        return len(self._views)


def _prefix(view: PeerView, hashes: Sequence[int]) -> int:
    return prefix_tokens(view, [fingerprint(h, view.fp_bits) for h in hashes])


def prefix_tokens(view: PeerView, prompt_fingerprints: Sequence[int]) -> int:
    """Cached prefix in tokens, given the prompt's block fingerprints at ``view.fp_bits``
    (computed once per prompt by the router, not once per peer)."""
    fps = view.fingerprints
    n = 0
    for fp in prompt_fingerprints:
        if fp not in fps:
            break
        n += 1
    return n * BLOCK_SIZE
