"""The emulated model: no weights, no torch. Compute time from a cost model, tokens from a hash.

Contract:
- ``EmulatedBackend(vocab_size, cost, eos_token_id)`` is a ``Backend`` (see ``_backend.py``)
  that sleeps what ``cost`` predicts for each forward and returns ``EmulatedLogits``. The engine
  keeps its real radix tree (token structure only, no KV), so cache hits, block events and
  routing behave as with the model while compute time comes from the cost model.
- ``EmulatedLogits`` is one row of the emulated model's logits after ``length`` tokens ending
  in ``last``: ``VALUE`` on one token (``emulated_pick``, a crc32 of the input, never EOS) and 0
  everywhere else. It is kept in that form instead of a ``[V]`` array: every quantity the
  engine, the sampler and the audits need of it (argmax, the temperature + top-p distribution,
  log-probabilities, entropy) has a closed form, so an emulated node needs neither torch nor
  numpy and a row costs O(1), not O(V). ``tensor()`` builds the dense row (torch, lazily) where
  a caller wants one.
- Sampling follows ``sampling.probs_from_logits``: softmax at the temperature, then the smallest
  top-probability set reaching ``top_p``. All non-picked tokens tie; the nucleus keeps the
  lowest ids among them (torch's sort leaves the order of ties unspecified, so this is the one
  rule the emulated sampler and the emulated audit share). The random source is a
  ``random.Random`` (``make_generator``), seeded when the request is.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from p2pnode.inference.costmodel import CostModel

if TYPE_CHECKING:
    import torch

    from p2pnode.inference.sampling import SamplingParams
    from p2pnode.inference.scoring import EmulatedScorer

VALUE = 10.0  # the picked token's logit; every other token's is 0


def emulated_pick(length: int, last: int, vocab_size: int, eos_token_id: int | None) -> int:
    """The token the emulated model favours after ``length`` tokens ending in ``last``."""
    pick = zlib.crc32(f"{length}:{last}".encode()) % vocab_size
    if pick == eos_token_id:
        pick = (pick + 1) % vocab_size
    return pick


class _Nucleus:
    """The sampling distribution of one row: ``p_pick`` on the pick, ``p_other`` on each of the
    ``others`` lowest ids besides it, 0 elsewhere."""

    __slots__ = ("p_pick", "p_other", "others")

    def __init__(self, vocab_size: int, temperature: float, top_p: float) -> None:
        # weights exp(VALUE / T) : 1, scaled by exp(-VALUE / T) so a low temperature cannot overflow
        rest = math.exp(-VALUE / temperature) * (vocab_size - 1)
        z = 1.0 + rest
        p_pick = 1.0 / z
        q = (rest / (vocab_size - 1)) / z if vocab_size > 1 else 0.0
        others = vocab_size - 1
        if top_p < 1.0:
            others = (
                0 if top_p <= p_pick or q == 0 else min(others, math.ceil((top_p - p_pick) / q))
            )
        kept = p_pick + others * q
        self.p_pick = p_pick / kept
        self.p_other = q / kept if others else 0.0
        self.others = others


class EmulatedLogits:
    """One row of emulated logits (see the module contract)."""

    __slots__ = ("vocab_size", "pick")

    def __init__(self, vocab_size: int, pick: int) -> None:
        self.vocab_size = vocab_size
        self.pick = pick

    @classmethod
    def after(
        cls, length: int, last: int, vocab_size: int, eos_token_id: int | None
    ) -> EmulatedLogits:
        return cls(vocab_size, emulated_pick(length, last, vocab_size, eos_token_id))

    def argmax(self) -> int:
        return self.pick

    def logit(self, token: int) -> float:
        return VALUE if token == self.pick else 0.0

    def _other_id(self, j: int) -> int:
        """The ``j``-th lowest id other than the pick."""
        return j if j < self.pick else j + 1

    def _other_rank(self, token: int) -> int:
        return token if token < self.pick else token - 1

    # ---- the sampling distribution (temperature > 0) ---------------------------------------
    def log_prob(self, token: int, temperature: float, top_p: float) -> float:
        """log p(token) under the temperature + top-p distribution (-inf outside the nucleus)."""
        n = _Nucleus(self.vocab_size, temperature, top_p)
        if token == self.pick:
            return math.log(n.p_pick)
        if self._other_rank(token) < n.others and n.p_other > 0:
            return math.log(n.p_other)
        return -math.inf

    def entropy_and_variance(self, temperature: float, top_p: float) -> tuple[float, float]:
        """Mean and variance of the surprisal ``-log p(t)`` of a token sampled from the row."""
        n = _Nucleus(self.vocab_size, temperature, top_p)
        terms = [(n.p_pick, math.log(n.p_pick))]
        if n.others:
            terms.append((n.others * n.p_other, math.log(n.p_other)))
        mean = -sum(mass * lp for mass, lp in terms)
        square = sum(mass * lp * lp for mass, lp in terms)
        return mean, max(0.0, square - mean * mean)

    def sample(self, params: SamplingParams, rng: random.Random | None) -> int:
        if params.temperature == 0.0:
            return self.pick
        n = _Nucleus(self.vocab_size, params.temperature, params.top_p)
        u = (rng or random).random()
        if u < n.p_pick or n.others == 0:
            return self.pick
        return self._other_id(min(n.others - 1, int((u - n.p_pick) / n.p_other)))

    # ---- raw log-softmax (what logprobs report) --------------------------------------------
    def raw_log_softmax(self, token: int) -> float:
        log_z = VALUE + math.log1p((self.vocab_size - 1) * math.exp(-VALUE))
        return self.logit(token) - log_z

    def top(self, n: int) -> list[int]:
        """The ``n`` most likely ids, best first (ties by lowest id)."""
        return [self.pick, *(self._other_id(j) for j in range(min(n, self.vocab_size) - 1))][:n]

    def tensor(self) -> torch.Tensor:
        import torch

        row = torch.zeros(self.vocab_size)
        row[self.pick] = VALUE
        return row


class EmulatedRows(Sequence[EmulatedLogits]):
    """``[n, V]`` emulated logits, one ``EmulatedLogits`` per row (what an emulated scorer
    returns; the audits read it in closed form)."""

    def __init__(self, rows: list[EmulatedLogits], vocab_size: int) -> None:
        self.rows = rows
        self.shape = (len(rows), vocab_size)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):  # type: ignore[override]
        return self.rows[i]

    # ---- scoring.LogitRows: what the audits read, in closed form ----------------------------
    def greedy_gaps(self, tokens: Sequence[int]) -> list[float]:
        return [r.logit(r.argmax()) - r.logit(t) for r, t in zip(self.rows, tokens, strict=True)]

    def sampled_scores(
        self, tokens: Sequence[int], temperature: float, top_p: float
    ) -> tuple[list[float], float, float]:
        rows = zip(self.rows, tokens, strict=True)
        chosen = [r.log_prob(t, temperature, top_p) for r, t in rows]
        moments = [r.entropy_and_variance(temperature, top_p) for r in self.rows]
        return chosen, sum(h for h, _ in moments), sum(v for _, v in moments)


class _EmuState:
    __slots__ = ("length", "last")

    def __init__(self, length: int) -> None:
        self.length = length
        self.last = 0


class EmulatedBackend:
    """No model: sleeps what the cost model predicts and returns ``EmulatedLogits``."""

    def __init__(self, vocab_size: int, cost: CostModel, eos_token_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.kv_bytes_per_token = 0
        self.cost = cost
        self.eos_token_id = eos_token_id

    def make_generator(self, seed: int | None) -> random.Random:
        return random.Random(seed)

    def no_grad(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # no tensors: torch stays unloaded

    def scorer(self, cost: CostModel) -> EmulatedScorer:
        from p2pnode.inference.scoring import EmulatedScorer

        return EmulatedScorer(self.vocab_size, self.eos_token_id, cost)

    def new_state(self, prefix_kv: object, prefix_len: int, expect: int = 0) -> _EmuState:
        return _EmuState(prefix_len)

    def _logits(self, state: _EmuState) -> EmulatedLogits:
        return EmulatedLogits.after(state.length, state.last, self.vocab_size, self.eos_token_id)

    def extend(self, state: _EmuState, tokens: list[int]) -> EmulatedLogits:
        time.sleep(self.cost.overhead_s + len(tokens) * self.cost.prefill_s_per_token)
        state.length += len(tokens)
        state.last = tokens[-1]
        return self._logits(state)

    def extend_rows(self, state: _EmuState, tokens: list[int], keep: int) -> EmulatedRows:
        start = state.length
        self.extend(state, tokens)
        n = len(tokens)
        rows = [
            EmulatedLogits.after(start + j + 1, tokens[j], self.vocab_size, self.eos_token_id)
            for j in range(n - keep, n)
        ]
        return EmulatedRows(rows, self.vocab_size)

    def concat_rows(self, parts: list[EmulatedRows]) -> EmulatedRows:
        return EmulatedRows([r for part in parts for r in part.rows], self.vocab_size)

    def decode(self, states: list[_EmuState], tokens: list[int]) -> list[EmulatedLogits]:
        time.sleep(self.cost.decode_s_per_token)
        out = []
        for s, t in zip(states, tokens, strict=True):
            s.length += 1
            s.last = t
            out.append(self._logits(s))
        return out

    def export_kv(self, state: _EmuState, begin: int, end: int) -> None:
        return None

    def free(self, state: _EmuState) -> None:
        return None
