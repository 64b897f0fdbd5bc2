"""Scoped views' prefix lookups: the simulated DHTs and the lookup beside a request.

``Lookups`` is mixed into ``Simulation`` (``_run.py``) and reads its state (``cfg``, ``env``,
``net``, ``nodes``, ``store``, ``keys``, ``hashes``, ``_decide``); it keeps the directories and counters below.
``on_block_event`` is each cache's listener: a stored chain that reaches a prompt's key block
puts its node first among the key's holders, in the world's DHT and its region's (a cluster, as
in Coral's DSHT), at most 8 each. ``_lookup_wanted`` says whether a request's lookup could pay
(``ScopePolicy.lookup_worth`` at ``ceil(log2 n) / 2`` hops); ``_lookup`` is the lookup as a
simpy process: the DHT answers, a pull of the holders' digests, and a new decision with them
admitted; ``redirect`` says whether that decision should move the running request.
"""

from __future__ import annotations

import math
from typing import Any

from p2pnode.overlay.digest import seal_digest
from p2pnode.overlay.router import Router, RoutingDecision
from p2pnode.overlay.scope import ScopedViews, prefix_key
from p2pnode.testnet.sim._node import SimNode, fields


class Lookups:
    """The DHT directories, the lookups made and the requests they moved (a mixin of
    ``Simulation``: the lookup reads the whole run's state, so it shares the instance)."""

    def _init_lookups(self) -> None:
        self.pull_bytes = 0  # full digests pulled from holders a lookup found
        self.lookups = 0
        self.redirects = 0
        self.directory: dict[bytes, list[int]] = {}
        # The region's own DHT (a cluster, as in Coral's DSHT): its records name the region's
        # holders, and a lookup there costs hops at the region's RTT, not the world's.
        self.region_directory: dict[tuple[str, bytes], list[int]] = {}
        self.region_size: dict[str, int] = {}
        for r in self.net.region:
            self.region_size[r] = self.region_size.get(r, 0) + 1
        # Diagnostics, not read by any router: every node that ever stored a key's prefix.
        self.ever_held: dict[bytes, set[int]] = {}

    def _index_keys(self) -> None:
        """Which block hash completes which prompt's key, for the listener to look up."""
        self._key_of_block: dict[int, bytes] = {}
        kb = self.cfg.scope.key_blocks
        for hashes in self.hashes:
            key = prefix_key(hashes, kb)
            if key is not None:
                self._key_of_block[hashes[kb - 1]] = key

    def on_block_event(self, node: SimNode):
        """The listener ``node``'s cache reports its block events to."""

        def listener(event: Any) -> None:
            hashes = getattr(event, "hashes", None)
            if not hashes:
                return
            # A stored chain that reaches the key block announces this node under the key.
            for h in hashes:
                key = self._key_of_block.get(h)
                if key is not None:
                    self.ever_held.setdefault(key, set()).add(node.index)
                if key is not None and self.cfg.views == "scoped":
                    region = self.net.region[node.index]
                    for holders in (
                        self.directory.setdefault(key, []),
                        self.region_directory.setdefault((region, key), []),
                    ):
                        if node.index not in holders:
                            holders.insert(0, node.index)
                            del holders[8:]

        return listener

    def _held_anywhere(self, ids, hashes) -> int:
        key = prefix_key(hashes, self.cfg.scope.key_blocks)
        holders = self.ever_held.get(key, ()) if key is not None else ()
        return max((self.nodes[h].tree.prefix_len(ids) for h in holders), default=0)

    def _lookup_wanted(self, node: SimNode, ids, hashes, decision, info) -> bool:
        """A prefix lookup when nobody in view holds the key and the saving could still pay
        for the lookup and a forward to a holder (``ScopePolicy.lookup_worth``)."""
        kb = self.cfg.scope.key_blocks
        best = max((c.view_cached_tokens for c in decision.candidates), default=0)
        here = node.tree.prefix_len(ids)
        if prefix_key(hashes, kb) is None or best > kb * 16 or here > kb * 16:
            return False
        uncached = len(ids) - max(best, here)
        steps = self._lookup_steps(node, uncached)
        if not steps:
            info["lookup"] = "not_worth"
            return False
        info["lookup"] = "pending"
        info["uncached"] = uncached
        return True

    def _hops(self, n: int) -> int:
        return max(1, math.ceil(math.log2(max(2, n)) / 2))

    def _lookup_steps(self, node: SimNode, uncached: int) -> list[tuple[str, float, float]]:
        """The lookups worth making, in the order their answers come: ``(level, lookup s,
        RTT to a holder there)``; both start at once, the region's DHT answers first."""
        policy = self.cfg.scope
        region = self.net.region[node.index]
        levels = []
        if self.cfg.lookup_levels == "region" and self.region_size[region] > 1:
            levels.append(("region", self._hops(self.region_size[region]) * node.region_rtt_s))
        levels.append(("world", self._hops(self.cfg.nodes) * node.mean_rtt_s))
        steps = []
        for level, cost in levels:
            rtt = node.region_rtt_s if level == "region" else node.mean_rtt_s
            if policy.lookup_worth(uncached, cost, rtt):
                steps.append((level, cost, rtt))
        return sorted(steps, key=lambda step: step[1])

    def _lookup(self, router: Router, node: SimNode, ids, hashes, info):
        """The DHT lookups of the prompt's key, then a pull of the holders' digests; the new
        decision and the holders admitted, or None when nobody holds the key."""
        key = prefix_key(hashes, self.cfg.scope.key_blocks)
        region = self.net.region[node.index]
        start = self.env.now
        holders: list[int] = []
        rtt = node.mean_rtt_s
        for level, spent, step_rtt in self._lookup_steps(node, info["uncached"]):
            rtt = step_rtt
            where = self.region_directory.get((region, key), []) if level == "region" else None
            found = self.directory.get(key, []) if where is None else where
            holders = [h for h in found if h != node.index and self.nodes[h].up]
            self.lookups += 1
            yield self.env.timeout(max(0.0, start + spent - self.env.now))
            if holders:
                break
        if not holders:
            info["lookup"] = "no_holder"
            return None
        info["lookup"] = "found"
        views = router.views
        assert isinstance(views, ScopedViews)
        yield self.env.timeout(rtt)  # the holders' digests, pulled
        for h in holders:
            views.admit_temporarily(str(h), 2 * self.cfg.gossip_interval_s)
            # A pull answers with the holder's digest as of now (the shared view would lag
            # by up to a gossip interval); everyone's copy of that view gets it, as the
            # holder's next publish would bring it anyway.
            full = self.nodes[h].builder.full()
            self.pull_bytes += len(seal_digest(self.keys[h % len(self.keys)], full, now=0.0))
            self.store.apply(type(full)(**{**fields(full), "timestamp": self.env.now}))
        return self._decide(router, node, ids, hashes), {str(h) for h in holders}


def redirect(
    decision: RoutingDecision, holders: set[str], left_s: float, current: int
) -> tuple[int, int] | None:
    """The holder to move a request to, with the cached tokens expected there: the one the
    router expects to finish soonest, if that beats what is left of the first path by the
    router's margin; else None."""
    best = min(
        (
            c
            for c in decision.candidates
            if c.peer_id in holders and c.skipped is None and int(c.peer_id) != current
        ),
        key=lambda c: c.total_s,
        default=None,
    )
    if best is None or best.total_s + decision.margin_s >= left_s:
        return None
    return int(best.peer_id), best.cached_tokens
