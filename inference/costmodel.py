"""Latency model of one engine: prefill and decode seconds per token plus a fixed overhead.

Contract:
- ``estimate(prompt_tokens, cached_tokens, max_tokens)`` = overhead
  + (prompt_tokens - cached_tokens) * prefill_s_per_token + max_tokens * decode_s_per_token.
  It is the time one request takes alone; queueing is the engine's ``estimated_wait_s()``.
- ``await calibrate(engine)`` measures the engine's own backend at start-up (one uncached
  prefill of ~96 tokens and a few decode steps, ~1-2 s on the default model on 2 CPU cores).
- ``observe_prefill`` / ``observe_decode`` fold in timings from real requests with an EWMA
  (``alpha``), so the model follows load and context length drift.
- Defaults (before calibration) are the figures measured for SmolLM2-135M fp32 on 2 cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2pnode.inference.engine import Engine


@dataclass
class CostModel:
    prefill_s_per_token: float = 1 / 430
    decode_s_per_token: float = 1 / 16
    overhead_s: float = 0.01
    alpha: float = 0.2
    calibrated: bool = False
    observations: int = 0

    def estimate(self, prompt_tokens: int, cached_tokens: int, max_tokens: int) -> float:
        new = max(0, prompt_tokens - cached_tokens)
        return (
            self.overhead_s
            + new * self.prefill_s_per_token
            + max(0, max_tokens) * self.decode_s_per_token
        )

    def _blend(self, old: float, new: float) -> float:
        return (1 - self.alpha) * old + self.alpha * new

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A forward over ``tokens`` new prompt tokens took ``seconds`` (>= 8 tokens counts)."""
        if tokens >= 8 and seconds > 0:
            self.prefill_s_per_token = self._blend(self.prefill_s_per_token, seconds / tokens)
            self.observations += 1

    def observe_decode(self, seconds_per_step: float) -> None:
        """One decode step (one token for each running request) took ``seconds_per_step``."""
        if seconds_per_step > 0:
            self.decode_s_per_token = self._blend(self.decode_s_per_token, seconds_per_step)
            self.observations += 1

    def as_dict(self) -> dict[str, float]:
        return {
            "prefill_s_per_token": self.prefill_s_per_token,
            "decode_s_per_token": self.decode_s_per_token,
            "overhead_s": self.overhead_s,
        }


async def calibrate(
    engine: Engine, *, prefill_tokens: int = 96, decode_steps: int = 4
) -> CostModel:
    """Measure the engine's backend directly (bypassing the cache) and set ``engine.cost``."""
    import time

    import trio

    backend = engine._backend
    vocab = engine.vocab_size
    prompt = [(17 + 31 * i) % vocab for i in range(prefill_tokens)]

    def run() -> tuple[float, float, float]:
        warm = backend.new_state(None, 0)
        backend.extend(warm, prompt[:4])  # the first forward pays one-off allocations
        backend.free(warm)
        state = backend.new_state(None, 0)
        t0 = time.perf_counter()
        backend.extend(state, prompt[:8])
        t1 = time.perf_counter()
        backend.extend(state, prompt[8:])
        t2 = time.perf_counter()
        for _ in range(decode_steps):
            backend.decode([state], [prompt[0]])
        t3 = time.perf_counter()
        backend.free(state)
        return t1 - t0, t2 - t1, (t3 - t2) / decode_steps

    def run_no_grad() -> tuple[float, float, float]:
        import torch

        with torch.inference_mode():
            return run()

    small, big, step = await trio.to_thread.run_sync(run_no_grad)
    cost = engine.cost
    per_token = big / (prefill_tokens - 8)
    cost.prefill_s_per_token = per_token
    cost.overhead_s = max(0.0, small - 8 * per_token)
    cost.decode_s_per_token = step
    cost.calibrated = True
    return cost
