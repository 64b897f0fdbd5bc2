"""How many tokens a request will generate, predicted from the completions seen so far.

Queue estimates and routing used to charge every request its full ``max_tokens``; chat clients
rarely send one, so every request looked 1,024 tokens long and every queue looked minutes deep.
``OutputLengths`` keeps the recent completions (a bounded window) and predicts the mean
generated length of a new request, bounded by its own ``max_tokens``.

A completion that stopped at its limit is censored: its natural length is unknown beyond the
limit, so for a request with a larger limit it counts as reaching that limit (the conservative
reading). With no history the prediction is ``max_tokens``: what the estimates assumed before.
"""

from __future__ import annotations

from collections import deque

DEFAULT_WINDOW = 128


class OutputLengths:
    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"the length window needs at least one completion, got {window}")
        self._seen: deque[tuple[int, bool]] = deque(maxlen=window)  # (generated, hit its limit)

    def __len__(self) -> int:
        return len(self._seen)

    def observe(self, generated: int, *, hit_limit: bool) -> None:
        self._seen.append((max(0, int(generated)), bool(hit_limit)))

    def predict(self, max_tokens: int) -> float:
        """Expected tokens a new request with this limit generates (``<= max_tokens``)."""
        return self.remaining(0, max_tokens) if self._seen else float(max_tokens)

    def remaining(self, generated: int, max_tokens: int) -> float:
        """Expected tokens still to come for a request that has generated ``generated``:
        the mean over past completions that got further than it (at least one token)."""
        left = max_tokens - generated
        if left <= 0:
            return 0.0
        longer = [
            max_tokens if censored else min(n, max_tokens)
            for n, censored in self._seen
            if censored or n > generated
        ]
        if not longer:
            # Every completion seen so far was shorter: the request is in the tail, where the
            # history says nothing; expect it to run about as long again (bounded by its limit).
            return float(min(left, max(1, generated)))
        return max(1.0, sum(longer) / len(longer) - generated)

    def as_dict(self) -> dict[str, float | int]:
        lengths = [n for n, _ in self._seen]
        return {
            "completions": len(lengths),
            "mean_generated": round(sum(lengths) / len(lengths), 2) if lengths else 0.0,
            "hit_limit_share": (
                round(sum(c for _, c in self._seen) / len(self._seen), 3) if self._seen else 0.0
            ),
        }
