"""One simulated node: its real radix cache and digest builder, its load, its gossip.

``SimNode`` holds what a node owns: a ``RadixCache`` whose block events feed a real
``DigestBuilder`` (and the simulated DHT's listener, ``Simulation.on_block_event``), a
one-slot server (one request at a time, no batching), the exact backlog it advertises, and its
``PushBack``. ``gossip_loop`` publishes a full digest, then deltas, every gossip interval on
the sim clock: sealed with a real key (the bytes counted are real), opened with
``open_digest``, and applied to the shared ``PeerViews`` after the node's mean one-way delay;
a GAP is repaired by a pull of a full digest, as anti-entropy does. ``restart`` is churn: an
empty cache and a new digest epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import simpy

from p2pnode.inference.radix import RadixCache
from p2pnode.overlay.cache.digest import DigestBuilder, LoadInfo, open_digest, seal_digest
from p2pnode.overlay.cache.views import ApplyResult
from p2pnode.overlay.routing.router import LocalState, PushBack
from p2pnode.testnet.sim._config import MODEL_ID
from p2pnode.testnet.sim.hotprefix import HotPrefixes

if TYPE_CHECKING:
    from p2pnode.testnet.sim._run import Simulation


class SimNode:
    """A node of the run ``sim``; ``index`` is its place in ``sim.nodes`` and its peer id."""

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
        # the prefixes this node served, for the hot-prefix summary (lost with the cache)
        self.hot = HotPrefixes(self.sim.cfg.hot)
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

    # -- gossip ---------------------------------------------------------------------------

    def publish(self) -> None:
        sim = self.sim
        b = self.builder
        digest = b.full() if self.last_published is None else b.delta_since(self.last_published)
        self.last_published = b.version
        key = sim.keys[self.index % len(sim.keys)]
        data = seal_digest(key, digest, now=sim.env.now)
        sim.digest_bytes[self.index] += len(data)
        opened = open_digest(data, now=sim.env.now, max_age=1e12)
        # the opened digest names the signing key; the view belongs to the simulated node
        opened = type(opened)(**{**fields(opened), "peer_id": self.pid})
        sim.env.process(self._deliver(opened))

    def _deliver(self, digest: Any):
        sim = self.sim
        yield sim.env.timeout(self.mean_rtt_s / 2)
        if sim.store.apply(digest) is ApplyResult.GAP:  # repaired by a pull of a full digest
            full = self.builder.full()
            sim.store.apply(type(full)(**{**fields(full), "timestamp": sim.env.now}))

    def gossip_loop(self):
        sim = self.sim
        yield sim.env.timeout(sim.rng.random() * sim.cfg.gossip_interval_s)
        while True:
            if self.up:
                self.publish()
            yield sim.env.timeout(sim.cfg.gossip_interval_s)


def fields(d: Any) -> dict[str, Any]:
    """A slotted digest's fields, to rebuild it with one changed."""
    return {name: getattr(d, name) for name in d.__slots__}
