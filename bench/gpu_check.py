"""The ONE prepared GPU check: vLLM node, KV events -> digest, CUDA verifier.

Needs an NVIDIA GPU and vLLM 0.33: `make gpu-check` builds .venv-gpu and runs this script
(docs/gpu.md); the script itself installs nothing. Budget: about 8-10 minutes on one H200, most of it vLLM's start-ups
(three: two for the tests, one for the figures).

    python bench/gpu_check.py [--skip-vllm] [--skip-vllm-figures] [--skip-verifier]
    python bench/gpu_check.py --skip-vllm --device cpu --section-timeout 900   # CPU dry run
    .venv-vllm/bin/python bench/gpu_check.py --device cpu --skip-verifier --skip-vllm-figures
        # the vLLM section on vLLM's CPU build (what `make test-vllm` checks, run from here)

Checks (any failure -> exit 1, with the reason printed):
1. the tests of tests/inference/test_vllm_engine.py, unchanged (they pass on vLLM's CPU build):
   greedy output of vLLM in fp32 equal to our CPU engine's for 4 concurrent streams, queue
   depth and wait estimate, cost calibration, the CPU engine's validation errors, early close;
   KV events feeding a DigestBuilder whose cached lengths equal what was sent and vLLM's own
   hits, evictions removing blocks from it, a prefix-cache reset emptying it.
2. a speculation session (the W4A16 draft on CPU, speculation/edge.py) verified by
   speculation/verify.py's BatchedVerifier on CUDA returns the target's greedy output (HF fp32
   greedy on the same GPU), alone and with 16 sessions batched together.
Figures printed and written to $OUT/gpu_check.json (if $OUT is set) and bench/results/: vLLM
start-up, prefill and decode throughput (bf16), verifier throughput for 1/16/64 tenants.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import trio

RESULTS: dict = {"checks": {}, "figures": {}, "failures": []}
GAMMA = 4


def check(name: str, ok: bool, detail: object) -> None:
    RESULTS["checks"][name] = {"ok": bool(ok), "detail": detail}
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
    if not ok:
        RESULTS["failures"].append(name)


def figure(name: str, value: float, unit: str) -> None:
    RESULTS["figures"][name] = {"value": value, "unit": unit}
    print(f"  {name}: {value:,.1f} {unit}", flush=True)


# ------------------------------------------------------------------ 1. vLLM node


def _vllm_tests():
    """tests/inference/test_vllm_engine.py, the checks `make test-vllm` runs on vLLM's CPU build."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path.insert(0, str(tests))  # the test module imports the tests' helpers (testkit)
    path = tests / "inference" / "test_vllm_engine.py"
    spec = importlib.util.spec_from_file_location("vllm_cpu_tests", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def vllm_checks() -> None:
    """The vLLM engine's tests of the CPU build, run on this GPU: greedy output equal to the
    CPU engine's (vLLM in fp32), load views, validation, KV events -> digest, eviction, reset."""
    from p2pnode.inference.models import load_model

    tests = _vllm_tests()
    loaded = load_model(None)  # the CPU engine's reference (fp32 torch, on the CPU)
    for name, run in (
        (
            "vllm_engine_serves_like_the_cpu_engine",
            lambda: tests.test_vllm_engine_serves_like_the_cpu_engine(loaded),
        ),
        (
            "vllm_kv_events_feed_the_digest_and_evictions",
            tests.test_kv_events_feed_the_digest_and_evictions_remove_blocks,
        ),
    ):
        t = time.perf_counter()
        try:
            await run()
            check(name, True, f"{time.perf_counter() - t:.1f} s")
        except AssertionError as exc:
            traceback.print_exc()
            check(name, False, str(exc)[:500] or repr(exc))


async def vllm_figures() -> None:
    """Throughput of the default model on vLLM's defaults for this GPU (bf16)."""
    from p2pnode.inference.vllm.engine import open_vllm_engine

    t0 = time.perf_counter()
    async with open_vllm_engine(max_batch=64, gpu_memory_utilization=0.3) as engine:
        figure("vllm_startup_s", time.perf_counter() - t0, "s")
        print(f"  model_id {engine.model_id}; cost {engine.cost.as_dict()}")

        # Throughput: prefill (64 x 512 distinct tokens, 1 output) and decode (64 streams).
        async def run_all(prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
            out = []

            async def one(p: list[int]) -> None:
                out.append(await engine.generate(p, {"max_tokens": max_tokens}))

            t = time.perf_counter()
            async with trio.open_nursery() as n:
                for p in prompts:
                    n.start_soon(one, p)
            return time.perf_counter() - t, sum(len(x.tokens) for x in out)

        v = engine.vocab_size
        pre = [[(1000 + 97 * i + 13 * j) % v for j in range(512)] for i in range(64)]
        secs, _ = await run_all(pre, 1)
        figure("vllm_prefill_tok_s_64x512", 64 * 512 / secs, "tok/s")
        dec = [[(5000 + 31 * i + 7 * j) % v for j in range(32)] for i in range(64)]
        secs, n = await run_all(dec, 128)
        figure("vllm_decode_tok_s_64_streams", n / secs, "tok/s")
        secs, n = await run_all(dec[:1], 128)
        figure("vllm_decode_tok_s_1_stream", n / secs, "tok/s")


# ------------------------------------------------------------------ 2. CUDA verifier


class OnDevice:
    """Moves the verifier's (CPU-built) input tensors to the GPU; the KV caches and logits stay
    there. speculation/verify.py builds its inputs on the CPU; this is the only adaptation."""

    def __init__(self, model: torch.nn.Module, device: str) -> None:
        self.model, self.device = model, device
        self.config, self.generation_config = model.config, model.generation_config

    def __call__(self, **kw):
        return self.model(
            **{k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        )


def greedy_reference(
    model: torch.nn.Module, prompt: list[int], n: int, eos: set[int], device: str
) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=sorted(eos) or None,
            pad_token_id=0,
        )
    toks = out[0, len(prompt) :].tolist()
    for i, t in enumerate(toks):
        if t in eos:
            return toks[: i + 1]
    return toks


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def verifier_checks(device: str) -> None:
    from dataclasses import replace

    from p2pnode.inference.models import load_model
    from p2pnode.speculation import (
        BatchedVerifier,
        Block,
        SamplingOptions,
        load_draft,
        speculative_generate,
    )
    from p2pnode.speculation.testing import inprocess_transport

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: greedy ties stay put
    base = load_model(None)
    base.model.to(device)
    target = replace(base, model=OnDevice(base.model, device))
    draft = load_draft(None)  # the edge's W4A16 draft, on the CPU as on an edge
    eos = set(base.eos_token_ids)
    tok = base.tokenizer
    # Completion-style prompts: the model continues them (a bare question often gets EOS first).
    prompts = [
        tok.encode(
            f"Here are three facts about the number {i + 3}. First,", add_special_tokens=False
        )
        for i in range(16)
    ]
    n_new = 32
    refs = [greedy_reference(base.model, p, n_new, eos, device) for p in prompts]

    async def session(v: BatchedVerifier, p: list[int]) -> list[int]:
        async with inprocess_transport(v) as tr:
            r = await speculative_generate(
                draft, tr, p, n_new, gamma=GAMMA, eos_token_ids=sorted(eos)
            )
        return r.tokens

    v = BatchedVerifier(target, max_sessions=128, max_batch=64, max_wait_ms=2.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(v.run)
        got = await session(v, prompts[0])
        check(
            "spec_session_equals_greedy",
            got == refs[0] and len(got) >= 8,
            {"n": len(got), "got": got[:12], "ref": refs[0][:12]},
        )
        outs: dict[int, list[int]] = {}

        async def tenant(i: int) -> None:
            outs[i] = await session(v, prompts[i])

        b0 = v.stats["batches"]
        blocks0 = v.stats["blocks"]
        async with trio.open_nursery() as n:
            for i in range(16):
                n.start_soon(tenant, i)
        same = [i for i in range(16) if outs[i] == refs[i]]
        check("16_batched_sessions_equal_greedy", len(same) == 16, f"{len(same)}/16 equal")
        per_forward = (v.stats["blocks"] - blocks0) / max(1, v.stats["batches"] - b0)
        check("multi_tenant_batching_holds", per_forward > 1.5, f"{per_forward:.2f} blocks/forward")
        nursery.cancel_scope.cancel()

    # Verifier throughput: tenants replaying fixed blocks (isolates the verifier's cost).
    prompt = prompts[0]
    for tenants in (1, 16, 64):
        v = BatchedVerifier(target, max_sessions=128, max_batch=64, max_wait_ms=2.0)
        done = 0

        async def replay(sid: str, vv: BatchedVerifier) -> None:
            nonlocal done
            length, last = len(prompt) + 1, prompt[-1]
            for b in range(16):
                r = await vv.verify(sid, Block(b, length, last, tuple(range(100, 100 + GAMMA))))
                length, last, done = r.committed_len, r.next_token, done + 1

        async with trio.open_nursery() as nursery:
            await nursery.start(v.run)
            sids = [await v.open_session([i, *prompt], SamplingOptions()) for i in range(tenants)]
            sync(device)
            t = time.perf_counter()
            async with trio.open_nursery() as n:
                for sid in sids:
                    n.start_soon(replay, sid, v)
            sync(device)
            secs = time.perf_counter() - t
            nursery.cancel_scope.cancel()
        figure(f"verifier_blocks_s_{tenants}_tenants", done / secs, "blocks/s")
        figure(f"verifier_positions_s_{tenants}_tenants", done * (GAMMA + 1) / secs, "positions/s")


# ------------------------------------------------------------------ main


async def main(args: argparse.Namespace) -> None:
    sections = (
        ("vllm", vllm_checks, (), args.skip_vllm),
        ("vllm_figures", vllm_figures, (), args.skip_vllm or args.skip_vllm_figures),
        ("verifier", verifier_checks, (args.device,), args.skip_verifier),
    )
    for name, fn, fn_args, skip in sections:
        if skip:
            continue
        t = time.perf_counter()
        try:
            with trio.fail_after(args.section_timeout):
                await fn(*fn_args)
        except BaseException as exc:  # noqa: BLE001 - any crash is a loud, named failure
            traceback.print_exc()
            check(f"{name}_section_ran", False, repr(exc)[:500])
        figure(f"{name}_section_s", time.perf_counter() - t, "s")


def run() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-vllm-figures", action="store_true")
    ap.add_argument("--skip-verifier", action="store_true")
    ap.add_argument("--section-timeout", type=float, default=480.0)
    ap.add_argument(
        "--device",
        default="cuda",
        help="verifier device; 'cpu' with --skip-vllm dry-runs the script's logic without a GPU",
    )
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("FAIL: no CUDA device visible to torch; this script needs an NVIDIA GPU", flush=True)
        return 2
    RESULTS["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    RESULTS["torch"] = torch.__version__
    try:
        import vllm

        RESULTS["vllm"] = vllm.__version__
    except ImportError:
        RESULTS["vllm"] = None
        if not args.skip_vllm:
            print("FAIL: vllm is not installed: `make gpu-check` (docs/gpu.md)", flush=True)
            return 2
    print(f"device {RESULTS['device']}, torch {RESULTS['torch']}, vllm {RESULTS['vllm']}")
    started = time.perf_counter()
    trio.run(main, args)
    RESULTS["total_s"] = time.perf_counter() - started
    text = json.dumps(RESULTS, indent=2, default=str)
    for folder in filter(None, (os.environ.get("OUT"), str(Path(__file__).parent / "results"))):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "gpu_check.json").write_text(text)
    failed = RESULTS["failures"]
    print(f"{len(RESULTS['checks']) - len(failed)} passed, {len(failed)} failed", flush=True)
    if failed:
        print("FAILED: " + ", ".join(failed), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run())
