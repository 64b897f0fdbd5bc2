"""The seam between the engine and its compute backend (contract in ``_backend.py``).

Kept apart from the backends so that importing it pulls in neither torch (the model backend)
nor anything else heavy: the emulated backend runs without them.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias

if TYPE_CHECKING:
    import torch

    from p2pnode.inference.costmodel import CostModel
    from p2pnode.inference.emulated import EmulatedLogits, EmulatedRows
    from p2pnode.inference.scoring import Scorer

# A ``[V]`` row (``[B, V]`` from decode): a tensor from the model, a closed form when emulated.
Logits: TypeAlias = "torch.Tensor | EmulatedLogits"
# ``[n, V]`` rows, one per position (a teacher-forced pass): a tensor, or emulated rows.
Rows: TypeAlias = "torch.Tensor | EmulatedRows"


class Backend(Protocol):
    vocab_size: int
    kv_bytes_per_token: int

    def new_state(
        self,
        prefix_kv: torch.Tensor | Sequence[torch.Tensor] | None,
        prefix_len: int,
        expect: int = 0,
    ) -> object: ...
    def extend(self, state: object, tokens: list[int]) -> Logits: ...
    def extend_rows(self, state: object, tokens: list[int], keep: int) -> Rows: ...
    def concat_rows(self, parts: list[Rows]) -> Rows: ...
    def decode(self, states: list, tokens: list[int]) -> torch.Tensor | list[EmulatedLogits]: ...
    def export_kv(self, state: object, begin: int, end: int) -> torch.Tensor | None: ...
    def free(self, state: object) -> None: ...
    # What differs between a model and the emulated stand-in, asked of the backend itself so
    # that no caller checks its type: the sampler's random source, the autograd mode of its
    # steps, and the scorer that recomputes its logits for audits (``inference/scoring.py``).
    def make_generator(self, seed: int | None) -> torch.Generator | random.Random: ...
    def no_grad(self) -> contextlib.AbstractContextManager: ...
    def scorer(self, cost: CostModel) -> Scorer: ...
