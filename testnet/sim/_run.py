"""One simulated run: the real routers on simpy's clock, and ``simulate`` (a run with its
hit-rate ceiling).

``Simulation(cfg, prompts, net=, plan=)`` builds the world (``_world.Network`` unless ``net``
is given), the nodes (``_node.SimNode``), one real ``Router`` per node over the shared views
(scoped ones with ``views="scoped"``), and the prompts' block hashes. ``run()`` starts every
node's gossip, the arrivals (``plan``'s ``(at_s, prompt index, entry node)``, else
``_workload.poisson_arrivals``) and churn, runs the clock to ``duration_s + 30`` s so late
requests finish, and returns ``_metrics.result_of``. Each request: the entry's router decides
(timed on the wall clock), a scoped lookup may start beside it (``_lookup.Lookups``), the
request is sent (the entry's network-cost model prices the forward) and served one at a time
on its server, then recorded in ``records``. A run is seeded by ``cfg.seed`` and reads no
clock but simpy's, so the same seed gives the same figures (decision time aside).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import simpy

from p2pnode.identity import NodeKey
from p2pnode.inference.blockhash import block_hashes, model_salt
from p2pnode.overlay.cache.scope import ScopedViews
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.routing.router import (
    LOCAL,
    Router,
    RouterConfig,
    RoutingDecision,
    request_bytes,
)
from p2pnode.testnet.sim._config import MODEL_ID, SimConfig, SimResult
from p2pnode.testnet.sim._lookup import Lookups, redirect
from p2pnode.testnet.sim._metrics import result_of
from p2pnode.testnet.sim._node import SimNode
from p2pnode.testnet.sim._workload import arrival_order, poisson_arrivals
from p2pnode.testnet.sim._world import Network


class Simulation(Lookups):
    """One run. ``net`` replaces the generated positions (``testnet/sim/simspec.py`` gives a trial
    spec's regions and delays); ``plan``, a list of ``(at_s, prompt index, entry node)``,
    replaces the generated arrivals."""

    def __init__(
        self,
        cfg: SimConfig,
        prompts: list[list[int]],
        *,
        net: Network | None = None,
        plan: Sequence[tuple[float, int, int]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.env = simpy.Environment()
        self.net = net if net is not None else Network(cfg, self.rng)
        self.plan = plan
        self.store = PeerViews(
            expire_after_s=max(30.0, 6 * cfg.gossip_interval_s),
            clock=lambda: self.env.now,
            wall_clock=lambda: self.env.now,
        )
        self.nodes = [SimNode(self, i) for i in range(cfg.nodes)]
        self.keys = [NodeKey.generate() for _ in range(min(cfg.nodes, 64))]
        self.peer_of_key = {k.peer_id: k for k in self.keys}
        self.scope_str: list[set[str]] = []
        self.cell = self.net.cells(cfg.scope)
        self.cell_members: dict[str, list[int]] = {}
        for i, c in enumerate(self.cell):
            self.cell_members.setdefault(c, []).append(i)
        self._init_lookups()
        self.routers = [self._router(i) for i in range(cfg.nodes)]
        self.prompts = prompts
        self.salt = model_salt(MODEL_ID)
        self.hashes = [block_hashes(p, self.salt) for p in prompts]
        self.records: list[dict[str, Any]] = []
        self.digest_bytes = [0] * cfg.nodes  # sealed bytes published, per publisher
        self.decide_s: list[float] = []
        self.reasons: dict[str, int] = {}  # decisions by the router's reason (diagnostics)
        self.down_since: dict[int, float] = {}

    def _router(self, i: int) -> Router:
        cfg = self.cfg
        config = RouterConfig(max_remote_attempts=2 if cfg.routing else 0, placement=cfg.placement)
        pool = None
        if cfg.views == "scoped":
            cell = self.cell_members[self.cell[i]] if cfg.scope.cell_nodes else []
            scope = {str(j) for j in self.net.nearest(i, cfg.scope, cell)}
            if cfg.scope.cell_nodes:
                members = {str(j) for j in cell}
                pool = members.__contains__
            self.scope_str.append(scope)
            views: PeerViews = ScopedViews(
                lambda s=scope: s, clock=lambda: self.env.now, wall_clock=lambda: self.env.now
            )
            views._views = self.store._views  # one copy of each view: see the package doc
            views.expire_after_s = self.store.expire_after_s
        else:
            views = self.store
        return Router(
            views,
            rtt_s=lambda p, a=i: self.net.base_rtt(a, int(p)),
            is_up=lambda p: self._seen_up(int(p)),
            config=config,
            # Its own name in the rendezvous ranking of placement on misses, as a node has.
            self_id=str(i),
            placement_pool=pool,
        )

    def _seen_up(self, j: int) -> bool:
        since = self.down_since.get(j)
        return since is None or self.env.now - since < self.cfg.detect_s

    # -- requests -------------------------------------------------------------------------

    def request(self, i: int, entry: int, seq: int = 0):
        cfg = self.cfg
        t0 = self.env.now
        ids, hashes = self.prompts[i], self.hashes[i]
        node = self.nodes[entry]
        target, estimate, total = entry, 0, 0.0
        anywhere = self._held_anywhere(ids, hashes)
        visible = node.tree.prefix_len(ids)
        info = {"lookup": "none"}
        lookup = None
        if cfg.routing:
            router = self.routers[entry]
            decision = self._decide(router, node, ids, hashes)
            visible = max(visible, *(c.view_cached_tokens for c in decision.candidates))
            hot = cfg.views == "scoped" and cfg.hot is not None
            if hot and self._uncached_without_holder(node, ids, hashes, decision, info):
                pulled = yield from self._hot_pull(router, node, ids, hashes, info)
                decision = pulled or decision
            if cfg.views == "scoped" and self._lookup_wanted(node, ids, hashes, decision, info):
                lookup = self.env.process(self._lookup(router, node, ids, hashes, info))
                if cfg.lookup == "before":
                    found = yield lookup
                    decision = found[0] if found else decision
                    lookup = None
            target, estimate, total = _target(decision, entry)
        attempt = self.env.process(self._attempt(entry, target, ids, estimate))
        if lookup is not None:
            # The lookup overlaps the request's first path; when it returns first with a
            # holder the router expects to finish sooner than what is left of that path, the
            # request moves there (the work done on the first path is lost).
            yield lookup | attempt
            if attempt.is_alive and lookup.triggered and lookup.value:
                left = total - (self.env.now - t0)
                moved = redirect(*lookup.value, left, target)
                if moved is not None:
                    attempt.interrupt("redirect")
                    yield attempt
                    target, estimate = moved
                    info["lookup"] = "redirected"
                    self.redirects += 1
                    attempt = self.env.process(self._attempt(entry, target, ids, estimate))
        cached = yield attempt
        self.note_served(self.nodes[target], hashes)
        self.records.append(
            {
                "i": i,
                "seq": seq,  # arrival order
                "latency": self.env.now - t0,
                "prompt": len(ids),
                "cached": cached,
                "server": target,
                "forwarded": target != entry,
                # diagnostics: the longest prefix some up node held when the request arrived,
                # the longest the entry's first decision could see, and the lookup's outcome
                "anywhere": min(anywhere, len(ids) - 1),
                "visible": min(visible, len(ids) - 1),
                "lookup": info["lookup"],
            }
        )

    def _attempt(self, entry: int, target: int, ids: Sequence[int], estimate: int):
        """Send the request to ``target`` (``entry``: serve here) and serve it; its cached
        tokens, or None when interrupted (a redirect)."""
        cfg = self.cfg
        server = self.nodes[target]
        router = self.routers[entry]
        guess = cfg.overhead_s + len(ids) * cfg.prefill_s_per_token
        remote = target != entry
        if remote:
            router.note_sent(server.pid, guess)
        try:
            if remote:
                rtt = self.net.rtt(entry, target)
                yield self.env.timeout(
                    router.netcost.estimate(server.pid, rtt, request_bytes(len(ids)))
                )
            cached, _ = yield from self._serve(server, ids)
        except simpy.Interrupt:
            if remote:
                router.note_done(server.pid, guess)
            return None
        if remote:
            router.note_done(server.pid, guess)
            router.observe_served(server.pid, estimate, cached)
        return cached

    def _decide(self, router: Router, node: SimNode, ids, hashes):
        t = time.perf_counter()
        d = router.decide(
            model_id=MODEL_ID,
            prompt_block_hashes=hashes,
            prompt_tokens=len(ids),
            max_tokens=self.cfg.max_tokens,
            local=node.local_state(ids),
            record=False,
        )
        self.decide_s.append(time.perf_counter() - t)
        self.reasons[d.reason] = self.reasons.get(d.reason, 0) + 1
        return d

    def _serve(self, server: SimNode, ids: Sequence[int]):
        cfg = self.cfg
        guess = cfg.overhead_s + (len(ids) - server.tree.prefix_len(ids)) * cfg.prefill_s_per_token
        server.queued += 1
        server.backlog_s += guess
        try:  # an interrupt (a redirect) leaves the queue and inserts nothing
            with server.server.request() as slot:
                yield slot
                m = server.tree.match(ids)
                cached = max(0, min(m.length, len(ids) - 1))
                # The first token is sampled from the prefill's logits (inference/engine.py):
                # only the later ones take a decode step.
                service = (
                    cfg.overhead_s
                    + (len(ids) - cached) * cfg.prefill_s_per_token
                    + max(0, cfg.max_tokens - 1) * cfg.decode_s_per_token
                )
                yield self.env.timeout(service)
                server.tree.insert(ids, None)
        finally:
            server.queued -= 1
            server.backlog_s = max(0.0, server.backlog_s - guess)
        server.served += 1
        return cached, service

    def arrivals(self):
        if self.plan is not None:
            for at, q, entry in self.plan:
                yield self.env.timeout(max(0.0, at - self.env.now))
                self.order.append(q)
                self.env.process(self.request(q, entry, len(self.order) - 1))
            return
        for gap, q, entry in poisson_arrivals(self.cfg):
            yield self.env.timeout(gap)
            if self.env.now >= self.cfg.duration_s:
                return
            self.order.append(q)
            self.env.process(self.request(q, entry, len(self.order) - 1))

    def churn(self):
        if self.cfg.churn_per_min <= 0:
            return
        rng = random.Random(self.cfg.seed + 2)
        while True:
            yield self.env.timeout(rng.expovariate(self.cfg.churn_per_min * self.cfg.nodes / 60))
            j = rng.randrange(self.cfg.nodes)
            self.down_since[j] = self.env.now
            self.nodes[j].restart()
            self.nodes[j].up = True

    def mean_rtts(self, samples: int = 32) -> None:
        members: dict[str, list[int]] = {}
        for i, r in enumerate(self.net.region):
            members.setdefault(r, []).append(i)
        for node in self.nodes:
            peers = [self.rng.randrange(self.cfg.nodes) for _ in range(samples)]
            node.mean_rtt_s = statistics.fmean(self.net.base_rtt(node.index, p) for p in peers)
            near = members[self.net.region[node.index]]
            near = [self.rng.choice(near) for _ in range(samples)]
            node.region_rtt_s = statistics.fmean(self.net.base_rtt(node.index, p) for p in near)

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        self._index_keys()
        self.order: list[int] = []
        self.mean_rtts()
        for node in self.nodes:
            self.env.process(node.gossip_loop())
        self.env.process(self.arrivals())
        self.env.process(self.churn())
        self.env.process(self.hot_loop())
        self.env.run(until=self.cfg.duration_s + 30.0)
        return result_of(self, time.perf_counter() - t0)


def _target(decision: RoutingDecision, entry: int) -> tuple[int, int, float]:
    """Where a decision sends the request, the cached tokens it expects there, its total."""
    chosen = decision.estimate_for(decision.chosen)
    total = chosen.total_s if chosen else (decision.local_total_s or 0.0)
    if decision.chosen == LOCAL:
        return entry, 0, total
    return int(decision.chosen), chosen.cached_tokens if chosen else 0, total


def simulate(cfg: SimConfig, prompts: list[list[int]]) -> SimResult:
    """One run. The hit-rate ceiling needs the request order, so the arrival sequence is
    drawn first (seeded, the same for every views mode and for the baseline)."""
    from p2pnode.testnet.workload.driver import oracle_cached

    sim = Simulation(cfg, prompts)
    result = sim.run()
    if sim.order != arrival_order(cfg):
        raise AssertionError("the arrival sequence differs from the one the ceiling assumes")
    oracle = oracle_cached([prompts[q] for q in sim.order])
    total_prompt = sum(len(prompts[q]) for q in sim.order) or 1
    result.hit_rate_ceiling = round(sum(oracle) / total_prompt, 4)
    return result
