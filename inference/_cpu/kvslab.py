"""A preallocated KV cache in the radix tree's layout, for transformers' Cache API.

Contract:
- ``Slab(num_layers, kv_heads, head_dim, batch, capacity)`` holds ONE tensor ``kv`` of shape
  ``[layers, 2, batch, kv_heads, capacity, head_dim]`` (fp32) and a length per layer. Its
  ``cache`` (a ``transformers.Cache``) hands each attention layer views ``[batch, heads, n,
  head_dim]`` of the first ``n`` positions: a forward writes its new keys/values in place and
  copies nothing else (``DynamicCache`` concatenates the whole cache on every step: a copy of
  all the KV per token).
- Capacity doubles (one copy) when a write would overflow.
- ``load(prefix_kv)`` fills the first ``T`` positions of row 0 from a radix-layout tensor
  ``[layers, 2, kv_heads, T, head_dim]`` (one copy); ``load_parts(parts)`` does it from the
  radix nodes' spans without concatenating them first. ``load_parts(..., defer=True)`` only
  records the spans (holding them): the first read of ``kv`` copies them, unless the C decoder
  stack takes them first (``take_pending``) and copies each layer's on another thread while
  the layers before it compute. ``rows(b, begin, end)`` is a view in the radix layout,
  ``export(b, begin, end)`` a contiguous copy of it.
- ``crop(n)`` drops the last ``n`` positions (no copy).
- ``SlabPool``: finished sequences' slab tensors, handed to the next sequence of a fitting
  shape instead of a fresh allocation (bounded in bytes). A fresh tensor of a cache hit's size
  (58 MB for 1,000 cached tokens) takes a page fault per 4 KB page on its first write: 25 of
  the 30 ms that loading 1,000 cached tokens took here; into a reused tensor, 4-8 ms.
  Only the owner of a slab that nothing else reads may give it back.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_MIN_CAPACITY = 256


class _SlabLayer(DynamicLayer):
    """One decoder layer's view of the slab. ``keys`` and ``values`` are views made when read:
    refreshing two views per layer on every length change cost ~0.6 ms a decode step (60
    refreshes), and the fast path reads the slab itself, never these."""

    def __init__(self, slab: Slab, index: int) -> None:
        super().__init__()
        self.slab, self.index, self.n = slab, index, 0
        self.dtype, self.device = slab._kv.dtype, slab._kv.device
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:
        return self.slab.kv[self.index, 0, :, :, : self.n]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        _only_none(value)

    @property
    def values(self) -> torch.Tensor:
        return self.slab.kv[self.index, 1, :, :, : self.n]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        _only_none(value)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, t = self.n, key_states.shape[-2]
        self.slab.reserve(n + t)
        kv = self.slab.kv
        kv[self.index, 0, :, :, n : n + t].copy_(key_states)
        kv[self.index, 1, :, :, n : n + t].copy_(value_states)
        self.n = n + t
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n

    def crop(self, max_length: int) -> None:
        # transformers' DynamicLayer.crop: a negative value drops that many tokens, any other
        # keeps the first max_length (callers use both through DynamicCache.crop).
        keep = self.n + max_length if max_length < 0 else max_length
        self.n = max(0, min(self.n, keep))

    def reset(self) -> None:
        self.n = 0


def _only_none(value: torch.Tensor | None) -> None:
    # DynamicLayer.__init__ sets None; any other assignment would be lost, so it is refused.
    if value is not None:
        raise TypeError("a slab layer's KV lives in its slab: write through update() or the slab")


class Slab:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        batch: int = 1,
        capacity: int = _MIN_CAPACITY,
        dtype: torch.dtype = torch.float32,
        kv: torch.Tensor | None = None,
    ) -> None:
        """``kv``: a tensor to reuse (``SlabPool``), of this shape with at least ``capacity``
        positions; its contents are ignored."""
        shape = (num_layers, 2, batch, kv_heads, max(capacity, 1), head_dim)
        if kv is None:
            kv = torch.empty(shape, dtype=dtype)
        elif kv.dtype != dtype or kv.shape[:4] + kv.shape[5:] != shape[:4] + shape[5:]:
            raise ValueError(f"a reused KV tensor {tuple(kv.shape)} does not fit {shape}")
        elif kv.shape[4] < shape[4] or not kv.is_contiguous():
            raise ValueError(f"a reused KV tensor has {kv.shape[4]} positions, needs {shape[4]}")
        self._kv = kv
        # (row, first position, radix-layout span) still to copy in: see load_parts
        self._pending: list[tuple[int, int, torch.Tensor]] = []
        self.layers = [_SlabLayer(self, i) for i in range(num_layers)]
        self.cache = Cache(layers=self.layers)

    @property
    def kv(self) -> torch.Tensor:
        """The KV tensor, with every deferred span copied in."""
        if self._pending:
            pending, self._pending = self._pending, []
            for row, pos, part in pending:
                self._kv[:, :, row, :, pos : pos + part.shape[-2]].copy_(part)
        return self._kv

    def take_pending(self) -> tuple[torch.Tensor, list[tuple[int, int, torch.Tensor]]]:
        """The KV tensor as it is and the deferred spans, now the caller's to copy in before
        anything reads those positions."""
        pending, self._pending = self._pending, []
        return self._kv, pending

    @property
    def length(self) -> int:
        return self.layers[0].n

    @property
    def capacity(self) -> int:
        return self._kv.shape[4]

    @property
    def batch(self) -> int:
        return self._kv.shape[2]

    def reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity, _MIN_CAPACITY)
        old = self.kv
        shape = list(old.shape)
        shape[4] = cap
        self._kv = torch.empty(shape, dtype=old.dtype)
        used = max(layer.n for layer in self.layers)
        self._kv[:, :, :, :, :used].copy_(old[:, :, :, :, :used])

    def set_length(self, n: int) -> None:
        self.reserve(n)
        for layer in self.layers:
            layer.n = n

    def load_parts(self, parts: list[torch.Tensor], row: int = 0, defer: bool = False) -> None:
        """Positions ``[0, sum of spans)`` of ``row`` from radix-layout spans, in order;
        ``defer``: recorded, copied on first read (see the module contract)."""
        total = sum(p.shape[-2] for p in parts)
        self.reserve(total)
        pos = 0
        for p in parts:
            t = p.shape[-2]
            if defer:
                self._pending.append((row, pos, p))
            else:
                self.kv[:, :, row, :, pos : pos + t].copy_(p)
            pos += t
        if row == 0:
            self.set_length(total)

    def load(self, prefix_kv: torch.Tensor) -> None:
        self.load_parts([prefix_kv])

    def rows(self, b: int, begin: int, end: int) -> torch.Tensor:
        """View ``[layers, 2, kv_heads, end - begin, head_dim]`` of row ``b``."""
        return self.kv[:, :, b, :, begin:end]

    def export(self, b: int, begin: int, end: int) -> torch.Tensor:
        return self.rows(b, begin, end).contiguous()

    def crop(self, n: int) -> None:
        self.cache.crop(-n)


class SlabPool:
    """See the module contract. ``max_bytes`` bounds what the pool holds; a tensor is reused
    for a request of up to its own capacity and at least half of it (more would waste it)."""

    def __init__(self, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._free: list[torch.Tensor] = []

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._free)

    def slab(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        batch: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
    ) -> Slab:
        capacity = max(capacity, 1)
        want = (num_layers, 2, batch, kv_heads)
        fitting = [
            (t.shape[4], i)
            for i, t in enumerate(self._free)
            if t.dtype == dtype
            and tuple(t.shape[:4]) == want
            and t.shape[5] == head_dim
            and capacity <= t.shape[4] <= 2 * capacity
        ]
        kv = self._free.pop(min(fitting)[1]) if fitting else None  # the smallest that fits
        return Slab(num_layers, kv_heads, head_dim, batch, capacity, dtype, kv=kv)

    def give(self, slab: Slab) -> None:
        """Keep ``slab``'s tensor for reuse (the slab must not be used again)."""
        t = slab._kv  # deferred spans are dropped, not copied into a tensor being given back
        size = t.numel() * t.element_size()
        if size > self.max_bytes or not t.is_contiguous():
            return
        while self._free and self.held_bytes + size > self.max_bytes:
            self._free.pop(0)  # the oldest first
        self._free.append(t)
