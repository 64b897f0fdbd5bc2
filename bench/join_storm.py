"""A join storm: one bootstrap and N joiner processes started at once, as a network's start.

Starts `p2pnode bootstrap` and N `p2pnode join --bootstrap INVITE` processes (default flags,
emulated engines, forked from one process that imported the modules: testnet/run/zygote.py)
on 127.0.0.1 with no pause between joiners, and measures from the moment the last joiner was
started:
- per joiner, when its node ran (its invite redeemed: ``started_*``);
- per joiner, the time its scope is complete: it sees the peers it should up (every other
  joiner, or with bounded connections, the default, its low watermark less one:
  ``testnet.run.formation``) and holds a cache view of each; p50/p95/max and max/p50;
- formed: the time every joiner's scope is complete and the up links make one overlay;
- the bootstrap's admissions (``admitted`` hellos, ``overlay/net/admission.py``; connections
  and streams turned away as busy, hellos answered "busy, retry after N s" and abandoned
  streams skipped, ``patches/busy.py``), admitted joins a second (peak over 5 s and
  mean over the storm), its CPU and connections; the joiners' failed and retried joins
  (``bootstrap_retries``), the busy answers they got and the referrals; the load average.

`--load-generator`: instead of N node processes, `--procs` processes each run
`--hosts`/`--procs` light overlay hosts (no engine, no API) in one trio loop; each joins the
bootstrap at once; measures how many joins a second the bootstrap admits when its joiners
are cheap (the bootstrap's own admission rate, not 2 cores shared by N full nodes).

Measuring starts with the first joiner running, not the slowest; a joiner that exits (its
invite not redeemed) is counted, not fatal. Prints the figures and writes
bench/results/join_storm-N.json (join_storm-loadgen.json). Every process it starts is stopped
on the way out, also on failure or SIGTERM; `--keep DIR` copies the logs and final statuses.
Run: `python bench/join_storm.py --nodes 32` or `python bench/join_storm.py --load-generator`.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from p2pnode.testnet.run.formation import formation_state
from p2pnode.testnet.run.zygote import Zygote

POLL_S = 0.5
PEAK_WINDOW_S = 5.0
# Statuses asked at once: one by one, a round of 128 on a saturated machine took longer than
# the joins it measures.
POLL_PARALLEL = 16
# Load generators start their hosts this long after they are launched (imports first).
LOADGEN_START_S = 8.0


def spawn(args: list[str], home: Path, zygote: Zygote, log_level: str = "warning") -> Any:
    home.mkdir(parents=True, exist_ok=True)
    argv = [*args, "--home", str(home), "--listen", "/ip4/127.0.0.1/tcp/0"]
    argv += ["--api-port", "0", "--log-level", log_level]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return zygote.spawn(argv, env, home / "node.log", entry="p2pnode.bootstrap.cli")


def runtime(home: Path, deadline: float, proc: Any) -> dict[str, Any]:
    while time.monotonic() < deadline:
        try:
            info = json.loads((home / "runtime.json").read_text())
            if info.get("api"):
                return info
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if proc.poll() is not None:
            log = home / "node.log"
            tail = log.read_text()[-800:] if log.exists() else "(no log)"
            raise RuntimeError(f"{home.name} exited with {proc.returncode}: {tail}")
        time.sleep(0.05)
    raise TimeoutError(f"{home} did not start")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def invite(boot_home: Path, uses: int) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "p2pnode.bootstrap.cli", "invite", "--home", str(boot_home)]
        + ["--uses", str(uses)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def scope_complete(status: dict[str, Any], me: str, ids: set[str], want_views: bool) -> bool:
    """This joiner's share of ``formation_state``'s rule (one node, not the graph)."""
    others = ids - {me}
    up = {p.get("peer_id") for p in status.get("peers", []) if p.get("state") == "up"} & others
    conns = status.get("connections") or {}
    want = len(others)
    if conns.get("enabled"):
        want = min(want, max(1, int(conns.get("low", 0)) - 1))
    if len(up) < want:
        return False
    views = set((status.get("routing") or {}).get("views") or {})
    return not want_views or up <= views


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def admissions(status: dict[str, Any] | None) -> tuple[int, int]:
    """Hellos a node answered with an admission, and connections it turned away as busy."""
    counters = (status or {}).get("counters") or {}
    return int(counters.get("admitted", 0)), int(counters.get("busy_conns", 0))


def gossip_figures(statuses: list[dict | None]) -> dict[str, Any]:
    """Where digests were late, summed over the joiners: their ages as they arrived
    (``gossip_age_in_*``) and as our own left a send queue (``gossip_age_out_*``), those
    dropped as expired on arrival or in a queue (``patches/safepubsub.py``), what came of
    the rest (``antientropy.py``'s results, drops and pulls), and the pubsub RPCs written,
    batched and dropped for a full send queue (``patches/tuning.py``)."""
    out: dict[str, Any] = {"age_in": {}, "age_out_own": {}, "results": {}, "drops": {}}
    out["pulls"] = {}
    expired = {"in": 0, "out": 0}
    sent = {"rpcs_out": 0, "rpcs_batched": 0}
    for status in statuses:
        counters = (status or {}).get("counters") or {}
        for key, value in counters.items():
            if key in sent or key.startswith("rpcs_dropped_"):
                sent[key] = sent.get(key, 0) + int(value)
        for key, value in counters.items():
            for prefix, where in (("gossip_age_in_", "age_in"), ("gossip_age_out_", "age_out_own")):
                if key.startswith(prefix):
                    bucket = key[len(prefix) :]
                    out[where][bucket] = out[where].get(bucket, 0) + int(value)
        expired["in"] += int(counters.get("gossip_expired_in", 0))
        expired["out"] += int(counters.get("gossip_expired_out", 0))
        gossip = ((status or {}).get("routing") or {}).get("gossip") or {}
        for part in ("results", "drops", "pulls"):
            for key, value in (gossip.get(part) or {}).items():
                out[part][key] = out[part].get(key, 0) + int(value)
    order = ["lt2", "lt10", "lt30", "lt60", "lt120", "ge120"]
    for where in ("age_in", "age_out_own"):
        out[where] = {b: out[where][b] for b in order if b in out[where]}
    out["expired_in"], out["expired_out"] = expired["in"], expired["out"]
    out["pubsub_out"] = sent  # RPCs written, those that shared a write, and those dropped
    return out


def peak_rate(samples: list[tuple[float, int]]) -> float:
    best = 0.0
    for i, (t0, n0) in enumerate(samples):
        for t1, n1 in samples[i + 1 :]:
            if t1 - t0 >= PEAK_WINDOW_S:
                best = max(best, (n1 - n0) / (t1 - t0))
                break
    return round(best, 2)


def run_storm(args: argparse.Namespace, root: Path, zygote: Zygote, procs: list[Any]) -> dict:
    boot_flags = ["bootstrap"] + (["--open"] if args.open else [])
    procs.append(spawn(boot_flags, root / "boot", zygote, args.boot_log_level))
    boot = runtime(root / "boot", time.monotonic() + 60, procs[0])
    target = boot["addrs"][0] if args.open else invite(root / "boot", args.nodes)
    engine = ["--model", "default", "--backend", "emulated"]
    homes = [root / f"n{i}" for i in range(args.nodes)]
    boot_cpu0 = cpu_s(procs[0].pid)
    t0 = time.monotonic()
    for home in homes:
        procs.append(spawn(["join", *engine, "--bootstrap", target], home, zygote))
    launched = time.monotonic()
    deadline = launched + args.timeout
    infos: list[dict[str, Any]] = []
    started_at: list[float] = []  # when each joiner's node ran (its invite redeemed)
    failed_starts: list[str] = []
    starting = list(zip(homes, procs[1:], strict=True))

    def collect() -> None:
        """Joiners whose node runs now (runtime.json), and those that gave up: measuring
        starts with the first, not after the slowest (a storm's last joiners may take
        minutes to redeem their invite)."""
        for home, proc in list(starting):
            try:
                info = json.loads((home / "runtime.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                info = None
            if info and info.get("api"):
                infos.append(info)
                started_at.append(time.monotonic() - launched)
                starting.remove((home, proc))
            elif proc.poll() is not None:  # a failed join is a figure, not a crash
                log = home / "node.log"
                tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
                failed_starts.append(f"{home.name}: {' '.join(tail)[:300]}")
                starting.remove((home, proc))

    done_at: dict[str, float] = {}  # links: up to every peer in its scope
    views_at: dict[str, float] = {}  # and a cache view of each of them
    links_formed_at: float | None = None
    formed_at: float | None = None
    admit_samples: list[tuple[float, int]] = []
    all_admitted_at: float | None = None
    boot_conns_max = 0
    libp2p_max: dict[str, int] = {}
    load_max = 0.0
    last_print = time.monotonic()
    state = None
    statuses: list[dict | None] = []

    def ask(client: httpx.Client, api: str) -> dict | None:
        try:
            return client.get(api + "/status").json()
        except (httpx.HTTPError, ValueError):
            return None

    with httpx.Client(timeout=10) as client, ThreadPoolExecutor(POLL_PARALLEL) as pool:
        while time.monotonic() < deadline:
            now = time.monotonic() - launched
            collect()
            ids = {info["peer_id"] for info in infos}
            order = [info["peer_id"] for info in infos]
            names = [f"n{k}" for k in range(len(infos))]
            apis = [info["api"] for info in infos]
            bstat = ask(client, boot["api"])
            admitted_now = admissions(bstat)[0]
            admit_samples.append((now, admitted_now))
            if all_admitted_at is None and admitted_now >= args.nodes:
                all_admitted_at = now
            boot_conns_max = max(boot_conns_max, (bstat or {}).get("connected", 0))
            lib = (bstat or {}).get("libp2p") or {}
            for key in ("connections", "rcmgr_connections"):
                libp2p_max[key] = max(libp2p_max.get(key, 0), int(lib.get(key) or 0))
            load_max = max(load_max, os.getloadavg()[0])
            statuses = list(pool.map(lambda api: ask(client, api), apis))
            seen = time.monotonic() - launched
            for me, status in zip(order, statuses, strict=True):
                if status and me not in done_at and scope_complete(status, me, ids, False):
                    done_at[me] = seen
                if status and me not in views_at and scope_complete(status, me, ids, True):
                    views_at[me] = seen
            links = formation_state(names, order, statuses, False)
            if links_formed_at is None and not starting and not links.missing:
                links_formed_at = seen
            state = formation_state(names, order, statuses, True)
            if not starting and not state.missing and len(views_at) == len(infos):
                formed_at = time.monotonic() - launched
                break
            if time.monotonic() - last_print > 15:
                last_print = time.monotonic()
                print(
                    f"{now:.0f} s: {len(infos)} running, {len(failed_starts)} failed, "
                    f"scopes linked {len(done_at)}/{len(infos)}, with views "
                    f"{len(views_at)}, bootstrap "
                    f"admitted {admitted_now} with {boot_conns_max} conns max, "
                    f"{state.parts} part(s), load {os.getloadavg()[0]:.1f}; "
                    f"{state.missing[:2]}",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(POLL_S)
        bstat = ask(client, boot["api"])
    admitted, busy = admissions(bstat)
    waits = list(done_at.values())
    p50 = pct(waits, 0.5)
    counters = [(s or {}).get("counters") or {} for s in statuses]
    return {
        "mode": "processes",
        "nodes": args.nodes,
        "network": "open" if args.open else "closed (invite)",
        "cpu_count": os.cpu_count(),
        "launch_s": round(launched - t0, 2),
        "joiners_failed_to_start": len(failed_starts),
        "joiners_not_started": len(starting),
        "failed_starts": failed_starts[:5],
        "started_p50_s": pct(started_at, 0.5),
        "started_max_s": round(max(started_at), 2) if started_at else None,
        "scopes_linked": len(done_at),
        "links_formed_s": None if links_formed_at is None else round(links_formed_at, 2),
        "scopes_with_views": len(views_at),
        "views_formed_s": None if formed_at is None else round(formed_at, 2),
        "views_p50_s": pct(list(views_at.values()), 0.5),
        "views_max_s": round(max(views_at.values()), 2) if views_at else None,
        "not_formed": [] if state is None or not state.missing else state.missing[:5],
        "scope_p50_s": p50,
        "scope_p95_s": pct(waits, 0.95),
        "scope_max_s": round(max(waits), 2) if waits else None,
        "max_over_p50": round(max(waits) / p50, 2) if waits and p50 else None,
        "bootstrap_admitted": admitted,
        "bootstrap_busy_conns": busy,
        "admitted_per_s_peak": peak_rate(admit_samples),
        "all_admitted_s": None if all_admitted_at is None else round(all_admitted_at, 2),
        "admitted_per_s_mean": round(admitted / all_admitted_at, 2) if all_admitted_at else None,
        "bootstrap_connections_max": boot_conns_max,
        "bootstrap_cpu_s": round(cpu_s(procs[0].pid) - boot_cpu0, 1),
        "bootstrap_busy_streams": int(((bstat or {}).get("counters") or {}).get("busy_streams", 0)),
        "bootstrap_busy_answered": int(
            ((bstat or {}).get("counters") or {}).get("busy_answered", 0)
        ),
        "bootstrap_abandoned_streams": int(
            ((bstat or {}).get("counters") or {}).get("abandoned_streams", 0)
        ),
        "bootstrap_reachability": ((bstat or {}).get("reachability") or {}).get("verdict"),
        "bootstrap_libp2p_end": (bstat or {}).get("libp2p"),
        "bootstrap_libp2p_max": libp2p_max,
        "joiner_referrals_received": sum(int(c.get("referrals_received", 0)) for c in counters),
        "joiner_bootstrap_retries": sum(int(c.get("bootstrap_retries", 0)) for c in counters),
        "joiner_busy_answers": sum(int(c.get("busy_answers", 0)) for c in counters),
        "digests": gossip_figures(statuses),
        "joiner_loop_lag_s_p50": pct(
            [float(((s or {}).get("liveness") or {}).get("loop_lag_s") or 0) for s in statuses],
            0.5,
        ),
        "joiner_echo_delay_s_p50": pct(
            [float(((s or {}).get("liveness") or {}).get("echo_delay_s") or 0) for s in statuses],
            0.5,
        ),
        "load_avg_1m_max": round(load_max, 2),
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
        "waits_s": sorted(round(w, 2) for w in waits),
        "final_statuses": [bstat, *statuses] if args.keep else None,
    }


def run_load_generator(args: argparse.Namespace, root: Path, zygote: Zygote, procs: list) -> dict:
    procs.append(spawn(["bootstrap", "--open"], root / "boot", zygote, args.boot_log_level))
    boot = runtime(root / "boot", time.monotonic() + 60, procs[0])
    per = max(1, args.hosts // args.procs)
    outs = [root / f"gen{k}.json" for k in range(args.procs)]
    boot_cpu0 = cpu_s(procs[0].pid)
    launched = time.monotonic()
    start_at = time.time() + LOADGEN_START_S  # every generator starts its hosts at once
    for k, out in enumerate(outs):
        cmd = [sys.executable, __file__, "--worker", boot["addrs"][0], str(out)]
        cmd += ["--hosts", str(per), "--timeout", str(args.timeout), "--start-at", str(start_at)]
        with (root / f"gen{k}.log").open("wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    samples: list[tuple[float, int]] = []
    deadline = launched + args.timeout + 30
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs[1:]):
            try:
                bstat = client.get(boot["api"] + "/status").json()
                samples.append((time.monotonic() - launched, admissions(bstat)[0]))
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(POLL_S)
        bstat = client.get(boot["api"] + "/status").json()
    admitted, busy = admissions(bstat)
    joined: list[float] = []
    failed = retries = busy_answers = 0
    for out in outs:
        if out.exists():
            data = json.loads(out.read_text())
            joined += data["joined_s"]
            failed += data["failed"]
            retries += data["retries"]
            busy_answers += data.get("busy_answers", 0)
    span = max(joined) if joined else args.timeout
    return {
        "mode": "load generator",
        "hosts": per * args.procs,
        "procs": args.procs,
        "joined": len(joined),
        "failed": failed,
        "retries": retries,
        "busy_answers": busy_answers,
        "join_p50_s": pct(joined, 0.5),
        "join_max_s": round(max(joined), 2) if joined else None,
        "bootstrap_admitted": admitted,
        "bootstrap_busy_conns": busy,
        "bootstrap_busy_streams": int((bstat.get("counters") or {}).get("busy_streams", 0)),
        "bootstrap_busy_answered": int((bstat.get("counters") or {}).get("busy_answered", 0)),
        "admitted_per_s_peak": peak_rate(samples),
        "admitted_per_s_mean": round(len(joined) / span, 2) if span else None,
        "bootstrap_cpu_s": round(cpu_s(procs[0].pid) - boot_cpu0, 1),
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
    }


async def light_joins(boot_addr: str, hosts: int, limit_s: float, start_at: float) -> dict:
    """``hosts`` bare libp2p hosts (Noise, yamux, no overlay services) in this process, each
    dialing the bootstrap and saying hello at ``start_at``, retrying with jittered backoff
    when turned away; they stay connected until every one has joined or ``limit_s``."""
    import random

    import trio
    from libp2p.custom_types import TProtocol

    from p2pnode.identity import NodeKey
    from p2pnode.overlay.net.config import VERSION
    from p2pnode.overlay.net.dialing import jittered, parse_peer_addr
    from p2pnode.overlay.net.hello import DEFAULT_NETWORK, HELLO_PROTOCOL, Hello, say_hello
    from p2pnode.overlay.net.host import make_host, parse_multiaddr

    boot = parse_peer_addr(boot_addr)
    rng = random.Random(start_at)
    joined: list[float] = []
    counts = {"failed": 0, "retries": 0, "busy_answers": 0}
    done = trio.Event()
    ours = Hello(network=DEFAULT_NETWORK, version=VERSION)

    async def one(host: Any) -> None:
        listen = [parse_multiaddr("/ip4/127.0.0.1/tcp/0")]
        async with host.run(listen_addrs=listen):
            await trio.sleep(max(0.0, start_at - time.time()))
            delay = 0.2
            end = start_at + limit_s
            while time.time() < end:
                try:
                    with trio.fail_after(15):
                        await host.connect(boot)
                        theirs = await say_hello(
                            lambda: host.new_stream(boot.peer_id, [TProtocol(HELLO_PROTOCOL)]), ours
                        )
                    if theirs.retry_after_s is not None:
                        # "Busy, retry after N s": leave, and come back after 1-1.5x N
                        # (overlay/net/admission.py does the same).
                        counts["busy_answers"] += 1
                        with trio.move_on_after(2):
                            await host.disconnect(boot.peer_id)
                        await trio.sleep(theirs.retry_after_s * (1.0 + 0.5 * rng.random()))
                        continue
                    joined.append(time.time() - start_at)
                    break
                except (Exception, trio.TooSlowError):
                    counts["retries"] += 1
                    unblock = getattr(host.get_network(), "unblock_peer", None)
                    if unblock is not None:
                        unblock(boot.peer_id)
                    await trio.sleep(jittered(delay, rng))
                    delay = min(2 * delay, 8.0)
            else:
                counts["failed"] += 1
            if len(joined) + counts["failed"] >= hosts:
                done.set()
            with trio.move_on_after(max(0.0, start_at + limit_s - time.time())):
                await done.wait()

    async with trio.open_nursery() as nursery:
        for _ in range(hosts):
            nursery.start_soon(one, make_host(NodeKey.generate(), ["/ip4/127.0.0.1/tcp/0"]))
    return {"joined_s": sorted(round(j, 3) for j in joined), **counts}


def stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + 15
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--open", action="store_true", help="an open network (no invite)")
    parser.add_argument("--boot-log-level", default="info")
    parser.add_argument("--keep", type=Path, default=None, help="copy every node's log here")
    parser.add_argument("--load-generator", action="store_true")
    parser.add_argument("--hosts", type=int, default=128, help="load generator: light hosts")
    parser.add_argument("--procs", type=int, default=4, help="load generator: processes")
    parser.add_argument("--worker", nargs=2, metavar=("BOOTSTRAP", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import trio

        boot_addr, out = args.worker
        result = trio.run(light_joins, boot_addr, args.hosts, args.timeout, args.start_at)
        Path(out).write_text(json.dumps(result))
        return
    root = Path(tempfile.mkdtemp(prefix="p2pnode-join-storm-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs: list[Any] = []
    load_at_start = os.getloadavg()
    zygote = Zygote.start({**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        if args.load_generator:
            result = run_load_generator(args, root, zygote, procs)
        else:
            result = run_storm(args, root, zygote, procs)
        result["load_avg_at_start"] = [round(x, 2) for x in load_at_start]
        result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        finals = result.pop("final_statuses", None)
        if finals and args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            (args.keep / "final_statuses.json").write_text(json.dumps(finals))
        print(json.dumps({k: v for k, v in result.items() if k != "waits_s"}, indent=2))
        suffix = "loadgen" if args.load_generator else str(args.nodes)
        out = Path(__file__).parent / "results" / f"join_storm-{suffix}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        stop(procs)
        zygote.close()
        if args.keep is not None:
            shutil.copytree(root, args.keep, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
