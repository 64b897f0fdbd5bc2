"""Scoped views: keep full cache views only of the peers that could win a request.

Rule (derived from the router's choice rule, ``overlay/routing/router.py``): a peer is chosen only when
it beats local by the margin (before forwards are measured, one round trip: ``rtt_margin``), and
a forward costs ``forward_round_trips * rtt`` more than serving here (the network-cost prior of
``overlay/routing/netcost.py``, 3 round trips). What a peer can save us is at most the
prefill of the longest prompt we expect, ``max_prompt_tokens * prefill_s_per_token`` (plus the
difference in queues, which push-back bounds). So a peer whose RTT exceeds

    rtt_budget_s = max_prompt_tokens * prefill_s_per_token / (forward_round_trips + rtt_margin)

can never win on cache and is not worth a view. ``ScopePolicy.select`` keeps, of the peers
within the budget, the ``max_views`` nearest, and always the ``k_nearest`` nearest whatever their
RTT (so a node far from everyone still has somewhere to send work). Memory and digest traffic
per node are then O(max_views), independent of the swarm's size.

A far holder of a LONG prefix can still win (its saving grows with the prefix): it is found on
demand, not kept in view. ``prefix_key(block_hashes)`` is the DHT key of a prompt: the chained
hash of its first ``key_blocks`` blocks (the router's placement key: the same leading blocks),
which names the whole leading prefix (block hashes chain over their parents). A node caching a
prompt of at least ``key_blocks`` blocks announces itself under that key, in its region's DHT
and in the world's (two levels, as Coral's clusters: a lookup in the region costs hops at the
region's RTT); a node routing such a prompt with no in-scope holder looks the key up in both at
once, pulls the holders' digests (``ScopedViews.admit_temporarily``) and decides again. The
lookup runs beside the request, which starts on its first path: it moves to a holder only if the
router expects the holder to finish before what is left of that path. So a lookup is made only
when ``lookup_worth``: when its answer comes, the prefill left to save must still beat the
forward to the holder, i.e. ``uncached * prefill_s_per_token > lookup_s + (forward_round_trips
+ rtt_margin) * rtt``.

The prefixes served most across the swarm are found without a lookup: the hot-prefix summary
(``testnet/sim/hotprefix.py``) names, for at most ``HotPolicy.max_keys`` keys, at most
``holders_per_zone`` holders in each of at most ``max_zones`` zones; a node routing a prompt
whose key it names, with no in-scope holder, pulls the nearest holders' digests before the
request starts when ``lookup_worth`` holds with the pull's round trip as the lookup, and the DHT
lookup above is left for the keys the summary does not name. The summary adds a bounded copy
per node and ``fanout + 1`` summaries received per gossip interval, independent of the swarm's
size, so the bound below still holds.

Placement on misses (``overlay/routing/router.py``) ranks rendezvous homes over a set of peers; for
misses of one prefix to converge, every entry node should rank the same set. ``cell_nodes > 0``
makes that set the node's *cell*: the peers of its region whose name hashes to the same bucket
(``cell_of``; a region of ``s`` nodes has ``max(1, s // cell_nodes)`` buckets, so a cell holds
``cell_nodes`` to ``2 * cell_nodes`` peers on average: a hash bucket, so some a few more, some
fewer). Every node then keeps its whole cell in view and ranks homes over its cell only
(``Router(placement_pool=...)``), so every entry node of a cell sends a miss of one prefix to
the same home. Views per node are then about ``max(max_views, 2 * cell_nodes) + k_nearest``.
Cells are off by default (``cell_nodes = 0``: homes are ranked over the node's own scope, the
nearest peers): in the simulator (``testnet/sim/``) cells of 32 lost hit rate at 100 and
1,000 nodes against the nearest-peer scope, because the misses that placement could make
converge are few next to those a lookup resolves, and a cell spread over a region is farther
than the nearest peers.

``ScopedViews`` is the hook into ``PeerViews``: the same class, whose ``live()`` (what the router
reads) lists in-scope and temporarily admitted peers only, and whose ``apply`` drops digests of
peers out of scope before storing them (so their fingerprints cost no memory).
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from p2pnode.overlay.cache.digest import Digest
from p2pnode.overlay.cache.views import ApplyResult, PeerView, PeerViews


@dataclass(frozen=True)
class ScopePolicy:
    max_prompt_tokens: int = 2048
    prefill_s_per_token: float = 1 / 430
    forward_round_trips: float = 3.0
    rtt_margin: float = 1.0
    max_views: int = 64
    k_nearest: int = 8
    key_blocks: int = 4  # a prompt of at least 64 tokens has a DHT key
    cell_nodes: int = 0  # 0: no cells (homes ranked over the node's scope); see the module doc

    def __post_init__(self) -> None:
        if self.max_views < 0 or self.k_nearest < 0 or self.key_blocks < 1:
            raise ValueError("need max_views >= 0, k_nearest >= 0 and key_blocks >= 1")
        if self.cell_nodes < 0:
            raise ValueError("need cell_nodes >= 0 (0: no cells)")

    @property
    def rtt_budget_s(self) -> float:
        saving = self.max_prompt_tokens * self.prefill_s_per_token
        return saving / max(1e-9, self.forward_round_trips + self.rtt_margin)

    def lookup_worth(self, uncached_tokens: int, lookup_s: float, rtt_s: float) -> bool:
        """Is a prefix lookup worth its latency? Only when the prefill it could save beats the
        lookup plus the forward to a holder ``rtt_s`` away (what the router would then add)."""
        forward = (self.forward_round_trips + self.rtt_margin) * rtt_s
        return uncached_tokens * self.prefill_s_per_token > lookup_s + forward

    def select(self, rtts: Iterable[tuple[str, float]], cell: Iterable[str] = ()) -> set[str]:
        """Peers to keep in view, from ``(peer_id, rtt_s)`` pairs and the node's ``cell``
        (see the module doc): the whole cell, then the nearest within the budget up to
        ``max_views`` in all, and the ``k_nearest`` whatever their RTT."""
        keep = set(cell)
        ranked = heapq.nsmallest(
            max(self.max_views, self.k_nearest), rtts, key=lambda pr: (pr[1], pr[0])
        )
        budget = self.rtt_budget_s
        room = max(0, self.max_views - len(keep))
        keep.update([p for p, rtt in ranked if rtt <= budget and p not in keep][:room])
        keep.update(p for p, _ in ranked[: self.k_nearest])
        return keep

    def cells(self, region_size: int) -> int:
        """How many cells a region of ``region_size`` nodes has (1 without cells)."""
        return 1 if self.cell_nodes == 0 else max(1, region_size // self.cell_nodes)


def cell_of(peer_id: str, region: str, cells: int) -> str:
    """A peer's cell: its region and a bucket of its name's hash. Every node that agrees on a
    region's size (``ScopePolicy.cells``) puts every peer in the same cell."""
    h = int.from_bytes(hashlib.blake2b(peer_id.encode(), digest_size=8).digest(), "big")
    return f"{region}/{h % max(1, cells)}"


def prefix_key(block_hashes: Sequence[int], key_blocks: int) -> bytes | None:
    """DHT key of a prompt's leading prefix, or None when it has fewer than ``key_blocks``
    full blocks. Block ``i``'s hash covers blocks ``0..i``, so one hash names the prefix."""
    if len(block_hashes) < key_blocks:
        return None
    return hashlib.sha256(
        b"p2pnode-prefix-v1" + struct.pack("<Q", block_hashes[key_blocks - 1])
    ).digest()


class ScopedViews(PeerViews):
    """``PeerViews`` restricted to a scope (see the module doc); ``scope`` is re-read on every
    call, so the owner can update it as RTTs are measured."""

    def __init__(self, scope: Callable[[], set[str]], **kwargs) -> None:
        super().__init__(**kwargs)
        self._scope = scope
        self._temporary: dict[str, float] = {}  # peer -> admitted until (views clock)

    def in_scope(self, peer_id: str) -> bool:
        until = self._temporary.get(peer_id)
        if until is not None and until >= self._clock():
            return True
        return peer_id in self._scope()

    def admit_temporarily(self, peer_id: str, for_s: float) -> None:
        """A holder found by a prefix lookup: in view for ``for_s`` seconds."""
        self._temporary[peer_id] = max(self._temporary.get(peer_id, 0.0), self._clock() + for_s)

    def apply(self, d: Digest) -> ApplyResult:
        if not self.in_scope(d.peer_id):
            return ApplyResult.STALE  # nothing to store, nothing to repair
        return super().apply(d)

    def live(self, model_id: str) -> list[PeerView]:
        return [v for v in super().live(model_id) if self.in_scope(v.peer_id)]

    def expire(self) -> list[tuple[str, str]]:
        now = self._clock()
        self._temporary = {p: t for p, t in self._temporary.items() if t >= now}
        gone = super().expire()
        for key in [k for k in self._views if not self.in_scope(k[0])]:
            del self._views[key]
            gone.append(key)
        return gone
