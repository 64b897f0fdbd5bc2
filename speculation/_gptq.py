"""GPTQ (Frantar et al. 2022) for the W4A16 draft: Hessian-based int4 rounding with error feedback.

Contract:
- ``calibration_ids(tokenizer, n_seqs, seq_len)`` -> ``[n_seqs, seq_len]`` token ids of real text:
  MMLU 5-shot prefixes (``p2pnode.datasets.mmlu``) interleaved with chat-template conversations
  built from MMLU questions, so both plain text and the chat format the edge serves are seen.
- ``gptq_linear(w, h, group_size)`` quantizes one ``[out, in]`` weight given ``h = X^T X`` of its
  inputs: columns are rounded left to right (symmetric int4, one scale per ``group_size`` inputs,
  chosen when the group's first column is reached) and each column's rounding error is pushed
  onto the columns not yet rounded through the inverse Hessian (lazy blocks of 128 columns).
  Returns ``(q int32 [out, in] in 0..15, scales fp16 [in / group, out])``: GPTQ's symmetric
  convention w ~ (q - 8) * scale, the same as ``draft.quantize_sym_int4``.
- ``gptq_model(model, ids, group_size, progress)`` walks the decoder layers in order: each layer's
  linears get their Hessians from inputs produced by the ALREADY QUANTIZED earlier layers (so
  later layers compensate earlier errors), are quantized, and the layer is re-run to feed the
  next one. The model is modified in place (weights replaced by their dequantized values);
  returns ``{layer_index: {linear_name: (q, scales)}}``.
- With fewer calibration tokens than a layer's input width the Hessian is rank-deficient and GPTQ
  does no better than rounding; ``gptq_model`` raises ``QuantizeError`` (a ``ValueError``) below
  2x the widest input.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from p2pnode.inference.models import LLAMA_LINEAR_GROUPS, LLAMA_LINEARS
from p2pnode.speculation._errors import QuantizeError

_BLOCK = 128
_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def calibration_ids(tokenizer, n_seqs: int = 12, seq_len: int = 256) -> torch.Tensor:
    """Real-text calibration batch: MMLU few-shot text and chat-formatted MMLU questions."""
    from p2pnode.datasets import mmlu

    rows: list[list[int]] = []
    for i, subject in enumerate(mmlu.subjects()):
        if len(rows) >= n_seqs:
            break
        if i % 2 == 0:
            text = mmlu.fewshot_prefix(subject, 5)
            ids = tokenizer(text)["input_ids"]
        else:
            ids = []
            for row in mmlu.load_split(subject, "dev"):
                msgs = [
                    {"role": "user", "content": mmlu.format_example(row, with_answer=False)},
                    {
                        "role": "assistant",
                        "content": f"The answer is {mmlu.LETTERS[row['answer']]}.",
                    },
                ]
                ids += list(tokenizer.apply_chat_template(msgs, tokenize=True)["input_ids"])
        if len(ids) >= seq_len:
            rows.append(ids[:seq_len])
    if len(rows) < n_seqs:
        raise QuantizeError(f"only {len(rows)} calibration sequences of {seq_len} tokens available")
    return torch.tensor(rows)


def _sym_params(w: torch.Tensor) -> torch.Tensor:
    """Per-row scale of a [out, group] slice: GPTQ symmetric 2 * max|w| / 15, shrunk by the
    factor in ``_SHRINK`` that minimizes the slice's |w - dequant(w)|^2.4 (GPTQ's ``mse`` option:
    clipping a few outliers buys finer steps for all other weights)."""
    base = 2 * w.abs().amax(-1, keepdim=True) / 15
    best, best_err = base, torch.full_like(base, float("inf"))
    for p in _SHRINK:
        scale = (base * p).clamp_min(1e-8).half().float()
        deq = (torch.clamp(torch.round(w / scale) + 8, 0, 15) - 8) * scale
        err = (w - deq).abs().pow(2.4).sum(-1, keepdim=True)
        better = err < best_err
        best, best_err = torch.where(better, scale, best), torch.where(better, err, best_err)
    return best.squeeze(-1)


@torch.no_grad()
def gptq_linear(
    w: torch.Tensor,
    h: torch.Tensor,
    group_size: int,
    *,
    percdamp: float = 0.01,
    act_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    if k % group_size or _BLOCK % group_size:
        raise QuantizeError(f"width {k} / block {_BLOCK} must be multiples of group {group_size}")
    w = w.detach().float().clone()
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += percdamp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    perm = torch.arange(k)
    static: torch.Tensor | None = None
    if act_order:
        # Static groups: scales fixed from the unrounded weights BEFORE permuting, so a column
        # keeps its contiguous group (g_idx = col // group) and the checkpoint layout is unchanged.
        static = torch.stack(
            [_sym_params(w[:, g : g + group_size]) for g in range(0, k, group_size)]
        )
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    hinv = hinv.float()
    q = torch.zeros(n, k, dtype=torch.int32)
    scales = torch.zeros(k // group_size, n)
    for i1 in range(0, k, _BLOCK):
        i2 = min(i1 + _BLOCK, k)
        w1, h1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            col = i1 + i
            if static is not None:
                scale = static[int(perm[col]) // group_size]
            elif col % group_size == 0:
                scale = _sym_params(w1[:, i : i + group_size])
                scales[col // group_size] = scale
            qc = torch.clamp(torch.round(w1[:, i] / scale) + 8, 0, 15)
            q[:, col] = qc.to(torch.int32)
            e = (w1[:, i] - (qc - 8) * scale) / h1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * h1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    if static is not None:
        q[:, perm] = q.clone()  # back to the original column order
        scales = static
    return q, scales.half()


def _passes(sequential: bool) -> tuple[tuple[str, ...], ...]:
    """Linears quantized per forward pass: all at once (fast) or group by group (true-sequential:
    o_proj sees quantized q/k/v and so on; ~2.5x the forwards for a small gain)."""
    return LLAMA_LINEAR_GROUPS if sequential else (LLAMA_LINEARS,)


def _layer_inputs(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Hidden states and keyword arguments the first decoder layer receives for ``ids``."""
    captured: dict = {}

    class _Stop(Exception):
        pass

    def hook(_mod, args, kwargs):
        captured["x"], captured["kw"] = args[0], dict(kwargs)
        raise _Stop

    handle = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    kw = {k: v for k, v in captured["kw"].items() if k not in ("past_key_values", "use_cache")}
    return captured["x"], kw


@torch.no_grad()
def gptq_model(
    model: nn.Module,
    ids: torch.Tensor,
    group_size: int,
    progress: Callable[[str], None] = lambda _msg: None,
    *,
    sequential: bool = False,
    act_order: bool = False,
) -> dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    layers = model.model.layers
    widest = max(lin.in_features for lin in layers[0].modules() if isinstance(lin, nn.Linear))
    if ids.numel() < 2 * widest:
        raise QuantizeError(
            f"{ids.numel()} calibration tokens < 2 x input width {widest}: add more"
        )
    started = time.monotonic()
    x, kw = _layer_inputs(model, ids)
    out: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for li, layer in enumerate(layers):
        out[li] = {}
        for group in _passes(sequential):
            hs: dict[str, torch.Tensor] = {}
            handles = []
            for name in group:

                def acc(_mod, args, _out, name: str = name, hs: dict = hs) -> None:
                    a = args[0].reshape(-1, args[0].shape[-1]).float()
                    hs[name] = hs.get(name, 0) + a.t() @ a

                handles.append(layer.get_submodule(name).register_forward_hook(acc))
            try:
                layer(x, **kw)
            finally:
                for hnd in handles:
                    hnd.remove()
            for name in group:
                lin = layer.get_submodule(name)
                q, scales = gptq_linear(lin.weight.data, hs[name], group_size, act_order=act_order)
                deq = (q.float() - 8).reshape(q.shape[0], -1, group_size)
                deq = deq * scales.float().t().unsqueeze(-1)
                lin.weight.data = deq.reshape(q.shape).to(lin.weight.dtype)
                out[li][name] = (q, scales)
        x = layer(x, **kw)
        progress(f"GPTQ layer {li + 1}/{len(layers)} done ({time.monotonic() - started:.0f} s)")
    return out
