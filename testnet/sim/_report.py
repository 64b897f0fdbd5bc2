"""The simulator's report: a grid of runs, its markdown table and its plot.

``run_grid(sizes, base, prompts)`` runs, for each swarm size, the baseline (no routing, full
views) and routing with full and with scoped views, and returns one row per routing run
(``as_row``, plus the baseline's latency and the ratio to it). ``markdown_table`` and ``plot``
(matplotlib, loaded on demand) read such rows, from this run or from earlier runs' JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from p2pnode.testnet.sim._config import SimConfig, SimResult
from p2pnode.testnet.sim._run import simulate


def as_row(r: SimResult) -> dict[str, Any]:
    return asdict(r)


COLUMNS = (
    ("nodes", "N"),
    ("views", "views"),
    ("digest_bytes_per_node_s", "digest B/node/s"),
    ("hot_bytes_per_node_s", "of which summary"),
    ("view_bytes_per_node", "view memory B/node"),
    ("views_per_node", "views/node"),
    ("decide_ms_mean", "decide ms"),
    ("hit_rate", "hit rate"),
    ("hit_rate_ceiling", "ceiling"),
    ("busiest_share", "busiest"),
    ("mean_latency_s", "mean latency s"),
    ("latency_vs_baseline", "vs no routing"),
    ("hot_pulls", "summary pulls"),
    ("lookups", "lookups"),
    ("redirects", "redirects"),
    ("wall_s", "wall s"),
)


def run_grid(
    sizes: Sequence[int], base: SimConfig, prompts: list[list[int]], log=print
) -> list[dict[str, Any]]:

    rows = []
    for n in sizes:
        baseline = simulate(replace(base, nodes=n, views="full", routing=False), prompts)
        log(f"N={n} baseline (no routing): mean latency {baseline.mean_latency_s} s")
        for views in ("full", "scoped"):
            r = simulate(replace(base, nodes=n, views=views, routing=True), prompts)
            row = as_row(r)
            row["baseline_latency_s"] = baseline.mean_latency_s
            row["latency_vs_baseline"] = round(r.mean_latency_s / baseline.mean_latency_s, 3)
            rows.append(row)
            log(markdown_table([row], header=len(rows) == 1))
    return rows


def markdown_table(rows: Sequence[dict[str, Any]], header: bool = True) -> str:
    lines = []
    if header:
        lines.append("| " + " | ".join(title for _, title in COLUMNS) + " |")
        lines.append("|" + "---|" * len(COLUMNS))
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "-")) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("digest_bytes_per_node_s", "digest bytes / node / s", True),
        ("view_bytes_per_node", "view memory / node (B)", True),
        ("decide_ms_mean", "routing decision (ms)", True),
        ("hit_rate", "token hit rate (dashed: ceiling)", False),
        ("busiest_share", "busiest node's share", False),
        ("latency_vs_baseline", "mean latency / no routing", False),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, title, log_y) in zip(axes.flat, metrics, strict=True):
        for views, style in (("full", "o-"), ("scoped", "s-")):
            pts = sorted((r["nodes"], r[key]) for r in rows if r["views"] == views)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{views} views")
            if key == "hit_rate":
                ceil = sorted(
                    (r["nodes"], r["hit_rate_ceiling"]) for r in rows if r["views"] == views
                )
                ax.plot([p[0] for p in ceil], [p[1] for p in ceil], "k--", lw=0.8)
        ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("nodes")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
