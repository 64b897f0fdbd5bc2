"""Run a trial: ``python -m p2pnode.testnet.run_trial SPEC [--arms routing,baseline] [--out DIR]``.

Contract:
- SPEC is a spec file or the name of a shipped one (``lan-2ms``, ``zipf-2ms``, ``wan-200ms``,
  ``wan-1000ms``, ``smoke``). Each arm runs on fresh processes (cold caches, new identities):
  launch (``launch.launch_trial``), drive the seeded workload through the nodes' HTTP API
  (``driver.drive``; the same request sequence for every arm), apply ``[[churn]]`` events at
  their times, snapshot each node's ``/status`` and ``/metrics``, stop.
- Writes into ``--out`` (default ``testnet/results/<name>-<UTC time>``): ``<arm>/requests.jsonl``,
  ``<arm>/status.json``, ``<arm>/metrics/<node>.prom``, ``nodes/<arm>/`` (homes, ``logs/``), ``results.json`` (spec
  echo incl. compute mode, per-arm summary, consistency problems, warnings, machine, command)
  and the report (``report.md`` + PNGs, see ``report.py``). Progress goes to stderr.
- ``run_trial(spec, arms, out_dir, ...) -> dict`` is the same as a function (tests). An arm that
  fails to start is recorded with its error and the next arm still runs; the exit status is 1
  when any arm failed or is inconsistent.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import trio

from p2pnode.testnet import driver
from p2pnode.testnet.launch import NODE_CMD, LaunchError, RunningTrial, launch_trial
from p2pnode.testnet.report import check_consistency, write_report
from p2pnode.testnet.spec import ARMS, SpecError, TrialSpec, builtin_spec_path, load_spec


def _spec_echo(spec: TrialSpec) -> dict[str, Any]:
    w = spec.workload
    return {
        "name": spec.name,
        "path": str(spec.path),
        "compute": spec.compute,
        "model": spec.model,
        "seed": spec.seed,
        "nodes": spec.node_count,
        "placement": list(spec.placement),
        "max_delay_ms": spec.max_delay_ms(),
        "links": [
            {"between": [link.a, link.b], "delay_ms": link.delay_ms, "mbps": link.bandwidth_mbps}
            for link in spec.network.links
        ],
        "node": vars(spec.node),
        "workload": {
            "subjects": w.subjects if isinstance(w.subjects, int) else list(w.subjects),
            "per_subject": w.per_subject,
            "popularity": w.popularity if w.popularity == "uniform" else f"zipf(s={w.zipf_s:g})",
            "requests": w.requests,
            "arrival": f"poisson({w.rate_per_s:g}/s)" if w.arrival == "poisson" else "closed",
            "concurrency": w.concurrency,
            "max_tokens": w.max_tokens,
        },
    }


class _Progress:
    """One stderr line per ~10 % of the requests (plain text: works in logs and CI)."""

    def __init__(self, arm: str, total: int) -> None:
        self.arm, self.total, self.done, self.ok = arm, total, 0, 0
        self.step = max(1, total // 10)
        self.t0 = time.monotonic()

    def __call__(self, rec: dict[str, Any]) -> None:
        self.done += 1
        self.ok += rec["status"] == "ok"
        if self.done % self.step == 0 or self.done == self.total:
            print(
                f"  [{self.arm}] {self.done}/{self.total} done ({self.ok} ok) "
                f"{time.monotonic() - self.t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )


async def _churn(trial: RunningTrial) -> None:
    start = trio.current_time()
    for event in trial.spec.churn:
        await trio.sleep_until(start + event.at_s)
        print(f"  [{trial.arm}] churn: node{event.node} {event.action}s", file=sys.stderr)
        action = trial.leave if event.action == "leave" else trial.join
        await trio.to_thread.run_sync(action, event.node)


async def _drive_arm(trial: RunningTrial, requests: list[driver.PlannedRequest], stream: bool):
    spec = trial.spec
    progress = _Progress(trial.arm, len(requests))
    async with trio.open_nursery() as nursery:
        if spec.churn:
            nursery.start_soon(_churn, trial)
        records = await driver.drive(
            trial.apis,
            requests,
            spec.workload,
            max_duration_s=spec.max_duration_s,
            peer_ids=trial.peer_ids,
            stream=stream,
            on_record=progress,
        )
        nursery.cancel_scope.cancel()
    return records


def _snapshot(trial: RunningTrial, arm_dir: Path) -> None:
    (arm_dir / "status.json").write_text(json.dumps(trial.statuses(), indent=1))
    metrics = arm_dir / "metrics"
    metrics.mkdir(exist_ok=True)
    for node in trial.nodes:
        try:
            text = httpx.get(node.api + "/metrics", timeout=5.0).text
        except (httpx.HTTPError, LaunchError) as exc:
            text = f"# unavailable: {exc}\n"
        (metrics / f"{node.name}.prom").write_text(text)


def run_arm(
    spec: TrialSpec,
    arm: str,
    out_dir: Path,
    *,
    stream: bool = False,
    node_cmd: Sequence[str] = NODE_CMD,
) -> dict[str, Any]:
    arm_dir = out_dir / arm
    arm_dir.mkdir(parents=True, exist_ok=True)
    requests = driver.build_requests(spec.workload, spec.seed, spec.node_count)
    result: dict[str, Any] = {"warnings": []}
    t0 = time.monotonic()
    try:
        print(f"[{arm}] starting {spec.node_count} nodes + bootstrap ...", file=sys.stderr)
        with launch_trial(spec, arm, out_dir / "nodes", node_cmd=node_cmd) as trial:
            print(f"[{arm}] overlay formed in {trial.formed_s:.1f} s", file=sys.stderr)
            result["warnings"] += trial.warnings
            result["formed_s"] = round(trial.formed_s, 2)
            result["peer_ids"] = trial.peer_ids
            result["apis"] = trial.apis
            records = trio.run(_drive_arm, trial, requests, stream)
            _snapshot(trial, arm_dir)
    except LaunchError as exc:
        print(f"[{arm}] failed to start: {exc}", file=sys.stderr)
        result["error"] = str(exc)[:4000]
        return result
    result["logs"] = str(out_dir / "nodes" / arm / "logs")
    driver.write_jsonl(arm_dir / "requests.jsonl", records)
    summary = driver.summarize(records, spec.node_count)
    result["summary"] = summary
    result["consistency"] = check_consistency(records, summary, len(requests))
    result["wall_s"] = round(time.monotonic() - t0, 1)
    lat = summary["latency_s"]
    print(
        f"[{arm}] {summary['answered']}/{summary['requests']} answered, mean {lat['mean']} s, "
        f"p95 {lat['p95']} s, hit rate {summary['hit_rate']}, busiest {summary['max_share']}, "
        f"forwarded {summary['forwarded_fraction']}",
        file=sys.stderr,
    )
    return result


def run_trial(
    spec: TrialSpec,
    arms: Sequence[str],
    out_dir: Path,
    *,
    stream: bool = False,
    command: str = "",
    node_cmd: Sequence[str] = NODE_CMD,
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "spec": _spec_echo(spec),
        "arms": {},
        "command": command,
        "node_cmd": list(node_cmd),
        "machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for arm in arms:
        results["arms"][arm] = run_arm(spec, arm, out_dir, stream=stream, node_cmd=node_cmd)
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    write_report(results, out_dir)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2pnode.testnet.run_trial")
    parser.add_argument("spec", help="spec file or shipped spec name (lan-2ms, wan-200ms, ...)")
    parser.add_argument("--arms", default=None, help="comma list of routing,baseline")
    parser.add_argument("--out", default=None, help="results folder")
    parser.add_argument("--stream", action="store_true", help="stream answers (measures TTFT)")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(builtin_spec_path(args.spec))
    except SpecError as exc:
        parser.error(str(exc))
    arms = spec.arms if args.arms is None else tuple(a for a in args.arms.split(",") if a)
    if not arms or any(a not in ARMS for a in arms):
        parser.error(f"--arms: use a comma list of {', '.join(ARMS)}")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(args.out) if args.out else Path("testnet/results") / f"{spec.name}-{stamp}"
    command = "python -m p2pnode.testnet.run_trial " + shlex.join(argv or sys.argv[1:])
    try:
        results = run_trial(spec, arms, out, stream=args.stream, command=command)
    except KeyboardInterrupt:
        print("interrupted; every node was stopped", file=sys.stderr)
        return 130
    print((out / "report.md").read_text())
    bad = [a for a, r in results["arms"].items() if "summary" not in r or r.get("consistency")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
