"""What an edge and a verifier exchange, as plain data: sampling options, a draft block, the
verdict on it and a token the verifier committed on its own (lead).

Contract: frozen dataclasses, no behaviour beyond checking their own fields. ``Block`` names the
committed length and last token it builds on, so a verifier that holds something else there
answers it stale at no cost; ``BlockResult.accepted == -1`` is that answer. ``protocol.py``
carries them over libp2p; the in-process transport (``testing.py``) passes them as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from p2pnode.speculation._errors import BadRequest

__all__ = ["Block", "BlockResult", "Lead", "SamplingOptions"]


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, int | float) or not (0 <= t < math.inf):
            raise BadRequest(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0 < p <= 1):
            raise BadRequest(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise BadRequest(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Block:
    number: int
    base_len: int  # committed tokens (prompt + output) the block builds on
    base_token: int  # the last of them, as the edge believes it to be
    tokens: tuple[int, ...]
    draft_probs: torch.Tensor | None = None  # [len(tokens), V] fp32, sampling only


@dataclass(frozen=True)
class Lead:
    """A token the verifier committed on its own while no block of the session was waiting."""

    position: int  # its index in the session's tokens (prompt + output)
    token: int


@dataclass(frozen=True)
class BlockResult:
    number: int
    accepted: int  # -1: stale block, nothing verified
    next_token: int  # the target's token after the accepted prefix; -1 when stale
    committed_len: int  # the session's committed length after this block
    # Draft tokens the verifier wants in this session's next blocks (its block-size control,
    # ``_blocksize.py``; 0: let it decode alone); None: no advice.
    want: int | None = None

    @property
    def stale(self) -> bool:
        return self.accepted < 0
