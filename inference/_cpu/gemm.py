"""Prefill-sized matmuls (more than ``_kernels.MAX_ROWS`` rows) on a packed copy of a weight.

Two packed forms, one chosen per process by timing both (``choice()``):
- ``panels``: the C kernel ``gemm_panels`` (``kernels.c``) on the weight in panels of
  ``panel_width()`` outputs, ``[N / GN, K, GN]``. On the AVX2 EPYC (Zen 2) these notes were
  measured on, it ran the model's shapes at 84-87 GFLOP/s at 50 rows and 93-100 at 128-1,024
  rows on one thread, against oneDNN's 55-65 and 67-76.
- ``onednn``: oneDNN's GEMM on its blocked copy (``torch.ops.mkldnn._reorder_linear_weight``),
  multi-threaded by torch. With two threads it beat the panels' start-a-thread-per-call split
  below ~128 rows here, and it may win on CPUs this was not measured on (AVX-512), hence the
  timing rather than a fixed pick.

Contract:
- ``prefill_weight(w)``: a ``PrefillWeight`` for an fp32 ``[N, K]`` weight, or None (packing
  off by ``P2PNODE_PACKED_PREFILL=0``, or neither form available): the caller keeps
  ``F.linear``. Either form is a copy of the weight (its size again in memory).
- ``PrefillWeight(x)``: ``x @ w.T`` for fp32 ``x [rows, K]`` (contiguous), ``[rows, N]`` out.
  Float rounding apart from ``F.linear`` (each output of ``panels`` sums over k in order).
- ``choice()``: "panels", "onednn" or "plain", cached; ``P2PNODE_PREFILL_GEMM=panels|onednn``
  pins it (a form that is unavailable falls back to the other).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from functools import cache
from typing import Protocol

import torch

from p2pnode.inference._cpu import kernels as _kernels

log = logging.getLogger(__name__)

__all__ = ["PanelWeight", "PrefillWeight", "choice", "pack_panels", "panel_width", "prefill_weight"]


class PrefillWeight(Protocol):
    kind: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def panel_width() -> int:
    lib = _kernels.library()
    return 0 if lib is None else int(lib.panel_width())


def pack_panels(w: torch.Tensor, width: int) -> torch.Tensor:
    """``w [N, K]`` as ``[N / width, K, width]``: the weights of one input for ``width``
    consecutive outputs side by side. Needs ``N % width == 0``."""
    n, k = w.shape
    if width < 1 or n % width:
        raise ValueError(f"{n} outputs do not split into panels of {width}")
    return w.reshape(n // width, width, k).transpose(1, 2).contiguous()


class PanelWeight:
    """The ``panels`` form: ``packed`` in the layout of a build whose ``panel_width()`` is
    ``width`` (the C decoder stack reads it directly for prefill rows)."""

    kind = "panels"

    def __init__(self, w: torch.Tensor, lib: ctypes.CDLL, width: int) -> None:
        self.n, self.k = w.shape
        self.width = width  # the build's panel_width(): another build reads another layout
        self.packed = pack_panels(w, width)
        self._fn = lib.gemm_panels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        y = torch.empty(rows, self.n, dtype=torch.float32)
        self._fn(
            self.packed.data_ptr(),
            x.data_ptr(),
            y.data_ptr(),
            rows,
            self.n,
            self.k,
            torch.get_num_threads(),
        )
        return y


class _OneDNN:
    kind = "onednn"

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def _onednn(w: torch.Tensor) -> _OneDNN | None:
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return _OneDNN(torch.ops.mkldnn._reorder_linear_weight(w, 64))
    except (RuntimeError, AttributeError) as exc:  # a torch built without oneDNN's linear
        log.info("oneDNN linear unavailable: %s", exc)
        return None


def _panels(w: torch.Tensor) -> PanelWeight | None:
    lib, width = _kernels.library(), panel_width()
    if lib is None or width < 1 or w.shape[0] % width:
        return None
    return PanelWeight(w, lib, width)


def panels_for(w: torch.Tensor) -> PanelWeight | None:
    """``w`` (fp32, 2-D) packed as panels whatever ``choice()`` says, or None where this build
    has none: for callers that need the C stack's own GEMM (a pass of many decode rows)."""
    if w.dtype != torch.float32 or w.dim() != 2:
        return None
    return _panels(w)


def _round_s(calls: list[tuple[PrefillWeight, torch.Tensor]], rounds: int = 5) -> float:
    """Best seconds of one round of ``f(x)`` over ``calls`` in turn."""
    for f, x in calls:  # warm: page faults, oneDNN's kernel selection
        f(x)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for f, x in calls:
            f(x)
        best = min(best, time.perf_counter() - t0)
    return best


@cache
def choice() -> str:
    if os.environ.get("P2PNODE_PACKED_PREFILL", "1") == "0":
        return "plain"
    pinned = os.environ.get("P2PNODE_PREFILL_GEMM", "auto")
    g = torch.Generator().manual_seed(0)
    # A cached-prefix extend's shape: 64 rows through the MLP's 1,536 x 576 and 576 x 1,536
    # weights (the hit is the prefill whose latency a user waits on; longer prefills favoured
    # the panels more here). Six distinct weights in turn, as a forward calls them: one weight
    # timed alone stays in L2, and on an AVX-512 Xeon (2026-12-06) that made oneDNN look 4-30 %
    # faster where, in turn over 4-8 weights, it was 6-20 % slower, and the C prefill it then
    # ruled out took a cache hit's TTFT from 145 to 200 ms.
    ws = [torch.randn(*shape, generator=g) for shape in [(1536, 576), (576, 1536)] * 3]
    xs = {k: torch.randn(64, k, generator=g) for k in (576, 1536)}
    calls = {}
    for kind, make in (("panels", _panels), ("onednn", _onednn)):
        forms = [make(w) for w in ws]
        if all(f is not None for f in forms):
            calls[kind] = [(f, xs[w.shape[1]]) for f, w in zip(forms, ws, strict=True)]
    if not calls:
        return "plain"
    if pinned in calls:
        return pinned
    times = {kind: _round_s(c) for kind, c in calls.items()}
    pick = min(times, key=times.__getitem__)
    log.info(
        "prefill GEMM: %s (%s)", pick, ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items())
    )
    return pick


def prefill_weight(w: torch.Tensor) -> PrefillWeight | None:
    """The packed form ``choice()`` names for fp32 ``w``, or the other where that one cannot
    take it (e.g. outputs not a multiple of the panel width), or None."""
    if w.dtype != torch.float32 or w.dim() != 2:
        return None
    kind = choice()
    if kind == "plain":
        return None
    makers = [_panels, _onednn] if kind == "panels" else [_onednn, _panels]
    for make in makers:
        form = make(w)
        if form is not None:
            return form
    return None
