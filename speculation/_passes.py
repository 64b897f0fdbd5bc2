"""The verifier's forward pass over a plan's rows, in one of its modes (``verify.py`` picks).

- ``forward_rows(model, device, rows, mode)`` -> (each row's logits at its inputs and its
  cache after them, the mode that ran). Modes: ``"fused"`` (one call of the C stack: each
  linear one matmul over all rows, each row attending to its own session's slab; falls back
  to ``"serial"`` where a cache is not a slab the C stack reads), ``"one"`` / ``"serial"``
  (each row a forward of its own, its session's cache extended in place) and ``"stacked"``
  (one transformers forward over the caches left-padded into a batch, ``_kvstack.py``).
- ``prefill(model, device, cache, ids, options=None, generator=None)``: a session's prompt
  into its cache; with ``options``, the token the target picks after it (a first lead).
- ``device_of(model)``: where the target's weights live (inputs go there).
Runs in a worker thread: no trio calls here.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from p2pnode.inference._cpu import fastpath as _fastpath
from p2pnode.inference._cpu.kvslab import Slab
from p2pnode.speculation._accept import accept_draft
from p2pnode.speculation._batching import Row
from p2pnode.speculation._blocks import SamplingOptions
from p2pnode.speculation._kvstack import pad_batch

__all__ = ["device_of", "forward_rows", "prefill"]


def forward_rows(
    model: torch.nn.Module, device: torch.device, rows: list[Row], mode: str
) -> tuple[list[tuple[torch.Tensor, DynamicCache]], str]:
    """Each row's logits at its inputs and its cache after them (one pass for all)."""
    inputs = [row.inputs for row in rows]
    if mode == "fused":
        slabs = _slabs(model, rows)
        if slabs is not None:  # one C pass, each session's cache extended in place
            logits = _fastpath.extend_many(model, slabs, inputs)
            return [(lg, row.session.cache) for lg, row in zip(logits, rows, strict=True)], mode
        mode = "serial"  # a cache the C stack cannot read: each row on its own
    if mode in ("one", "serial"):  # each session's own cache, extended in place
        got = []
        for row in rows:
            cache = row.session.cache
            ids = torch.tensor([row.inputs], device=device)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            got.append((out.logits[0], cache))
        return got, mode
    batch = pad_batch([r.session.cache for r in rows], inputs, model.config.num_hidden_layers)
    out = model(**batch.model_inputs(device))
    caches = batch.split()
    return [(out.logits[i, : len(x)], caches[i]) for i, x in enumerate(inputs)], mode


@torch.inference_mode()
def prefill(
    model: torch.nn.Module,
    device: torch.device,
    cache: DynamicCache,
    ids: list[int],
    options: SamplingOptions | None = None,
    generator: torch.Generator | None = None,
) -> int | None:
    """``ids`` into ``cache``; with ``options``, the token the target picks after them."""
    if options is None:
        model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True)
        return None
    logits = model(
        input_ids=torch.tensor([ids], device=device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[0]
    return accept_draft(options, logits, (), None, generator)[1]


def _slabs(model: torch.nn.Module, rows: list[Row]) -> list[Slab] | None:
    """Each row's session cache as a one-row slab, or None where the C stack's batched pass
    does not run the target (no plan: not a CPU Llama, kernels off)."""
    slabs = [_fastpath.slab_of(row.session.cache, model) for row in rows]
    return None if any(s is None for s in slabs) else slabs  # type: ignore[return-value]


def device_of(model: torch.nn.Module) -> torch.device:
    """Where the target's weights live: inputs go there, sampling stays on the CPU."""
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):  # a wrapper without parameters (bench/gpu_check.py)
        return torch.device("cpu")
