"""Scoped views' prefix lookups: the simulated DHTs and the lookup beside a request.

``Lookups`` is mixed into ``Simulation`` (``_run.py``) and reads its state (``cfg``, ``env``,
``net``, ``nodes``, ``store``, ``keys``, ``hashes``, ``_decide``); it keeps the directories and counters below.
``on_block_event`` is each cache's listener: a stored chain that reaches a prompt's key block
puts its node first among the key's holders, in the world's DHT and its region's (a cluster, as
in Coral's DSHT), at most 8 each. ``_lookup_wanted`` says whether a request's lookup could pay
(``ScopePolicy.lookup_worth`` at ``ceil(log2 n) / 2`` hops); ``_lookup`` is the lookup as a
simpy process: the DHT answers, a pull of the holders' digests, and a new decision with them
admitted; ``redirect`` says whether that decision should move the running request.
``hot_loop`` merges every node's hot-prefix table once per gossip interval and hands the summary
down after the aggregation tree's trip; ``_hot_pull`` pulls the holders it names for a prompt
before the request starts, when that pays (``ScopePolicy.lookup_worth``).
"""

from __future__ import annotations

import math
from typing import Any

from p2pnode.overlay.cache.digest import seal_digest
from p2pnode.overlay.cache.scope import ScopedViews, prefix_key
from p2pnode.overlay.routing.router import Router, RoutingDecision
from p2pnode.testnet.sim._node import SimNode, fields
from p2pnode.testnet.sim.hotprefix import HotPrefixes


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
        # The hot-prefix summary as the aggregation tree hands it down (one copy: every node
        # receives the same merged summary), and the bytes each node received for it.
        self.hot_world = HotPrefixes(self.cfg.hot)
        self.hot_bytes = 0.0
        self.hot_pulls = 0

    def hot_loop(self):
        """Once per gossip interval, every node's table merged up the aggregation tree
        (``testnet/sim/hotprefix.py``); the result reaches every node after the trip up and down
        the tree (``ceil(log2 n)`` levels at the mean one-way delay each way)."""
        cfg = self.cfg
        if cfg.views != "scoped" or cfg.hot is None:
            return
        levels = math.ceil(math.log2(max(2, cfg.nodes)))
        one_way = sum(n.mean_rtt_s for n in self.nodes) / len(self.nodes) / 2
        while True:
            yield self.env.timeout(cfg.gossip_interval_s)
            merged = HotPrefixes(cfg.hot)
            for node in self.nodes:
                if node.up and len(node.hot):
                    merged.merge(node.hot)
                node.hot.decay()
            # received per node per round: the children's summaries and the parent's
            # (the simulation's peer ids are short: a real one is counted instead)
            pad = sum(
                len(self.keys[0].peer_id) - len(h.peer_id)
                for _, _, holders in merged.entries()
                for h in holders
            )
            self.hot_bytes += (cfg.hot.fanout + 1) * (len(merged.encode()) + pad)
            self.env.process(self._hand_down(merged, 2 * levels * one_way))

    def _hand_down(self, merged: HotPrefixes, after_s: float):
        yield self.env.timeout(after_s)
        self.hot_world = merged

    def note_served(self, server: SimNode, hashes) -> None:
        """``server`` served a prompt: count it under the prompt's key, as its holder."""
        key = prefix_key(hashes, self.cfg.scope.key_blocks)
        if key is not None and self.cfg.hot is not None:
            server.hot.note_served(key, server.pid, self.net.region[server.index], self.env.now)

    def _hot_pull(self, router: Router, node: SimNode, ids, hashes, info):
        """Holders the summary names for the prompt's key, nearest first, pulled before the
        request starts when the prefill they could save beats the pull and the forward
        (``ScopePolicy.lookup_worth`` with the pull's round trip as the lookup); the new
        decision, or None when the summary names nobody worth pulling."""
        cfg = self.cfg
        key = prefix_key(hashes, cfg.scope.key_blocks)
        region = self.net.region[node.index]
        found = [
            int(h.peer_id)
            for h in self.hot_world.holders(key, region)
            if int(h.peer_id) != node.index and self.nodes[int(h.peer_id)].up
        ]
        near = sorted(found, key=lambda h: (self.net.base_rtt(node.index, h), h))[: cfg.hot_pull]
        if not near:
            return None
        pull_s = max(self.net.base_rtt(node.index, h) for h in near)
        nearest = self.net.base_rtt(node.index, near[0])
        if not cfg.scope.lookup_worth(info["uncached"], pull_s, nearest):
            return None
        self.hot_pulls += 1
        yield self.env.timeout(pull_s)
        self._pull(router, near)
        info["lookup"] = "summary"
        return self._decide(router, node, ids, hashes)

    def _pull(self, router: Router, holders: list[int]) -> None:
        """The holders' digests as of now, admitted to the router's views for a while."""
        views = router.views
        assert isinstance(views, ScopedViews)
        for h in holders:
            views.admit_temporarily(str(h), 2 * self.cfg.gossip_interval_s)
            # A pull answers with the holder's digest as of now (the shared view would lag
            # by up to a gossip interval); everyone's copy of that view gets it, as the
            # holder's next publish would bring it anyway.
            full = self.nodes[h].builder.full()
            self.pull_bytes += len(seal_digest(self.keys[h % len(self.keys)], full, now=0.0))
            self.store.apply(type(full)(**{**fields(full), "timestamp": self.env.now}))

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

    def _uncached_without_holder(self, node: SimNode, ids, hashes, decision, info) -> bool:
        """Nobody in view (nor this node) holds more of the prompt than its key: put the
        tokens a far holder could save in ``info["uncached"]``."""
        kb = self.cfg.scope.key_blocks
        best = max((c.view_cached_tokens for c in decision.candidates), default=0)
        here = node.tree.prefix_len(ids)
        if prefix_key(hashes, kb) is None or best > kb * 16 or here > kb * 16:
            return False
        info["uncached"] = len(ids) - max(best, here)
        return True

    def _lookup_wanted(self, node: SimNode, ids, hashes, decision, info) -> bool:
        """A prefix lookup when nobody in view holds the key and the saving could still pay
        for the lookup and a forward to a holder (``ScopePolicy.lookup_worth``)."""
        if not self._uncached_without_holder(node, ids, hashes, decision, info):
            return False
        steps = self._lookup_steps(node, info["uncached"])
        if not steps:
            info["lookup"] = "not_worth"
            return False
        info["lookup"] = "pending"
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
        yield self.env.timeout(rtt)  # the holders' digests, pulled
        self._pull(router, holders)
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
