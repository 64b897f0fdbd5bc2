"""Engine benchmark: TTFT hit vs miss, decode throughput, KV bytes/token, radix match+insert.

Run: ``python bench/engine_bench.py`` (prints figures, writes bench/results/engine.json).
Targets: TTFT with a cached ~1,000-token prefix <= 0.1 x the uncached TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import trio

from p2pnode.inference.engine import open_engine
from p2pnode.inference.models import load_model
from p2pnode.inference.radix import RadixCache
from p2pnode.inference.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results" / "engine.json"
REPEATS = 3


def make_tokens(engine, n: int, text: str) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += engine.encode(text)
    return ids[:n]


async def ttft_bench(engine) -> dict:
    prefix = make_tokens(engine, 1000, "The history of the river valley and its old towns. ")
    suffixes = [make_tokens(engine, 50, f"Question {i}: name one town and why. ") for i in range(8)]
    one = SamplingParams(max_tokens=1)
    miss, hit = [], []
    for i in range(REPEATS):
        engine.tree.clear()
        r = await engine.generate(prefix + suffixes[i], one)
        assert r.cached_tokens == 0
        miss.append(r.ttft_s)
        r = await engine.generate(prefix + suffixes[REPEATS + i], one)
        assert r.cached_tokens >= len(prefix)
        hit.append(r.ttft_s)
    m, h = statistics.median(miss), statistics.median(hit)
    return {
        "prefix_tokens": 1000,
        "suffix_tokens": 50,
        "ttft_miss_s": m,
        "ttft_hit_s": h,
        "hit_over_miss": h / m,
        "target_met": h <= 0.1 * m,
        "miss_all": miss,
        "hit_all": hit,
    }


async def decode_bench(engine, concurrency: int, max_tokens: int = 32) -> dict:
    topics = ["the ocean", "mountains", "a robot", "the moon", "a library", "winter"]
    prompts = [
        engine.encode_chat([{"role": "user", "content": f"Write a long story about {topics[i]}."}])
        for i in range(concurrency)
    ]
    results = []

    async def one(p: list[int]) -> None:
        results.append(await engine.generate(p, SamplingParams(max_tokens=max_tokens)))

    t0 = time.perf_counter()
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            for p in prompts:
                nursery.start_soon(one, p)
    wall = time.perf_counter() - t0
    decoded = sum(len(r.tokens) - 1 for r in results)
    decode_window = max(r.total_s for r in results) - max(r.ttft_s for r in results)
    per_req = [(len(r.tokens) - 1) / (r.total_s - r.ttft_s) for r in results if len(r.tokens) > 1]
    return {
        "concurrency": concurrency,
        "tokens": sum(len(r.tokens) for r in results),
        "wall_s": wall,
        "aggregate_decode_tok_s": decoded / decode_window if decode_window > 0 else None,
        "per_request_decode_tok_s": statistics.mean(per_req) if per_req else None,
    }


def radix_bench(n_prefixes: int = 10_000, prompt_len: int = 2000) -> dict:
    """Match + insert of a 2,000-token prompt in a tree of 10,000 cached prefixes.

    Placeholder KV: a [1, T, 1] fp32 tensor per node (4 bytes/token), so this measures the tree
    walk, splitting and block hashing, not KV copies.
    """
    tree = RadixCache("bench@0")
    kv = lambda b, e: torch.zeros(1, e - b, 1)  # noqa: E731
    systems = [[10_000 + 1000 * s + j for j in range(200)] for s in range(100)]
    t0 = time.perf_counter()
    for i in range(n_prefixes):
        s = systems[i % 100]
        tree.insert(s + [20_000 + (i // 100) * 7 + j for j in range(50)], kv)
    build_s = time.perf_counter() - t0
    times = []
    for r in range(20):
        prompt = systems[r] + [30_000 + r * 3 + j for j in range(prompt_len - 200)]
        t = time.perf_counter()
        m = tree.match(prompt)
        tree.insert(prompt, kv)
        times.append(time.perf_counter() - t)
        assert m.length == 200
    return {
        "cached_prefixes": n_prefixes,
        "tree_tokens": tree.num_tokens,
        "tree_nodes": tree.num_nodes,
        "build_s": build_s,
        "prompt_tokens": prompt_len,
        "match_insert_ms_median": 1000 * statistics.median(times),
        "match_insert_ms_max": 1000 * max(times),
        "kv": "placeholder [1,T,1] fp32",
    }


async def main(threads: int) -> None:
    loaded = load_model(None)
    out: dict = {"torch_threads": threads, "load_avg_start": os.getloadavg()}
    async with open_engine(
        loaded, max_batch=4, cache_budget_tokens=20_000, torch_threads=threads
    ) as engine:
        out["cost_model_calibrated"] = engine.cost.as_dict()
        out["ttft"] = await ttft_bench(engine)
        print(
            f"TTFT 1000+50 tokens: miss {out['ttft']['ttft_miss_s']:.3f} s, hit "
            f"{out['ttft']['ttft_hit_s']:.3f} s, ratio {out['ttft']['hit_over_miss']:.3f}"
        )
        engine.tree.clear()
        out["decode"] = [await decode_bench(engine, c) for c in (1, 4)]
        for d in out["decode"]:
            print(
                f"decode x{d['concurrency']}: aggregate {d['aggregate_decode_tok_s']:.1f} tok/s,"
                f" per request {d['per_request_decode_tok_s']:.1f} tok/s"
            )
        t = engine.tree
        out["kv_bytes_per_token"] = engine.kv_bytes_per_token
        out["kv_bytes_per_cached_token_measured"] = t.num_bytes / max(1, t.num_tokens)
        print(
            f"KV bytes per cached token: {out['kv_bytes_per_token']} "
            f"(tree: {t.num_bytes} B / {t.num_tokens} tokens)"
        )
        out["cost_model_after"] = engine.cost.as_dict()
    out["radix"] = radix_bench()
    r = out["radix"]
    print(
        f"radix match+insert of {r['prompt_tokens']} tokens in a tree of "
        f"{r['cached_prefixes']} prefixes: median {r['match_insert_ms_median']:.2f} ms, "
        f"max {r['match_insert_ms_max']:.2f} ms (placeholder KV)"
    )
    out["load_avg_end"] = os.getloadavg()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    trio.run(main, parser.parse_args().threads)
