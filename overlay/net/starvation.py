"""How starved this node's machine looks: the liveness probe floor and when not to blame peers.

Why: with more busy processes than cores (64 emulated nodes on 2 cores) every process waits
for a CPU, often for seconds. An echo then takes the network RTT plus the PEER's scheduling
delay plus ours, and a fixed 1 s probe floor declared live peers down and closed their links
(a bootstrap node had missed 488 probes); a node left with no link waits out its discovery
back-off, and the overlay never formed. A hung peer is one peer going silent; a starved
machine shows in the node's own loop lag and in the echo delays of most of its peers at once.
So the floor follows those two node-wide figures, and a connection is not closed on probe
misses while they say the CPU, not the peer, is the problem.

Contract (pure; the clock is injected so tests need no sleeps):
- `Starvation(base_floor, clock=time.monotonic)`, one per node, fed by ``liveness.py``:
  `note_loop_lag(lag_s)` (the liveness tick woke this late), `note_echo(peer, delay_s)` (an
  echo's round trip, late ones too), `forget(peer)` (its last connection closed). Samples
  count for `WINDOW_S`.
- `floor()`: the probe timeout floor. `base_floor` (``ping_timeout``) on a healthy machine,
  so a hung peer on a quiet machine is still found within seconds; else `FLOOR_FACTOR` times
  the larger of the median over peers of each one's recent echo delay (a few far or hung peers
  do not move it; most peers slow does) and the 90th percentile of the node's own loop lag,
  at most `MAX_FLOOR_FACTOR` * `base_floor`.
- `stalled(since, limit)`: our own loop lagged more than `limit` s since `since`.
- `close_withheld(missing, total)`: why a connection must not be closed on probe misses now
  (`None` when it may be): our own loop lagged more than `base_floor` / 2 within `WINDOW_S`,
  or more than half of `total` (at least `MIN_CROWD`) connected peers miss probes at once.
- `status()`: plain data for ``/status``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["FLOOR_FACTOR", "MAX_FLOOR_FACTOR", "MIN_CROWD", "WINDOW_S", "Starvation"]

# Samples older than this say nothing about the machine now.
WINDOW_S = 30.0
# The floor is this many times the typical delay: a probe times out only when its echo takes
# well over what most echoes take now. At 3, loopback and WAN-emulated links (echoes under
# ~300 ms) keep the base floor, so healthy detection times are unchanged.
FLOOR_FACTOR = 3.0
# However starved, a probe times out after at most this many base floors (10 s by default):
# a hung peer is still found, later.
MAX_FLOOR_FACTOR = 10.0
# "Most peers miss at once" needs at least this many peers: with one or two, a hung peer and a
# starved machine look alike, and a hung peer must be found.
MIN_CROWD = 4
# Echo delays remembered per peer (its median is its recent delay).
PER_PEER_SAMPLES = 5
# Own loop-lag samples remembered (the liveness tick is 0.25 s: 30 s is 120 of them).
MAX_LAG_SAMPLES = 256


class Starvation:
    """Node-wide lag estimates (see the module contract)."""

    def __init__(self, base_floor: float, clock: Callable[[], float] = time.monotonic) -> None:
        if base_floor <= 0:
            raise ValueError(f"the probe floor must be > 0 s, got {base_floor}")
        self.base_floor = base_floor
        self._clock = clock
        self._lags: deque[tuple[float, float]] = deque(maxlen=MAX_LAG_SAMPLES)
        self._echoes: dict[Hashable, deque[tuple[float, float]]] = {}

    def note_loop_lag(self, lag_s: float) -> None:
        self._lags.append((self._clock(), max(0.0, lag_s)))

    def note_echo(self, peer: Hashable, delay_s: float) -> None:
        samples = self._echoes.get(peer)
        if samples is None:
            samples = self._echoes[peer] = deque(maxlen=PER_PEER_SAMPLES)
        samples.append((self._clock(), max(0.0, delay_s)))

    def forget(self, peer: Hashable) -> None:
        self._echoes.pop(peer, None)

    def _recent_lags(self) -> list[float]:
        horizon = self._clock() - WINDOW_S
        return [lag for at, lag in self._lags if at >= horizon]

    def echo_delay(self) -> float | None:
        """Median over peers of each one's median recent echo delay; None without samples."""
        horizon = self._clock() - WINDOW_S
        per_peer = []
        for samples in self._echoes.values():
            recent = [d for at, d in samples if at >= horizon]
            if recent:
                per_peer.append(statistics.median(recent))
        return statistics.median(per_peer) if per_peer else None

    def loop_lag(self) -> float:
        """90th percentile of our own recent loop lag (0 without samples)."""
        lags = sorted(self._recent_lags())
        if not lags:
            return 0.0
        return lags[min(len(lags) - 1, math.ceil(0.9 * len(lags)) - 1)]

    def floor(self) -> float:
        typical = max(self.echo_delay() or 0.0, self.loop_lag())
        return min(max(self.base_floor, FLOOR_FACTOR * typical), MAX_FLOOR_FACTOR * self.base_floor)

    def stalled(self, since: float, limit: float) -> bool:
        """Did OUR event loop lag more than `limit` s since `since`? Then silence proves
        nothing about the peer (we may not have run to read its frames)."""
        return any(lag > limit for at, lag in self._lags if at >= since)

    def close_withheld(self, missing: int, total: int) -> str | None:
        """Why probe misses must not close a connection now; None when they may."""
        if any(lag > self.base_floor / 2 for lag in self._recent_lags()):
            return "own event loop starved"
        if total >= MIN_CROWD and 2 * missing > total:
            return f"{missing} of {total} peers miss probes at once"
        return None

    def status(self) -> dict[str, Any]:
        echo = self.echo_delay()
        return {
            "probe_floor_s": round(self.floor(), 3),
            "echo_delay_s": None if echo is None else round(echo, 3),
            "loop_lag_s": round(self.loop_lag(), 3),
        }
