"""The results page: ``python -m p2pnode.testnet.report.page [RESULT_DIR ...] [--page PATH]``.

Contract:
- Reads each trial output folder's ``results.json`` (default: every folder under
  ``testnet/results/``) and keeps the newest run of each spec (a run on an inventory's hosts
  is its own row, ``<spec> (hosts)``), then rewrites the part of the page
  (default ``docs/results.md``) between ``<!-- trials:begin -->`` and ``<!-- trials:end -->``
  with one table row per spec and arm pair: routing / baseline mean latency (and the floor no
  routing can beat, where the run recorded one), hit rate and its
  share of the ceiling, busiest node, forwarded share, chat figures where the workload is chat,
  and the date and command of the run. A spec with no output here keeps the row and command
  the page already has (trial outputs stay on the machine that ran them, so one machine's run
  of a few specs must not drop the others' figures). The rest of the page (written by hand or
  by other scripts, e.g. the scale runs) is kept as it is; a page without the markers gets
  them appended.
- Trial outputs are git-ignored (they hold node homes and logs); this page is what a reader of
  the repository sees of them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pnode.testnet.run.formation import describe

BEGIN = "<!-- trials:begin -->"
END = "<!-- trials:end -->"
DEFAULT_PAGE = Path("docs/results.md")
DEFAULT_RESULTS = Path("testnet/results")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _num(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def load_runs(dirs: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """Newest ``results.json`` per spec name (by its ``started`` time)."""
    newest: dict[str, dict[str, Any]] = {}
    for d in dirs:
        path = d / "results.json"
        if not path.is_file():
            continue
        try:
            results = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            print(f"skipping {path}: {exc}", file=sys.stderr)
            continue
        name = results.get("spec", {}).get("name")
        if not name or not results.get("arms"):
            continue
        if results.get("hosts") == "inventory":  # real hosts: a row beside the spec's own
            name = f"{name} (hosts)"
        old = newest.get(name)
        if old is None or results.get("started", "") > old.get("started", ""):
            results["_dir"] = str(d)
            newest[name] = results
    return newest


def row(name: str, results: dict[str, Any]) -> str:
    arms = results["arms"]
    r = (arms.get("routing") or {}).get("summary")
    b = (arms.get("baseline") or {}).get("summary")
    if not r:
        return f"| {name} | routing arm failed or missing | | | | | | | |"
    ratio = None
    if b and r["latency_s"]["mean"] and b["latency_s"]["mean"]:
        ratio = r["latency_s"]["mean"] / b["latency_s"]["mean"]
    floor = r.get("latency_floor_s")
    floor_cell = ""
    if floor and b and b["latency_s"]["mean"]:
        floor_cell = f" (floor {floor / b['latency_s']['mean']:.3f})"
    chat = (arms.get("routing") or {}).get("chat") or {}
    chat_b = (arms.get("baseline") or {}).get("chat") or {}
    chat_cell = "-"
    if chat:
        copies = list(chat.get("serving_nodes_per_system_prompt", {}).values())
        chat_cell = (
            f"history cached {_pct(chat.get('history_cached_share'))} "
            f"(baseline {_pct(chat_b.get('history_cached_share'))}); copies per system "
            f"prompt {copies}"
        )
    spec = results["spec"]
    return (
        f"| {name} | {spec['compute']}, {spec['nodes']} nodes, {spec['max_delay_ms']:g} ms"
        f"{_formation_note(arms)} "
        f"| {r['answered']}/{r['requests']} | **{_num(ratio)}**{floor_cell} "
        f"| {_num(r['latency_s']['mean'])} / {_num(b['latency_s']['mean'] if b else None)} "
        f"| {_pct(r['hit_rate'])} ({_pct(r.get('hit_of_ceiling'))} of ceiling "
        f"{_pct(r.get('hit_rate_ceiling'))}) | {_pct(r['max_share'])} "
        f"| {_pct(r['forwarded_fraction'])} | {chat_cell} | {results.get('started', '?')} |"
    )


def _formation_note(arms: dict[str, Any]) -> str:
    """How far each arm's overlay had formed when its workload started, where it had not."""
    notes = []
    for arm in ("routing", "baseline"):
        f = (arms.get(arm) or {}).get("formation") or {}
        if f and not f.get("formed", True):
            started = arms[arm].get("formed_s") or 0
            notes.append(f"{arm} started at {started:.0f} s with {describe(f)}")
    return f"; {'; '.join(notes)}" if notes else ""


def kept_rows(text: str) -> dict[str, tuple[str, str]]:
    """The (row, command line) of each spec in the page's generated section, by spec name."""
    if BEGIN not in text or END not in text:
        return {}
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows: dict[str, str] = {}
    commands: dict[str, str] = {}
    for line in body.splitlines():
        if line.startswith("| ") and not line.startswith(("| spec |", "|---")):
            rows[line.split("|")[1].strip()] = line
        elif line.startswith("- ") and ": `" in line:
            commands[line[2:].split(":", 1)[0]] = line
    return {name: (row, commands.get(name, f"- {name}: `?`")) for name, row in rows.items()}


def section(runs: dict[str, dict[str, Any]], kept: dict[str, tuple[str, str]] | None = None) -> str:
    kept = {k: v for k, v in (kept or {}).items() if k not in runs}
    names = sorted({*runs, *kept})
    lines = [
        BEGIN,
        "## Trials: routing against the no-routing baseline",
        "",
        "Generated by `python -m p2pnode.testnet.report.page` from the newest output of each "
        "spec (`p2pnode testnet SPEC`); each row is one run of both arms on fresh processes (a "
        "spec with no output on the machine that regenerated the page keeps its earlier row). "
        "Hit rate: cached / prompt tokens of the routing arm; the ceiling is what one unbounded "
        "cache that saw every earlier request would reuse. The floor in brackets is the smallest "
        "ratio any routing could show on that workload: every request alone at that one cache, "
        "with no network and no queue, at the calibrated speeds (`driver.latency_floor_s`), "
        "over the baseline's mean.",
        "",
        "| spec | setup | answered | routing / baseline latency | mean s (routing / baseline) "
        "| hit rate | busiest node | forwarded | chat | run (UTC) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [row(name, runs[name]) if name in runs else kept[name][0] for name in names]
    lines += ["", "Commands:", ""]
    lines += [
        f"- {name}: `{runs[name].get('command') or '?'}`" if name in runs else kept[name][1]
        for name in names
    ]
    lines.append(END)
    return "\n".join(lines)


def update_page(page: Path, runs: dict[str, dict[str, Any]]) -> None:
    text = page.read_text() if page.exists() else "# Measured results\n"
    new = section(runs, kept_rows(text))
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + new + tail
    else:
        text = text.rstrip("\n") + "\n\n" + new + "\n"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2pnode.testnet.report.page")
    parser.add_argument("dirs", nargs="*", type=Path, help="trial output folders")
    parser.add_argument("--page", type=Path, default=DEFAULT_PAGE)
    args = parser.parse_args(argv)
    dirs = args.dirs or sorted(p for p in DEFAULT_RESULTS.glob("*") if p.is_dir())
    runs = load_runs(dirs)
    if not runs:
        print("no trial results found; run `p2pnode testnet SPEC` first", file=sys.stderr)
        return 1
    update_page(args.page, runs)
    print(f"{args.page}: {len(runs)} specs ({', '.join(sorted(runs))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
