"""Join-to-full-view time with every node in its own OS process (the way volunteers run).

Starts `p2pnode bootstrap` and N `p2pnode join --model none` processes on 127.0.0.1, all
knowing only the bootstrap, and measures the time from launching the joiners until every
joiner's /peers lists every other joiner as "up". Prints and writes
bench/results/overlay_join_processes.json. Run: `python bench/overlay_join_processes.py [--nodes 16]`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def spawn(args: list[str], home: Path) -> subprocess.Popen:
    home.mkdir(parents=True)
    return subprocess.Popen(
        [sys.executable, "-m", "p2pnode.bootstrap.cli", *args, "--home", str(home)]
        + ["--listen", "/ip4/127.0.0.1/tcp/0", "--api-port", "0", "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def runtime(home: Path, deadline: float) -> dict:
    while time.monotonic() < deadline:
        try:
            return json.loads((home / "runtime.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.05)
    raise TimeoutError(f"{home} did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="p2pnode-join-bench-"))
    procs: list[subprocess.Popen] = []
    load_at_start = os.getloadavg()[0]
    try:
        procs.append(spawn(["bootstrap"], root / "boot"))
        boot = runtime(root / "boot", time.monotonic() + 60)
        launched = time.monotonic()
        deadline = launched + args.timeout
        homes = [root / f"n{i}" for i in range(args.nodes)]
        for home in homes:
            procs.append(spawn(["join", "--model", "none", "--bootstrap", boot["addrs"][0]], home))
        infos = [runtime(home, deadline) for home in homes]
        started = time.monotonic() - launched
        ids = {info["peer_id"] for info in infos}
        full_view_at: dict[str, float] = {}
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline and len(full_view_at) < len(infos):
                for info in infos:
                    if info["peer_id"] in full_view_at:
                        continue
                    peers = client.get(info["api"] + "/peers").json()
                    up = {p["peer_id"] for p in peers if p["state"] == "up"}
                    if ids - {info["peer_id"]} <= up:
                        full_view_at[info["peer_id"]] = time.monotonic() - launched
                time.sleep(0.2)
        result = {
            "nodes": args.nodes,
            "processes": args.nodes + 1,
            "cpu_count": os.cpu_count(),
            "load_avg_1m_at_start": load_at_start,
            "load_avg_1m_at_end": os.getloadavg()[0],
            "all_started_s": round(started, 2),
            "nodes_with_full_view": len(full_view_at),
            "join_to_full_view_s": round(max(full_view_at.values()), 2)
            if len(full_view_at) == len(infos)
            else None,
            "median_node_full_view_s": round(
                sorted(full_view_at.values())[len(full_view_at) // 2], 2
            )
            if full_view_at
            else None,
        }
        print(json.dumps(result, indent=2))
        out = Path(__file__).parent / "results" / "overlay_join_processes.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
