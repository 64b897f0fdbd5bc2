"""The vLLM build differences (``_vllm_compat``) and ``--engine`` / ``backend`` settings.

No vLLM needed: these run in the normal suite (the vLLM engine itself: test_vllm_engine.py).
"""

from __future__ import annotations

import importlib.util

import pytest

from p2pnode.bootstrap.config import ConfigError, settings_from
from p2pnode.inference.blockhash import BLOCK_SIZE
from p2pnode.inference.vllm.compat import (
    CPU_DEFAULT_KV_TOKENS,
    VllmBuild,
    VllmBuildError,
    detect,
    engine_args,
)

CPU = VllmBuild("0.32.0", "cpu")
GPU = VllmBuild("0.33.0", "cuda")


def args(build: VllmBuild, **kw: object) -> dict:
    base = {"kv_cache_tokens": 4096, "kv_bytes_per_token": 46080, "max_model_len": 512}
    return engine_args(build, model="/m", max_num_seqs=4, kv_events="EVENTS", **{**base, **kw})


def test_cpu_build_runs_32_token_blocks_fp32_eager_with_its_cache_in_bytes() -> None:
    a = args(CPU)
    assert a["block_size"] == 32 and a["block_size"] % BLOCK_SIZE == 0
    assert a["dtype"] == "float32" and a["enforce_eager"] is True
    assert a["num_gpu_blocks_override"] == 4096 // 32 + 1  # + vLLM's null block
    assert a["kv_cache_memory_bytes"] == a["num_gpu_blocks_override"] * 32 * 46080
    assert "gpu_memory_utilization" not in a
    assert a["enable_prefix_caching"] and a["kv_events_config"] == "EVENTS"
    assert a["max_model_len"] == 512 and a["model"] == a["tokenizer"] == "/m"
    default = args(CPU, kv_cache_tokens=None)
    assert default["num_gpu_blocks_override"] == CPU_DEFAULT_KV_TOKENS // 32 + 1


def test_gpu_build_keeps_our_block_size_and_vllms_defaults() -> None:
    a = args(GPU)
    assert a["block_size"] == BLOCK_SIZE and a["dtype"] == "auto"
    assert a["num_gpu_blocks_override"] == 4096 // BLOCK_SIZE + 1
    assert "enforce_eager" not in a and "kv_cache_memory_bytes" not in a
    assert 0 < a["gpu_memory_utilization"] < 1
    assert "num_gpu_blocks_override" not in args(GPU, kv_cache_tokens=None)


def test_a_cache_smaller_than_one_request_is_refused_with_what_to_change() -> None:
    with pytest.raises(ValueError, match="raise the cache budget or lower max_model_len"):
        args(CPU, kv_cache_tokens=256, max_model_len=512)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_detect_without_vllm_says_how_to_install_it() -> None:
    with pytest.raises(VllmBuildError, match="make test-vllm"):
        detect()


def test_engine_setting_with_backend_as_its_older_name() -> None:
    assert settings_from({}).engine == "hf"
    assert settings_from({"engine": "vllm"}).engine == "vllm"
    old = settings_from({"backend": "emulated"})
    assert old.engine == old.backend == "emulated"
    same = settings_from({"engine": "vllm", "backend": "vllm"})
    assert same.engine == same.backend == "vllm"
    with pytest.raises(ConfigError, match="give only engine"):
        settings_from({"engine": "vllm", "backend": "emulated"})
    with pytest.raises(ConfigError, match="engine 'tpu'"):
        settings_from({"engine": "tpu"})
    with pytest.raises(ConfigError, match="backend 'gpu'"):
        settings_from({"backend": "gpu"})


def test_engine_from_a_toml_file(tmp_path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('engine = "vllm"\nmax_batch = 8\n')
    s = settings_from({}, path)
    assert s.engine == "vllm" and s.max_batch == 8
    assert settings_from({"engine": "hf"}, path).engine == "hf"  # the command line wins


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_join_engine_vllm_without_vllm_exits_saying_how_to_get_it(tmp_path) -> None:
    import subprocess
    import sys

    from p2pnode.identity import NodeKey

    peer = NodeKey.generate().peer_id
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "p2pnode.bootstrap.cli", "join", "--engine", "vllm"),
            *("--bootstrap", f"/ip4/127.0.0.1/tcp/1/p2p/{peer}", "--home", str(tmp_path)),
            *("--api-port", "0", "--listen", "/ip4/127.0.0.1/tcp/0"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "--engine vllm: vLLM is not installed" in proc.stderr, proc.stderr[-2000:]
    assert "make gpu-check" in proc.stderr and "make test-vllm" in proc.stderr
