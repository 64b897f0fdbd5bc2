"""``p2pnode simulate``: the real routing code on a simulated clock and network (simpy).

What is real (imported and driven, not re-implemented): each node's exact radix prefix cache
(``inference/radix.py``, token structure, LRU eviction, block events), its ``DigestBuilder``
(``overlay/digest.py``) turning those events into versioned digests, digests sealed with a real
node key and opened with ``open_digest`` (signature check, size limits: the bytes counted are
real), ``PeerViews.apply`` (``overlay/views.py``: full/delta/gap semantics; a GAP is repaired
by a pull of a full digest, as anti-entropy does), ``PushBack`` and ``Router.decide``
(``overlay/router.py``) with the router's in-flight and confidence feedback, ``ScopePolicy`` /
``ScopedViews`` / ``prefix_key`` (``overlay/scope.py``). The workload is MMLU 5-shot prompts
(``inference/mmlu.py``), tokenized by the model's tokenizer, Zipf popularity, Poisson arrivals
at uniformly random nodes.

What is simulated (stated so figures are read right):
- Network: nodes placed around 4 region centres; one-way delay = great-circle distance at fiber
  speed (200,000 km/s) + an access delay per end + exponential jitter per message. A forward
  costs what the entry router's network-cost model says (``overlay/netcost.py``: its prior
  of 3 RTTs plus the request's bytes at 10 Mbit/s, as nothing is measured in the simulation).
- Compute: one request at a time per node (no batching), taking the cost model's time (the
  first token comes with the prefill, as in the engine; later ones take a decode step each);
  the advertised load is the exact backlog. Digests travel as gossip reaching every subscriber
  after the mean one-way delay (no per-receiver ordering; a receiver's own view of a peer
  is the shared one, so the simulation holds one copy of each view).
- Scoped views: a node applies only digests of its scope; digest traffic into a node is the
  sealed bytes of the publishers it keeps in view (as with per-scope topics or direct pushes),
  plus its share of the digests pulled after lookups. A prompt of at least ``key_blocks``
  blocks that no in-scope view holds beyond its first key block triggers prefix lookups when
  ``ScopePolicy.lookup_worth`` (simulated DHTs: ``ceil(log2 n) / 2`` hops, in the region's DHT
  at the node's mean RTT within its region, in the world's at its mean RTT to anyone; both
  start at once). The lookup runs beside the request, which has started on its first path; the
  holders found are pulled (their digest as of now) and admitted for the decision, and the
  request moves to the best of them if the router expects it to finish before what is left of
  the first path (``redirects``; the work done there is lost).
- Churn: ``churn_per_min`` of the nodes leave per minute (cache lost) and come back at once
  with an empty cache; others see them down after ``detect_s``.

Figures per run (``SimResult``): digest bytes received per node per second, view memory per
node (fingerprints and view objects, bytes), routing decision time (wall clock of
``Router.decide``), token hit rate and its ceiling (one unbounded cache that saw every earlier
prompt), busiest node's share of requests, mean latency, and the same workload's mean latency
without routing (every request served where it arrives).
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import simpy

from p2pnode.identity import NodeKey
from p2pnode.inference.blockhash import block_hashes, model_salt
from p2pnode.inference.radix import RadixCache
from p2pnode.overlay.digest import DigestBuilder, LoadInfo, open_digest, seal_digest
from p2pnode.overlay.router import (
    LOCAL,
    LocalState,
    PushBack,
    Router,
    RouterConfig,
    RoutingDecision,
    request_bytes,
)
from p2pnode.overlay.scope import ScopedViews, ScopePolicy, cell_of, prefix_key
from p2pnode.overlay.views import ApplyResult, PeerViews

FIBER_KM_PER_S = 200_000.0
EARTH_KM = 6371.0
REGIONS = {"eu": (50.0, 10.0), "us": (39.0, -95.0), "ap": (30.0, 125.0), "sa": (-15.0, -50.0)}
REGION_SHARE = {"eu": 0.35, "us": 0.3, "ap": 0.2, "sa": 0.15}
MODEL_ID = "sim-model@0000000000000000"


@dataclass
class SimConfig:
    nodes: int = 100
    views: str = "full"  # "full" | "scoped"
    routing: bool = True
    duration_s: float = 60.0
    rate_per_s: float | None = None  # default: 4 + nodes / 100, at most 20
    subjects: int = 57
    per_subject: int = 20
    zipf_s: float = 1.1
    max_tokens: int = 1
    gossip_interval_s: float = 5.0
    cache_budget_tokens: int = 4096
    prefill_s_per_token: float = 1 / 430
    decode_s_per_token: float = 1 / 16
    overhead_s: float = 0.01
    pushback_high: int = 8
    access_ms: float = 5.0
    jitter_ms: float = 1.0
    spread_deg: float = 6.0
    churn_per_min: float = 0.0
    detect_s: float = 3.5
    scope: ScopePolicy = field(default_factory=ScopePolicy)
    placement: bool = True  # the router's placement on misses (RouterConfig.placement)
    lookup: str = "overlap"  # "overlap": beside the first path; "before": on the critical path
    lookup_levels: str = "region"  # "region": the region's DHT, then the world's; "world"
    seed: int = 1

    @property
    def rate(self) -> float:
        # capped: a decision with full views reads every view, so 10,000 nodes at a rate that
        # grows with N would take hours to simulate; the figures are per node and per request
        return self.rate_per_s if self.rate_per_s is not None else min(20.0, 4.0 + self.nodes / 100)


@dataclass
class SimResult:
    nodes: int
    views: str
    routing: bool
    requests: int
    digest_bytes_per_node_s: float
    view_bytes_per_node: float
    views_per_node: float
    decide_ms_mean: float
    hit_rate: float
    hit_rate_ceiling: float
    busiest_share: float
    mean_latency_s: float
    forwarded: float
    lookups: int
    wall_s: float
    redirects: int = 0  # requests a lookup moved to a far holder while they ran


def _great_circle_km(a: tuple[float, float], b: tuple[float, float]) -> float:
    la1, lo1, la2, lo2 = map(math.radians, (*a, *b))
    h = (
        math.sin((la2 - la1) / 2) ** 2
        + math.cos(la1) * math.cos(la2) * math.sin((lo2 - lo1) / 2) ** 2
    )
    return 2 * EARTH_KM * math.asin(min(1.0, math.sqrt(h)))


class Network:
    """Positions and delays (see the module doc)."""

    def __init__(self, cfg: SimConfig, rng: random.Random) -> None:
        self.cfg = cfg
        self.rng = rng
        names = list(REGIONS)
        weights = [REGION_SHARE[r] for r in names]
        self.region = [rng.choices(names, weights)[0] for _ in range(cfg.nodes)]
        self.pos = [
            (
                max(-89.0, min(89.0, REGIONS[r][0] + rng.gauss(0, cfg.spread_deg))),
                REGIONS[r][1] + rng.gauss(0, cfg.spread_deg),
            )
            for r in self.region
        ]
        self.access_s = [cfg.access_ms / 1e3 * (0.5 + rng.random()) for _ in range(cfg.nodes)]

    def base_rtt(self, a: int, b: int) -> float:
        if a == b:
            return 0.0
        one_way = _great_circle_km(self.pos[a], self.pos[b]) / FIBER_KM_PER_S
        return 2 * (one_way + self.access_s[a] + self.access_s[b])

    def rtt(self, a: int, b: int) -> float:
        return self.base_rtt(a, b) + self.rng.expovariate(1e3 / self.cfg.jitter_ms)

    def nearest(self, a: int, policy: ScopePolicy, cell: Iterable[int] = ()) -> set[int]:
        """The node's scope, by measured (jitter-free) RTT; numpy for the N distances."""
        import numpy as np

        lat = np.radians(np.array([p[0] for p in self.pos]))
        lon = np.radians(np.array([p[1] for p in self.pos]))
        h = (
            np.sin((lat - lat[a]) / 2) ** 2
            + np.cos(lat[a]) * np.cos(lat) * np.sin((lon - lon[a]) / 2) ** 2
        )
        km = 2 * EARTH_KM * np.arcsin(np.minimum(1.0, np.sqrt(h)))
        rtt = 2 * (km / FIBER_KM_PER_S + self.access_s[a] + np.array(self.access_s))
        rtt[a] = np.inf
        k = min(len(rtt) - 1, max(policy.max_views, policy.k_nearest))
        idx = np.argpartition(rtt, k)[:k] if k < len(rtt) - 1 else np.arange(len(rtt))
        pairs = [(str(int(i)), float(rtt[i])) for i in idx if int(i) != a]
        return {int(p) for p in policy.select(pairs, cell=(str(j) for j in cell if j != a))}

    def cells(self, policy: ScopePolicy) -> list[str]:
        """Each node's cell (``overlay/scope.py``); region sizes are known exactly here."""
        size: dict[str, int] = {}
        for r in self.region:
            size[r] = size.get(r, 0) + 1
        return [cell_of(str(i), r, policy.cells(size[r])) for i, r in enumerate(self.region)]


class SimNode:
    def __init__(self, sim: Simulation, index: int) -> None:
        self.sim = sim
        self.index = index
        self.pid = str(index)
        self.server = simpy.Resource(sim.env, capacity=1)
        self.backlog_s = 0.0
        self.queued = 0
        self.pushback = PushBack(sim.cfg.pushback_high)
        self.up = True
        self.served = 0
        self.mean_rtt_s = 0.1
        self.region_rtt_s = 0.1
        self._new_cache()

    def _new_cache(self) -> None:
        cfg = self.sim.cfg
        self.tree = RadixCache(MODEL_ID, max_tokens=cfg.cache_budget_tokens)
        self.builder = DigestBuilder(self.pid, MODEL_ID, load_fn=self.load)
        self.tree.add_listener(self.builder.on_event)
        self.tree.add_listener(self.sim.on_block_event(self))
        self.last_published: int | None = None

    def load(self) -> LoadInfo:
        cfg = self.sim.cfg
        return LoadInfo(
            queue_depth=self.queued,
            est_wait_s=self.backlog_s,
            push_back=self.pushback.update(self.queued),
            prefill_s_per_token=cfg.prefill_s_per_token,
            decode_s_per_token=cfg.decode_s_per_token,
        )

    def local_state(self, ids: Sequence[int]) -> LocalState:
        cfg = self.sim.cfg
        return LocalState(
            cached_tokens=self.tree.prefix_len(ids),
            wait_s=self.backlog_s,
            prefill_s_per_token=cfg.prefill_s_per_token,
            decode_s_per_token=cfg.decode_s_per_token,
            overhead_s=cfg.overhead_s,
        )

    def restart(self) -> None:
        """Churn: the node left and came back with an empty cache and a new epoch."""
        self._new_cache()


class Simulation:
    """One run. ``net`` replaces the generated positions (``testnet/simspec.py`` gives a trial
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
        self.pull_bytes = 0  # full digests pulled from holders a lookup found
        self.routers = [self._router(i) for i in range(cfg.nodes)]
        self.prompts = prompts
        self.salt = model_salt(MODEL_ID)
        self.hashes = [block_hashes(p, self.salt) for p in prompts]
        self.records: list[dict[str, Any]] = []
        self.digest_bytes = [0] * cfg.nodes  # sealed bytes published, per publisher
        self.decide_s: list[float] = []
        self.lookups = 0
        self.redirects = 0
        self.reasons: dict[str, int] = {}  # decisions by the router's reason (diagnostics)
        self.directory: dict[bytes, list[int]] = {}
        # The region's own DHT (a cluster, as in Coral's DSHT): its records name the region's
        # holders, and a lookup there costs hops at the region's RTT, not the world's.
        self.region_directory: dict[tuple[str, bytes], list[int]] = {}
        self.region_size: dict[str, int] = {}
        for r in self.net.region:
            self.region_size[r] = self.region_size.get(r, 0) + 1
        # Diagnostics, not read by any router: every node that ever stored a key's prefix.
        self.ever_held: dict[bytes, set[int]] = {}
        self.down_since: dict[int, float] = {}

    # -- set-up ---------------------------------------------------------------------------

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
            views._views = self.store._views  # one copy of each view: see the module doc
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

    def on_block_event(self, node: SimNode):

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

    # -- gossip ---------------------------------------------------------------------------

    def publish(self, node: SimNode) -> None:
        b = node.builder
        digest = b.full() if node.last_published is None else b.delta_since(node.last_published)
        node.last_published = b.version
        key = self.keys[node.index % len(self.keys)]
        data = seal_digest(key, digest, now=self.env.now)
        self.digest_bytes[node.index] += len(data)
        opened = open_digest(data, now=self.env.now, max_age=1e12)
        # the opened digest names the signing key; the view belongs to the simulated node
        opened = type(opened)(**{**_fields(opened), "peer_id": node.pid})
        self.env.process(self._deliver(node, opened))

    def _deliver(self, node: SimNode, digest: Any):
        yield self.env.timeout(node.mean_rtt_s / 2)
        if self.store.apply(digest) is ApplyResult.GAP:  # repaired by a pull of a full digest
            full = node.builder.full()
            self.store.apply(type(full)(**{**_fields(full), "timestamp": self.env.now}))

    def gossip_loop(self, node: SimNode):
        yield self.env.timeout(self.rng.random() * self.cfg.gossip_interval_s)
        while True:
            if node.up:
                self.publish(node)
            yield self.env.timeout(self.cfg.gossip_interval_s)

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
                moved = _redirect(*lookup.value, left, target)
                if moved is not None:
                    attempt.interrupt("redirect")
                    yield attempt
                    target, estimate = moved
                    info["lookup"] = "redirected"
                    self.redirects += 1
                    attempt = self.env.process(self._attempt(entry, target, ids, estimate))
        cached = yield attempt
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

    def _held_anywhere(self, ids, hashes) -> int:
        key = prefix_key(hashes, self.cfg.scope.key_blocks)
        holders = self.ever_held.get(key, ()) if key is not None else ()
        return max((self.nodes[h].tree.prefix_len(ids) for h in holders), default=0)

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
            self.store.apply(type(full)(**{**_fields(full), "timestamp": self.env.now}))
        return self._decide(router, node, ids, hashes), {str(h) for h in holders}

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
        rng = random.Random(self.cfg.seed + 1)
        weights = [1 / (k + 1) ** self.cfg.zipf_s for k in range(self.cfg.subjects)]
        per = self.cfg.per_subject
        i = 0
        while True:
            yield self.env.timeout(rng.expovariate(self.cfg.rate))
            if self.env.now >= self.cfg.duration_s:
                return
            subject = rng.choices(range(self.cfg.subjects), weights)[0]
            q = subject * per + rng.randrange(per)
            entry = rng.randrange(self.cfg.nodes)
            self.order.append(q)
            self.env.process(self.request(q, entry, len(self.order) - 1))
            i += 1

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
        self._key_of_block: dict[int, bytes] = {}
        kb = self.cfg.scope.key_blocks
        for hashes in self.hashes:
            key = prefix_key(hashes, kb)
            if key is not None:
                self._key_of_block[hashes[kb - 1]] = key
        self.order: list[int] = []
        self.mean_rtts()
        for node in self.nodes:
            self.env.process(self.gossip_loop(node))
        self.env.process(self.arrivals())
        self.env.process(self.churn())
        self.env.run(until=self.cfg.duration_s + 30.0)
        return self._result(time.perf_counter() - t0)

    def _result(self, wall: float) -> SimResult:
        cfg = self.cfg
        recs = self.records
        n = cfg.nodes
        published_per_s = [b / (cfg.duration_s + 30.0) for b in self.digest_bytes]
        if cfg.views == "scoped":
            pulled = self.pull_bytes / (cfg.duration_s + 30.0) / n
            received = [
                sum(published_per_s[int(p)] for p in scope) + pulled for scope in self.scope_str
            ]
            in_view = [len(scope) for scope in self.scope_str]
        else:
            total = sum(published_per_s)
            received = [total - published_per_s[i] for i in range(n)]
            in_view = [n - 1] * n
        per_view = _view_bytes(self.store)
        served = [0] * n
        for r in recs:
            served[r["server"]] += 1
        prompt = sum(r["prompt"] for r in recs) or 1
        return SimResult(
            nodes=n,
            views=cfg.views,
            routing=cfg.routing,
            requests=len(recs),
            digest_bytes_per_node_s=round(statistics.fmean(received), 1),
            view_bytes_per_node=round(per_view * statistics.fmean(in_view), 0),
            views_per_node=round(statistics.fmean(in_view), 1),
            decide_ms_mean=round(1e3 * statistics.fmean(self.decide_s), 3)
            if self.decide_s
            else 0.0,
            hit_rate=round(sum(r["cached"] for r in recs) / prompt, 4),
            hit_rate_ceiling=0.0,  # set by simulate(), which knows the arrival order
            busiest_share=round(max(served) / max(1, len(recs)), 4),
            mean_latency_s=round(statistics.fmean(r["latency"] for r in recs), 4) if recs else 0.0,
            forwarded=round(sum(r["forwarded"] for r in recs) / max(1, len(recs)), 4),
            lookups=self.lookups,
            redirects=self.redirects,
            wall_s=round(wall, 1),
        )


def _target(decision: RoutingDecision, entry: int) -> tuple[int, int, float]:
    """Where a decision sends the request, the cached tokens it expects there, its total."""
    chosen = decision.estimate_for(decision.chosen)
    total = chosen.total_s if chosen else (decision.local_total_s or 0.0)
    if decision.chosen == LOCAL:
        return entry, 0, total
    return int(decision.chosen), chosen.cached_tokens if chosen else 0, total


def _redirect(
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


def _fields(d: Any) -> dict[str, Any]:
    return {name: getattr(d, name) for name in d.__slots__}


def _view_bytes(store: PeerViews) -> float:
    """Mean memory of one view: the view object, its load record and its fingerprint set."""
    views = store.views()
    if not views:
        return 0.0
    sizes = [
        sys.getsizeof(v)
        + sys.getsizeof(v.load)
        + sys.getsizeof(v.fingerprints)
        + sum(sys.getsizeof(f) for f in v.fingerprints)
        for v in views
    ]
    return statistics.fmean(sizes)


# ---------------------------------------------------------------------------- workload


def mmlu_prompts(subjects: int, per_subject: int) -> list[list[int]]:
    """Token ids of the MMLU prompts, subject by subject (``per_subject`` each)."""
    from p2pnode.inference import mmlu
    from p2pnode.inference.models import load_light_model

    tok = load_light_model().tokenizer
    out = []
    for s in mmlu.subjects()[:subjects]:
        for q in mmlu.questions([s], per_subject):
            out.append(tok.encode(q.prompt, add_special_tokens=False))
    return out


def simulate(cfg: SimConfig, prompts: list[list[int]]) -> SimResult:
    """One run. The hit-rate ceiling needs the request order, so the arrival sequence is
    drawn first (seeded, the same for every views mode and for the baseline)."""
    from p2pnode.testnet.driver import oracle_cached

    sim = Simulation(cfg, prompts)
    result = sim.run()
    if sim.order != _arrival_order(cfg):
        raise AssertionError("the arrival sequence differs from the one the ceiling assumes")
    oracle = oracle_cached([prompts[q] for q in sim.order])
    total_prompt = sum(len(prompts[q]) for q in sim.order) or 1
    result.hit_rate_ceiling = round(sum(oracle) / total_prompt, 4)
    return result


def _arrival_order(cfg: SimConfig) -> list[int]:
    rng = random.Random(cfg.seed + 1)
    weights = [1 / (k + 1) ** cfg.zipf_s for k in range(cfg.subjects)]
    t, out = 0.0, []
    while True:
        t += rng.expovariate(cfg.rate)
        if t >= cfg.duration_s:
            return out
        subject = rng.choices(range(cfg.subjects), weights)[0]
        out.append(subject * cfg.per_subject + rng.randrange(cfg.per_subject))
        rng.randrange(cfg.nodes)


def as_row(r: SimResult) -> dict[str, Any]:
    return asdict(r)


# ---------------------------------------------------------------------------- command line

COLUMNS = (
    ("nodes", "N"),
    ("views", "views"),
    ("digest_bytes_per_node_s", "digest B/node/s"),
    ("view_bytes_per_node", "view memory B/node"),
    ("views_per_node", "views/node"),
    ("decide_ms_mean", "decide ms"),
    ("hit_rate", "hit rate"),
    ("hit_rate_ceiling", "ceiling"),
    ("busiest_share", "busiest"),
    ("mean_latency_s", "mean latency s"),
    ("latency_vs_baseline", "vs no routing"),
    ("lookups", "lookups"),
    ("redirects", "redirects"),
    ("wall_s", "wall s"),
)


def run_grid(
    sizes: Sequence[int], base: SimConfig, prompts: list[list[int]], log=print
) -> list[dict[str, Any]]:
    from dataclasses import replace

    rows = []
    for n in sizes:
        baseline = simulate(replace(base, nodes=n, views="full", routing=False), prompts)
        log(f"N={n} baseline (no routing): mean latency {baseline.mean_latency_s} s")
        for views in ("full", "scoped"):
            r = simulate(replace(base, nodes=n, views=views, routing=True), prompts)
            row = as_row(r)
            row["baseline_latency_s"] = baseline.mean_latency_s
            row["latency_vs_baseline"] = round(r.mean_latency_s / baseline.mean_latency_s, 3)
            rows.append(row)
            log(markdown_table([row], header=len(rows) == 1))
    return rows


def markdown_table(rows: Sequence[dict[str, Any]], header: bool = True) -> str:
    lines = []
    if header:
        lines.append("| " + " | ".join(title for _, title in COLUMNS) + " |")
        lines.append("|" + "---|" * len(COLUMNS))
    for r in rows:
        lines.append("| " + " | ".join(str(r[k]) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("digest_bytes_per_node_s", "digest bytes / node / s", True),
        ("view_bytes_per_node", "view memory / node (B)", True),
        ("decide_ms_mean", "routing decision (ms)", True),
        ("hit_rate", "token hit rate (dashed: ceiling)", False),
        ("busiest_share", "busiest node's share", False),
        ("latency_vs_baseline", "mean latency / no routing", False),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, title, log_y) in zip(axes.flat, metrics, strict=True):
        for views, style in (("full", "o-"), ("scoped", "s-")):
            pts = sorted((r["nodes"], r[key]) for r in rows if r["views"] == views)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{views} views")
            if key == "hit_rate":
                ceil = sorted(
                    (r["nodes"], r["hit_rate_ceiling"]) for r in rows if r["views"] == views
                )
                ax.plot([p[0] for p in ceil], [p[1] for p in ceil], "k--", lw=0.8)
        ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("nodes")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="p2pnode simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,1000,10000", help="comma list of swarm sizes")
    parser.add_argument("--duration", type=float, default=SimConfig.duration_s, help="simulated s")
    parser.add_argument("--rate", type=float, default=None, help="requests per simulated s")
    parser.add_argument("--churn-per-min", type=float, default=0.0, help="share of nodes per min")
    parser.add_argument("--max-views", type=int, default=ScopePolicy.max_views)
    parser.add_argument("--k-nearest", type=int, default=ScopePolicy.k_nearest)
    parser.add_argument("--cell-nodes", type=int, default=ScopePolicy.cell_nodes)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        metavar="SIMULATE_JSON",
        help="run nothing: one table and plot from the rows of earlier runs' simulate.json",
    )
    parser.add_argument(
        "--spec",
        default=None,
        help="simulate this trial spec instead (its nodes, delays and planned requests), "
        "both arms, and print the figures a trial reports (testnet/simspec.py)",
    )
    parser.add_argument("--out", default="bench/results/simulate", help="folder for JSON + plot")
    args = parser.parse_args(argv)
    if args.spec is not None:
        from p2pnode.testnet.simspec import simulate_spec
        from p2pnode.testnet.spec import SpecError, builtin_spec_path, load_spec

        try:
            spec = load_spec(builtin_spec_path(args.spec))
        except (SpecError, OSError) as exc:
            parser.error(f"--spec: {exc}")
        try:
            print(json.dumps(simulate_spec(spec), indent=1))
        except ValueError as exc:
            parser.error(f"--spec: {exc}")
        return 0
    if args.from_json is not None:
        try:
            rows = [r for f in args.from_json for r in json.loads(Path(f).read_text())["rows"]]
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"--from-json: {exc} (give simulate.json files of earlier runs)")
        rows.sort(key=lambda r: (r["nodes"], r["views"]))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        plot(rows, out / "simulate.png")
        (out / "table.md").write_text(markdown_table(rows) + "\n")
        print(markdown_table(rows))
        print(f"\nplot and table in {out}/")
        return 0
    try:
        sizes = [int(x) for x in args.nodes.split(",") if x]
    except ValueError:
        parser.error("--nodes: a comma list of integers, e.g. 100,1000,10000")
    if not sizes or min(sizes) < 2:
        parser.error("--nodes: every size must be at least 2")
    base = SimConfig(
        duration_s=args.duration,
        rate_per_s=args.rate,
        churn_per_min=args.churn_per_min,
        scope=ScopePolicy(
            max_views=args.max_views, k_nearest=args.k_nearest, cell_nodes=args.cell_nodes
        ),
        seed=args.seed,
    )
    started = time.perf_counter()
    print("tokenizing the MMLU prompts ...", file=sys.stderr)
    prompts = mmlu_prompts(base.subjects, base.per_subject)
    rows = run_grid(sizes, base, prompts, log=lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": "p2pnode simulate " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {k: v for k, v in asdict(base).items() if k != "scope"}
        | {"scope": asdict(base.scope)},
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (out / "simulate.json").write_text(json.dumps(record, indent=1))
    (out / "table.md").write_text(markdown_table(rows) + "\n")
    plot(rows, out / "simulate.png")
    print(markdown_table(rows))
    print(f"\n{len(rows)} runs in {record['wall_s']} s; JSON and plot in {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
