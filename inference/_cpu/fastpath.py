"""A Llama model's forward in one C call (``llama_layers`` in ``kernels.c``) on the CPU:
decode steps and verify blocks (at most ``MAX_ROWS`` tokens), and prefills on one thread.

Why: a step of a 30-layer model through transformers is ~40 torch ops per layer; their
dispatch costs as much as streaming a small model's weights. The C stack runs the same
arithmetic (fp32, same weights, the same streaming kernels for every linear) with no dispatch,
and each row's result is independent of the other rows (a verify block gives a decode step's
bits). A prefill (more than ``MAX_ROWS`` tokens, at most ``MAX_PREFILL_ROWS``) runs the C
stack's prefill kernels: the panel GEMM on the linears' packed copies (``_gemm``) and a tiled
attention with an online softmax; it applies where the panels are this machine's prefill GEMM
and torch runs one thread (with more, oneDNN's and torch's attention use them all).

Contract:
- ``install(model)`` makes ``model(...)`` take the fast path when it applies and transformers'
  own forward otherwise; returns whether it installed (Llama-shaped decoder, fp32 activations,
  kernels available). Applies: no grad, at most ``MAX_ROWS`` new tokens per row (a prefill,
  up to ``MAX_PREFILL_ROWS``, under the conditions above), no attention
  mask (or an all-ones one), and a ``DynamicCache`` or a ``_kvslab.Slab`` cache (a
  ``DynamicCache`` is moved into a slab once, in place, so later steps append without copies).
  ``P2PNODE_KERNELS=0`` or ``_kernels.set_enabled(False)`` turns it off.
- ``run(model, ids, slab, batch_rows, slots, lo, positions)``: the explicit form for a batched
  slab with per-row offsets (``HFBackend``'s left-padded decode batch): row ``m`` writes its KV
  at ``slots[m]`` of slab row ``batch_rows[m]`` and attends over ``[lo[m], slots[m]]``. Returns
  the final hidden states ``[rows, hidden]`` (before the final norm); the caller sets lengths.
  Past ``MAX_ROWS`` rows (a decode batch of many sequences) the linears are the panel GEMM,
  packed for these passes where prefill chose oneDNN (float rounding away from the decode
  kernels' bits).
  ``head(model, hidden)``: their logits (the final norm in C, then the lm_head).
- ``extend_many(model, slabs, inputs)``: many sequences, each in a one-row slab of its own
  (``slab_of(cache, model)``: a session's cache as one), extended by their tokens in ONE C
  call (``llama_layers_multi``): every linear is one matmul over all their rows (past
  ``MAX_ROWS`` rows the panel GEMM, as ``run``'s, on ``threads`` threads, default torch's), each
  sequence's rows attend to its own slab. Returns each sequence's logits ``[tokens, vocab]``;
  each slab's length grows by its tokens. Where all rows number at most ``MAX_ROWS``, every
  row's bits are a one-token step's; past it, float rounding away (the GEMM sums in order).
- Numerics: float rounding only (norms, softmax and SiLU in another summation order); logits
  agree with the torch path to ~1e-4 on logits of magnitude ~20. A prefill's rows are float
  rounding away from the same rows as one-token steps (other kernels), not bitwise equal.
- The plan (weight pointers) is built on first use and checked on every call against the
  model's current tensors, so a replaced weight is never read through a stale pointer.
"""

from __future__ import annotations

import ctypes
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from p2pnode.inference._common import LLAMA_LINEARS
from p2pnode.inference._cpu import gemm as _gemm
from p2pnode.inference._cpu import kernels as _kernels
from p2pnode.inference._cpu.kvslab import Slab, _SlabLayer

# New tokens per sequence on the exact kernels (a row's bits those of a one-token step). Past
# 16 the forward is matmul-bound, and the streaming kernels lost to a packed GEMM: after 1,024
# cached tokens, 20/24/32 new tokens took 114/162/213 ms as one C call on them against
# 100/108/131 ms on torch's path with oneDNN; at 9-16 they were even.
MAX_ROWS = 16
# A prefill through the C stack holds ~21 KB of work buffers per row (the default model): this
# many rows bound it (~85 MB); the engine prefills in chunks of at most 1,024.
MAX_PREFILL_ROWS = 4096


def _c_struct(name: str, **fields: type) -> type[ctypes.Structure]:
    """A ctypes mirror of a struct of ``kernels.c``: its fields in declaration order."""
    return type(name, (ctypes.Structure,), {"_fields_": list(fields.items())})


_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
# lin_t: one linear layer; ``p`` is the panel-packed weight for prefill rows, or None.
_Lin = _c_struct("_Lin", kind=_i32, N=_i32, K=_i32, G=_i32, w=_ptr, s=_ptr, p=_ptr)
# kv_copy_t: a deferred prefix span (``Slab.take_pending``).
_KVCopy = _c_struct(
    "_KVCopy", src=_ptr, s_layer=_i64, s_kv=_i64, s_head=_i64, s_pos=_i64, n=_i32, row=_i32,
    pos=_i32, pad=_i32,
)  # fmt: skip


# kv_seg_t: one sequence's KV buffer and its element strides (``llama_layers_multi``).
_KVSeg = _c_struct(
    "_KVSeg", kv=_ptr, s_layer=_i64, s_kv=_i64, s_b=_i64, s_head=_i64, s_pos=_i64
)  # fmt: skip


def _copies(kv: torch.Tensor, pending: list[tuple[int, int, torch.Tensor]]) -> ctypes.Array:
    """The deferred spans the C stack copies in layer by layer; one it cannot read (not fp32,
    or its last axis strided) is copied here first."""
    out = []
    for row, pos, part in pending:
        n = part.shape[-2]
        if (
            part.dtype != kv.dtype
            or part.stride(-1) != 1
            or part.shape[:3] != kv[:, :, 0].shape[:3]
        ):
            kv[:, :, row, :, pos : pos + n].copy_(part)
            continue
        out.append(_KVCopy(part.data_ptr(), *part.stride()[:4], n, row, pos, 0))
    return (_KVCopy * len(out))(*out)


@dataclass
class _Plan:
    lib: ctypes.CDLL
    lins: ctypes.Array
    norms: ctypes.Array
    # (the dict holding the attribute, its name, the tensor the plan points at): a plain dict
    # lookup, where nn.Module.__getattr__ on ~500 tensors took ~0.7 ms, twice per decode step
    refs: list[tuple[dict, str, torch.Tensor]]
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    scale: float
    final_norm: int  # the final RMSNorm's weight
    mods: list[nn.Module]  # the linears, in ``lins``' order
    # ``lins`` with every fp32 weight's panel-packed copy (``_gemm``): None until asked, then
    # the array, or False where some linear has none (prefill then stays on transformers)
    prefill_lins: ctypes.Array | bool | None = None
    # The same for passes of many decode rows (a verifier's tenants together): panels of their
    # own where prefill chose oneDNN, whose GEMM the C stack cannot call (kept alive here).
    batch_lins: ctypes.Array | bool | None = None
    batch_panels: list[_gemm.PanelWeight] = field(default_factory=list)

    def current(self) -> bool:
        return all(d.get(attr) is t for d, attr, t in self.refs)


_plans: weakref.WeakKeyDictionary[nn.Module, _Plan | None] = weakref.WeakKeyDictionary()


def _ref(mod: nn.Module, attr: str, t: torch.Tensor) -> tuple[dict, str, torch.Tensor]:
    """Where ``mod.attr`` lives (a parameter, a buffer or a plain attribute) and its tensor."""
    for d in (mod._parameters, mod._buffers, mod.__dict__):
        if attr in d:
            return d, attr, t
    raise AttributeError(f"{type(mod).__name__} has no tensor {attr!r}")


def _describe(mod: nn.Module, refs: list) -> _Lin | None:
    """One linear as the C side reads it, or None when it is of a kind the kernels lack."""
    if getattr(mod, "bias", None) is not None:
        return None
    q4 = getattr(mod, "q4", None)
    if q4 is not None and getattr(mod, "stream", False):  # speculation.draft.Int4Linear
        refs += [_ref(mod, "q4", q4), _ref(mod, "q4_scales", mod.q4_scales)]
        n, k = q4.shape[0], q4.shape[1] * 2
        # 3: int8 activations (gemv_q4a8); 4: the same in blocks of four rows (gemv_q4a8i)
        kind = 3 if getattr(mod, "int8_act", False) else 2
        if kind == 3 and getattr(mod, "interleaved", False):
            kind = 4
        return _Lin(kind, n, k, int(mod.group_size), q4.data_ptr(), mod.q4_scales.data_ptr())
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_contiguous():
        return None
    if w.dtype not in (torch.float32, torch.bfloat16) or w.shape[1] % 32 or w.device.type != "cpu":
        return None
    refs.append(_ref(mod, "weight", w))
    return _Lin(0 if w.dtype == torch.float32 else 1, w.shape[0], w.shape[1], 0, w.data_ptr(), None)


def _build(model: nn.Module) -> _Plan | None:
    lib = _kernels.library()
    cfg = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if lib is None or cfg is None or inner is None or getattr(cfg, "model_type", "") != "llama":
        return None
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return None
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return None
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    hidden = int(cfg.hidden_size)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    if head_dim % 16 or heads % kv_heads:
        return None
    refs: list = []
    lins, norms, mods = [], [], []
    scale = None
    for layer in inner.layers:
        for name in LLAMA_LINEARS:
            mod = layer.get_submodule(name)
            d = _describe(mod, refs)
            if d is None:
                return None
            lins.append(d)
            mods.append(mod)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            w = norm.weight
            if w.dtype != torch.float32 or not w.is_contiguous():
                return None
            refs.append(_ref(norm, "weight", w))
            norms.append(w.data_ptr())
        scale = float(layer.self_attn.scaling)
    final = inner.norm.weight
    if not lins or final.dtype != torch.float32 or not final.is_contiguous():
        return None
    if getattr(inner.norm, "variance_epsilon", None) != float(cfg.rms_norm_eps):
        return None
    refs.append(_ref(inner.norm, "weight", final))
    return _Plan(
        lib=lib,
        lins=(_Lin * len(lins))(*lins),
        norms=(ctypes.c_void_p * len(norms))(*norms),
        refs=refs,
        layers=len(inner.layers),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=int(cfg.intermediate_size),
        eps=float(cfg.rms_norm_eps),
        scale=float(scale),
        final_norm=final.data_ptr(),
        mods=mods,
    )


def plan(model: nn.Module) -> _Plan | None:
    """The model's plan (built once, rebuilt when its tensors changed), or None."""
    p = _plans.get(model, False)
    if p is False or (p is not None and not p.current()):
        p = _plans[model] = _build(model)
    return p


def _prefill_lins(p: _Plan) -> ctypes.Array | None:
    """``p.lins`` pointing each linear at its panel-packed copy (made on first use, as the
    transformers path would make it), or None where a linear has none: a bf16 or int4 one, or
    oneDNN's GEMM chosen on this machine (``_gemm.choice()``)."""

    def its_own(mod: _kernels.StreamLinear) -> _gemm.PanelWeight | None:
        packed = mod._packed()
        return packed if isinstance(packed, _gemm.PanelWeight) else None

    if p.prefill_lins is None:
        p.prefill_lins = _panel_lins(p, its_own) or False
    return p.prefill_lins or None


def _batch_lins(p: _Plan) -> ctypes.Array | None:
    """``_prefill_lins`` for a pass of many decode rows: where prefill chose oneDNN, the
    panels are packed for it alone (~the fp32 linears' size again, once). Prefill keeps its
    choice; a many-row pass on the decode kernels ran at a fifth of the panel GEMM's rate
    (16 tenants batched 1.7-1.9x one after another, against 4.3-4.5x with the panels)."""

    def packed_here(mod: _kernels.StreamLinear) -> _gemm.PanelWeight | None:
        weight = getattr(mod, "weight", None)
        packed = None if weight is None else _gemm.panels_for(weight.data)
        if packed is not None:
            p.batch_panels.append(packed)  # the table points into it: keep it alive
        return packed

    if p.batch_lins is None:
        p.batch_lins = _prefill_lins(p) or _panel_lins(p, packed_here) or False
    return p.batch_lins or None


def _panel_lins(
    p: _Plan, panels: Callable[[_kernels.StreamLinear], _gemm.PanelWeight | None]
) -> ctypes.Array | None:
    """The C stack's table of linears, each pointing at the panels ``panels`` gives its fp32
    module, or None where one has none (a bf16 or int4 linear, or panels of another width)."""
    lins = []
    for d, mod in zip(p.lins, p.mods, strict=True):
        fp32 = d.kind == 0 and isinstance(mod, _kernels.StreamLinear)
        packed = panels(mod) if fp32 else None
        if packed is None or packed.width != p.lib.panel_width():  # another kernels build
            return None
        lins.append(_Lin(d.kind, d.N, d.K, d.G, d.w, d.s, packed.packed.data_ptr()))
    return (_Lin * len(lins))(*lins)


def _required_plan(model: nn.Module) -> _Plan:
    p = plan(model)
    if p is None:
        raise RuntimeError("no fast path for this model: check plan(model) first")
    return p


def run(
    model: nn.Module,
    ids: torch.Tensor,
    slab: Slab,
    batch_rows: list[int],
    slots: list[int],
    lo: list[int],
    positions: torch.Tensor,
    *,
    plan: _Plan | None = None,
    lins: ctypes.Array | None = None,
) -> torch.Tensor:
    """See the module contract; ``ids`` and ``positions`` hold one entry per row. ``plan``
    (default: the model's) and ``lins`` (default: the plan's decode linears) are the prefill
    path's: its panel-packed linears."""
    p = plan if plan is not None else _required_plan(model)
    inner = model.model
    rows = ids.numel()
    if lins is None and rows > MAX_ROWS:  # a decode batch of many rows: the panel GEMM's rate
        lins = _batch_lins(p)
    x = inner.embed_tokens(ids.reshape(1, rows)).float().contiguous()
    cos, sin = _cos_sin(inner.rotary_emb, x, positions.reshape(1, rows))
    slab.reserve(max(slots) + 1)
    kv, pending = slab.take_pending()  # the C call copies them in (``pending`` keeps them alive)
    copies = _copies(kv, pending)
    st = kv.stride()
    meta = torch.tensor([batch_rows, slots, lo], dtype=torch.int32)
    rc = p.lib.llama_layers(
        *_model_args(p, lins),
        x.data_ptr(),
        rows,
        cos.data_ptr(),
        sin.data_ptr(),
        kv.data_ptr(),
        st[0],
        st[1],
        st[2],
        st[3],
        st[4],
        meta[0].data_ptr(),
        meta[1].data_ptr(),
        meta[2].data_ptr(),
        copies,
        len(copies),
    )
    if rc != 0:
        raise MemoryError("the fast decode path could not allocate its work buffers")
    return x[0]


def _model_args(p: _Plan, lins: ctypes.Array | None) -> tuple[object, ...]:
    """The model's leading arguments of both C entry points (the linears: ``lins`` or the
    plan's own)."""
    return (
        p.lins if lins is None else lins,
        p.norms,
        p.layers,
        p.hidden,
        p.heads,
        p.kv_heads,
        p.head_dim,
        p.ffn,
        p.eps,
        p.scale,
    )


def extend_many(
    model: nn.Module,
    slabs: list[Slab],
    inputs: list[list[int]],
    *,
    threads: int | None = None,
) -> list[torch.Tensor]:
    """See the module contract. Needs ``plan(model)``, one-row slabs, each at most once."""
    p = _required_plan(model)
    if len({id(s) for s in slabs}) != len(slabs) or any(s.batch != 1 for s in slabs):
        raise ValueError("extend_many takes distinct one-row slabs")
    if len(slabs) != len(inputs) or not all(inputs):
        raise ValueError("extend_many needs one non-empty list of tokens per slab")
    rows = sum(len(x) for x in inputs)
    lins = _batch_lins(p) if rows > MAX_ROWS else None
    inner = model.model
    seg_of: list[int] = []
    slots: list[int] = []
    segs = []
    for i, (slab, x) in enumerate(zip(slabs, inputs, strict=True)):
        n = slab.length
        slab.reserve(n + len(x))
        kv = slab.kv  # deferred prefix spans copied in: the C call reads one buffer per slab
        segs.append(_KVSeg(kv.data_ptr(), *kv.stride()[:5]))
        seg_of += [i] * len(x)
        slots += range(n, n + len(x))
    pos = torch.tensor(slots)
    ids = torch.tensor([t for x in inputs for t in x])
    x = inner.embed_tokens(ids.reshape(1, rows)).float().contiguous()
    cos, sin = _cos_sin(inner.rotary_emb, x, pos.reshape(1, rows))
    meta = torch.tensor([seg_of, [0] * rows, slots, [0] * rows], dtype=torch.int32)
    seg_arr = (_KVSeg * len(segs))(*segs)
    rc = p.lib.llama_layers_multi(
        *_model_args(p, lins),
        x.data_ptr(),
        rows,
        cos.data_ptr(),
        sin.data_ptr(),
        seg_arr,
        meta[0].data_ptr(),
        meta[1].data_ptr(),
        meta[2].data_ptr(),
        meta[3].data_ptr(),
        torch.get_num_threads() if threads is None else threads,
    )
    if rc != 0:
        raise MemoryError("the fast path could not allocate its work buffers")
    for slab, x_ in zip(slabs, inputs, strict=True):
        slab.set_length(slab.length + len(x_))
    logits = _head(p, model, x[0])
    return list(logits.split([len(x_) for x_ in inputs]))


def slab_of(cache: Cache, model: nn.Module) -> Slab | None:
    """The one-row slab behind a sequence's cache (a ``DynamicCache`` moved into one, once, in
    place), or None where the C stack cannot read it."""
    return _slab_of(cache, 1, model)


# RoPE variants whose cos/sin depend on the position alone (not on the sequence length, as the
# dynamic ones do): their tables are computed once, for positions doubling as needed.
_STATIC_ROPE = frozenset({"default", "linear", "llama3"})
_rope_tables: weakref.WeakKeyDictionary[nn.Module, tuple[torch.Tensor, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def _cos_sin(rot: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp32 cos and sin ``[rows, head_dim]`` for ``positions [1, rows]``: rows of a table made
    by the model's own rotary module (the module's call was ~0.15 ms of a decode step)."""
    if getattr(rot, "rope_type", None) not in _STATIC_ROPE:
        cos, sin = rot(x, positions)
        return cos.float().contiguous(), sin.float().contiguous()
    need = int(positions.max()) + 1
    table = _rope_tables.get(rot)
    if table is None or table[0].shape[0] < need:
        n = max(need, 512, 2 * table[0].shape[0] if table is not None else 0)
        cos, sin = rot(x, torch.arange(n).reshape(1, n))
        table = _rope_tables[rot] = (cos[0].float().contiguous(), sin[0].float().contiguous())
    idx = positions.reshape(-1)
    return table[0][idx], table[1][idx]


def head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Logits from ``run``'s hidden states: the final norm (in C) and the lm_head."""
    return _head(_required_plan(model), model, hidden)


def _head(p: _Plan, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    hidden = hidden.contiguous()
    normed = torch.empty_like(hidden)
    rows = hidden.numel() // p.hidden
    p.lib.rms_norm_rows(hidden.data_ptr(), p.final_norm, normed.data_ptr(), rows, p.hidden, p.eps)
    return model.lm_head(normed)


def _slab_of(cache: Cache, batch: int, model: nn.Module) -> Slab | None:
    """The slab behind ``cache``, moving a ``DynamicCache``'s KV into one first (once)."""
    layers = cache.layers
    if layers and all(isinstance(lay, _SlabLayer) for lay in layers):
        slab = layers[0].slab
        if any(lay.slab is not slab for lay in layers) or slab.batch != batch:
            return None
        if any(lay.n != layers[0].n for lay in layers):
            return None
        return slab
    if not isinstance(cache, DynamicCache):
        return None
    if any(type(lay) is not DynamicLayer for lay in layers):
        return None
    cfg = model.config
    n_layers = int(cfg.num_hidden_layers)
    filled = [lay for lay in layers if lay.is_initialized and lay.keys is not None]
    n = filled[0].keys.shape[-2] if filled else 0
    if n and (len(filled) != n_layers or any(lay.keys.shape[-2] != n for lay in filled)):
        return None
    if n and (filled[0].keys.shape[0] != batch or filled[0].keys.dtype != torch.float32):
        return None
    heads = int(cfg.num_key_value_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    slab = Slab(n_layers, heads, head_dim, batch, n + 256)
    for i, lay in enumerate(filled):
        slab.kv[i, 0, :, :, :n].copy_(lay.keys)
        slab.kv[i, 1, :, :, :n].copy_(lay.values)
    slab.set_length(n)
    cache.layers[:] = slab.layers
    return slab


def _try(model, input_ids, cache, attention_mask, position_ids, use_cache, logits_to_keep, extra):
    if extra or torch.is_grad_enabled() or not _kernels.enabled() or use_cache is False:
        return None
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or cache is None:
        return None
    if input_ids.device.type != "cpu" or not isinstance(cache, Cache):
        return None
    batch, t = input_ids.shape
    p = plan(model) if 1 <= t <= MAX_PREFILL_ROWS else None
    if p is None:
        return None
    lins = _prefill_lins(p) if t > MAX_ROWS and torch.get_num_threads() == 1 else None
    if t > MAX_ROWS and lins is None:  # a prefill off the C stack's conditions: transformers
        return None
    slab = _slab_of(cache, batch, model)
    if slab is None:
        return None
    n = slab.length
    if attention_mask is not None and not (
        attention_mask.shape == (batch, n + t) and bool(attention_mask.all())
    ):
        return None
    if position_ids is None:
        position_ids = torch.arange(n, n + t).expand(batch, t)
    rows_b = [b for b in range(batch) for _ in range(t)]
    slots = [n + i for _ in range(batch) for i in range(t)]
    ids = input_ids.reshape(-1)
    hidden = run(model, ids, slab, rows_b, slots, [0] * len(slots), position_ids, plan=p, lins=lins)
    slab.set_length(n + t)
    hidden = hidden.reshape(batch, t, -1)
    keep = logits_to_keep if isinstance(logits_to_keep, int) else 0
    if keep:
        hidden = hidden[:, -keep:]
    return CausalLMOutputWithPast(logits=_head(p, model, hidden), past_key_values=cache)


def _forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    use_cache=None,
    logits_to_keep=0,
    **kwargs,
):
    extra = {k: v for k, v in kwargs.items() if not (k == "return_dict" and v in (None, True))}
    out = _try(
        self,
        input_ids,
        past_key_values,
        attention_mask,
        position_ids,
        use_cache,
        logits_to_keep,
        extra,
    )
    if out is not None:
        return out
    return type(self).forward(
        self,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        logits_to_keep=logits_to_keep,
        **kwargs,
    )


def install(model: nn.Module) -> bool:
    if plan(model) is None:
        return False
    # A bound method in the instance: a deep copy of the model rebinds it to the copy (whose
    # plan is built from the copy's own tensors).
    model.forward = types.MethodType(_forward, model)
    return True
