"""``p2pnode simulate``'s command line: parse the flags, run the grid (or a trial spec, or
re-plot earlier runs' JSON), write ``simulate.json``, ``table.md`` and ``simulate.png``.

``main(argv)`` returns the exit status; a bad flag exits through argparse with what to give.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

from p2pnode.overlay.cache.scope import ScopePolicy
from p2pnode.testnet.sim._config import SimConfig
from p2pnode.testnet.sim._report import markdown_table, plot, run_grid
from p2pnode.testnet.sim._workload import mmlu_prompts

DESCRIPTION = (
    "``p2pnode simulate``: the real routing code on a simulated clock and network (simpy)."
)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="p2pnode simulate", description=DESCRIPTION)
    parser.add_argument("--nodes", default="100,1000,10000", help="comma list of swarm sizes")
    parser.add_argument("--duration", type=float, default=SimConfig.duration_s, help="simulated s")
    parser.add_argument("--rate", type=float, default=None, help="requests per simulated s")
    parser.add_argument("--churn-per-min", type=float, default=0.0, help="share of nodes per min")
    parser.add_argument("--max-views", type=int, default=ScopePolicy.max_views)
    parser.add_argument("--k-nearest", type=int, default=ScopePolicy.k_nearest)
    parser.add_argument("--cell-nodes", type=int, default=ScopePolicy.cell_nodes)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        metavar="SIMULATE_JSON",
        help="run nothing: one table and plot from the rows of earlier runs' simulate.json",
    )
    parser.add_argument(
        "--spec",
        default=None,
        help="simulate this trial spec instead (its nodes, delays and planned requests), "
        "both arms, and print the figures a trial reports (testnet/sim/simspec.py)",
    )
    parser.add_argument("--out", default="bench/results/simulate", help="folder for JSON + plot")
    args = parser.parse_args(argv)
    if args.spec is not None:
        from p2pnode.testnet.sim.simspec import simulate_spec
        from p2pnode.testnet.spec import SpecError, builtin_spec_path, load_spec

        try:
            spec = load_spec(builtin_spec_path(args.spec))
        except (SpecError, OSError) as exc:
            parser.error(f"--spec: {exc}")
        try:
            print(json.dumps(simulate_spec(spec), indent=1))
        except ValueError as exc:
            parser.error(f"--spec: {exc}")
        return 0
    if args.from_json is not None:
        try:
            rows = [r for f in args.from_json for r in json.loads(Path(f).read_text())["rows"]]
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"--from-json: {exc} (give simulate.json files of earlier runs)")
        rows.sort(key=lambda r: (r["nodes"], r["views"]))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        plot(rows, out / "simulate.png")
        (out / "table.md").write_text(markdown_table(rows) + "\n")
        print(markdown_table(rows))
        print(f"\nplot and table in {out}/")
        return 0
    try:
        sizes = [int(x) for x in args.nodes.split(",") if x]
    except ValueError:
        parser.error("--nodes: a comma list of integers, e.g. 100,1000,10000")
    if not sizes or min(sizes) < 2:
        parser.error("--nodes: every size must be at least 2")
    base = SimConfig(
        duration_s=args.duration,
        rate_per_s=args.rate,
        churn_per_min=args.churn_per_min,
        scope=ScopePolicy(
            max_views=args.max_views, k_nearest=args.k_nearest, cell_nodes=args.cell_nodes
        ),
        seed=args.seed,
    )
    started = time.perf_counter()
    print("tokenizing the MMLU prompts ...", file=sys.stderr)
    prompts = mmlu_prompts(base.subjects, base.per_subject)
    rows = run_grid(sizes, base, prompts, log=lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": "p2pnode simulate " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {k: v for k, v in asdict(base).items() if k != "scope"}
        | {"scope": asdict(base.scope)},
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (out / "simulate.json").write_text(json.dumps(record, indent=1))
    (out / "table.md").write_text(markdown_table(rows) + "\n")
    plot(rows, out / "simulate.png")
    print(markdown_table(rows))
    print(f"\n{len(rows)} runs in {record['wall_s']} s; JSON and plot in {out}/")
