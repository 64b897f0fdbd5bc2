"""Compute backends behind the engine: the real model (``HFBackend``) or a cost-model delay.

Contract (``Backend``): all calls come from one thread at a time (the engine's scheduler).
- ``new_state(prefix_kv, prefix_len)`` starts a sequence whose first ``prefix_len`` tokens
  already have KV (``prefix_kv`` in the radix layout ``[layers, 2, kv_heads, T, head_dim]``, or
  ``None`` when ``prefix_len`` is 0 or the backend keeps no KV).
- ``extend(state, tokens)`` runs the tokens (batch of one, chunked prefill) and returns the
  logits ``[V]`` after the last one.
- ``decode(states, tokens)`` feeds one token to each state in ONE batched forward and returns
  logits ``[B, V]``. ``HFBackend`` keeps the decoding sequences in a left-padded batched cache
  (attention mask + per-row position ids) and rebuilds it only when the set of states changes.
- ``export_kv(state, begin, end)`` copies the KV of tokens ``[begin, end)`` out (radix layout)
  for the prefix cache; ``free(state)`` drops a finished sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from p2pnode.inference._backend_protocol import Backend
from p2pnode.inference.emulated import EmulatedBackend, EmulatedLogits

__all__ = ["Backend", "EmulatedBackend", "HFBackend", "emulated_logits"]


class _HFState:
    __slots__ = ("length", "cache", "row", "freed")

    def __init__(self, cache: DynamicCache, length: int) -> None:
        self.length = length
        self.cache: DynamicCache | None = cache
        self.row: int | None = None  # row in the batched cache while decoding
        self.freed = False


class _Batch:
    def __init__(
        self, rows: list[_HFState], cache: DynamicCache, pads: list[int], mask: torch.Tensor
    ):
        self.rows = rows
        self.cache = cache
        self.pads = pads
        self.mask = mask


class HFBackend:
    """The real transformers model, fp32 on CPU."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        self.model = model
        self.vocab_size = int(cfg.vocab_size)
        self.num_layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
        self.head_dim = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        dtype_size = next(model.parameters()).element_size()
        self.kv_bytes_per_token = self.num_layers * 2 * self.kv_heads * self.head_dim * dtype_size
        self._batch: _Batch | None = None

    # ---- per-state KV access ---------------------------------------------------------------
    def _layer_kv(self, state: _HFState, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, H, length, D]`` keys and values of one layer, wherever the state lives."""
        if state.row is not None and self._batch is not None:
            b, r = self._batch, state.row
            lay = b.cache.layers[layer]
            p = b.pads[r]
            return lay.keys[r : r + 1, :, p:], lay.values[r : r + 1, :, p:]
        assert state.cache is not None
        lay = state.cache.layers[layer]
        return lay.keys, lay.values

    def new_state(self, prefix_kv: torch.Tensor | None, prefix_len: int) -> _HFState:
        if prefix_kv is None or prefix_len == 0:
            return _HFState(DynamicCache(), 0)
        data = [
            (prefix_kv[i, 0].unsqueeze(0), prefix_kv[i, 1].unsqueeze(0))
            for i in range(self.num_layers)
        ]
        return _HFState(DynamicCache(ddp_cache_data=data), prefix_len)

    def extend(self, state: _HFState, tokens: list[int]) -> torch.Tensor:
        if state.row is not None:
            self._detach(state)
        n = len(tokens)
        pos = torch.arange(state.length, state.length + n).unsqueeze(0)
        out = self.model(
            input_ids=torch.tensor([tokens]),
            position_ids=pos,
            past_key_values=state.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        state.length += n
        return out.logits[0, -1]

    def decode(self, states: list[_HFState], tokens: list[int]) -> torch.Tensor:
        if self._batch is None or self._batch.rows != states:
            self._rebuild(states)
        b = self._batch
        assert b is not None
        mask = torch.cat([b.mask, torch.ones(len(states), 1, dtype=b.mask.dtype)], dim=1)
        pos = torch.tensor([[s.length] for s in states])
        out = self.model(
            input_ids=torch.tensor(tokens).unsqueeze(1),
            attention_mask=mask,
            position_ids=pos,
            past_key_values=b.cache,
            use_cache=True,
        )
        b.mask = mask
        for s in states:
            s.length += 1
        return out.logits[:, -1]

    def _detach(self, state: _HFState) -> None:
        """Move a state out of the batch into its own cache."""
        data = [tuple(t.clone() for t in self._layer_kv(state, i)) for i in range(self.num_layers)]
        state.cache = DynamicCache(ddp_cache_data=data)
        state.row = None

    def _rebuild(self, states: list[_HFState]) -> None:
        old = self._batch
        if old is not None:
            for s in old.rows:
                if not s.freed and s not in states:
                    self._detach(s)
        width = max(s.length for s in states)
        pads = [width - s.length for s in states]
        data = []
        for i in range(self.num_layers):
            ks, vs = [], []
            for s, p in zip(states, pads, strict=True):
                k, v = self._layer_kv(s, i)
                ks.append(F.pad(k, (0, 0, p, 0)) if p else k)
                vs.append(F.pad(v, (0, 0, p, 0)) if p else v)
            data.append(
                (torch.cat(ks) if len(ks) > 1 else ks[0], torch.cat(vs) if len(vs) > 1 else vs[0])
            )
        mask = torch.ones(len(states), width, dtype=torch.long)
        for r, p in enumerate(pads):
            mask[r, :p] = 0
        self._batch = _Batch(list(states), DynamicCache(ddp_cache_data=data), pads, mask)
        for r, s in enumerate(states):
            s.row = r
            s.cache = None

    def export_kv(self, state: _HFState, begin: int, end: int) -> torch.Tensor:
        layers = []
        for i in range(self.num_layers):
            k, v = self._layer_kv(state, i)
            layers.append(torch.stack([k[0, :, begin:end], v[0, :, begin:end]]))
        return torch.stack(layers).contiguous()

    def free(self, state: _HFState) -> None:
        state.freed = True
        state.cache = None
        b = self._batch
        if b is not None and all(s.freed for s in b.rows):
            self._batch = None


def emulated_logits(
    length: int, last: int, vocab_size: int, eos_token_id: int | None
) -> torch.Tensor:
    """The emulated model's logits as a dense ``[V]`` tensor (``emulated.EmulatedLogits``)."""
    return EmulatedLogits.after(length, last, vocab_size, eos_token_id).tensor()
