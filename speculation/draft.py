"""W4A16 draft model built from the target on the edge.

Contract:
- ``build_draft(target, folder, group_size=64, method="gptq")`` quantizes every decoder linear of
  ``target`` (not the embeddings nor the tied lm_head) to symmetric int4, one fp16 scale per
  ``group_size`` input columns, and writes a GPTQ checkpoint: ``qweight`` (int32, 8 nibbles packed
  along the input dim), ``qzeros`` (int32, GPTQ v1 "zero - 1" = 7 for symmetric), ``scales``
  (fp16), ``g_idx`` (int32), ``quantize_config.json`` (bits=4, sym=true, desc_act=false) and the
  same block as ``quantization_config`` in ``config.json``, so vLLM/GPTQ readers take the folder.
- Method: "gptq" (default; ``_gptq.py``, calibrated on 3072 tokens of MMLU text, ~50 s on 2
  idle cores, ~12 min at load 20) or "rtn" (round-to-nearest; env ``P2PNODE_DRAFT_METHOD=rtn``).
  GPTQ runs with act-order (columns in decreasing Hessian-diagonal order) and STATIC groups
  (each group's scale fixed from the unrounded weights first), so ``g_idx`` stays contiguous and
  the checkpoint layout is exactly the desc_act=false one. Measured greedy agreement with the
  target over 256 positions: GPTQ act-order 0.789, GPTQ plain 0.727, RTN 0.699 (bf16 vs fp32
  activations: no difference, 0.727 both).
- ``load_draft(folder=None)`` builds the default draft once under ``models.cache_dir()`` and then
  loads it: the int4 weights are repacked into torch's CPU int4 kernel layout and executed by
  ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (a private op: torch is pinned and
  tests/speculation/test_draft.py keeps a test on it). Decode steps run the streaming kernels of ``inference/_cpu/kernels.py`` (see ``load_draft``).
- Group size: SmolLM2's hidden size is 576 = 4.5 x 128, so group 128 cannot tile its q/k/v/gate/up
  inputs; 64 is the largest size the kernel accepts that divides every input width. Group 32 is
  avoided on purpose: the GGUF weights are already 4-bit in blocks of 32, so a group-32 draft
  would reproduce the target and prove nothing.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from p2pnode.inference._cpu import fastpath as _fastpath
from p2pnode.inference._cpu import hugepages as _hugepages
from p2pnode.inference._cpu import kernels as _kernels
from p2pnode.inference.models import LLAMA_LINEARS, LoadedModel, cache_dir, load_model
from p2pnode.speculation._errors import DraftError

log = logging.getLogger(__name__)

DEFAULT_GROUP_SIZE = 64
METHODS = ("gptq", "rtn")
DEFAULT_METHOD = os.environ.get("P2PNODE_DRAFT_METHOD", "gptq")
_MARKER = "p2pnode-draft.json"
_KERNEL_GROUPS = (32, 64, 128, 256)


def _log_progress(msg: str) -> None:
    log.info("%s", msg)
    print(msg, file=sys.stderr, flush=True)  # a first build takes minutes: show it's alive


@dataclass
class DraftModel:
    model: nn.Module
    tokenizer: object
    path: Path
    target_model_id: str
    group_size: int
    act_dtype: torch.dtype


# ---------------------------------------------------------------- quantization and GPTQ layout


def quantize_sym_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RTN symmetric int4 as GPTQ defines it: q in 0..15, w ~ (q - 8) * scale, per group of inputs.

    Returns ``q`` int32 [out, in] and ``scales`` fp16 [in / group, out].
    """
    n, k = w.shape
    if k % group_size:
        raise DraftError(f"input width {k} is not a multiple of group size {group_size}")
    wg = w.float().reshape(n, k // group_size, group_size)
    scale = (2 * wg.abs().amax(-1, keepdim=True) / 15).clamp_min(1e-8).half().float()
    q = torch.clamp(torch.round(wg / scale) + 8, 0, 15).to(torch.int32).reshape(n, k)
    return q, scale.squeeze(-1).t().contiguous().half()


def _pack_nibbles(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack int values 0..15 eight per int32 along ``dim`` (lowest nibble first), GPTQ style."""
    x = x.movedim(dim, -1).to(torch.int64)
    x = x.reshape(*x.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    packed = (x << shifts).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def _unpack_nibbles(x: torch.Tensor, dim: int) -> torch.Tensor:
    x = x.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    out = (x.unsqueeze(-1) >> shifts) & 0xF
    return out.reshape(*x.shape[:-1], -1).to(torch.int32).movedim(-1, dim).contiguous()


def to_gptq(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors for one linear from ``q`` [out, in] and ``scales`` [in / group, out]."""
    n, k = q.shape
    zeros = torch.full((k // group_size, n), 8 - 1, dtype=torch.int32)  # v1 stores zero - 1
    return {
        "qweight": _pack_nibbles(q.t(), 0),
        "qzeros": _pack_nibbles(zeros, 1),
        "scales": scales,
        "g_idx": (torch.arange(k, dtype=torch.int32) // group_size),
    }


def from_gptq(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Inverse of ``to_gptq`` for symmetric checkpoints with contiguous ``g_idx`` (plain or
    static-group act-order): (q [out, in], scales, group)."""
    q = _unpack_nibbles(t["qweight"], 0).t().contiguous()
    k = q.shape[1]
    groups = t["scales"].shape[0]
    group_size = k // groups
    if not torch.equal(t["g_idx"].to(torch.int64), torch.arange(k) // group_size):
        raise DraftError("g_idx is not contiguous groups: act-order (desc_act) is not supported")
    if not bool((_unpack_nibbles(t["qzeros"], 1) == 7).all()):
        raise DraftError("qzeros are not the symmetric value: only sym=true checkpoints load here")
    return q, t["scales"], group_size


class Int4Linear(nn.Module):
    """y = x @ dequant(W).T with W int4 (no bias): inputs of up to ``_kernels.MAX_ROWS`` rows
    through the streaming kernel (fp32 math), longer ones through torch's CPU int4pack op in
    ``dtype`` (activations are cast to it and back)."""

    def __init__(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        group_size: int,
        dtype: torch.dtype,
        *,
        int8_act: bool = False,
    ):
        super().__init__()
        if group_size not in _KERNEL_GROUPS:
            raise DraftError(f"group size {group_size} not in {_KERNEL_GROUPS} (CPU int4 kernel)")
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
        sz = torch.stack([scales.float(), torch.zeros_like(scales, dtype=torch.float32)], -1)
        self.register_buffer("weight_packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", sz.to(dtype).contiguous(), persistent=False)
        # Decode steps and short blocks: the streaming kernel (reads the 4-bit weights once at
        # near-memory speed; torch's int4 op spends ~5x its read time per step here).
        self.stream = _kernels.library() is not None and self.in_features % 32 == 0
        if self.stream:
            self.register_buffer("q4", _kernels.pack_int4(q), persistent=False)
            self.register_buffer("q4_scales", scales.float().t().contiguous(), persistent=False)
        # The streaming path on int8 activations (see ``_kernels.int4_matmul``), in blocks of
        # four rows where the shapes allow (one sequential stream, ~2x the read rate).
        self.int8_act = self.stream and int8_act
        self.interleaved = (
            self.int8_act
            and group_size == 64
            and self.out_features % 4 == 0
            and self.in_features % 64 == 0
            and _kernels.interleaved_int4()
        )
        if self.interleaved:
            self.q4, self.q4_scales = _kernels.interleave_q4(self.q4, self.q4_scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.stream and x.numel() <= _kernels.MAX_ROWS * self.in_features and _kernels.enabled():
            y = _kernels.int4_matmul(
                self.q4,
                self.q4_scales,
                x,
                self.group_size,
                int8_act=self.int8_act,
                interleaved=self.interleaved,
            )
            return y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        sz = self.scales_and_zeros  # the op runs in its dtype (fp32 there is ~5x slower than bf16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(sz.dtype), self.weight_packed, self.group_size, sz
        )
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


# ---------------------------------------------------------------- build and load


def quantize_config(group_size: int) -> dict:
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "sym": True,
        "desc_act": False,
        "static_groups": False,
        "true_sequential": True,
        "damp_percent": 0.01,
        "checkpoint_format": "gptq",
        "model_file_base_name": "model",
    }


def build_draft(
    target: LoadedModel,
    folder: Path,
    group_size: int = DEFAULT_GROUP_SIZE,
    *,
    method: str = DEFAULT_METHOD,
    progress: Callable[[str], None] = _log_progress,
    calib_seqs: int = 12,
    act_order: bool = True,
    sequential: bool = False,
) -> Path:
    """Quantize ``target``'s decoder linears and write a GPTQ folder at ``folder`` (atomic).

    ``method="gptq"``: Hessian-based rounding calibrated on real text (``_gptq``), on a copy of
    the target (the caller's model is left as is); ``"rtn"``: plain round-to-nearest.
    """
    from safetensors.torch import save_file

    if method not in METHODS:
        raise DraftError(f"method must be one of {METHODS}, got {method!r}")

    folder = Path(folder)
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    started = time.monotonic()
    tensors: dict[str, torch.Tensor] = {}
    quantized: set[str] = set()
    fp32_bytes = int4_bytes = 0
    calib_tokens = 0
    solved: dict = {}
    if method == "gptq":
        from p2pnode.speculation._gptq import calibration_ids, gptq_model

        ids = calibration_ids(target.tokenizer, calib_seqs)
        calib_tokens = ids.numel()
        progress(
            f"GPTQ: {calib_tokens} calibration tokens, {len(target.model.model.layers)} layers"
        )
        solved = gptq_model(
            copy.deepcopy(target.model),
            ids,
            group_size,
            progress,
            sequential=sequential,
            act_order=act_order,
        )
    for i, layer in enumerate(target.model.model.layers):
        for name in LLAMA_LINEARS:
            lin = layer.get_submodule(name)
            if lin.bias is not None:
                raise DraftError(f"layer {i} {name} has a bias: not supported by this draft")
            if solved:
                q, scales = solved[i][name]
            else:
                q, scales = quantize_sym_int4(lin.weight.data, group_size)
            prefix = f"model.layers.{i}.{name}"
            for key, value in to_gptq(q, scales, group_size).items():
                tensors[f"{prefix}.{key}"] = value
            quantized.add(f"{prefix}.weight")
            fp32_bytes += lin.weight.numel() * 4
            int4_bytes += lin.weight.numel() // 2 + scales.numel() * 2
    for key, value in target.model.state_dict().items():
        if key not in quantized and key != "lm_head.weight":  # lm_head is tied to embed_tokens
            tensors[key] = value.detach().half().contiguous()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = target.model.config.to_dict()
    config["quantization_config"] = quantize_config(group_size)
    config["torch_dtype"] = "float16"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "quantize_config.json").write_text(json.dumps(quantize_config(group_size), indent=2))
    target.tokenizer.save_pretrained(tmp)
    target.model.generation_config.save_pretrained(tmp)
    stats = {
        "target_model_id": target.model_id,
        "model_id_binds_weights": True,  # ids before that named no weights: rebuilt
        "group_size": group_size,
        "method": method,
        "calibration_tokens": calib_tokens,
        "act_order": act_order,
        "sequential": sequential,
        "decoder_linear_bytes_fp32": fp32_bytes,
        "decoder_linear_bytes_int4": int4_bytes,
        "build_seconds": round(time.monotonic() - started, 2),
    }
    (tmp / _MARKER).write_text(json.dumps(stats, indent=2))
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def default_draft_path(group_size: int = DEFAULT_GROUP_SIZE, method: str = DEFAULT_METHOD) -> Path:
    # "rtn" keeps the folder name it always had; "-ao": GPTQ with act-order (static groups)
    suffix = "" if method == "rtn" else f"-{method}-ao"
    return cache_dir() / "models" / f"SmolLM2-135M-Instruct-W4A16-g{group_size}{suffix}"


def ensure_default_draft(
    group_size: int = DEFAULT_GROUP_SIZE, method: str = DEFAULT_METHOD
) -> Path:
    """Build the default draft from the default target once; later calls only return its path."""
    folder = default_draft_path(group_size, method)
    marker = folder / _MARKER
    if not marker.is_file() or not json.loads(marker.read_text()).get("model_id_binds_weights"):
        folder.parent.mkdir(parents=True, exist_ok=True)
        # The plain model: GPTQ copies it, and the streaming kernels hold ctypes handles.
        build_draft(load_model(None, accelerate=False), folder, group_size, method=method)
    return folder


def draft_stats(folder: Path) -> dict:
    return json.loads((Path(folder) / _MARKER).read_text())


def load_draft(
    folder: str | Path | None = None,
    *,
    act_dtype: torch.dtype | None = None,
    int8_act: bool | None = None,
) -> DraftModel:
    """Load a symmetric GPTQ int4 folder for CPU execution (``None``: the default draft).

    ``act_dtype`` None: fp32 when the streaming kernels are available (decode then runs fp32
    activations over int4 linears and a bf16 lm_head, ~2x faster than bf16 activations, whose
    norms, rotary and attention convert on every op), else bf16. Prefill (more than
    ``_kernels.MAX_ROWS`` tokens) runs torch's int4 op in bf16 either way.

    ``int8_act`` None: decode steps round each linear's activations to int8 (per 64 inputs) and
    multiply in integers where the CPU has AVX-512 VNNI or AVX2 (``_kernels.int8_activations()``): a
    draft's outputs are only proposals, the target decides what is committed."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder) if folder is not None else ensure_default_draft()
    stream = _kernels.library() is not None
    if act_dtype is None:
        act_dtype = torch.float32 if stream else torch.bfloat16
    if not (folder / "quantize_config.json").is_file():
        raise DraftError(f"{folder} has no quantize_config.json: not a GPTQ draft folder")
    qcfg = json.loads((folder / "quantize_config.json").read_text())
    if qcfg.get("bits") != 4 or not qcfg.get("sym") or qcfg.get("desc_act"):
        raise DraftError(f"{folder}: only bits=4, sym=true, desc_act=false load here, got {qcfg}")
    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # we execute the int4 weights ourselves
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=act_dtype)
    state = load_file(str(folder / "model.safetensors"))
    group_size = int(qcfg["group_size"])
    if int8_act is None:
        int8_act = _kernels.int8_activations()
    for i, layer in enumerate(model.model.layers):
        for name in LLAMA_LINEARS:
            prefix = f"model.layers.{i}.{name}"
            parts = {
                k: state.pop(f"{prefix}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")
            }
            q, scales, gs = from_gptq(parts)
            parent, child = name.split(".")
            lin = Int4Linear(q, scales, gs, torch.bfloat16, int8_act=int8_act)
            setattr(layer.get_submodule(parent), child, lin)
    plain = {k: v.to(act_dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(plain, strict=False, assign=True)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise DraftError(f"{folder}: unexpected {unexpected[:3]} / missing {missing[:3]} tensors")
    model.tie_weights()
    # Non-persistent buffers (rotary inv_freq) stay on meta after a meta init: rebuild them.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise DraftError(f"{folder}: tensors left uninitialized: {meta[:3]}")
    if stream:
        # The lm_head stays bf16 (an untied copy) whatever the activations: it is half the
        # draft's bytes per token, and fp32 would double them.
        head = model.get_input_embeddings().weight.detach().to(torch.bfloat16).contiguous()
        model.lm_head = _kernels.StreamLinear(head, _kernels.library())
    model.eval()
    _hugepages.move_to_huge_pages(model)  # before any plan keeps a weight's address
    if act_dtype == torch.float32:
        _fastpath.install(model)  # decode steps: the whole stack in one C call
    marker = folder / _MARKER
    target_id = json.loads(marker.read_text())["target_model_id"] if marker.is_file() else ""
    return DraftModel(
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(folder),
        path=folder,
        target_model_id=target_id,
        group_size=group_size,
        act_dtype=act_dtype,
    )
