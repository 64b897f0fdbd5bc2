"""Many sessions' KV caches as one batch, and back: left-padding, masks, true positions.

Contract: ``pad_batch(caches, inputs, num_layers)`` stacks each session's ``DynamicCache``
LEFT-padded with zeros to the longest one and RIGHT-pads the new tokens; the 2-D attention mask
hides both pads and the position ids are each row's true positions. Cached keys already carry
their RoPE rotation, so moving them in storage changes nothing: a forward over the batch equals
each session's own forward; only float summation order may differ (logits agree to ~1e-5).
``PaddedBatch.split(cache)`` slices each row's cache back out of the batch's (pads dropped,
new tokens kept), as fresh tensors. Inputs are built on the CPU; ``model_inputs(device)`` moves
them. No model here: ``verify.py`` runs the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

__all__ = ["PaddedBatch", "pad_batch"]


@dataclass(frozen=True)
class PaddedBatch:
    cache: DynamicCache  # every row's cache, left-padded to ``lmax``
    ids: torch.Tensor  # [rows, nmax] new tokens, right-padded
    mask: torch.Tensor  # [rows, lmax + nmax] 1 where a real token is
    positions: torch.Tensor  # [rows, nmax] true positions
    lens: list[int]  # each row's cached length
    widths: list[int]  # each row's new tokens

    @property
    def lmax(self) -> int:
        return max(self.lens)

    def model_inputs(self, device: torch.device) -> dict:
        return {
            "input_ids": self.ids.to(device),
            "attention_mask": self.mask.to(device),
            "position_ids": self.positions.to(device),
            "past_key_values": self.cache,
            "use_cache": True,
        }

    def split(self) -> list[DynamicCache]:
        """Each row's cache after the forward: its cached and new tokens, pads dropped."""
        out = []
        for i, (n, w) in enumerate(zip(self.lens, self.widths, strict=True)):
            rows = slice(self.lmax - n, self.lmax + w)
            out.append(
                DynamicCache(
                    ddp_cache_data=[
                        (
                            lay.keys[i : i + 1, :, rows].clone(),
                            lay.values[i : i + 1, :, rows].clone(),
                        )
                        for lay in self.cache.layers
                    ]
                )
            )
        return out


def pad_batch(caches: list[DynamicCache], inputs: list[list[int]], num_layers: int) -> PaddedBatch:
    lens = [c.get_seq_length() for c in caches]
    lmax, nmax = max(lens), max(len(x) for x in inputs)
    cache = DynamicCache()
    if lmax:
        cache = DynamicCache(
            ddp_cache_data=[_stack_layer(caches, lens, li, lmax) for li in range(num_layers)]
        )
    ids = torch.zeros(len(inputs), nmax, dtype=torch.long)
    mask = torch.zeros(len(inputs), lmax + nmax, dtype=torch.long)
    pos = torch.zeros(len(inputs), nmax, dtype=torch.long)
    for i, (x, n) in enumerate(zip(inputs, lens, strict=True)):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, lmax - n : lmax + len(x)] = 1
        pos[i] = torch.arange(n, n + nmax)
    return PaddedBatch(cache, ids, mask, pos, lens, [len(x) for x in inputs])


def _stack_layer(
    caches: list[DynamicCache], lens: list[int], li: int, lmax: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``li`` of every cache, left-padded with zeros to ``lmax`` and stacked."""
    ks: list[torch.Tensor | None] = []
    vs: list[torch.Tensor | None] = []
    for cache, n in zip(caches, lens, strict=True):
        if n:
            layer = cache.layers[li]
            ks.append(F.pad(layer.keys, (0, 0, lmax - n, 0)))
            vs.append(F.pad(layer.values, (0, 0, lmax - n, 0)))
        else:
            ks.append(None)
            vs.append(None)
    like = next(k for k in ks if k is not None)
    zero = torch.zeros(1, like.shape[1], lmax, like.shape[3], dtype=like.dtype, device=like.device)
    return (
        torch.cat([zero if k is None else k for k in ks]),
        torch.cat([zero if v is None else v for v in vs]),
    )
