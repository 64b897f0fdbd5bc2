"""Weight-streaming CPU kernels for decode and short verify blocks (``kernels.c``).

Contract:
- ``library()`` compiles ``kernels.c`` once with the system C compiler (``$CC``, else ``cc``)
  into ``_common.cache_dir()/kernels/`` (keyed by the source, the compiler and the CPU flags;
  ~0.3 s) and loads it with ctypes. It returns ``None`` (and logs why, once) when no compiler
  works or ``P2PNODE_KERNELS=0``: every caller then keeps the plain torch path.
- ``StreamLinear(weight)`` replaces an ``nn.Linear`` without bias: inputs of at most
  ``MAX_ROWS`` rows (decode steps, verify blocks) go through the fp32 or bf16 kernel, longer
  ones (prefill) through a packed copy of an fp32 weight (``_gemm``: the C panel GEMM or
  oneDNN's, whichever ran faster here), made on the first such input
  (``P2PNODE_PACKED_PREFILL=0`` or a bf16 weight: ``F.linear``). It keeps the caller's weight
  tensor (a tied lm_head stays tied). Outputs agree with ``F.linear`` to float rounding, and
  a row's output of up to ``MAX_ROWS`` rows is bitwise the same whatever the number of rows.
- ``accelerate(model)`` swaps the bias-free linears of a decoder and its lm_head in place;
  returns how many were swapped (0 when the kernels are unavailable).
- ``int4_matmul(packed, scales, x, group)``: ``x @ W.T`` for symmetric int4 weights in the
  layout ``pack_int4`` makes (see ``kernels.c``); ``int8_act=True`` rounds the activations to
  int8 per group of 64 and multiplies in integers (AVX-512 VNNI or AVX2, ``int8_activations()``), ~2x
  fewer instructions: the draft's decode, whose numerics only move acceptance;
  ``interleaved=True`` reads the blocks of four rows of ``interleave_q4`` (the draft's layout).
- ``llama_layers`` (C): a whole Llama decoder stack for a few rows over a KV slab, driven by
  ``_fastpath.py``; ``llama_layers_multi``: the same for the rows of many sequences, each in a
  KV buffer of its own (``fastpath.extend_many``).
"""

from __future__ import annotations

import copy
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from p2pnode.inference._cpu.gemm import PrefillWeight

log = logging.getLogger(__name__)

MAX_ROWS = 16  # above this a matmul is compute-bound and a packed GEMM is the faster path
_enabled = [True]


def set_enabled(on: bool) -> bool:
    """Route ``StreamLinear`` through the kernels (True) or ``F.linear``; returns the old value.
    For benchmarks that compare both paths in one run."""
    old, _enabled[0] = _enabled[0], on
    return old


def enabled() -> bool:
    return _enabled[0]


_SOURCE = Path(__file__).with_name("kernels.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-shared", "-fPIC"]
_LIBS = ["-lm", "-pthread"]
_P = ctypes.c_void_p
_I = ctypes.c_int


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("P2PNODE_KERNELS", "1") == "0":
        return None
    return build(_SOURCE.read_bytes())


def build(src: bytes, march: str = "native") -> ctypes.CDLL | None:
    """``src`` (a version of ``kernels.c``) compiled into the model cache and loaded, or None
    (logged) without a working compiler. ``library()`` is this on the current source;
    ``bench/kernel_ab.py`` loads another revision's beside it. ``march``: the compiler's
    ``-march`` (the tests build narrower CPUs' code paths, e.g. ``x86-64-v2``, to run them)."""
    from p2pnode.inference._common import cache_dir

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler (cc/gcc): decode runs on the slower torch path")
        return None
    cflags = [f"-march={march}" if f == "-march=native" else f for f in _FLAGS]
    flags = " ".join(cflags + _LIBS).encode()
    key = hashlib.sha256(src + cc.encode() + flags + _cpu_flags().encode())
    out = cache_dir() / "kernels" / f"stream-{key.hexdigest()[:16]}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        c_file = out.with_name(f"{out.stem}.tmp-{os.getpid()}.c")
        try:
            c_file.write_bytes(src)
            subprocess.run(
                [cc, *cflags, "-o", str(tmp), str(c_file), *_LIBS],
                check=True,
                capture_output=True,
                timeout=120,
            )
            tmp.replace(out)  # atomic: a process starting at the same time loads all or nothing
        except (OSError, subprocess.SubprocessError) as exc:
            err = getattr(exc, "stderr", b"") or b""
            log.warning("building %s failed (%s %s): torch path", _SOURCE.name, exc, err[:300])
            tmp.unlink(missing_ok=True)
            return None
        finally:
            c_file.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(out))
    for name in ("gemv_f32", "gemv_bf16"):
        getattr(lib, name).argtypes = [_P, _P, _P, _I, _I, _I]
        getattr(lib, name).restype = None
    for name in ("gemv_int4", "gemv_q4a8"):
        getattr(lib, name).argtypes = [_P, _P, _P, _P, _I, _I, _I, _I]
        getattr(lib, name).restype = None
    lib.rms_norm_rows.argtypes = [_P, _P, _P, _I, _I, ctypes.c_float]
    lib.rms_norm_rows.restype = None
    lib.gemv_q4a8i.argtypes = [_P, _P, _P, _P, _I, _I, _I]
    lib.gemv_q4a8i.restype = _I
    lib.q4a8_native.argtypes = []
    lib.q4a8_native.restype = _I
    lib.vec_lanes.argtypes = []
    lib.vec_lanes.restype = _I
    i64, f32 = ctypes.c_int64, ctypes.c_float
    lib.llama_layers.argtypes = [_P, _P, *[_I] * 6, f32, f32, _P, _I, _P, _P, _P]
    lib.llama_layers.argtypes += [i64] * 5 + [_P] * 3 + [_P, _I]
    lib.llama_layers.restype = _I
    if hasattr(lib, "llama_layers_multi"):  # an older revision (bench/kernel_ab.py) lacks it
        lib.llama_layers_multi.argtypes = [_P, _P, *[_I] * 6, f32, f32, _P, _I, _P, _P, _P]
        lib.llama_layers_multi.argtypes += [_P] * 4 + [_I]
        lib.llama_layers_multi.restype = _I
    lib.gemm_panels.argtypes = [_P, _P, _P, _I, _I, _I, _I]
    lib.gemm_panels.restype = None
    lib.panel_width.argtypes = []
    lib.panel_width.restype = _I
    return lib


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32:
        x2 = x2.float()
    return x2.contiguous()


class StreamLinear(nn.Module):
    """``F.linear(x, weight)`` with the streaming kernel for short inputs (see the contract)."""

    def __init__(self, weight: torch.Tensor, lib: ctypes.CDLL) -> None:
        super().__init__()
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.shape[1] % 32:
            raise ValueError(f"needs fp32/bf16 weights with inputs % 32 == 0, got {weight.shape}")
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, False)
        self.out_features, self.in_features = weight.shape
        self._fn = lib.gemv_f32 if weight.dtype == torch.float32 else lib.gemv_bf16
        self._lib = lib
        # A packed copy of an fp32 weight for prefill-shaped inputs (``_gemm``), made on the
        # first one, with the weight it was made from (a replaced weight gets a new copy). A
        # copy, not a view: the decode kernels keep streaming the plain layout.
        self._prefill: list[tuple[torch.Tensor, PrefillWeight | None]] = []  # [] until asked

    def _packed(self) -> PrefillWeight | None:
        if not self._prefill or self._prefill[0][0] is not self.weight:
            from p2pnode.inference._cpu import gemm as _gemm  # it times the C kernels it may choose

            self._prefill[:] = [(self.weight, _gemm.prefill_weight(self.weight.data))]
        return self._prefill[0][1]

    def __deepcopy__(self, memo: dict) -> StreamLinear:
        # The kernel handle is shared, never copied (ctypes pointers cannot be); the weight is
        # copied through ``memo``, so a tied lm_head stays tied to the copied embedding.
        return StreamLinear(copy.deepcopy(self.weight, memo), self._lib)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        n_rows = x.numel() // self.in_features
        if not _enabled[0] or x.device.type != "cpu" or not w.is_contiguous():
            return F.linear(x.to(w.dtype), w).to(x.dtype)
        if n_rows > MAX_ROWS:
            packed = self._packed()
            if packed is None or x.dtype != torch.float32 or x.requires_grad:
                return F.linear(x.to(w.dtype), w).to(x.dtype)
            return packed(_rows(x)).reshape(*x.shape[:-1], self.out_features)
        x2 = _rows(x)
        y = torch.empty(n_rows, self.out_features, dtype=torch.float32)
        self._fn(w.data_ptr(), x2.data_ptr(), y.data_ptr(), n_rows, *w.shape)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def accelerate(model: nn.Module) -> int:
    """Swap every bias-free ``nn.Linear`` (decoder and lm_head) for a ``StreamLinear``."""
    lib = library()
    if lib is None:
        return 0
    swapped = 0
    for mod in list(model.modules()):
        for child_name, child in list(mod.named_children()):
            if (
                type(child) is nn.Linear
                and child.bias is None
                and child.weight.dtype in (torch.float32, torch.bfloat16)
                and child.in_features % 32 == 0
            ):
                setattr(mod, child_name, StreamLinear(child.weight, lib))
                swapped += 1
    return swapped


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int values 0..15 ``[N, K]`` -> ``[N, K / 2]`` uint8 in the kernel's layout: in each run of
    32 inputs, byte j holds input j (low nibble) and input j + 16 (high nibble)."""
    n, k = q.shape
    if k % 32:
        raise ValueError(f"int4 kernel needs inputs % 32 == 0, got {k}")
    runs = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def describe() -> str:
    """What the kernels run on here, for logs and benches: "off", or the vector width and
    whether the draft's int4 linears take int8 activations."""
    lib = library()
    if lib is None:
        return "off (plain torch)"
    lanes = lib.vec_lanes()
    avx2 = " avx2" in f" {_cpu_flags()}"
    isa = {16: "AVX-512", 8: "AVX2" if avx2 else "AVX", 4: "SSE or NEON"}.get(lanes, "?")
    acts = {2: "int8 (VNNI)", 1: "int8 (AVX2)"}.get(lib.q4a8_native(), "fp32")
    return f"on: {isa}, {lanes} fp32 lanes, draft activations {acts}"


def int8_activations() -> bool:
    """Whether ``int4_matmul(..., int8_act=True)`` really runs on int8 activations here (AVX-512
    VNNI or AVX2); elsewhere it is the fp32 kernel."""
    lib = library()
    return lib is not None and lib.q4a8_native() >= 1


def interleaved_int4() -> bool:
    """Whether the blocks-of-four-rows int4 layout (``interleave_q4``) runs here: AVX-512 VNNI."""
    lib = library()
    return lib is not None and lib.q4a8_native() == 2


def interleave_q4(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_int4``'s layout ``[N, K / 2]`` and scales ``[N, K / 64]`` -> the blocks of four
    rows that ``int4_matmul(..., interleaved=True)`` reads (see ``gemv_q4a8i`` in
    ``kernels.c``): the same bytes and shapes, reordered. Needs N % 4 == 0, K % 64 == 0."""
    n, half = packed.shape
    if n % 4 or half % 32 or scales.shape != (n, half // 32):
        raise ValueError(f"needs N % 4 == 0, K % 64 == 0, group 64: {packed.shape}, {scales.shape}")
    runs = packed.reshape(n // 4, 4, half // 16, 16).permute(0, 2, 1, 3)
    groups = scales.reshape(n // 4, 4, half // 32).permute(0, 2, 1)
    return runs.reshape(n, half).contiguous(), groups.reshape(n, half // 32).contiguous()


def int4_matmul(
    packed: torch.Tensor,
    scales: torch.Tensor,
    x: torch.Tensor,
    group_size: int,
    *,
    int8_act: bool = False,
    interleaved: bool = False,
) -> torch.Tensor:
    """``x @ W.T`` (fp32 out) with ``W = (q - 8) * scales[:, k // group]``; ``scales`` fp32
    ``[N, K / group]``. Needs ``library()``; at most ``MAX_ROWS`` rows. ``int8_act``: each
    group of 64 inputs of a row rounded to int8 first (one scale, amax / 127), integer dot
    products (``gemv_q4a8``, where ``int8_activations()``): for a draft, not for exact paths.
    ``interleaved``: ``packed`` and ``scales`` as ``interleave_q4`` made them (int8 activations,
    group 64, ``interleaved_int4()`` true): the draft's decode layout, ~2x the read rate."""
    lib = library()
    assert lib is not None
    n, k = packed.shape[0], packed.shape[1] * 2
    x2 = _rows(x)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if interleaved:
        if group_size != 64 or not interleaved_int4():
            raise ValueError("the interleaved layout needs group 64 and int8 activations (VNNI)")
        args = (packed.data_ptr(), scales.data_ptr(), x2.data_ptr(), y.data_ptr())
        if lib.gemv_q4a8i(*args, x2.shape[0], n, k):
            raise MemoryError(f"gemv_q4a8i failed for {x2.shape[0]} x {n} x {k} (out of memory?)")
        return y
    (lib.gemv_q4a8 if int8_act else lib.gemv_int4)(
        packed.data_ptr(),
        scales.data_ptr(),
        x2.data_ptr(),
        y.data_ptr(),
        x2.shape[0],
        n,
        k,
        group_size,
    )
    return y
