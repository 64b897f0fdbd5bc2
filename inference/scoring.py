"""Teacher-forced scoring: the target model's logits at every position of a given answer.

Contract:
- A ``Scorer`` answers ``logits(prompt, answer)`` with ``[len(answer), V]`` logits (an fp32
  tensor, or ``LogitRows`` that score an answer themselves) whose
  row ``i`` is the target's logits for ``answer[i]`` given ``prompt + answer[:i]``: ONE forward
  pass over ``prompt + answer[:-1]`` (no decode loop), so checking an answer costs about a
  prefill of its length, not its generation. Synchronous and CPU-bound: call it from a worker
  thread (``trio.to_thread.run_sync``). ``cost_s(tokens)`` is the expected seconds of that pass.
- ``ModelScorer(model, cost)`` runs a transformers causal LM (any dtype; logits come back fp32).
  Safe to use next to an engine on the same model: a forward reads the weights only.
- ``EmulatedScorer(vocab_size, eos_token_id, cost)`` recomputes the emulated backend's logits
  (a deterministic function of the input tokens, as ``EmulatedRows``, no torch) and sleeps the
  prefill cost of the pass, so audits behave in emulated trials as with the model.
- ``LogitRows``: rows that score an answer themselves (``greedy_gaps``, ``sampled_scores``), in
  closed form where a dense tensor would cost O(V) a row; the audits take them as they take a
  tensor (``overlay/trust/audit.py``), without asking where they came from.
- ``emulated_answer(prompt, max_tokens, vocab_size, eos_token_ids)`` is what an honest
  emulated engine answers greedily (its tokens are a function of the input tokens alone,
  whatever was cached or batched): the reference a trial's wrong-answer count compares with.
- ``scorer_for(engine)`` builds the one that matches an engine's backend (None when the engine
  has neither, e.g. vLLM).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from p2pnode.inference.costmodel import CostModel
from p2pnode.inference.emulated import EmulatedLogits, EmulatedRows, emulated_pick

if TYPE_CHECKING:
    import torch


@runtime_checkable
class LogitRows(Protocol):
    """``[n, V]`` logits of an answer that score it themselves (see the module contract)."""

    shape: tuple[int, int]

    def greedy_gaps(self, tokens: Sequence[int]) -> list[float]:
        """Per row, how many logits ``tokens[i]`` lies below the row's argmax."""
        ...

    def sampled_scores(
        self, tokens: Sequence[int], temperature: float, top_p: float
    ) -> tuple[list[float], float, float]:
        """Each ``tokens[i]``'s log-probability under the temperature + top-p distribution of
        its row (-inf outside the nucleus), and over all rows the sum of that distribution's
        entropy and of its surprisal's variance."""
        ...


class Scorer(Protocol):
    def logits(self, prompt: Sequence[int], answer: Sequence[int]) -> torch.Tensor | LogitRows: ...
    def cost_s(self, tokens: int) -> float: ...


class ModelScorer:
    """Logits of a transformers causal LM (see the module contract)."""

    def __init__(self, model: torch.nn.Module, cost: CostModel | None = None) -> None:
        self.model = model
        self.cost = cost or CostModel()

    def logits(self, prompt: Sequence[int], answer: Sequence[int]) -> torch.Tensor:
        if not prompt or not answer:
            raise ValueError("scoring needs a non-empty prompt and answer")
        import torch

        ids = torch.tensor([list(prompt) + list(answer[:-1])])
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=False, logits_to_keep=len(answer))
        return out.logits[0].float()

    def cost_s(self, tokens: int) -> float:
        return self.cost.overhead_s + tokens * self.cost.prefill_s_per_token


class EmulatedScorer:
    """The emulated backend's logits, with its prefill cost slept (see the module contract)."""

    def __init__(self, vocab_size: int, eos_token_id: int | None, cost: CostModel) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.cost = cost

    def logits(self, prompt: Sequence[int], answer: Sequence[int]) -> EmulatedRows:
        if not prompt or not answer:
            raise ValueError("scoring needs a non-empty prompt and answer")
        seq = list(prompt) + list(answer)
        time.sleep(self.cost_s(len(seq)))
        rows = [
            EmulatedLogits.after(
                len(prompt) + i, seq[len(prompt) + i - 1], self.vocab_size, self.eos_token_id
            )
            for i in range(len(answer))
        ]
        return EmulatedRows(rows, self.vocab_size)

    def cost_s(self, tokens: int) -> float:
        return self.cost.overhead_s + tokens * self.cost.prefill_s_per_token


def emulated_answer(
    prompt: Sequence[int], max_tokens: int, vocab_size: int, eos_token_ids: Sequence[int]
) -> list[int]:
    """The emulated engine's greedy answer to ``prompt`` (see the module contract)."""
    if not prompt:
        raise ValueError("an answer needs a non-empty prompt")
    eos = set(eos_token_ids)
    backend_eos = min(eos) if eos else None  # the one the emulated backend never picks
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        token = emulated_pick(len(seq), seq[-1], vocab_size, backend_eos)
        out.append(token)
        seq.append(token)
        if token in eos:
            break
    return out


def scorer_for(engine: Any) -> Scorer | None:
    """The scorer that recomputes what ``engine``'s backend computes, or None (an engine with
    no ``Backend`` of ours, e.g. vLLM)."""
    backend = getattr(engine, "backend", None)
    make = getattr(backend, "scorer", None)
    return make(engine.cost) if make is not None else None
