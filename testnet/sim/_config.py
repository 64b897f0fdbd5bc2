"""The simulator's settings (``SimConfig``) and one run's figures (``SimResult``).

Plain data: every other module of the simulator reads its knobs from a ``SimConfig``; a run
returns a ``SimResult``. ``MODEL_ID`` is the one model every simulated node serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pnode.overlay.cache.scope import ScopePolicy
from p2pnode.testnet.sim.hotprefix import HotPolicy

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
    # Scoped views: the hot-prefix summary (testnet/sim/hotprefix.py) names holders of the most
    # served prefixes, pulled at once instead of looked up; None: DHT lookups only.
    hot: HotPolicy | None = field(default_factory=HotPolicy)
    hot_pull: int = 2  # holders of a summary entry pulled, nearest first
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
    hot_bytes_per_node_s: float = 0.0  # hot-prefix summaries received (part of the digest B/s)
    hot_pulls: int = 0  # requests that pulled holders the summary named
