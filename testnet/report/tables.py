"""Trial report: consistency checks, a Markdown table next to the paper's figures, PNG plots.

Contract:
- ``check_consistency(records, summary, planned) -> list[str]``: the problems found (empty list:
  consistent): one record per planned request (indices 0..planned-1, none twice), status counts
  add up to the requests, per-node served counts plus unknown servers equal the answered ones,
  cached <= prompt tokens for every answer, hit rate and shares recomputed from the records.
- ``write_report(results, out_dir) -> Path`` writes ``report.md`` from a trial's
  ``results.json`` content (per-arm summaries) and the plots from each arm's
  ``<arm>/requests.jsonl``: ``latency_cdf.png``, ``load_share.png``, ``hit_rate.png``,
  ``share_over_time.png`` (per node, sliding window of requests: the specialization-eviction
  cycle). Plotting uses matplotlib's Agg backend (no display).
- ``plot_forwarded_vs_delay(results_list, path)``: forwarded fraction of the routing arm
  against the trial's one-way delay, over several trials' results.
- ``grid_markdown(results_list)``: one table row per (trial, arm) of several trials.
- ``python -m p2pnode.testnet.report.tables RESULTS_DIR [...]`` re-renders reports, and with several
  directories also ``forwarded_vs_delay.png`` and ``grid.md`` in the first one.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pnode.testnet.workload.driver import read_jsonl

# The routing paper (4 nodes, 0.5B model, MMLU): mean latency in s, cache hit rate; keyed by the
# shipped spec that reproduces each point.
_PAPER_ZIPF_LAN = {
    "routing": {"mean": 0.206, "hit_rate": 0.914},
    "baseline": {"mean": 0.266, "hit_rate": 0.85},
}
_PAPER_WAN = {"note": "routing slower than baseline"}
PAPER = {
    "paper-lan": {"routing": {"mean": 0.310}, "baseline": {"mean": 0.323}},
    "paper-lan-zipf": _PAPER_ZIPF_LAN,
    "paper-lan-zipf-real": _PAPER_ZIPF_LAN,
    "paper-wan-200": _PAPER_WAN,
    "paper-wan-200-zipf": _PAPER_WAN,
    "paper-wan-1000": _PAPER_WAN,
    "paper-wan-1000-zipf": _PAPER_WAN,
}
WINDOW = 20  # requests per point of the share-over-time plot


def check_consistency(
    records: Sequence[dict[str, Any]], summary: dict[str, Any], planned: int
) -> list[str]:
    problems = []
    idx = [r["i"] for r in records]
    if sorted(idx) != list(range(planned)):
        dup = len(idx) - len(set(idx))
        problems.append(f"{len(records)} records for {planned} planned requests ({dup} twice)")
    if sum(summary["statuses"].values()) != summary["requests"]:
        problems.append(f"status counts {summary['statuses']} do not add up to the requests")
    if summary["requests"] != len(records):
        problems.append("summary.requests differs from the record count")
    ok = [r for r in records if r["status"] == "ok"]
    if summary["answered"] != len(ok):
        problems.append("summary.answered differs from the ok records")
    if sum(summary["served_per_node"]) + summary["unknown_server"] != len(ok):
        problems.append(
            f"served per node {summary['served_per_node']} + unknown "
            f"{summary['unknown_server']} != answered {len(ok)}"
        )
    for r in ok:
        if r["prompt_tokens"] is None or r["cached_tokens"] is None:
            problems.append(f"request {r['i']}: answer without token counts")
        elif not 0 <= r["cached_tokens"] <= r["prompt_tokens"]:
            problems.append(
                f"request {r['i']}: {r['cached_tokens']} cached of {r['prompt_tokens']} tokens"
            )
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    if (
        prompt
        and summary["hit_rate"] is not None
        and abs(cached / prompt - summary["hit_rate"]) > 1e-3
    ):
        problems.append("hit rate does not match the records")
    if ok and abs(sum(summary["load_share"]) + summary["unknown_server"] / len(ok) - 1) > 1e-2:
        problems.append("load shares do not add up to 1")
    return problems


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f} %" if pct else f"{x:.3f}"


def _hosts_line(results: dict[str, Any]) -> list[str]:
    """Where the nodes ran, for trials on an inventory (testnet/remote/)."""
    if results.get("hosts") != "inventory":
        return []
    hosts = results.get("inventory", {}).get("hosts", [])
    named = ", ".join(f"{h['name']} ({h['role']}, {h['region']})" for h in hosts)
    return [f"- hosts (inventory, over SSH): {named}; checks in `preflight.md`"]


def markdown(results: dict[str, Any]) -> str:
    name = results["spec"]["name"]
    lines = [
        f"# Trial {name}",
        "",
        f"- compute mode: **{results['spec']['compute']}** "
        f"({'model forward replaced by calibrated delays, cost model frozen' if results['spec']['compute'] == 'emulated' else 'real model'})",
        f"- nodes: {results['spec']['nodes']} in regions {results['spec']['placement']}; "
        f"max one-way delay {results['spec']['max_delay_ms']:g} ms",
        f"- workload: {results['spec']['workload']}",
        f"- command: `{results.get('command', '')}`",
        f"- machine: {results.get('machine', {})}",
        *_hosts_line(results),
        "",
        "| arm | answered | mean s | p50 s | p90 s | p95 s | hit rate | hit ceiling | busiest node "
        "| forwarded | accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    emulated = results["spec"]["compute"] == "emulated"
    for arm, a in results["arms"].items():
        s = a.get("summary")
        if s is None:
            lines.append(f"| {arm} | failed: {a.get('error', '?')} |")
            continue
        lat = s["latency_s"]
        # emulated compute returns placeholder tokens: its answers say nothing about the model
        accuracy = "n/a" if emulated else _fmt(s["accuracy"], True)
        lines.append(
            f"| {arm} | {s['answered']}/{s['requests']} | {_fmt(lat['mean'])} | "
            f"{_fmt(lat['p50'])} | {_fmt(lat['p90'])} | {_fmt(lat['p95'])} | "
            f"{_fmt(s['hit_rate'], True)} | {_fmt(s.get('hit_rate_ceiling'), True)} | "
            f"{_fmt(s['max_share'], True)} | {_fmt(s['forwarded_fraction'], True)} | {accuracy} |"
        )
    lines.append(
        "\nhit ceiling: cached / prompt tokens of ONE unbounded cache that served every earlier "
        "request (driver.oracle_cached); no placement or routing can reuse more."
    )
    arms = results["arms"]
    r, b = (arms.get(k, {}).get("summary") for k in ("routing", "baseline"))
    if r and b and r["latency_s"]["mean"] and b["latency_s"]["mean"]:
        ratio = r["latency_s"]["mean"] / b["latency_s"]["mean"]
        lines += ["", f"routing / baseline mean latency: **{ratio:.3f}**"]
        floor = r.get("latency_floor_s")
        if floor:
            lines.append(
                f"\nlatency floor: {floor:.3f} s, each request alone at the one unbounded cache "
                "(no network, no queue, this machine's calibrated speeds; driver.latency_floor_s): "
                f"no routing can bring routing / baseline below **{floor / b['latency_s']['mean']:.3f}**"
                " on this workload."
            )
    chats = {arm: a["chat"] for arm, a in arms.items() if a.get("chat")}
    if chats:
        lines += [
            "",
            "| arm | mean latency by turn (s) | later turns with their history cached "
            "| nodes serving each system prompt |",
            "|---|---|---|---|",
        ]
        for arm, c in chats.items():
            by_turn = ", ".join(f"{t}: {v:.2f}" for t, v in c["latency_s_by_turn"].items())
            copies = ", ".join(f"{k}: {v}" for k, v in c["serving_nodes_per_system_prompt"].items())
            lines.append(
                f"| {arm} | {by_turn} | {_fmt(c['history_cached_share'], True)} | {copies} |"
            )
    lines += _adversary_lines(arms)
    paper = PAPER.get(name)
    if paper:
        lines += ["", f"Paper ({name}): {json.dumps(paper)}"]
    for arm, a in arms.items():
        for w in a.get("warnings", []):
            lines.append(f"- warning ({arm}): {w}")
        for p in a.get("consistency", []):
            lines.append(f"- INCONSISTENT ({arm}): {p}")
    return "\n".join(lines) + "\n"


def _adversary_lines(arms: dict[str, Any]) -> list[str]:
    """The ``[[adversary]]`` table: per arm and liar, what it did and who caught it."""
    lines: list[str] = []
    for arm, a in arms.items():
        adv = a.get("adversaries")
        if not adv:
            continue
        lines += [
            "",
            f"Adversaries ({arm}): wrong answers kept **{adv['wrong_answers']}**, after "
            f"detection **{adv['wrong_answers_after_detection']}**; liars demoted "
            f"**{adv['liars_demoted']}/{len(adv['liars'])}**",
            "",
            "| node | kind | routed to it | kept | wrong kept | audits failed | first caught s "
            "| attempts until caught | demoted by / routed by |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for node, liar in adv["liars"].items():
            kind = liar["kind"] + (f" ({liar['rate']:g})" if liar.get("rate") else "")
            kind += ", forged digest" if liar.get("forge_digest") else ""
            lines.append(
                f"| {node} | {kind} | {sum(liar['routed'].values())} | {liar['kept']} | "
                f"{liar['wrong_kept']} | {liar['audit_failed']} | "
                f"{_fmt(liar['first_detected_s'])} | "
                f"{json.dumps(liar['attempts_until_detection'])} | "
                f"{liar['demoted_by']} / {liar['routed_by']} |"
            )
    if lines:
        lines.append(
            "\nwrong: the answer differs from the honest one (recomputed from the emulated "
            "model); after detection: kept by an origin from a liar that origin had caught "
            "(testnet/adversary/liars.py)."
        )
    return lines


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_arms(arm_records: dict[str, list[dict[str, Any]]], n_nodes: int, out: Path) -> list[Path]:
    plt = _plt()
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, recs in arm_records.items():
        lat = sorted(r["latency_s"] for r in recs if r["status"] == "ok")
        if lat:
            ax.step(lat, [(k + 1) / len(lat) for k in range(len(lat))], where="post", label=arm)
    ax.set_xlabel("latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("latency CDF")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend()
    written.append(_save(fig, out / "latency_cdf.png", plt))

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(arm_records))
    for k, (arm, recs) in enumerate(arm_records.items()):
        ok = [r for r in recs if r["status"] == "ok"]
        shares = [sum(r["served_node"] == n for r in ok) / max(1, len(ok)) for n in range(n_nodes)]
        ax.bar([n + k * width for n in range(n_nodes)], shares, width, label=arm)
    ax.set_xlabel("node")
    ax.set_ylabel("share of requests served")
    ax.set_title("load share per node")
    if arm_records:
        ax.legend()
    written.append(_save(fig, out / "load_share.png", plt))

    fig, ax = plt.subplots(figsize=(5, 4))
    rates = []
    for recs in arm_records.values():
        ok = [r for r in recs if r["status"] == "ok"]
        prompt = sum(r["prompt_tokens"] or 0 for r in ok)
        rates.append(sum(r["cached_tokens"] or 0 for r in ok) / prompt if prompt else 0.0)
    ax.bar(list(arm_records), rates)
    ax.set_ylim(0, 1)
    ax.set_ylabel("cached / prompt tokens")
    ax.set_title("cache hit rate")
    written.append(_save(fig, out / "hit_rate.png", plt))

    fig, axes = plt.subplots(
        len(arm_records), 1, figsize=(7, 2.6 * len(arm_records)), squeeze=False
    )
    for ax, (arm, recs) in zip(axes[:, 0], arm_records.items(), strict=True):
        ok = sorted((r for r in recs if r["status"] == "ok"), key=lambda r: r["sent_s"])
        w = min(WINDOW, max(1, len(ok) // 4))  # small trials still get several points
        for n in range(n_nodes):
            xs, ys = [], []
            for end in range(w, len(ok) + 1):
                window = ok[end - w : end]
                xs.append(window[-1]["sent_s"])
                ys.append(sum(r["served_node"] == n for r in window) / w)
            ax.plot(xs, ys, ".-", markersize=3, label=f"node{n}")
        ax.set_title(f"{arm}: share of the last {w} requests served per node")
        ax.set_ylim(0, 1)
        ax.set_xlabel("time (s)")
    if axes[0, 0].get_lines():
        axes[0, 0].legend(fontsize=7, ncol=min(n_nodes, 8))
    written.append(_save(fig, out / "share_over_time.png", plt))
    return written


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_forwarded_vs_delay(results_list: Sequence[dict[str, Any]], path: Path) -> Path:
    """Forwarded fraction of the routing arm against one-way delay, one line per popularity."""
    plt = _plt()
    series: dict[str, list[tuple[float, float]]] = {}
    for r in results_list:
        summary = r["arms"].get("routing", {}).get("summary")
        if summary:
            label = f"{r['spec']['workload']['popularity']}, {r['spec']['compute']}"
            point = (r["spec"]["max_delay_ms"], summary["forwarded_fraction"] or 0.0)
            series.setdefault(label, []).append(point)
    fig, ax = plt.subplots(figsize=(5, 4))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("one-way delay between nodes (ms)")
    ax.set_ylabel("forwarded fraction (routing arm)")
    ax.set_ylim(0, 1)
    if series:
        ax.legend(fontsize=8)
    return _save(fig, path, plt)


def grid_markdown(results_list: Sequence[dict[str, Any]]) -> str:
    """One row per (trial, arm): the closing-note table of a grid of trials."""
    lines = [
        "| trial | compute | delay ms | popularity | arm | mean s | p95 s | hit | ceiling "
        "| busiest | forwarded | routing/baseline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results_list, key=lambda r: (r["spec"]["max_delay_ms"], r["spec"]["name"])):
        sp = r["spec"]
        summaries = {arm: a.get("summary") for arm, a in r["arms"].items()}
        means = {arm: (s or {}).get("latency_s", {}).get("mean") for arm, s in summaries.items()}
        ratio = "-"
        if means.get("routing") and means.get("baseline"):
            ratio = f"{means['routing'] / means['baseline']:.3f}"
        for arm, s in summaries.items():
            if s is None:
                lines.append(f"| {sp['name']} | {sp['compute']} | | | {arm} | failed |")
                continue
            lines.append(
                f"| {sp['name']} | {sp['compute']} | {sp['max_delay_ms']:g} | "
                f"{sp['workload']['popularity']} | {arm} | {_fmt(s['latency_s']['mean'])} | "
                f"{_fmt(s['latency_s']['p95'])} | {_fmt(s['hit_rate'], True)} | "
                f"{_fmt(s.get('hit_rate_ceiling'), True)} | {_fmt(s['max_share'], True)} | "
                f"{_fmt(s['forwarded_fraction'], True)} | {ratio if arm == 'routing' else ''} |"
            )
    return "\n".join(lines) + "\n"


def write_report(results: dict[str, Any], out_dir: Path) -> Path:
    arm_records = {}
    for arm in results["arms"]:
        path = out_dir / arm / "requests.jsonl"
        if path.is_file():
            arm_records[arm] = read_jsonl(path)
    if arm_records:
        plot_arms(arm_records, results["spec"]["nodes"], out_dir)
    report = out_dir / "report.md"
    report.write_text(markdown(results))
    return report


def main(argv: Sequence[str]) -> int:
    if not argv:
        print("usage: python -m p2pnode.testnet.report.tables RESULTS_DIR [RESULTS_DIR ...]")
        return 2
    loaded = []
    for d in map(Path, argv):
        results = json.loads((d / "results.json").read_text())
        print(write_report(results, d))
        loaded.append(results)
    if len(loaded) > 1:
        print(plot_forwarded_vs_delay(loaded, Path(argv[0]) / "forwarded_vs_delay.png"))
        grid = Path(argv[0]) / "grid.md"
        grid.write_text(grid_markdown(loaded))
        print(grid.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
