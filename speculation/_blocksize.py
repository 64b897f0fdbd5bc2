"""How many draft tokens the verifier asks each session for per block (``want``), from its load.

The rule. A verify pass over P positions (all rows' inputs together) costs about
``t(P) = base + c * max(0, P - FREE_POSITIONS)``: up to ``FREE_POSITIONS`` the pass is bound by
reading the weights and a position costs nothing extra; beyond it each position costs ``c``
seconds. A session's k-th draft token commits ``alpha ** k`` tokens on average (``alpha``: its
measured per-token acceptance) and takes one position. While the pass is busy it delivers
``R`` committed tokens per second, so one position's time is worth ``c * R`` tokens there. The
verifier wants the k-th draft iff ``alpha ** k >= cost(k)``, where ``cost(k)`` is 0 while the
other sessions' positions plus this block's stay within ``FREE_POSITIONS``, else ``c * R``:
``want`` is the largest such k (at most ``max_want``); 0 means the session gains more by the
verifier decoding for it alone (the edge moves to lead-only decoding; see ``edge.py``).
Load up (more positions from others, so the free positions are taken, or a slower pass per
position) or acceptance down shortens the blocks. Why never worse than everyone target-only:
at ``want`` 0 for every session each pass is a target-only pass, and a session gets a k-th draft
only while that position commits more (``alpha ** k``) than the pass's own rate would with the
same time (``c * R``), so each granted position raises the tokens per second of the pass.
Where the verifier runs a pass's rows one after another (``verify.py``'s serial mode, where
its fused C pass does not run), each row is a pass of its own and has its own free positions.

The constants, and the measurement behind each (docs/performance.md unless named):
- ``FREE_POSITIONS = 5``: verify(5) / verify(1) = 0.97 on the Xeon (``bench/floor.py``,
  2026-12-06): five positions cost what one does; nine cost 1.3x.
- ``PRIOR_C_S = 0.008``: 16 sessions x 5 positions in one batched pass took 0.66 s against
  44 ms for one position (``bench/speculation_bench.py --skip-edge``, 2026-12-06):
  (0.66 - 0.044) / 75 = 8.2 ms a position. The verifier's own passes replace it as they come
  (``observe_pass``), and ``base`` likewise starts from the 44 ms decode step.
- ``PRIOR_ALPHA = 0.7``: the draft's greedy agreement with the target on chat prompts is
  0.7-0.8 (``bench/speculation_bench.py``); a session starts from it, as ``PRIOR_WEIGHT``
  blocks' worth of evidence, until its own blocks outweigh it.
- ``DECAY = 0.8`` per observation: about the last five blocks (or passes) count, so a session
  whose text turns hard, or a verifier whose load jumps, answers within a few blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AcceptanceMeter", "BlockSizer"]

FREE_POSITIONS = 5
PRIOR_C_S = 0.008
PRIOR_BASE_S = 0.044
PRIOR_ALPHA = 0.7
PRIOR_WEIGHT = 2.0
DECAY = 0.8


@dataclass
class AcceptanceMeter:
    """A session's per-token acceptance: each verified draft token is one trial, accepted or
    the one rejection that ends its block (tokens after a rejection were never judged)."""

    accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    trials: float = PRIOR_WEIGHT

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0 or accepted < 0:  # an empty or stale block judged nothing
            return
        self.accepted = DECAY * self.accepted + accepted
        self.trials = DECAY * self.trials + accepted + (1 if accepted < drafted else 0)

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else PRIOR_ALPHA


class BlockSizer:
    """The verifier's load, learned from its passes, and the ``want`` rule (module doc)."""

    def __init__(self, *, max_want: int = 16, free_positions: int = FREE_POSITIONS) -> None:
        if max_want < 0 or free_positions < 1:
            raise ValueError(
                f"need max_want >= 0, free_positions >= 1: {max_want}, {free_positions}"
            )
        self.max_want = max_want
        self.free = free_positions
        self.base_s = PRIOR_BASE_S
        self.c_s = PRIOR_C_S
        self.positions = 0.0  # positions per pass (smoothed): the load
        self._tokens = 0.0  # committed tokens and busy seconds per pass (smoothed): the rate R
        self._seconds = 0.0

    def observe_pass(self, positions: float, seconds: float, committed: float) -> None:
        """One forward pass: its positions, its time and the tokens it committed (a serial
        pass, rows one after another, is given as the mean of its rows)."""
        if positions <= 0 or seconds <= 0:
            return
        if positions <= self.free:
            self.base_s = DECAY * self.base_s + (1 - DECAY) * seconds
        else:
            per = max(0.0, seconds - self.base_s) / (positions - self.free)
            self.c_s = DECAY * self.c_s + (1 - DECAY) * per
        self.positions = DECAY * self.positions + (1 - DECAY) * positions
        self._tokens = DECAY * self._tokens + (1 - DECAY) * committed
        self._seconds = DECAY * self._seconds + (1 - DECAY) * seconds

    @property
    def rate(self) -> float:
        """Committed tokens per busy second (R); before any pass, one token per base step."""
        if self._seconds <= 0:
            return 1.0 / self.base_s
        return self._tokens / self._seconds

    def want(self, alpha: float, own_positions: float = 0.0) -> int:
        """Draft tokens to ask of a session with acceptance ``alpha`` whose last block took
        ``own_positions`` of the smoothed load (the others' positions are the rest)."""
        others = max(0.0, self.positions - own_positions)
        price = self.c_s * self.rate  # tokens one position's time commits at the pass's rate
        k = 0
        while k < self.max_want:
            nxt = k + 1
            cost = 0.0 if others + nxt + 1 <= self.free else price
            if alpha**nxt < cost:
                break
            k = nxt
        return k
