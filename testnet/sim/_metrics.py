"""One run's figures: a finished ``Simulation``'s records and counters as a ``SimResult``.

``result_of(sim, wall_s)`` reads, never changes, the run: digest bytes received per node per
second (with scoped views, the sealed bytes of the publishers in view plus a share of the
digests pulled after lookups), view memory per node (``view_bytes``: the view object, its load
record and fingerprints), decision time, token hit rate, busiest node's share, mean latency,
share forwarded, lookups and redirects. The hit-rate ceiling needs the arrival order and is
set by ``simulate()``.
"""

from __future__ import annotations

import statistics
import sys
from typing import TYPE_CHECKING

from p2pnode.overlay.cache.views import PeerViews
from p2pnode.testnet.sim._config import SimResult
from p2pnode.testnet.sim.hotprefix import HotPrefixes

if TYPE_CHECKING:
    from p2pnode.testnet.sim._run import Simulation


def result_of(sim: Simulation, wall: float) -> SimResult:
    """The figures of ``sim``, run to its end; ``wall`` is the run's wall-clock seconds."""
    cfg = sim.cfg
    recs = sim.records
    n = cfg.nodes
    published_per_s = [b / (cfg.duration_s + 30.0) for b in sim.digest_bytes]
    hot = 0.0
    if cfg.views == "scoped":
        pulled = sim.pull_bytes / (cfg.duration_s + 30.0) / n
        hot = sim.hot_bytes / (cfg.duration_s + 30.0)
        received = [
            sum(published_per_s[int(p)] for p in scope) + pulled + hot for scope in sim.scope_str
        ]
        in_view = [len(scope) for scope in sim.scope_str]
    else:
        total = sum(published_per_s)
        received = [total - published_per_s[i] for i in range(n)]
        in_view = [n - 1] * n
    per_view = view_bytes(sim.store)
    # each node keeps one copy of the summary: its in-memory size counts as view memory
    summary = (
        summary_bytes(sim.hot_world, len(sim.keys[0].peer_id)) if cfg.views == "scoped" else 0.0
    )
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
        view_bytes_per_node=round(per_view * statistics.fmean(in_view) + summary, 0),
        views_per_node=round(statistics.fmean(in_view), 1),
        decide_ms_mean=round(1e3 * statistics.fmean(sim.decide_s), 3) if sim.decide_s else 0.0,
        hit_rate=round(sum(r["cached"] for r in recs) / prompt, 4),
        hit_rate_ceiling=0.0,  # set by simulate(), which knows the arrival order
        busiest_share=round(max(served) / max(1, len(recs)), 4),
        mean_latency_s=round(statistics.fmean(r["latency"] for r in recs), 4) if recs else 0.0,
        forwarded=round(sum(r["forwarded"] for r in recs) / max(1, len(recs)), 4),
        lookups=sim.lookups,
        redirects=sim.redirects,
        wall_s=round(wall, 1),
        hot_bytes_per_node_s=round(hot, 1),
        hot_pulls=sim.hot_pulls,
    )


def view_bytes(store: PeerViews) -> float:
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


def summary_bytes(hot: HotPrefixes, real_id_len: int) -> float:
    """Memory of one copy of the hot-prefix summary: entries, holders and their strings (a
    real peer id's length, not the simulation's short names)."""
    total = sys.getsizeof(dict.fromkeys(hot.keys()))
    for key, _, holders in hot.entries():
        total += sys.getsizeof(key) + 64 + sys.getsizeof(holders)  # 64: the entry's slots
        total += sum(
            sys.getsizeof(h) + sys.getsizeof("x" * real_id_len) + sys.getsizeof(h.zone)
            for h in holders
        )
    return float(total)
