"""Two builds of the decode kernels, timed against each other in one process, step by step.

`python bench/kernel_ab.py [--against REV] [--reps N]` compiles `inference/_kernels.c` as it
is in the working tree and as it was at git revision REV (default HEAD), and times the decode
steps whose C decoder stack (`llama_layers`) either build can run: the W4A16 draft's decode
step, and the target's verify of 1 and 5 positions over a 200-token context (``--context``). Steps alternate
between the builds rep by rep (the order flipping every rep), with a 160 MB read between any
two steps, so both builds see the same load and start each step with the weights out of the
caches, as in a running node. On this project's shared 2-core machines run-to-run noise is
+-10-20 %, larger than most kernel changes: a comparison inside one process is the only one
that says which build is faster. The lm_head and prefill use the working tree's build in both
arms (they are not part of the decoder stack).

Prints, per step, best and median of each build for the whole step and for the C stack alone,
and verify(5) / verify(1); writes `bench/results/kernel_ab.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from p2pnode.inference import _fastpath, _kernels
from p2pnode.inference.models import load_model
from p2pnode.speculation.draft import load_draft

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "kernel_ab.json"
CONTEXT = 200  # default, as bench/floor.py
SOURCE = "inference/_kernels.c"


def source_at(rev: str) -> bytes:
    try:
        return subprocess.run(
            ["git", "show", f"{rev}:{SOURCE}"], cwd=ROOT, check=True, capture_output=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"cannot read {SOURCE} at {rev!r} (is it a git revision?): {exc}") from exc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="HEAD", help="git revision to compare with")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--context", type=int, default=CONTEXT, help="tokens cached before a step")
    args = ap.parse_args()
    if args.reps < 1 or args.context < 8:
        raise SystemExit("need --reps >= 1 and --context >= 8")
    torch.set_num_threads(1)
    builds = {
        "base": _kernels.build(source_at(args.against)),
        "tree": _kernels.build((ROOT / SOURCE).read_bytes()),
    }
    if any(lib is None for lib in builds.values()):
        raise SystemExit("a build failed (see the warning above): nothing to compare")
    loaded = load_model(None)
    target, draft = loaded.model, load_draft().model
    if _fastpath.plan(target) is None or _fastpath.plan(draft) is None:
        raise SystemExit("no C decoder stack for these models here (P2PNODE_KERNELS=0?)")
    text = "The river runs past the old mill and the stone bridge. "
    prompt = loaded.tokenizer.encode(text * (args.context // 8 + 1))[: args.context]
    caches = {}
    for model in (target, draft):
        cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        caches[id(model)] = cache
    paths = [("draft decode", draft, 1), ("verify 1", target, 1), ("verify 5", target, 5)]

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
        order = ("base", "tree") if rep % 2 else ("tree", "base")
        for name, model, k in paths:
            cache = caches[id(model)]
            for build in order:
                _fastpath.plan(model).lib = builds[build]
                flush.sum()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    model(
                        input_ids=torch.tensor([prompt[-k:]]), past_key_values=cache, use_cache=True
                    )
                step = time.perf_counter() - t0
                cache.crop(-k)
                if rep:
                    times.setdefault((name, build, "step"), []).append(step)
                    times.setdefault((name, build, "C stack"), []).append(c_time[0])
        print(f"rep {rep}/{args.reps}", flush=True)
    _fastpath.run = run
    _fastpath.plan(target).lib = _fastpath.plan(draft).lib = _kernels.library()

    rows = []
    print(
        f"{'step':14} {'part':8} {args.against + ' best / median ms':>26} {'tree best / median ms':>24}"
    )
    for name, _, _ in paths:
        for part in ("step", "C stack"):
            b, t = times[(name, "base", part)], times[(name, "tree", part)]
            row = {"path": name, "part": part}
            for build, ts in (("base", b), ("tree", t)):
                row[f"{build}_best_ms"] = 1000 * min(ts)
                row[f"{build}_median_ms"] = 1000 * statistics.median(ts)
            rows.append(row)
            print(
                f"{name:14} {part:8} {row['base_best_ms']:12.2f} / {row['base_median_ms']:7.2f}"
                f" {row['tree_best_ms']:13.2f} / {row['tree_median_ms']:7.2f}"
            )
    ratio = {}
    for build in ("base", "tree"):
        v1, v5 = times[("verify 1", build, "step")], times[("verify 5", build, "step")]
        ratio[build] = {
            "best": min(v5) / min(v1),
            "median": statistics.median(v5) / statistics.median(v1),
        }
        print(
            f"verify(5)/verify(1) {build}: best {ratio[build]['best']:.3f}, "
            f"median {ratio[build]['median']:.3f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "against": args.against,
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
