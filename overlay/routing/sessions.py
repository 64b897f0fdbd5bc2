"""How many more turns a chat session will send: the router's look-ahead for sessions.

Why: a chat's history lives where its last turn ran, so forwarding one turn moves the whole
session: every later turn pays the forward's network cost again (or re-prefills the history
somewhere else). Judged turn by turn, forwarding a first turn to the holder of its system
prompt wins on a WAN link and then loses a round trip on each later turn, which the node
serving it locally would not have paid.

Contract:
- ``SessionTurns.observe(turn)``: one chat request arrived at this node's API with ``turn``
  earlier assistant answers in its messages (0: a session's first request).
- ``future_turns(turn)``: the expected number of requests the same session sends after this
  one, learned from the turn counts seen: ``sum_{k > turn} n_k / n_turn`` with ``n_k`` the
  (exponentially forgotten, ``decay`` per observation) count of requests seen at turn ``k``.
  0 before anything was seen, for a turn never seen, and for non-chat requests (which never
  call it). Turns past ``max_turn`` count as ``max_turn``.
- The router adds ``future_turns * network`` to a peer's estimate (``overlay/routing/router.py``).

Limits: it assumes a session's later turns arrive at the node its first one did (an API
client keeps its connection); one that hops nodes pays the look-ahead for nothing.
"""

from __future__ import annotations


class SessionTurns:
    def __init__(self, *, decay: float = 0.995, max_turn: int = 64) -> None:
        if not 0 < decay <= 1 or max_turn < 1:
            raise ValueError("need 0 < decay <= 1 and max_turn >= 1")
        self.decay = decay
        self.max_turn = max_turn
        self._counts = [0.0] * (max_turn + 1)

    def observe(self, turn: int) -> None:
        if turn < 0:
            raise ValueError(f"turn must be >= 0, got {turn}")
        d = self.decay
        counts = self._counts
        for k in range(len(counts)):
            counts[k] *= d
        counts[min(turn, self.max_turn)] += 1.0

    def future_turns(self, turn: int) -> float:
        t = min(max(turn, 0), self.max_turn)
        here = self._counts[t]
        if here <= 0:
            return 0.0
        return sum(self._counts[t + 1 :]) / here

    def as_dict(self) -> dict[str, float]:
        return {"future_after_first": round(self.future_turns(0), 3)}
