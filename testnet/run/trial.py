"""Run a trial: ``p2pnode testnet SPEC [--arms routing,baseline] [--out DIR]`` (flags parsed in
``testnet/commands.py``; also ``python -m p2pnode.testnet.run.trial``).

Contract:
- SPEC is a spec file or the name of a shipped one (``paper-lan``, ``paper-lan-zipf``,
  ``paper-wan-200[-zipf]``, ``paper-wan-1000[-zipf]``, ``paper-lan-zipf-real``, ``chat-lan``,
  ``chat-wan``, ``chat-lan-real``, ``mixed-6``, ``scale-64``, ``scale-128``, ``smoke``,
  ``adversarial-liar``). Each arm runs on fresh processes (cold caches, new identities):
  launch (``launch.launch_trial``), drive the seeded workload through the nodes' HTTP API
  (``driver.drive``; the same request sequence for every arm), apply ``[[churn]]`` events at
  their times, snapshot each node's ``/status`` and ``/metrics``, stop.
- Writes into ``--out`` (default ``testnet/results/<name>-<UTC time>``): ``<arm>/requests.jsonl``,
  ``<arm>/status.json``, ``<arm>/metrics/<node>.prom``, ``nodes/<arm>/`` (homes, ``logs/``), ``results.json`` (spec
  echo incl. compute mode, per-arm summary, consistency problems, warnings, machine, command)
  and the report (``report.md`` + PNGs, see ``report.py``). Progress goes to stderr.
- Each record gets ``oracle_cached`` (``driver.oracle_cached`` over the plan, prompts tokenized
  with the spec's model tokenizer as the nodes do), so the summary carries the workload's hit
  rate ceiling; left out, with a warning, when the tokenizer cannot load or its counts differ
  from the nodes' ``prompt_tokens``. With it the summary also carries ``latency_floor_s``
  (``driver.latency_floor_s`` at this machine's calibration of the model, the one emulated nodes
  read): no routing brings the arm's mean below it.
- Adversaries: a spec with ``[[adversary]]`` adds ``adversaries`` to the arm's result
  (``liars.adversary_summary``: wrong answers kept, also after detection, liars demoted).
- Churn: a spec with ``[[churn]]`` runs its events during the workload
  (``churn.run_churn``), drives through ``churn.drive_with_retries`` (a request whose node left
  is retried on a live one) and adds ``churn`` (lost, duplicates, retries, latency near/away
  from events, departure watches) to the arm's result; ``--no-churn`` runs the same spec
  without its events.
- ``run_trial(spec, arms, out_dir, ...) -> dict`` is the same as a function (tests). An arm that
  fails to start is recorded with its error and the next arm still runs; the exit status is 1
  when any arm failed or is inconsistent.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from p2pnode.testnet.adversary import liars
from p2pnode.testnet.report.tables import check_consistency, write_report
from p2pnode.testnet.run import formation
from p2pnode.testnet.run.capacity import check_cpu, check_memory
from p2pnode.testnet.run.launch import NODE_CMD, LaunchError, RunningTrial, launch_trial
from p2pnode.testnet.spec import TrialSpec
from p2pnode.testnet.workload import chat, churn, driver

CHURN_RETRIES = 3  # churn: attempts after the first for a request whose node left


def spec_echo(spec: TrialSpec) -> dict[str, Any]:
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
        "bootstraps": spec.bootstraps,
        "formation": spec.formation,
        "links": [
            {"between": [link.a, link.b], "delay_ms": link.delay_ms, "mbps": link.bandwidth_mbps}
            for link in spec.network.links
        ],
        "node": vars(spec.node),
        "workload": {
            "kind": w.kind,
            **(
                {
                    "sessions": w.sessions,
                    "turns": w.turns,
                    "system_prompts": w.system_prompts,
                    "think_time_s": w.think_time_s,
                }
                if w.kind == "chat"
                else {}
            ),
            "subjects": w.subjects if isinstance(w.subjects, int) else list(w.subjects),
            "per_subject": w.per_subject,
            "popularity": w.popularity if w.popularity == "uniform" else f"zipf(s={w.zipf_s:g})",
            "requests": w.planned_requests,
            "arrival": f"poisson({w.rate_per_s:g}/s)" if w.arrival == "poisson" else "closed",
            "concurrency": w.concurrency,
            "max_tokens": w.max_tokens,
        },
    }


class Progress:
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


async def drive_churn(
    trial: churn.ChurnTrial,
    requests: list[driver.PlannedRequest],
    stream: bool,
    progress: Progress,
    churn_out: dict[str, Any],
) -> list[dict[str, Any]]:
    """Churn (testnet/workload/churn.py): nodes leave and join while requests run; a request
    whose node is gone is retried elsewhere; departure watches may outlive the workload."""
    spec = trial.spec
    pool = churn.NodePool(trial.apis, trial.peer_ids)
    churn_out["watches"] = watches = []
    churn_out["applied"] = applied = []
    start = trio.current_time()
    async with trio.open_nursery() as watch_nursery, trio.open_nursery() as nursery:
        nursery.start_soon(
            partial(
                churn.run_churn,
                trial,
                pool,
                start,
                watches=watches,
                applied=applied,
                nursery=watch_nursery,
            )
        )
        records = await churn.drive_with_retries(
            pool,
            requests,
            spec.workload,
            max_duration_s=spec.max_duration_s,
            retries=CHURN_RETRIES,
            stream=stream,
            on_record=progress,
        )
        nursery.cancel_scope.cancel()  # events planned after the last request are moot
    return records


async def _drive_arm(
    trial: RunningTrial,
    requests: list[driver.PlannedRequest],
    stream: bool,
    churn_out: dict[str, Any] | None = None,
):
    spec = trial.spec
    progress = Progress(trial.arm, len(requests))
    if spec.churn:
        return await drive_churn(
            trial, requests, stream, progress, {} if churn_out is None else churn_out
        )
    return await driver.drive(
        trial.apis,
        requests,
        spec.workload,
        max_duration_s=spec.max_duration_s,
        peer_ids=trial.peer_ids,
        stream=stream,
        on_record=progress,
    )


async def _drive_chat_arm(trial: RunningTrial) -> list[dict[str, Any]]:
    spec = trial.spec
    sessions = chat.build_sessions(spec.workload, spec.seed, spec.node_count)
    return await chat.drive_chat(
        trial.apis,
        sessions,
        spec.workload,
        max_duration_s=spec.max_duration_s,
        peer_ids=trial.peer_ids,
        tokenize=chat_tokenize(spec),
        on_record=Progress(trial.arm, spec.workload.planned_requests),
    )


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


def _tokenizer(spec: TrialSpec) -> Any:
    """The spec's tokenizer as a node loads it, or None. The light tokenizer tokenizes and
    renders chats as transformers does (tests/inference/test_emulated.py)."""
    from p2pnode.inference.models import ModelLoadError, load_light_model

    try:
        return load_light_model(None if spec.model == "default" else spec.model).tokenizer
    except ModelLoadError as exc:
        print(f"no tokenizer for the hit rate ceiling: {exc}", file=sys.stderr)
        return None


def _latency_floor(spec: TrialSpec, records: Sequence[dict[str, Any]]) -> float | None:
    """``driver.latency_floor_s`` at the calibration emulated nodes of this spec read."""
    from p2pnode.inference.costmodel import CalibrationError, load_calibration
    from p2pnode.inference.models import ModelLoadError, load_light_model

    try:
        model_id = load_light_model(None if spec.model == "default" else spec.model).model_id
        cal = load_calibration(model_id)
    except (ModelLoadError, CalibrationError) as exc:
        print(f"no latency floor: {exc}", file=sys.stderr)
        return None
    return driver.latency_floor_s(records, cal, spec.workload.max_tokens)


def prompt_token_ids(spec: TrialSpec, requests: Sequence[driver.PlannedRequest]):
    """Token ids of each planned prompt as a node encodes it, or None when no tokenizer loads."""
    tok = _tokenizer(spec)
    if tok is None:
        return None
    # as EngineFront.encode does: no special tokens
    return [list(tok.encode(p.prompt, add_special_tokens=False)) for p in requests]


def chat_tokenize(spec: TrialSpec) -> Any:
    """``messages -> ids`` as EngineFront.encode_chat renders a chat, or None."""
    tok = _tokenizer(spec)
    if tok is None:
        return None

    def encode(messages: list[dict[str, str]]) -> list[int]:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    return encode


def _attach_chat_oracle(records: list[dict[str, Any]]) -> str | None:
    """Chat prompts exist only once the answers before them do: the ceiling is taken over
    the turns in the order they were sent."""
    sent = sorted(
        (r for r in records if r["status"] == "ok" and r.get("prompt_ids")),
        key=lambda r: r["sent_order"],
    )
    if any(r["status"] == "ok" and not r.get("prompt_ids") for r in records):
        return "no hit rate ceiling: the model's tokenizer did not load"
    off = [r["i"] for r in sent if r["prompt_tokens"] != len(r["prompt_ids"])]
    if off:
        return f"no hit rate ceiling: prompt token counts differ from the nodes' for {off[:5]}"
    # What the engine cached after each turn: its prompt and the answer it generated, which
    # are the first tokens of the session's next prompt after this one.
    by_turn = {(r["session"], r["turn"]): r for r in sent}
    answers: list[list[int]] = []
    for r in sent:
        ids, after = r["prompt_ids"], by_turn.get((r["session"], r["turn"] + 1))
        generated = r.get("completion_tokens") or 0
        nxt = after["prompt_ids"] if after is not None else None
        if nxt is not None and nxt[: len(ids)] == ids:
            answers.append(nxt[len(ids) : len(ids) + generated])
        else:
            answers.append([])
    prompts = [r["prompt_ids"] for r in sent]
    for r, o in zip(sent, driver.oracle_cached(prompts, answers), strict=True):
        r["oracle_cached"] = o
    return None


def _attach_oracle(records: list[dict[str, Any]], ids: list[list[int]] | None) -> str | None:
    """Set each record's ``oracle_cached``; returns a warning when it cannot be trusted."""
    if ids is None:
        return "no hit rate ceiling: the model's tokenizer did not load"
    oracle = driver.oracle_cached(ids)
    off = [r["i"] for r in records if r["prompt_tokens"] not in (None, len(ids[r["i"]]))]
    if off:
        return f"no hit rate ceiling: prompt token counts differ from the nodes' for {off[:5]}"
    for r in records:
        r["oracle_cached"] = oracle[r["i"]]
    return None


def _adversaries(
    spec: TrialSpec,
    arm: str,
    out_dir: Path,
    records: list[dict[str, Any]],
    ids: list[list[int]] | None,
    result: dict[str, Any],
) -> dict[str, Any]:
    """The ``[[adversary]]`` figures of one arm (``liars.adversary_summary``)."""
    honest = liars.honest_texts(spec, ids)
    if honest is None:
        result["warnings"].append(
            "no wrong-answer count: honest answers are recomputed for greedy emulated compute only"
        )
    homes = [out_dir / "nodes" / arm / f"node{k}" for k in range(len(result["peer_ids"]))]
    adv = liars.adversary_summary(spec, records, result["peer_ids"], homes, honest)
    print(
        f"[{arm}] adversaries: wrong answers {adv['wrong_answers']} "
        f"({adv['wrong_answers_after_detection']} after detection), liars demoted "
        f"{adv['liars_demoted']}/{len(spec.adversaries)}",
        file=sys.stderr,
    )
    return adv


def finish_arm(
    spec: TrialSpec,
    arm: str,
    out_dir: Path,
    records: list[dict[str, Any]],
    requests: list[driver.PlannedRequest],
    result: dict[str, Any],
    churn_out: dict[str, Any] | None,
    started: float,
) -> None:
    """From an arm's request records to its result (every kind of trial, local or on an
    inventory): the hit rate ceiling, ``requests.jsonl``, the summary, chat / churn /
    adversary figures and consistency problems, the logs' folder and the arm's wall time
    since ``started`` (``time.monotonic``), added to ``result``."""
    arm_dir = out_dir / arm
    result["logs"] = str(out_dir / "nodes" / arm / "logs")
    is_chat = spec.workload.kind == "chat"
    ids = None
    if is_chat:
        warning = _attach_chat_oracle(records)
        for r in records:
            r.pop("prompt_ids", None)
            r.pop("sent_order", None)
    else:
        ids = prompt_token_ids(spec, requests)
        warning = _attach_oracle(records, ids)
    if warning:
        result["warnings"].append(warning)
    if spec.adversaries:
        result["adversaries"] = _adversaries(spec, arm, out_dir, records, ids, result)
    driver.write_jsonl(arm_dir / "requests.jsonl", records)
    summary = driver.summarize(records, churn.max_nodes(spec))  # churn: joiners serve too
    summary["latency_floor_s"] = _latency_floor(spec, records)
    result["summary"] = summary
    if is_chat:
        result["chat"] = chat.chat_summary(records)
        print(f"[{arm}] chat: {result['chat']}", file=sys.stderr)
    if spec.churn:  # churn
        out = churn_out or {}
        result["churn"] = churn.churn_summary(
            records, spec.churn, out.get("watches", []), out.get("applied", [])
        )
        c = result["churn"]
        print(
            f"[{arm}] churn: lost {c['lost']}, duplicates {c['duplicates']}, retried "
            f"{c['retried']} {c['retry_causes']}, overlay fallbacks {c['overlay_fallbacks']}, "
            f"latency near churn {c['latency_near_churn_s']} vs away "
            f"{c['latency_away_from_churn_s']}",
            file=sys.stderr,
        )
    result["consistency"] = check_consistency(records, summary, spec.workload.planned_requests)
    lat = summary["latency_s"]
    print(
        f"[{arm}] {summary['answered']}/{summary['requests']} answered, mean {lat['mean']} s, "
        f"p95 {lat['p95']} s, hit rate {summary['hit_rate']} (ceiling "
        f"{summary['hit_rate_ceiling']}), busiest {summary['max_share']}, "
        f"forwarded {summary['forwarded_fraction']}",
        file=sys.stderr,
    )
    result["wall_s"] = round(time.monotonic() - started, 1)


def run_arm(
    spec: TrialSpec,
    arm: str,
    out_dir: Path,
    *,
    stream: bool = False,
    node_cmd: Sequence[str] = NODE_CMD,
    hosts: str = "local",
) -> dict[str, Any]:
    arm_dir = out_dir / arm
    arm_dir.mkdir(parents=True, exist_ok=True)
    is_chat = spec.workload.kind == "chat"
    requests = [] if is_chat else driver.build_requests(spec.workload, spec.seed, spec.node_count)
    result: dict[str, Any] = {"warnings": []}
    t0 = time.monotonic()
    try:
        print(f"[{arm}] starting {spec.node_count} nodes + bootstrap ...", file=sys.stderr)
        with launch_trial(spec, arm, out_dir / "nodes", node_cmd=node_cmd, hosts=hosts) as trial:
            if trial.formation.get("formed", True):
                print(f"[{arm}] overlay formed in {trial.formed_s:.1f} s", file=sys.stderr)
            else:
                print(
                    f"[{arm}] overlay not formed after {trial.formed_s:.1f} s, started as the "
                    f"spec allows: {formation.describe(trial.formation)}",
                    file=sys.stderr,
                )
            result["warnings"] += trial.warnings
            result["formed_s"] = round(trial.formed_s, 2)
            result["formation"] = trial.formation
            result["peer_ids"] = trial.peer_ids
            result["apis"] = trial.apis
            churn_out: dict[str, Any] = {}  # churn: departure watches
            if is_chat:
                records = trio.run(_drive_chat_arm, trial)
            else:
                records = trio.run(_drive_arm, trial, requests, stream, churn_out)
            _snapshot(trial, arm_dir)
    except LaunchError as exc:
        print(f"[{arm}] failed to start: {exc}", file=sys.stderr)
        result["error"] = str(exc)[:4000]
        return result
    finish_arm(spec, arm, out_dir, records, requests, result, churn_out, t0)
    return result


def run_trial(
    spec: TrialSpec,
    arms: Sequence[str],
    out_dir: Path,
    *,
    stream: bool = False,
    command: str = "",
    node_cmd: Sequence[str] = NODE_CMD,
    hosts: str = "local",
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "spec": spec_echo(spec),
        "arms": {},
        "command": command,
        "node_cmd": list(node_cmd),
        "hosts": hosts,
        "machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for arm in arms:
        results["arms"][arm] = run_arm(
            spec, arm, out_dir, stream=stream, node_cmd=node_cmd, hosts=hosts
        )
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    write_report(results, out_dir)
    return results


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_on_signals() -> None:
    """SIGTERM (`timeout`, a job scheduler, kill) takes the Ctrl-C path, which stops every node
    the trial started; left to its default it ended the runner alone and orphaned them all.
    SIGINT gets Python's own handler back: a runner started with SIGINT ignored (a script's
    background job, a pytest-xdist worker's child) inherits that, ignored `kill -INT` and
    ran its whole workload."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def run_here(
    spec: TrialSpec,
    arms: Sequence[str],
    *,
    out: Path | None,
    stream: bool,
    hosts: str,
    command: str,
) -> int:
    """``p2pnode testnet`` on this host (its flags: ``testnet/commands.py``) -> exit status."""
    _stop_on_signals()
    fit = check_memory(spec)
    if not fit.ok:
        print(f"not started: {fit.message}", file=sys.stderr)
        return 2
    print(f"memory: {fit.message}", file=sys.stderr)
    cpu = check_cpu(spec)
    print(f"cpu: {'' if cpu.ok else 'WARNING: '}{cpu.message}", file=sys.stderr)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = out or Path("testnet/results") / f"{spec.name}-{stamp}"
    try:
        results = run_trial(spec, arms, out, stream=stream, command=command, hosts=hosts)
    except KeyboardInterrupt:
        print("interrupted; every node was stopped", file=sys.stderr)
        return 130
    print((out / "report.md").read_text())
    bad = [a for a, r in results["arms"].items() if "summary" not in r or r.get("consistency")]
    return 1 if bad else 0


def run_on_inventory(
    spec: TrialSpec,
    arms: Sequence[str],
    inventory_file: str,
    *,
    out: Path | None,
    allow_missing: int,
    command: str,
) -> int:
    """``--inventory``: the same spec on the inventory's hosts (testnet/remote/controller.py)."""
    from p2pnode.testnet.remote.controller import RemoteTrialError, run_inventory_trial
    from p2pnode.testnet.remote.envs import EnvError
    from p2pnode.testnet.remote.inventory import InventoryError, load_inventory
    from p2pnode.testnet.remote.ssh import ssh_available

    _stop_on_signals()  # as run_here: stop every node on the way out
    missing = ssh_available()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    try:
        inventory = load_inventory(inventory_file)
    except InventoryError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = out or Path("testnet/results") / f"{spec.name}-hosts-{stamp}"
    try:
        results = run_inventory_trial(
            spec, inventory, arms, out, allow_missing=allow_missing, command=command
        )
    except KeyboardInterrupt:
        print("interrupted; every node was stopped", file=sys.stderr)
        return 130
    except (RemoteTrialError, EnvError) as exc:
        print(f"not run: {exc}", file=sys.stderr)
        return 1
    print((out / "report.md").read_text())
    bad = [a for a, r in results["arms"].items() if "summary" not in r or r.get("consistency")]
    return 1 if bad else 0


if __name__ == "__main__":  # the same command as `p2pnode testnet`
    from p2pnode.testnet.commands import testnet

    testnet(prog_name="python -m p2pnode.testnet.run.trial")
