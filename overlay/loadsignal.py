"""The wait a node advertises: what a request arriving a gossip interval from now will see.

A digest's queue is read by peers up to a gossip interval after it was issued, and several
origins act on the same digest at once: an instantaneous queue of zero on a node that is busy
60 % of the time draws every origin's forwards, which then queue there. So next to the
engine's own estimate (the queue right now) a node advertises the mean wait of its recent load,
the textbook M/M/1 figure ``rho / (1 - rho) * S``: ``rho`` the share of the last ``window_s``
seconds its engine spent computing, ``S`` the compute time per finished request. The larger of
the two goes into the digest. Nothing here is tuned: the window spans a few gossip intervals, and
``rho`` is capped below 1 (``MAX_RHO``) only so that a saturated node advertises a long but
finite wait.
"""

from __future__ import annotations

from collections import deque

MAX_RHO = 0.95


class LoadSignal:
    def __init__(self, window_s: float = 10.0) -> None:
        if window_s <= 0:
            raise ValueError(f"the load window must be > 0 s, got {window_s}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float, int]] = deque()  # (time, busy_s, finished)

    def sample(self, now: float, busy_s: float, finished: int) -> None:
        self._samples.append((now, busy_s, finished))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def expected_wait_s(self) -> float:
        """Mean wait of the recent load (0 until the window holds two samples and a request)."""
        if len(self._samples) < 2:
            return 0.0
        (t0, b0, n0), (t1, b1, n1) = self._samples[0], self._samples[-1]
        if t1 <= t0 or n1 <= n0:
            return 0.0
        rho = min(MAX_RHO, max(0.0, (b1 - b0) / (t1 - t0)))
        service_s = (b1 - b0) / (n1 - n0)
        return rho / (1.0 - rho) * service_s
