"""Two variants of the decode path, timed against each other in one process, step by step.

`python bench/kernel_ab.py [--against REV] [--pages] [--reps N] [--context N]` times the
W4A16 draft's decode step and the target's verify of 1 and 5 positions over a 200-token context
(`--context`) in two arms:
- by default, `inference/_cpu/kernels.c` as it is in the working tree against the same file at git
  revision REV (default HEAD): both builds drive the same models' C decoder stack
  (`llama_layers`; the lm_head and prefill use the tree's build in both arms);
- with `--pages`, the models' weights on 4 KB pages against 2 MB pages
  (`inference/_cpu/hugepages.py`; two copies of each model, the tree's build).
Steps alternate between the arms rep by rep (the order flipping every rep), with a 160 MB read
before every step, so both arms see the same load and start each step with the weights out of
the caches, as in a running node. On this project's shared 2-core machines run-to-run noise is
+-10-20 %, larger than most changes: a comparison inside one process is the only one that says
which variant is faster.

Prints, per step, best and median of each arm for the whole step and for the C stack alone,
and verify(5) / verify(1); writes `bench/results/kernel_ab.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from p2pnode.inference._cpu import fastpath as _fastpath
from p2pnode.inference._cpu import kernels as _kernels
from p2pnode.inference.models import load_model
from p2pnode.speculation.draft import load_draft

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "kernel_ab.json"
CONTEXT = 200  # default, as bench/floor.py
SOURCE = "inference/_cpu/kernels.c"


@dataclass
class Arm:
    name: str
    target: torch.nn.Module
    draft: torch.nn.Module
    lib: object  # the kernel build its C stack runs on


def source_at(rev: str) -> bytes:
    try:
        return subprocess.run(
            ["git", "show", f"{rev}:{SOURCE}"], cwd=ROOT, check=True, capture_output=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"cannot read {SOURCE} at {rev!r} (is it a git revision?): {exc}") from exc


def load_arm(name: str, lib: object, huge_pages: bool = True) -> tuple[Arm, object]:
    """An arm's models, and the target's tokenizer."""
    os.environ["P2PNODE_HUGEPAGES"] = "1" if huge_pages else "0"
    try:
        loaded = load_model(None)
        return Arm(name, loaded.model, load_draft().model, lib), loaded.tokenizer
    finally:
        os.environ.pop("P2PNODE_HUGEPAGES")


def make_arms(args: argparse.Namespace) -> tuple[list[Arm], object]:
    if args.pages:
        lib = _kernels.library()
        (small, tokenizer), (huge, _) = (
            load_arm("4 KB pages", lib, False),
            load_arm("2 MB pages", lib),
        )
        return [small, huge], tokenizer
    base, tree = _kernels.build(source_at(args.against)), _kernels.library()
    if base is None or tree is None:
        raise SystemExit("a build failed (see the warning above): nothing to compare")
    arm, tokenizer = load_arm(args.against, base)
    return [arm, Arm("tree", arm.target, arm.draft, tree)], tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="HEAD", help="git revision to compare with")
    ap.add_argument("--pages", action="store_true", help="compare 4 KB with 2 MB weight pages")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--context", type=int, default=CONTEXT, help="tokens cached before a step")
    args = ap.parse_args()
    if args.reps < 1 or args.context < 8:
        raise SystemExit("need --reps >= 1 and --context >= 8")
    torch.set_num_threads(1)
    arms, tokenizer = make_arms(args)
    if any(_fastpath.plan(m) is None for a in arms for m in (a.target, a.draft)):
        raise SystemExit("no C decoder stack for these models here (P2PNODE_KERNELS=0?)")
    text = "The river runs past the old mill and the stone bridge. "
    prompt = tokenizer.encode(text * (args.context // 8 + 1))[: args.context]
    caches: dict[int, DynamicCache] = {}
    for model in {id(m): m for a in arms for m in (a.target, a.draft)}.values():
        cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        caches[id(model)] = cache
    paths = [("draft decode", "draft", 1), ("verify 1", "target", 1), ("verify 5", "target", 5)]

    c_time = [0.0]
    run = _fastpath.run

    def timed_run(*a, **kw):
        t0 = time.perf_counter()
        try:
            return run(*a, **kw)
        finally:
            c_time[0] = time.perf_counter() - t0

    _fastpath.run = timed_run
    flush = torch.ones(40_000_000)
    times: dict[tuple[str, str, str], list[float]] = {}
    for rep in range(args.reps + 1):  # rep 0 warms up
        order = arms if rep % 2 else arms[::-1]
        for name, which, k in paths:
            for arm in order:
                model = getattr(arm, which)
                _fastpath.plan(model).lib = arm.lib
                cache = caches[id(model)]
                flush.sum()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    model(
                        input_ids=torch.tensor([prompt[-k:]]), past_key_values=cache, use_cache=True
                    )
                step = time.perf_counter() - t0
                cache.crop(-k)
                if rep:
                    times.setdefault((name, arm.name, "step"), []).append(step)
                    times.setdefault((name, arm.name, "C stack"), []).append(c_time[0])
        print(f"rep {rep}/{args.reps}", flush=True)
    _fastpath.run = run
    for arm in arms:
        _fastpath.plan(arm.target).lib = _fastpath.plan(arm.draft).lib = _kernels.library()

    a, b = arms[0].name, arms[1].name
    rows = []
    print(f"{'step':14} {'part':8} {a + ' best / median ms':>26} {b + ' best / median ms':>26}")
    for name, _, _ in paths:
        for part in ("step", "C stack"):
            row: dict = {"path": name, "part": part}
            for arm in (a, b):
                ts = times[(name, arm, part)]
                row[arm] = {"best_ms": 1000 * min(ts), "median_ms": 1000 * statistics.median(ts)}
            rows.append(row)
            print(
                f"{name:14} {part:8} {row[a]['best_ms']:12.2f} / {row[a]['median_ms']:7.2f}"
                f" {row[b]['best_ms']:15.2f} / {row[b]['median_ms']:7.2f}"
            )
    ratio = {}
    for arm in (a, b):
        v1, v5 = times[("verify 1", arm, "step")], times[("verify 5", arm, "step")]
        ratio[arm] = {
            "best": min(v5) / min(v1),
            "median": statistics.median(v5) / statistics.median(v1),
        }
        print(
            f"verify(5)/verify(1) {arm}: best {ratio[arm]['best']:.3f}, median {ratio[arm]['median']:.3f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "arms": [a, b],
                "reps": args.reps,
                "context": args.context,
                "loadavg": os.getloadavg(),
                "rows": rows,
                "verify5_over_verify1": ratio,
            },
            indent=1,
        )
    )
    print(f"load average {os.getloadavg()[0]:.1f}; wrote {RESULTS}")


if __name__ == "__main__":
    main()
