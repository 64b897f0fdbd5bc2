"""``p2pnode demo``: the main job on one machine.

Starts a small local overlay as separate OS processes (one bootstrap, N serving nodes on the
embedded default model, members of the bootstrap's closed network through one invite), waits until every node sees every other, sends an MMLU 5-shot workload
to random nodes through their public HTTP API, and prints who served what, cache hits and
latencies. Everything it starts is stopped and its temporary homes removed, also on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console(stderr=False)


@dataclass
class LocalNode:
    name: str
    home: Path
    proc: subprocess.Popen
    info: dict | None = None

    @property
    def api(self) -> str:
        assert self.info is not None
        return self.info["api"]


def _spawn(name: str, root: Path, args: list[str], threads: int) -> LocalNode:
    home = root / name
    home.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "P2PNODE_TORCH_THREADS": str(threads)}
    log = open(home / "node.log", "wb")  # noqa: SIM115 - owned by the child process
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2pnode.bootstrap.cli", *args, "--home", str(home)]
        + ["--listen", "/ip4/127.0.0.1/tcp/0", "--api-port", "0", "--log-level", "warning"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # Ctrl-C in the terminal reaches only us; we stop them in order
    )
    return LocalNode(name, home, proc)


def _invite(boot: LocalNode, uses: int) -> str:
    """An invite of the bootstrap's closed network for ``uses`` joiners."""
    out = subprocess.run(
        [sys.executable, "-m", "p2pnode.bootstrap.cli", "invite", "--home", str(boot.home)]
        + ["--uses", str(uses), "--expires", "1h"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the bootstrap gave no invite: {out.stderr.strip()}")
    return out.stdout.strip()


def _wait_runtime(node: LocalNode, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(
                f"{node.name} exited:\n{(node.home / 'node.log').read_text()[-3000:]}"
            )
        try:
            node.info = json.loads((node.home / "runtime.json").read_text())
            return
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.2)
    raise RuntimeError(
        f"{node.name} did not start within {timeout:.0f} s; see {node.home / 'node.log'}"
    )


def _wait_mesh(nodes: list[LocalNode], timeout: float) -> float:
    """Until every serving node sees every other as up and holds a view of its cache digest."""
    started = time.monotonic()
    ids = {n.info["peer_id"] for n in nodes}
    while time.monotonic() - started < timeout:
        ready = 0
        for node in nodes:
            status = httpx.get(node.api + "/status", timeout=5).json()
            up = {p["peer_id"] for p in status.get("peers", []) if p.get("state") == "up"}
            viewed = set(status.get("routing", {}).get("views", {}))
            others = ids - {node.info["peer_id"]}
            ready += others <= up and others <= viewed
        if ready == len(nodes):
            return time.monotonic() - started
        time.sleep(0.3)
    raise RuntimeError(f"the overlay did not form within {timeout:.0f} s")


def _stop(nodes: list[LocalNode]) -> None:
    for node in nodes:
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)
    for node in nodes:
        try:
            node.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait(timeout=5)


def run_demo(*, nodes: int = 3, subjects: int = 3, per_subject: int = 4, seed: int = 0) -> dict:
    """Run the workload on a routed swarm, then the same requests (same order, same entry
    nodes) on a fresh swarm whose nodes serve everything they receive (``--no-routing``), and
    print both side by side."""
    from p2pnode.datasets import mmlu
    from p2pnode.inference.models import default_model_path

    default_model_path()  # convert once here, so the nodes don't all convert at the same time
    rng = random.Random(seed)
    subject_list = sorted(mmlu.subjects())[:subjects]
    workload = list(mmlu.questions(subject_list, per_subject))
    rng.shuffle(workload)
    entries = [rng.randrange(nodes) for _ in workload]
    summary = _run_swarm(nodes, workload, entries, routing=True)
    console.print("[bold]the same requests on a fresh swarm without routing[/]")
    baseline = _run_swarm(nodes, workload, entries, routing=False)
    table = Table(title="routing against serving every request where it arrives")
    table.add_column("")
    table.add_column("forwarded", justify="right")
    table.add_column("prompt-token hit rate", justify="right")
    table.add_column("mean latency (s)", justify="right")
    for name, s in (("routing", summary), ("no routing", baseline)):
        table.add_row(
            name,
            f"{s['forwarded']}/{s['requests']}",
            f"{s['prompt_token_hit_rate']:.0%}",
            f"{s['mean_latency_s']:.2f}",
        )
    console.print(table)
    return {**summary, "baseline": baseline}


def _run_swarm(nodes: int, workload: list, entries: list[int], *, routing: bool) -> dict:
    threads = max(1, (os.cpu_count() or 2) // nodes)
    root = Path(tempfile.mkdtemp(prefix="p2pnode-demo-"))
    started: list[LocalNode] = []
    try:
        console.print(
            f"[bold]p2pnode demo[/]: 1 bootstrap + {nodes} nodes on 127.0.0.1 (homes in {root})"
        )
        boot = _spawn("bootstrap", root, ["bootstrap"], threads)
        started.append(boot)
        _wait_runtime(boot, 60)
        flags = [] if routing else ["--no-routing"]
        # A closed network, as `p2pnode bootstrap` makes by default: one invite, one use per
        # node, redeemed by each at the bootstrap before it joins.
        invite = _invite(boot, uses=nodes)
        serving = [
            _spawn(f"node{i}", root, ["join", "--bootstrap", invite, *flags], threads)
            for i in range(nodes)
        ]
        started += serving
        with console.status("loading the model in every node and forming the overlay..."):
            for node in serving:
                _wait_runtime(node, 180)
            formed = _wait_mesh(serving, 60)
        names = {n.info["peer_id"]: n.name for n in serving}
        console.print(
            f"overlay formed: every node sees the others {formed:.1f} s after start-up "
            "(a closed network: each joined with the bootstrap's invite)"
        )
        rows = _send_workload(serving, workload, [serving[i] for i in entries], names)
        return _summarize(rows, serving)
    finally:
        with console.status("stopping nodes..."):
            _stop(started)
        for node in started:
            if node.proc.returncode not in (0, -signal.SIGTERM):
                console.print(f"[yellow]{node.name} exited with {node.proc.returncode}[/]")
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def _send_workload(serving, workload, entries, names) -> list[dict]:
    rows = []
    progress = Progress(
        TextColumn("[bold]requests"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    with progress, httpx.Client(timeout=120) as client:
        model = client.get(serving[0].api + "/v1/models").json()["data"][0]["id"]
        task = progress.add_task("requests", total=len(workload))
        for q, entry in zip(workload, entries, strict=True):
            t0 = time.perf_counter()
            response = client.post(
                entry.api + "/v1/completions",
                json={"model": model, "prompt": q.prompt, "max_tokens": 1, "temperature": 0},
            )
            elapsed = time.perf_counter() - t0
            if response.status_code != 200:
                raise RuntimeError(f"{entry.name} answered {response.status_code}: {response.text}")
            body = response.json()
            info = body.get("p2pnode", {})
            answer = body["choices"][0]["text"].strip()
            rows.append(
                {
                    "subject": q.subject,
                    "arrived_at": entry.name,
                    "served_by": names.get(info.get("served_by"), info.get("served_by", "?")),
                    "prompt_tokens": body["usage"]["prompt_tokens"],
                    "cached_tokens": info.get("cached_tokens", 0),
                    "latency_s": elapsed,
                    "correct": answer[:1] == q.answer,
                }
            )
            progress.advance(task)
            progress.console.print(
                f"  {q.subject[:22]:22} {entry.name} -> {rows[-1]['served_by']:6} "
                f"cached {rows[-1]['cached_tokens']:3}/{rows[-1]['prompt_tokens']:3}  {elapsed:5.2f} s"
            )
    return rows


def _summarize(rows: list[dict], serving) -> dict:
    table = Table(title="who served what")
    table.add_column("node")
    table.add_column("arrived", justify="right")
    table.add_column("served", justify="right")
    table.add_column("prompt tokens cached", justify="right")
    table.add_column("mean latency (s)", justify="right")
    arrived = Counter(r["arrived_at"] for r in rows)
    served = defaultdict(list)
    for r in rows:
        served[r["served_by"]].append(r)
    for node in serving:
        mine = served.get(node.name, [])
        cached = sum(r["cached_tokens"] for r in mine)
        total = sum(r["prompt_tokens"] for r in mine) or 1
        mean = sum(r["latency_s"] for r in mine) / len(mine) if mine else 0.0
        table.add_row(
            node.name,
            str(arrived[node.name]),
            str(len(mine)),
            f"{cached / total:.0%}",
            f"{mean:.2f}",
        )
    console.print(table)
    forwarded = sum(r["arrived_at"] != r["served_by"] for r in rows)
    hit = sum(r["cached_tokens"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows))
    latencies = sorted(r["latency_s"] for r in rows)
    summary = {
        "requests": len(rows),
        "forwarded": forwarded,
        "prompt_token_hit_rate": hit,
        "mean_latency_s": sum(latencies) / len(latencies),
        "p50_latency_s": latencies[len(latencies) // 2],
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
    }
    console.print(
        f"{summary['requests']} requests, {forwarded} forwarded to a peer by the router, "
        f"prompt-token cache hit rate {hit:.0%}, mean latency {summary['mean_latency_s']:.2f} s "
        f"(median {summary['p50_latency_s']:.2f} s), MMLU accuracy {summary['accuracy']:.0%} "
        "(a 135M model: near chance is expected)"
    )
    return summary
