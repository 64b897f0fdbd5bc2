"""Compute backends behind the engine: the real model (``HFBackend``) or a cost-model delay.

Contract (``Backend``): all calls come from one thread at a time (the engine's scheduler).
- ``new_state(prefix_kv, prefix_len)`` starts a sequence whose first ``prefix_len`` tokens
  already have KV (``prefix_kv`` in the radix layout ``[layers, 2, kv_heads, T, head_dim]``, or
  the radix nodes' spans in that layout, in order, as ``RadixCache.gather_parts`` returns them;
  ``None`` when ``prefix_len`` is 0 or the backend keeps no KV); ``expect=n`` makes room for
  ``n`` positions up front (the engine passes its prompt's length).
- ``extend(state, tokens)`` runs the tokens (batch of one, chunked prefill) and returns the
  logits ``[V]`` after the last one; ``extend_rows(state, tokens, keep)`` the same pass, with
  the logits ``[keep, V]`` after each of the last ``keep`` (a teacher-forced score);
  ``concat_rows(parts)`` joins such rows in order.
- ``decode(states, tokens)`` feeds one token to each state in ONE batched forward and returns
  logits ``[B, V]``. ``HFBackend`` keeps the decoding sequences in a left-padded batched slab
  (attention mask + per-row position ids) and rebuilds it only when the set of states changes.
- ``export_kv(state, begin, end)`` copies the KV of tokens ``[begin, end)`` out (radix layout)
  for the prefix cache; ``free(state)`` drops a finished sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from p2pnode.inference._backend_protocol import Backend
from p2pnode.inference._cpu import fastpath as _fastpath
from p2pnode.inference._cpu import kernels as _kernels
from p2pnode.inference._cpu.kvslab import Slab, SlabPool
from p2pnode.inference.emulated import EmulatedBackend, EmulatedLogits

if TYPE_CHECKING:
    from p2pnode.inference.costmodel import CostModel
    from p2pnode.inference.scoring import ModelScorer

__all__ = ["Backend", "EmulatedBackend", "HFBackend", "emulated_logits"]

# Positions a slab gets beyond what it must hold at creation: decode steps append in place and
# the slab doubles (one copy) only when they run out.
_SLACK = 256


class _HFState:
    __slots__ = ("length", "slab", "row", "freed")

    def __init__(self, slab: Slab | None, length: int) -> None:
        self.length = length
        self.slab = slab  # its own KV while not in the batch
        self.row: int | None = None  # row in the batched slab while decoding
        self.freed = False


class _Batch:
    def __init__(self, rows: list[_HFState], slab: Slab, pads: list[int], mask: torch.Tensor):
        self.rows = rows
        self.slab = slab
        self.pads = pads
        self.mask = mask


class HFBackend:
    """The real transformers model, fp32 on CPU.

    KV lives in preallocated slabs (``_kvslab.Slab``, the radix tree's layout with a batch
    axis): a forward writes its new positions in place, a cache hit is one copy from the tree's
    spans, an export one slice. The decoding batch has one slab, left-padded, rebuilt when the
    set of decoding states changes."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        self.model = model
        self.vocab_size = int(cfg.vocab_size)
        self.num_layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
        self.head_dim = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self.dtype = next(model.parameters()).dtype
        dtype_size = next(model.parameters()).element_size()
        self.kv_bytes_per_token = self.num_layers * 2 * self.kv_heads * self.head_dim * dtype_size
        self._batch: _Batch | None = None
        self._pool = SlabPool()

    def _slab(self, batch: int, capacity: int) -> Slab:
        return self._pool.slab(
            self.num_layers, self.kv_heads, self.head_dim, batch, capacity + _SLACK, self.dtype
        )

    # ---- per-state KV access ---------------------------------------------------------------
    def _rows(self, state: _HFState, begin: int, end: int) -> torch.Tensor:
        """Radix-layout view of the state's positions ``[begin, end)``, wherever it lives."""
        if state.row is not None and self._batch is not None:
            b, r = self._batch, state.row
            return b.slab.rows(r, b.pads[r] + begin, b.pads[r] + end)
        assert state.slab is not None
        return state.slab.rows(0, begin, end)

    def new_state(
        self,
        prefix_kv: torch.Tensor | Sequence[torch.Tensor] | None,
        prefix_len: int,
        expect: int = 0,
    ) -> _HFState:
        """``prefix_kv``: one radix-layout tensor, or the tree's spans in order (no concat).
        ``expect``: the positions the caller means to fill (its prompt), room made up front."""
        # Without room for the whole prompt, a chunked miss outgrew its cache between chunks:
        # one copy of the first 1,024 positions' KV into a fresh, doubled tensor (~125 ms of
        # a 1,050-token miss's ~3.2 s here, most of it the new tensor's page faults).
        slab = self._slab(1, max(prefix_len, expect))
        if prefix_kv is not None and prefix_len > 0:
            parts = [prefix_kv] if isinstance(prefix_kv, torch.Tensor) else list(prefix_kv)
            # Deferred: the C stack copies each layer's prefix on another thread while the
            # layers before it compute (46 MB for 1,000 cached tokens: ~5 ms of a hit's TTFT).
            slab.load_parts(parts, defer=True)
            if slab.length != prefix_len:
                raise ValueError(f"prefix KV covers {slab.length} tokens, not {prefix_len}")
        else:
            prefix_len = 0
        return _HFState(slab, prefix_len)

    def extend(self, state: _HFState, tokens: list[int]) -> torch.Tensor:
        return self._extend(state, tokens, 1)[-1]

    def extend_rows(self, state: _HFState, tokens: list[int], keep: int) -> torch.Tensor:
        return self._extend(state, tokens, keep).float()

    def concat_rows(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts)

    def make_generator(self, seed: int | None) -> torch.Generator:
        from p2pnode.inference.sampling import make_generator

        return make_generator(seed)

    def no_grad(self) -> contextlib.AbstractContextManager:
        return torch.inference_mode()

    def scorer(self, cost: CostModel) -> ModelScorer:
        from p2pnode.inference.scoring import ModelScorer

        return ModelScorer(self.model, cost)

    def _extend(self, state: _HFState, tokens: list[int], keep: int) -> torch.Tensor:
        if state.row is not None:
            self._detach(state)
        assert state.slab is not None
        n = len(tokens)
        pos = torch.arange(state.length, state.length + n).unsqueeze(0)
        out = self.model(
            input_ids=torch.tensor([tokens]),
            position_ids=pos,
            past_key_values=state.slab.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        state.length += n
        return out.logits[0, -keep:]

    def decode(self, states: list[_HFState], tokens: list[int]) -> torch.Tensor:
        if self._batch is None or self._batch.rows != states:
            self._rebuild(states)
        b = self._batch
        assert b is not None
        mask = torch.cat([b.mask, torch.ones(len(states), 1, dtype=b.mask.dtype)], dim=1)
        pos = torch.tensor([[s.length] for s in states])
        if _kernels.enabled() and _fastpath.plan(self.model) is not None:
            # Every row at the same slot, each attending from its own first position: the
            # left pads are never read, so no mask is built.
            width = b.slab.length
            ids = torch.tensor(tokens)
            rows = list(range(len(states)))
            hidden = _fastpath.run(
                self.model, ids, b.slab, rows, [width] * len(rows), b.pads, pos.reshape(-1)
            )
            b.slab.set_length(width + 1)
            b.mask = mask
            for s in states:
                s.length += 1
            return _fastpath.head(self.model, hidden)
        out = self.model(
            input_ids=torch.tensor(tokens).unsqueeze(1),
            attention_mask=mask if len(states) > 1 else None,
            position_ids=pos,
            past_key_values=b.slab.cache,
            use_cache=True,
        )
        b.mask = mask
        for s in states:
            s.length += 1
        return out.logits[:, -1]

    def _detach(self, state: _HFState) -> None:
        """Move a state out of the batch into its own slab (one copy)."""
        slab = self._slab(1, state.length)
        slab.load_parts([self._rows(state, 0, state.length)])
        state.slab, state.row = slab, None

    def _rebuild(self, states: list[_HFState]) -> None:
        old = self._batch
        if old is not None:
            for s in old.rows:
                if not s.freed and s not in states:
                    self._detach(s)
        width = max(s.length for s in states)
        pads = [width - s.length for s in states]
        slab = self._slab(len(states), width)
        for r, (s, p) in enumerate(zip(states, pads, strict=True)):
            if p:  # masked out, but must be finite: 0 x NaN is NaN in the attention sum
                slab.rows(r, 0, p).zero_()
            slab.rows(r, p, width).copy_(self._rows(s, 0, s.length))
        slab.set_length(width)
        mask = torch.ones(len(states), width, dtype=torch.long)
        for r, p in enumerate(pads):
            mask[r, :p] = 0
        self._batch = _Batch(list(states), slab, pads, mask)
        for r, s in enumerate(states):
            s.row = r
            if s.slab is not None:
                self._pool.give(s.slab)
            s.slab = None
        if old is not None:  # every row of it was detached or copied above
            self._pool.give(old.slab)

    def export_kv(self, state: _HFState, begin: int, end: int) -> torch.Tensor:
        # Always a copy (``contiguous`` would return a view of an exactly full slab): the
        # slab's tensor goes back to the pool when the state is freed.
        return self._rows(state, begin, end).clone(memory_format=torch.contiguous_format)

    def free(self, state: _HFState) -> None:
        state.freed = True
        if state.slab is not None:
            self._pool.give(state.slab)
        state.slab = None
        b = self._batch
        if b is not None and all(s.freed for s in b.rows):
            self._batch = None
            self._pool.give(b.slab)


def emulated_logits(
    length: int, last: int, vocab_size: int, eos_token_id: int | None
) -> torch.Tensor:
    """The emulated model's logits as a dense ``[V]`` tensor (``emulated.EmulatedLogits``)."""
    return EmulatedLogits.after(length, last, vocab_size, eos_token_id).tensor()
