"""Join-to-full-view time with every node in its own OS process (the way volunteers run).

Starts `p2pnode bootstrap` and N `p2pnode join` processes on 127.0.0.1 (`--compute emulated`,
the default: light emulated engines, as trials run them; `none`: no engine), all knowing only
the bootstrap, and measures the time from launching the joiners until
- ready: the overlay counts as formed for a trial (``testnet.formation.formation_missing``: every
  joiner sees all others up, or with bounded connections its low watermark of them less one;
  the up links make one graph; with engines, each holds a cache view of every peer it sees up);
- full view: every joiner's /peers lists every other joiner as "up" (a full mesh: with more
  joiners than `--max-connections`, never, by design);
- cache views (with engines): every joiner holds a cache view of every other one, which
  gossip brings over the bounded mesh too. Also the RSS of each joiner at the end, and
with `--idle S` the CPU the converged swarm burns while idle for S seconds (% of one core per
node: what many nodes on few cores leave for serving requests).
Prints and writes bench/results/overlay_join_processes[-N].json.
Run: `python bench/overlay_join_processes.py [--nodes 16] [--compute none]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

import httpx

from p2pnode.testnet.run.formation import formation_missing
from p2pnode.testnet.run.zygote import Zygote


def spawn(args: list[str], home: Path, zygote: Zygote | None = None):
    home.mkdir(parents=True)
    argv = [*args, "--home", str(home)]
    argv += ["--listen", "/ip4/127.0.0.1/tcp/0", "--api-port", "0", "--log-level", "warning"]
    if zygote is not None:
        return zygote.spawn(
            argv, dict(os.environ), home / "node.log", entry="p2pnode.bootstrap.cli"
        )
    return subprocess.Popen(
        [sys.executable, "-m", "p2pnode.bootstrap.cli", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def renice(pid: int, by: int) -> None:
    """Lower the CPU priority of every thread of `pid` by `by` (nice is per thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        tid = int(task.name)
        with suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + by)


def runtime(home: Path, deadline: float, proc) -> dict:
    while time.monotonic() < deadline:
        try:
            return json.loads((home / "runtime.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            if proc.poll() is not None:
                log = home / "node.log"
                tail = log.read_text()[-600:] if log.exists() else "(no log)"
                raise RuntimeError(f"{home.name} exited with {proc.returncode}: {tail}") from None
            time.sleep(0.05)
    raise TimeoutError(f"{home} did not start")


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _keep_diagnostics(
    into: Path, root: Path, names: list[str], not_ready: list[str], final: list
) -> None:
    """Status and log of each node named in `not_ready` ("n12 sees ..."), and the bootstrap's."""
    into.mkdir(parents=True, exist_ok=True)
    named = {line.split()[0].rstrip(":") for line in not_ready}
    (into / "not_ready.txt").write_text("\n".join(not_ready) + "\n")
    for name, status in zip(names, final, strict=True):
        if name in named:
            (into / f"{name}.status.json").write_text(json.dumps(status, indent=1))
    for name in sorted(named | {"boot"}):
        for log in (root / name).glob("*.log"):
            shutil.copy(log, into / f"{name}.{log.name}")
    print(f"diagnostics of {len(named)} node(s) in {into}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--compute", choices=["emulated", "none"], default="emulated")
    parser.add_argument("--gossip-interval", type=float, default=None)
    parser.add_argument("--gossip-budget", type=float, default=None)
    parser.add_argument("--gossip-degree", type=int, default=None)
    parser.add_argument("--ping-interval", type=float, default=None)
    parser.add_argument(
        "--stagger", type=float, default=0.0, help="seconds between joiner starts (trials: 0.25)"
    )
    parser.add_argument("--min-connections", type=int, default=None)
    parser.add_argument("--max-connections", type=int, default=None)
    parser.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="after convergence, measure the swarm's CPU for this many idle seconds",
    )
    parser.add_argument(
        "--joiner-nice",
        type=int,
        default=0,
        help="run the joiners this much nicer than the bootstrap (emulates a bootstrap with a "
        "machine of its own: on shared cores each process gets an equal CPU share, and the "
        "one node every joiner goes through starves first)",
    )
    parser.add_argument(
        "--diagnose",
        type=Path,
        default=None,
        help="if the swarm is not ready in time, copy the final /status and log of every node "
        "named as missing something into this folder (it is not removed)",
    )
    parser.add_argument(
        "--no-fork",
        action="store_true",
        help="start each node as a fresh interpreter instead of forking it (testnet/run/zygote.py)",
    )
    args = parser.parse_args()
    engine = (
        ["--model", "default", "--backend", "emulated"]
        if args.compute == "emulated"
        else ["--model", "none"]
    )
    if args.ping_interval is not None:
        engine += ["--ping-interval", str(args.ping_interval)]
    if args.gossip_interval is not None:
        engine += ["--gossip-interval", str(args.gossip_interval)]
    if args.gossip_budget is not None:
        engine += ["--gossip-budget", str(args.gossip_budget)]
    if args.gossip_degree is not None:
        engine += ["--gossip-degree", str(args.gossip_degree)]
    for flag in ("min_connections", "max_connections"):
        if getattr(args, flag) is not None:
            engine += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    root = Path(tempfile.mkdtemp(prefix="p2pnode-join-bench-"))
    # SIGTERM (e.g. `timeout`) unwinds through the finally below, which stops every node
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs: list = []
    load_at_start = os.getloadavg()[0]
    zygote = None if args.no_fork else Zygote.start(dict(os.environ))
    try:
        procs.append(spawn(["bootstrap", "--open"], root / "boot", zygote))
        boot = runtime(root / "boot", time.monotonic() + 60, procs[0])
        launched = time.monotonic()
        deadline = launched + args.timeout
        homes = [root / f"n{i}" for i in range(args.nodes)]
        for k, home in enumerate(homes):
            if k and args.stagger:
                time.sleep(args.stagger)
            procs.append(spawn(["join", *engine, "--bootstrap", boot["addrs"][0]], home, zygote))
            if args.joiner_nice:
                renice(procs[-1].pid, args.joiner_nice)
        infos = [runtime(home, deadline, proc) for home, proc in zip(homes, procs[1:], strict=True)]
        started = time.monotonic() - launched
        ids = {info["peer_id"] for info in infos}
        full_view_at: dict[str, float] = {}
        cache_view_at: dict[str, float] = {}
        seen_up: dict[str, int] = {}  # most other joiners a node listed as up (partial runs)
        want_views = args.compute == "emulated"
        ready_at: float | None = None
        not_ready: list[str] = ["not checked yet"]
        order = [info["peer_id"] for info in infos]
        names = [f"n{i}" for i in range(len(infos))]
        bounded = args.max_connections != 0 and args.nodes > (args.max_connections or 24)

        def done() -> bool:
            views_done = not want_views or len(cache_view_at) == len(infos)
            # A bounded swarm never reaches a full mesh: ready and cache views are its goals.
            mesh_done = bounded or len(full_view_at) == len(infos)
            return ready_at is not None and views_done and mesh_done

        last_progress = time.monotonic()
        with httpx.Client(timeout=3) as client:
            while time.monotonic() < deadline and not done():
                statuses: list[dict | None] = []
                for info in infos:
                    me = info["peer_id"]
                    try:
                        status = client.get(info["api"] + "/status").json()
                    except (httpx.HTTPError, ValueError):
                        statuses.append(None)  # a node still starting its API: asked again
                        continue
                    statuses.append(status)
                    up = {p["peer_id"] for p in status["peers"] if p["state"] == "up"}
                    seen_up[me] = max(seen_up.get(me, 0), len(up & ids))
                    if me not in full_view_at and ids - {me} <= up:
                        full_view_at[me] = time.monotonic() - launched
                    views = set((status.get("routing") or {}).get("views") or {})
                    if want_views and me not in cache_view_at and ids - {me} <= views:
                        cache_view_at[me] = time.monotonic() - launched
                if ready_at is None:
                    not_ready = formation_missing(names, order, statuses, want_views)
                    if not not_ready:
                        ready_at = time.monotonic() - launched
                if time.monotonic() - last_progress > 15:  # partial figures if it never ends
                    last_progress = time.monotonic()
                    conns = sorted(s["connected"] for s in statuses if s)
                    print(
                        f"{last_progress - launched:.0f} s: {len(conns)} answering, connected "
                        f"{conns[:1] + conns[len(conns) // 2 : len(conns) // 2 + 1] + conns[-1:]}"
                        f" (min/median/max), full views {len(full_view_at)}, cache views "
                        f"{len(cache_view_at)}, ready: {not_ready[:2] or 'yes'}",
                        file=sys.stderr,
                        flush=True,
                    )
                time.sleep(0.2)
            rss = [_rss_mb(p.pid) for p in procs[1:]]
        idle_cpu = None
        if args.idle > 0:
            before = sum(_cpu_s(p.pid) for p in procs[1:])
            time.sleep(args.idle)
            spent = sum(_cpu_s(p.pid) for p in procs[1:]) - before
            idle_cpu = round(100 * spent / args.idle / args.nodes, 2)
        # Connections at the end (after --idle: what the trims left).
        final = []
        with httpx.Client(timeout=2) as client:
            for info in infos:
                try:
                    final.append(client.get(info["api"] + "/status").json())
                except (httpx.HTTPError, ValueError):
                    final.append(None)
        connected = sorted(s["connected"] for s in final if s)
        pruned = sum(s["connections"]["pruned"] for s in final if s)
        result = {
            "nodes": args.nodes,
            "processes": args.nodes + 1,
            "cpu_count": os.cpu_count(),
            "load_avg_1m_at_start": load_at_start,
            "load_avg_1m_at_end": os.getloadavg()[0],
            "all_started_s": round(started, 2),
            "join_to_ready_s": None if ready_at is None else round(ready_at, 2),
            "not_ready": not_ready[:5] if ready_at is None else [],
            "connections_min_median_max": [
                connected[0],
                connected[len(connected) // 2],
                connected[-1],
            ]
            if connected
            else None,
            "pruned_connections": pruned,
            "min_connections": args.min_connections,
            "max_connections": args.max_connections,
            "nodes_with_full_view": len(full_view_at),
            "join_to_full_view_s": round(max(full_view_at.values()), 2)
            if len(full_view_at) == len(infos)
            else None,
            "median_node_full_view_s": round(
                sorted(full_view_at.values())[len(full_view_at) // 2], 2
            )
            if full_view_at
            else None,
            "up_peers_min": min(seen_up.values(), default=0),
            "up_peers_median": sorted(seen_up.values())[len(seen_up) // 2] if seen_up else 0,
            "compute": args.compute,
            "joiner_nice": args.joiner_nice,
            "forked": zygote is not None,
            "all_started_to_full_view_s": round(max(full_view_at.values()) - started, 2)
            if len(full_view_at) == len(infos)
            else None,
            "join_to_cache_views_s": round(max(cache_view_at.values()), 2)
            if want_views and len(cache_view_at) == len(infos)
            else None,
            "rss_mb_max": max((r for r in rss if r is not None), default=None),
            "idle_s": args.idle or None,
            "idle_cpu_pct_per_node": idle_cpu,
            "load_avg_1m_after_idle": os.getloadavg()[0] if args.idle > 0 else None,
            "rss_mb_mean": round(sum(r for r in rss if r) / max(1, sum(1 for r in rss if r)), 1),
        }
        print(json.dumps(result, indent=2))
        if args.diagnose is not None and ready_at is None:
            _keep_diagnostics(args.diagnose, root, names, not_ready, final)
        out = Path(__file__).parent / "results" / f"overlay_join_processes-{args.nodes}.json"
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
        if zygote is not None:
            zygote.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
