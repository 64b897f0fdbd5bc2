"""What a forward costs on the network, learned from the forwards this node has made.

A forward's network cost is everything between the origin and the serving engine: opening a
stream (yamux SYN, multistream-select), the request's bytes, the answer's first frame. It is
measured on every successful forward as the origin's time to first token minus the time the
serving engine itself reports for it (``ForwardDone.ttft_s``: queue + prefill there), and
modelled as ``round_trips * rtt + bytes / bandwidth``, plus a per-peer bias for what is
particular to a peer (a relayed circuit, a slow uplink).

The two shared coefficients are fitted by recursive least squares with forgetting, pulled
towards a prior (3 round trips: stream open, request, first token; 10 Mbit/s) that is itself
forgotten like an old observation: the first estimates are the prior, the learned ones take over
as forwards are observed. The
spread of the residuals gives the margin a forward must beat (one standard deviation; before
any sample, one round trip).

Peers report their own engine time, so a peer could claim a long one to look near. The
measured network cost is therefore never taken below one round trip, and the coefficients are
clamped to physical ranges (at least one round trip, at most ``MAX_ROUND_TRIPS``).

Nor is it taken above ``MAX_ROUND_TRIPS`` round trips plus the request at
``MIN_BANDWIDTH_BPS``: a first token later than that is a starved CPU (this node's event loop,
or the peer's outside its engine), not the network: one such sample on a loaded machine once put
a 10 s bias on a 21 ms link. A peer's bias also fades towards zero with the time since its last
sample (``bias_half_life_s``): a high estimate keeps forwards, and so fresh samples, away from
that peer, and must not keep it out for good.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

MB = 1e6
PRIOR_ROUND_TRIPS = 3.0
PRIOR_BANDWIDTH_BPS = 1.25e6  # 10 Mbit/s: a modest WAN uplink
MAX_ROUND_TRIPS = 20.0
MIN_BANDWIDTH_BPS = 1e4


@dataclass
class _PeerNet:
    bias_s: float = 0.0
    samples: int = 0
    at: float = 0.0  # clock of the last sample


@dataclass
class NetCostConfig:
    prior_round_trips: float = PRIOR_ROUND_TRIPS
    prior_bandwidth_Bps: float = PRIOR_BANDWIDTH_BPS
    # Weight of the prior in forwards: the prior counts as this many observations at a
    # typical WAN point (50 ms RTT, 4 KB request), so a handful of forwards already moves it.
    prior_weight: float = 4.0
    forgetting: float = 0.98  # per observation: the last ~50 forwards dominate
    bias_alpha: float = 0.2
    bias_half_life_s: float = 300.0

    def __post_init__(self) -> None:
        if not (self.prior_round_trips >= 1 and self.prior_bandwidth_Bps > 0):
            raise ValueError("a forward costs at least one round trip and bandwidth is > 0")
        if not (0 < self.forgetting <= 1 and 0 < self.bias_alpha <= 1 and self.prior_weight > 0):
            raise ValueError("forgetting and bias_alpha in (0, 1], prior_weight > 0")
        if self.bias_half_life_s <= 0:
            raise ValueError("bias_half_life_s must be > 0")


class ForwardCost:
    """``estimate(peer, rtt_s, request_bytes) -> seconds`` and ``observe(...)`` to learn."""

    _REF_RTT_S = 0.05
    _REF_MB = 0.004

    def __init__(
        self, config: NetCostConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = cfg = config or NetCostConfig()
        self._clock = clock
        self._theta0 = (cfg.prior_round_trips, MB / cfg.prior_bandwidth_Bps)
        # Normal equations of the weighted fit: a (2x2), b (2), with the prior as a ridge.
        self._lam = (cfg.prior_weight * self._REF_RTT_S**2, cfg.prior_weight * self._REF_MB**2)
        self._a = [[0.0, 0.0], [0.0, 0.0]]
        self._b = [0.0, 0.0]
        self._prior_scale = 1.0  # the prior is forgotten like an old observation
        self._theta = self._theta0
        self._sq_resid = 0.0
        self._resid_weight = 0.0
        self._peers: dict[str, _PeerNet] = {}
        self.samples = 0

    # -- estimates ----------------------------------------------------------------------------

    @property
    def round_trips(self) -> float:
        return self._theta[0]

    @property
    def bandwidth_Bps(self) -> float:
        return MB / self._theta[1]

    def estimate(self, peer_id: str, rtt_s: float, request_bytes: float) -> float:
        base = self._theta[0] * rtt_s + self._theta[1] * request_bytes / MB
        peer = self._peers.get(peer_id)
        return max(rtt_s, base + (0.0 if peer is None else self._bias(peer)))

    def _bias(self, peer: _PeerNet) -> float:
        age = max(0.0, self._clock() - peer.at)
        return peer.bias_s * 0.5 ** (age / self.config.bias_half_life_s)

    def spread_s(self, rtt_s: float) -> float:
        """One standard deviation of the network cost: the round-trip-sized variance a forward's
        real cost has around its estimate (one round trip until forwards were measured)."""
        if self._resid_weight < 1.0:
            return rtt_s
        return math.sqrt(self._sq_resid / self._resid_weight)

    # -- learning -----------------------------------------------------------------------------

    def observe(
        self,
        peer_id: str,
        rtt_s: float,
        request_bytes: float,
        first_token_s: float,
        engine_s: float,
    ) -> None:
        """One finished forward: the origin's time to first token and the serving engine's."""
        if not all(math.isfinite(v) and v >= 0 for v in (rtt_s, first_token_s, engine_s)):
            return
        x = (rtt_s, request_bytes / MB)
        ceiling = MAX_ROUND_TRIPS * rtt_s + request_bytes / MIN_BANDWIDTH_BPS
        y = min(ceiling, max(rtt_s, first_token_s - engine_s))
        predicted = self.estimate(peer_id, rtt_s, request_bytes)
        g = self.config.forgetting
        self._sq_resid = g * self._sq_resid + (y - predicted) ** 2
        self._resid_weight = g * self._resid_weight + 1.0
        for i in range(2):
            self._b[i] = g * self._b[i] + x[i] * y
            for j in range(2):
                self._a[i][j] = g * self._a[i][j] + x[i] * x[j]
        self._prior_scale = max(1e-3, g * self._prior_scale)
        self._theta = self._solve()
        self.samples += 1
        peer = self._peers.setdefault(peer_id, _PeerNet())
        shared = self._theta[0] * x[0] + self._theta[1] * x[1]
        a = self.config.bias_alpha
        peer.bias_s = (1 - a) * self._bias(peer) + a * (y - shared)
        peer.at = self._clock()
        peer.samples += 1

    def forget_peer(self, peer_id: str) -> None:
        self._peers.pop(peer_id, None)

    def _solve(self) -> tuple[float, float]:
        (l0, l1), (t0, t1) = self._lam, self._theta0
        l0, l1 = l0 * self._prior_scale, l1 * self._prior_scale
        a00, a01 = self._a[0][0] + l0, self._a[0][1]
        a10, a11 = self._a[1][0], self._a[1][1] + l1
        b0, b1 = self._b[0] + l0 * t0, self._b[1] + l1 * t1
        det = a00 * a11 - a01 * a10
        if det <= 0:
            return self._theta
        k = (b0 * a11 - a01 * b1) / det
        inv_bw = (a00 * b1 - a10 * b0) / det
        k = min(MAX_ROUND_TRIPS, max(1.0, k))
        inv_bw = min(MB / MIN_BANDWIDTH_BPS, max(0.0, inv_bw))
        return (k, inv_bw if inv_bw > 0 else self._theta0[1] * 1e-3)

    def as_dict(self) -> dict[str, object]:
        return {
            "samples": self.samples,
            "round_trips": round(self._theta[0], 3),
            "bandwidth_Bps": round(self.bandwidth_Bps),
            "spread_s": round(self.spread_s(0.0), 4) if self._resid_weight >= 1 else None,
            "peer_bias_s": {p: round(self._bias(v), 4) for p, v in self._peers.items()},
        }
