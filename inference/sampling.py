"""Sampling parameters and token sampling (greedy, temperature + top-p), shared with speculation.

Contract:
- ``SamplingParams`` validates itself on construction and raises ``InvalidParams`` (a
  ``ValueError``) for max_tokens <= 0, temperature < 0, top_p outside (0, 1], bad seeds or stop
  ids; ``SamplingParams.from_dict`` also rejects unknown option names.
- ``probs_from_logits(logits, temperature, top_p)`` is THE distribution the engine samples from:
  temperature 0 gives a one-hot on the argmax (ties -> lowest id, like ``torch.argmax``);
  otherwise softmax(logits / temperature) restricted to the smallest top-probability set whose
  mass reaches ``top_p`` (the most likely token is always kept), renormalised. Works on ``[V]``
  or ``[B, V]`` and returns fp32. Rejection sampling in speculation must use this same transform.
- ``Logits`` is one ``[V]`` row as the sampler and ``token_logprob`` read it: the model's rows
  are bare tensors (``as_logits`` wraps one in ``TensorLogits``), the emulated model's a closed
  form that needs no torch (``emulated.EmulatedLogits``). Both functions below read a row
  through it and never ask which kind it is.
- ``sample_token(logits, params, generator)`` draws one id from that distribution with the
  request's own ``torch.Generator`` (seeded when ``params.seed`` is set), so a seeded request is
  reproducible whatever else runs in the batch.
- ``params.logprobs``: None (the default) computes nothing; ``n`` in [0, ``MAX_TOP_LOGPROBS``]
  asks the engine for a ``TokenLogprob`` per generated token (``token_logprob``): the chosen
  token's log-probability under the model (log-softmax of the raw logits, before temperature
  and top-p, as OpenAI and vLLM report it) and the ``n`` most likely tokens with theirs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from p2pnode.inference._errors import InvalidParams

if TYPE_CHECKING:
    import random

    import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
# Log-probabilities are finite on the wire and in JSON: anything below this is reported as it.
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities at all

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidParams(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise InvalidParams(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise InvalidParams(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise InvalidParams(f"temperature must be finite and >= 0, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise InvalidParams(f"top_p must be a number, got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParams(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise InvalidParams(f"seed must be an int or None, got {self.seed!r}")
        stops = self.stop_token_ids
        if isinstance(stops, int | str | bytes) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stops
        ):
            raise InvalidParams(f"stop_token_ids must be non-negative ints, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        lp = self.logprobs
        if lp is not None and (
            isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS
        ):
            raise InvalidParams(
                f"logprobs must be None or an int in [0, {MAX_TOP_LOGPROBS}], got {lp!r}"
            )

    @classmethod
    def from_dict(cls, options: Mapping[str, object]) -> SamplingParams:
        """Build from a JSON-like mapping; unknown option names raise ``InvalidParams``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidParams(f"unknown sampling option(s) {unknown}; known: {sorted(known)}")
        opts = dict(options)
        if isinstance(opts.get("stop_token_ids"), list):
            opts["stop_token_ids"] = tuple(opts["stop_token_ids"])
        return cls(**opts)  # type: ignore[arg-type]


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution after the temperature and top-p transform (see module contract)."""
    import torch

    logits = logits.float()
    if temperature == 0.0:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return out
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    # A token stays if the mass of strictly more likely tokens is still below top_p; this keeps
    # the smallest set reaching top_p and always the argmax.
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True)


def make_generator(seed: int | None) -> torch.Generator:
    import torch

    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


@runtime_checkable
class Logits(Protocol):
    """One ``[V]`` row of next-token logits (see the module contract)."""

    def argmax(self) -> int: ...  # ties -> lowest id

    def sample(self, params: SamplingParams, generator: Any) -> int:
        """One id from ``probs_from_logits``' distribution; ``generator`` is what
        ``make_generator`` (or the emulated backend) made for the request."""
        ...

    def raw_log_softmax(self, token: int) -> float: ...  # before temperature and top-p

    def top(self, n: int) -> list[int]: ...  # the n most likely ids, best first


class TensorLogits:
    """A ``[V]`` tensor as ``Logits``; its log-softmax is computed once, on first use."""

    __slots__ = ("row", "_log_probs")

    def __init__(self, row: torch.Tensor) -> None:
        self.row = row
        self._log_probs: torch.Tensor | None = None

    def argmax(self) -> int:
        return int(self.row.argmax())

    def sample(self, params: SamplingParams, generator: torch.Generator | None) -> int:
        if params.temperature == 0.0:
            return self.argmax()
        import torch

        probs = probs_from_logits(self.row, params.temperature, params.top_p)
        return int(torch.multinomial(probs, 1, generator=generator))

    def _log_softmax(self) -> torch.Tensor:
        if self._log_probs is None:
            import torch

            self._log_probs = torch.log_softmax(self.row.float(), dim=-1)
        return self._log_probs

    def raw_log_softmax(self, token: int) -> float:
        return float(self._log_softmax()[token])

    def top(self, n: int) -> list[int]:
        return self._log_softmax().topk(n).indices.tolist() if n > 0 else []


def as_logits(logits: torch.Tensor | Logits) -> Logits:
    """``logits`` itself where it is ``Logits`` already, else the bare tensor (what the model
    backend returns) as ``TensorLogits``."""
    return logits if _speaks_logits(type(logits)) else TensorLogits(logits)


@functools.cache
def _speaks_logits(cls: type) -> bool:
    # Once per class: a protocol's isinstance costs ~10 us, twice per sampled token.
    return issubclass(cls, Logits)


def sample_token(
    logits: torch.Tensor | Logits,
    params: SamplingParams,
    generator: torch.Generator | random.Random | None = None,
) -> int:
    """One token id from ``[V]`` logits under ``params`` (greedy when temperature is 0)."""
    return as_logits(logits).sample(params, generator)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability and the ``top`` alternatives (best first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: torch.Tensor | Logits, token: int, top_n: int) -> TokenLogprob:
    """``token``'s log-softmax under ``[V]`` ``logits`` and the ``top_n`` best (see contract)."""
    row = as_logits(logits)
    chosen = max(MIN_LOGPROB, row.raw_log_softmax(token))
    top = tuple((i, max(MIN_LOGPROB, row.raw_log_softmax(i))) for i in row.top(max(0, top_n)))
    return TokenLogprob(token, chosen, top)
