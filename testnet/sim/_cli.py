"""What ``p2pnode simulate`` runs (its flags are parsed in ``testnet/commands.py``): the grid of
swarm sizes (``run``), a trial spec (``run_spec``) or a re-plot of earlier runs' JSON
(``replot``); each writes ``simulate.json``, ``table.md`` and ``simulate.png`` or prints.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from p2pnode.overlay.cache.scope import ScopePolicy
from p2pnode.testnet.sim._config import SimConfig
from p2pnode.testnet.sim._report import markdown_table, plot, run_grid
from p2pnode.testnet.sim._workload import mmlu_prompts


def config(
    *,
    rate_per_s: float | None,
    churn_per_min: float,
    seed: int,
    duration_s: float | None = None,
    max_views: int | None = None,
    k_nearest: int | None = None,
    cell_nodes: int | None = None,
) -> SimConfig:
    """The run's ``SimConfig``; a knob left None keeps its default."""
    scope = {"max_views": max_views, "k_nearest": k_nearest, "cell_nodes": cell_nodes}
    given = {"duration_s": duration_s} if duration_s is not None else {}
    return SimConfig(
        rate_per_s=rate_per_s,
        churn_per_min=churn_per_min,
        seed=seed,
        scope=ScopePolicy(**{k: v for k, v in scope.items() if v is not None}),
        **given,
    )


def run_spec(spec_name: str) -> None:
    """Simulate a trial spec (both arms) and print the figures a trial reports. Raises
    ``SpecError``/``OSError`` for a spec that does not load, ``ValueError`` for one the
    simulator cannot model."""
    from p2pnode.testnet.sim.simspec import simulate_spec
    from p2pnode.testnet.spec import builtin_spec_path, load_spec

    spec = load_spec(builtin_spec_path(spec_name))
    print(json.dumps(simulate_spec(spec), indent=1))


def replot(files: Sequence[str], out: Path) -> None:
    """One table and plot from the rows of earlier runs' ``simulate.json`` files."""
    rows = [r for f in files for r in json.loads(Path(f).read_text())["rows"]]
    rows.sort(key=lambda r: (r["nodes"], r["views"]))
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, out / "simulate.png")
    (out / "table.md").write_text(markdown_table(rows) + "\n")
    print(markdown_table(rows))
    print(f"\nplot and table in {out}/")


def run(sizes: Sequence[int], base: SimConfig, out: Path, *, command: str) -> None:
    """Every size with full and scoped views; ``command`` is recorded in the JSON."""
    started = time.perf_counter()
    print("tokenizing the MMLU prompts ...", file=sys.stderr)
    prompts = mmlu_prompts(base.subjects, base.per_subject)
    rows = run_grid(sizes, base, prompts, log=lambda m: print(m, file=sys.stderr, flush=True))
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": command,
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
