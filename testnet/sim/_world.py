"""The simulated WAN: where nodes sit and what a message between two of them costs.

``Network(cfg, rng)`` places ``cfg.nodes`` nodes around 4 region centres (Gaussian spread,
weighted by ``REGION_SHARE``) and gives each an access delay. ``base_rtt`` is the jitter-free
RTT (great-circle distance at fiber speed plus both ends' access delays), ``rtt`` adds
exponential jitter, ``nearest`` is a node's scope by measured RTT and ``cells`` each node's
cell. It draws from the run's ``rng`` in a fixed order, so a seed fixes the world.
``testnet/sim/simspec.py`` subclasses it with a trial spec's regions and link delays.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

from p2pnode.overlay.cache.scope import ScopePolicy, cell_of
from p2pnode.testnet.sim._config import SimConfig

FIBER_KM_PER_S = 200_000.0
EARTH_KM = 6371.0
REGIONS = {"eu": (50.0, 10.0), "us": (39.0, -95.0), "ap": (30.0, 125.0), "sa": (-15.0, -50.0)}
REGION_SHARE = {"eu": 0.35, "us": 0.3, "ap": 0.2, "sa": 0.15}


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
        """Each node's cell (``overlay/cache/scope.py``); region sizes are known exactly here."""
        size: dict[str, int] = {}
        for r in self.region:
            size[r] = size.get(r, 0) + 1
        return [cell_of(str(i), r, policy.cells(size[r])) for i, r in enumerate(self.region)]
