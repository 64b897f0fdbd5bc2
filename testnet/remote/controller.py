"""A trial on the hosts of an inventory, driven from this machine over SSH.

Contract:
- ``run_inventory_trial(spec, inventory, arms, out_dir, ...)`` -> results (the shape
  ``run_trial`` writes, plus ``inventory`` and ``preflight``): the spec gives the workload,
  the arms and the serving nodes' ``[node]`` settings; the inventory gives the hosts, their
  regions and roles (the workload goes to its serving, verifier and light hosts, in inventory
  order). No userspace WAN delay: real hosts have real links.
- Before anything starts: a cleanup pass on every host (``hold.py --cleanup``: leftovers of
  earlier runs, found by their run id), environments made where the inventory says ``create``
  (a wheel of this checkout, see ``envs.py``), then the preflight (``preflight.py``): a host
  that fails it is named with its reason and the run stops (``PreflightFailed``) unless
  ``allow_missing`` covers it (the bootstrap and the last workload host never can be).
- Each arm on fresh processes, in waves gated on ``GET /health``: the bootstrap (``p2pnode
  bootstrap``, a closed network), then relays and verifiers, then the rest, each joining with
  an invite from ``p2pnode invite`` on the bootstrap, as a user would. Every node runs under
  ``hold.py`` in one SSH session that also forwards its loopback API to a local port
  (``ssh -L``): the workload driver, the health gate and the snapshots use those tunnels; the
  APIs never listen on the network and need no key. A heartbeat byte goes down every session
  every ``hold.HEARTBEAT_S``.
- A spec's ``[[churn]]`` runs as on this machine (``trial.drive_churn``), node ``i`` being
  the i-th workload host (``faults.RemoteChurn``); joins of new nodes and ``[[adversary]]``
  specs are refused before anything starts.
- After the workload: each node's ``/status``, ``/metrics`` and ``/peers`` (the RTT matrix and
  reachability verdicts join the preflight), then teardown, always (also on Ctrl-C, SIGTERM or
  an error): every session's stdin is closed, so every node stops, then each node's log comes
  back to ``nodes/<arm>/logs/<host>.log``. ``results.json``, ``report.md`` and plots are
  ``run_trial``'s; ``preflight.json`` / ``preflight.md`` and ``inventory.json`` (no key paths)
  are added.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import trio

from p2pnode.errors import P2PNodeError
from p2pnode.testnet.remote import envs, hold, preflight, probe
from p2pnode.testnet.remote.faults import RemoteChurn
from p2pnode.testnet.remote.inventory import Host, Inventory
from p2pnode.testnet.remote.ssh import SshClient, SshError, python_command, rpath
from p2pnode.testnet.report.tables import write_report
from p2pnode.testnet.run import formation
from p2pnode.testnet.run.trial import Progress, chat_tokenize, drive_churn, finish_arm, spec_echo
from p2pnode.testnet.spec import TrialSpec
from p2pnode.testnet.workload import chat, driver

CLI = "p2pnode.bootstrap.cli"
HEALTH_LIMIT_S = 180.0  # per wave: imports and the model load on the slowest host
STOP_LIMIT_S = hold.STOP_GRACE_S + 20.0
# The serving nodes' flags that carry the spec's [node] table (NodeSettingsSpec's fields).
NODE_FLAGS = (
    "pushback_threshold",
    "gossip_interval",
    "gossip_budget",
    "gossip_degree",
    "cache_budget_tokens",
    "max_batch",
    "torch_threads",
    "ping_interval",
    "min_connections",
    "max_connections",
)


class RemoteTrialError(P2PNodeError, RuntimeError):
    """A node on a host did not come up; the message names the host and its log tail."""

    reason = "remote_trial_failed"


class PreflightFailed(RemoteTrialError):
    reason = "preflight_failed"


@dataclass
class RemoteNode:
    host: Host
    dir: str  # the node's folder on its host (log, pid file, home)
    local_port: int
    session: subprocess.Popen | None = None
    session_log: Path | None = None
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.local_port}"

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def peer_id(self) -> str:
        return str(self.status.get("peer_id", ""))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_args(host: Host, spec: TrialSpec, arm: str, invite: str, home: str) -> list[str]:
    """The ``p2pnode`` command line a user would type for this host's role (quoted for the
    remote shell; ``home`` is already quoted)."""
    q = shlex.quote
    api = ["--api-port", str(host.api_port), "--home", home, "--log-level", "info"]
    if host.role == "bootstrap":
        return ["bootstrap", *api]
    args = ["join", "--invite", q(invite), *api]
    if host.role in ("relay", "light"):
        args += ["--model", "none"]
        if host.role == "relay":
            args += ["--relay-hop", "on"]
        return args
    args += ["--model", q(host.model), "--engine", host.engine]
    args.append("--routing" if arm == "routing" else "--no-routing")
    for name in NODE_FLAGS:
        args += ["--" + name.replace("_", "-"), str(getattr(spec.node, name))]
    if host.role == "verifier":
        args += ["--role", "verifier"]
    return args


class RemoteSwarm:
    """One arm's nodes on their hosts (module doc); ``close()`` stops every one of them."""

    def __init__(self, client: SshClient, run_id: str, arm: str, local_dir: Path) -> None:
        self.client, self.run_id, self.arm, self.local_dir = client, run_id, arm, local_dir
        self.nodes: list[RemoteNode] = []
        self._beat = threading.Event()
        self._heart = threading.Thread(target=self._heartbeat, daemon=True)
        self._heart.start()

    def _heartbeat(self) -> None:
        while not self._beat.wait(hold.HEARTBEAT_S):
            for node in list(self.nodes):
                s = node.session
                if s is not None and s.poll() is None and s.stdin is not None:
                    with contextlib.suppress(OSError, ValueError):
                        s.stdin.write(b".")
                        s.stdin.flush()

    def start(self, host: Host, spec: TrialSpec, invite: str) -> RemoteNode:
        node_dir = f"{host.workdir}/{self.run_id}/{self.arm}-{host.name}"
        node = RemoteNode(host, node_dir, _free_port())
        self.launch(node, spec, invite)
        self.nodes.append(node)
        return node

    def launch(self, node: RemoteNode, spec: TrialSpec, invite: str) -> None:
        """Start (or restart, with the same home and so the same peer id) ``node``'s session."""
        host = node.host
        py = rpath(host.env.interpreter)
        argv = node_args(host, spec, self.arm, invite, rpath(node.dir + "/home"))
        command = (
            f"{py} -m p2pnode.testnet.remote.hold --run {self.run_id} --dir {rpath(node.dir)}"
            f" -- {py} -m {CLI} " + " ".join(argv)
        )
        node.local_port = _free_port()
        restarts = sum(1 for p in self.local_dir.glob(f"{host.name}*.ssh.log"))
        suffix = f".{restarts}" if restarts else ""
        node.session_log = self.local_dir / f"{host.name}{suffix}.ssh.log"
        node.session = self.client.start(
            host, command, node.session_log, forward=(node.local_port, host.api_port)
        )

    def stop_node(self, node: RemoteNode, *, kill: bool = False) -> None:
        """A clean stop (end of its session: SIGTERM) or SIGKILL of its process group; returns
        once its session has ended."""
        s = node.session
        if s is None or s.poll() is not None:
            return
        if kill:
            py = rpath(node.host.env.interpreter)
            command = f"{py} -m p2pnode.testnet.remote.hold --signal KILL --dir {rpath(node.dir)}"
            self.client.run(node.host, command, timeout=60)
        elif s.stdin is not None:
            with contextlib.suppress(OSError):
                s.stdin.close()
        try:
            s.wait(timeout=STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            s.kill()
            s.wait(timeout=10)

    def remote_log(self, node: RemoteNode, tail: int = 3000) -> str:
        with contextlib.suppress(SshError):
            return self.client.run(
                node.host, f"tail -c {tail} {rpath(node.dir + '/node.log')}", timeout=30
            )
        return ""

    def wait_healthy(self, nodes: Sequence[RemoteNode], limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        waiting = list(nodes)
        while waiting:
            for node in list(waiting):
                if node.session is None or node.session.poll() is not None:
                    local = node.session_log.read_text(errors="replace")[-1500:]
                    raise RemoteTrialError(
                        f"{node.name}: its SSH session ended ({local.strip()}); node log:\n"
                        f"{self.remote_log(node)}"
                    )
                try:
                    if httpx.get(node.api + "/health", timeout=5.0).status_code == 200:
                        node.status = httpx.get(node.api + "/status", timeout=10.0).json()
                        waiting.remove(node)
                        print(f"[{self.arm}] {node.name} healthy", file=sys.stderr, flush=True)
                except (httpx.HTTPError, ValueError):
                    pass
            if waiting and time.monotonic() > deadline:
                names = ", ".join(n.name for n in waiting)
                tail = self.remote_log(waiting[0])
                raise RemoteTrialError(
                    f"not healthy within {limit_s:.0f} s: {names}; {waiting[0].name}'s log:\n{tail}"
                )
            if waiting:
                time.sleep(0.5)

    def get(self, node: RemoteNode, path: str) -> Any:
        try:
            return httpx.get(node.api + path, timeout=10.0).json()
        except (httpx.HTTPError, ValueError):
            return None

    def close(self, logs: Path) -> None:
        """Stop every node (EOF on its session), then fetch each node's log."""
        self._beat.set()
        for node in self.nodes:
            s = node.session
            if s is not None and s.stdin is not None:
                with contextlib.suppress(OSError):
                    s.stdin.close()
        deadline = time.monotonic() + STOP_LIMIT_S
        for node in self.nodes:
            s = node.session
            if s is None:
                continue
            try:
                s.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # the remote side still stops: no heartbeat
                s.kill()
                s.wait(timeout=10)
        logs.mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            with contextlib.suppress(SshError):
                text = self.client.run(
                    node.host, f"cat {rpath(node.dir + '/node.log')}", timeout=60
                )
                (logs / f"{node.name}.log").write_text(text)


def _invite(client: SshClient, boot: RemoteNode, uses: int) -> str:
    home = rpath(boot.dir + "/home")
    command = python_command(boot.host, CLI, []) + (
        f" invite --home {home} --uses {uses} --expires 1d"
    )
    lines = client.run(boot.host, command, timeout=60).strip().splitlines()
    if not lines:
        raise RemoteTrialError(f"{boot.name}: `p2pnode invite` printed nothing")
    return lines[-1].strip()


def _wait_formed(swarm: RemoteSwarm, workers: list[RemoteNode], spec: TrialSpec, arm: str):
    """Every workload node sees every other one up (``formation.formation_state``); bounded."""
    limit_s = 90.0 + 10 * len(workers)
    deadline = time.monotonic() + limit_s
    names = [n.name for n in workers]
    ids = [n.peer_id for n in workers]
    while True:
        statuses = [swarm.get(n, "/status") for n in workers]
        state = formation.formation_state(names, ids, statuses, arm == "routing")
        if not state.missing:
            return state.to_json(), []
        if time.monotonic() > deadline:
            if spec.formation == "settled":
                why = f"not formed in {limit_s:.0f} s: " + "; ".join(state.missing[:12])
                return state.to_json(), [why]
            raise RemoteTrialError(
                f"the overlay did not form within {limit_s:.0f} s: " + "; ".join(state.missing)
            )
        time.sleep(1.0)


def _snapshot(swarm: RemoteSwarm, arm_dir: Path) -> tuple[dict, dict]:
    statuses = {n.name: swarm.get(n, "/status") for n in swarm.nodes}
    (arm_dir / "status.json").write_text(json.dumps(list(statuses.values()), indent=1))
    metrics = arm_dir / "metrics"
    metrics.mkdir(parents=True, exist_ok=True)
    for n in swarm.nodes:
        try:
            text = httpx.get(n.api + "/metrics", timeout=10.0).text
        except httpx.HTTPError as exc:
            text = f"# unavailable: {exc}\n"
        (metrics / f"{n.name}.prom").write_text(text)
    peers = {n.name: swarm.get(n, "/peers") for n in swarm.nodes}
    (arm_dir / "peers.json").write_text(json.dumps(peers, indent=1))
    return statuses, peers


def _trio_run(fn: Callable[[], Awaitable[list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """``trio.run``, with a Ctrl-C that arrived inside a nursery (wrapped in a group) raised
    as the plain KeyboardInterrupt the command line answers with exit status 130."""
    try:
        return trio.run(fn)
    except BaseExceptionGroup as group:
        if group.subgroup(KeyboardInterrupt) is not None:
            raise KeyboardInterrupt from None
        raise


def _drive(spec: TrialSpec, arm: str, workers: list[RemoteNode], churn_trial: RemoteChurn):
    """The spec's workload through the tunnels -> (planned requests, records, churn figures);
    an MMLU workload with ``[[churn]]`` goes through ``trial.drive_churn``, as on this machine
    (chat sessions stay with their node, as there)."""
    apis, ids = [n.api for n in workers], [n.peer_id for n in workers]
    progress = Progress(arm, spec.workload.planned_requests)
    if spec.workload.kind == "chat":
        sessions = chat.build_sessions(spec.workload, spec.seed, len(workers))
        return [], _trio_run(
            lambda: chat.drive_chat(
                apis, sessions, spec.workload, max_duration_s=spec.max_duration_s,
                peer_ids=ids, tokenize=chat_tokenize(spec), on_record=progress,
            )
        ), {}  # fmt: skip
    requests = driver.build_requests(spec.workload, spec.seed, len(workers))
    if spec.churn:
        out: dict[str, Any] = {}
        records = _trio_run(lambda: drive_churn(churn_trial, requests, False, progress, out))
        return requests, records, out
    return requests, _trio_run(
        lambda: driver.drive(
            apis, requests, spec.workload, max_duration_s=spec.max_duration_s,
            peer_ids=ids, on_record=progress,
        )
    ), {}  # fmt: skip


@contextmanager
def _swarm(client: SshClient, run_id: str, arm: str, out_dir: Path) -> Iterator[RemoteSwarm]:
    swarm = RemoteSwarm(client, run_id, arm, out_dir / "nodes" / arm / "ssh")
    try:
        yield swarm
    finally:
        print(f"[{arm}] stopping {len(swarm.nodes)} nodes", file=sys.stderr, flush=True)
        swarm.close(out_dir / "nodes" / arm / "logs")


def run_arm(
    spec: TrialSpec, inv: Inventory, client: SshClient, run_id: str, arm: str, out_dir: Path
) -> dict[str, Any]:
    arm_dir = out_dir / arm
    arm_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"warnings": [], "hosts": {}}
    t0 = time.monotonic()
    try:
        with _swarm(client, run_id, arm, out_dir) as swarm:
            waves = inv.start_order()
            boot = swarm.start(waves[0][0], spec, "")
            swarm.wait_healthy([boot], HEALTH_LIMIT_S)
            invite = _invite(client, boot, uses=len(inv.hosts))
            for wave in waves[1:]:
                started = [swarm.start(h, spec, invite) for h in wave]
                swarm.wait_healthy(started, HEALTH_LIMIT_S)
            workers = [n for n in swarm.nodes if n.host.takes_workload]
            result["formation"], warns = _wait_formed(swarm, workers, spec, arm)
            result["warnings"] += warns
            result["formed_s"] = round(time.monotonic() - t0, 2)
            print(f"[{arm}] overlay formed in {result['formed_s']:.1f} s", file=sys.stderr)
            result["peer_ids"] = [n.peer_id for n in workers]
            result["apis"] = [f"{n.name}:{n.host.api_port} via {n.api}" for n in workers]
            result["hosts"] = {n.name: n.host.role for n in swarm.nodes}
            churn_trial = RemoteChurn(swarm, workers, spec, arm, invite)
            requests, records, churn_out = _drive(spec, arm, workers, churn_trial)
            statuses, peers = _snapshot(swarm, arm_dir)
            names = {n.peer_id: n.name for n in swarm.nodes}
            result["rtt_ms"] = preflight.rtt_matrix(peers, names)
            result["reachability"] = preflight.reachability(statuses)
    except (RemoteTrialError, SshError) as exc:
        print(f"[{arm}] failed: {exc}", file=sys.stderr)
        result["error"] = str(exc)[:4000]
        return result
    finish_arm(spec, arm, out_dir, records, requests, result, churn_out, t0)
    return result


def _preflight(
    client: SshClient, inv: Inventory, allow_missing: int, out_dir: Path
) -> tuple[Inventory, preflight.Preflight]:
    """The checks before anything starts, saved and printed whatever they find."""
    local = probe.describe()
    checks = preflight.check_hosts(client, inv, local)
    pf = preflight.Preflight(controller=local, hosts=checks)
    failed = pf.failed()
    stop = failed and (len(failed) > allow_missing or inv.bootstrap.name in failed)
    pf.dropped = [] if stop else sorted(failed)
    _write_preflight(out_dir, pf)
    if stop:
        detail = "; ".join(f"{h}: {why}" for h, why in failed.items())
        raise PreflightFailed(f"preflight failed on {len(failed)} host(s): {detail}")
    hosts = tuple(h for h in inv.hosts if h.name not in failed)
    if not any(h.takes_workload for h in hosts):
        raise PreflightFailed("no workload host passed the preflight")
    return replace(inv, hosts=hosts), pf


def _cleanup(client: SshClient, inv: Inventory) -> dict[str, Any]:
    """Leftovers of earlier runs on every reachable host (unreachable ones fail preflight)."""
    found: dict[str, Any] = {}
    for h in inv.hosts:
        cmd = (
            python_command(h, "p2pnode.testnet.remote.hold", ["--cleanup"]) + " " + rpath(h.workdir)
        )
        with contextlib.suppress(SshError):
            killed = json.loads(client.run(h, cmd, timeout=60).strip().splitlines()[-1])
            if killed.get("killed"):
                found[h.name] = killed["killed"]
                print(f"cleanup: {h.name}: killed {killed['killed']}", file=sys.stderr)
    return found


def run_inventory_trial(
    spec: TrialSpec,
    inventory: Inventory,
    arms: Sequence[str],
    out_dir: Path,
    *,
    allow_missing: int = 0,
    command: str = "",
) -> dict[str, Any]:
    if spec.adversaries:
        raise RemoteTrialError("trials on an inventory run no [[adversary]] yet")
    if spec.churn_new_nodes():
        raise RemoteTrialError(
            "[[churn]] joins of new nodes need hosts of their own: not on an inventory"
        )

    out_dir.mkdir(parents=True, exist_ok=True)
    run_id = time.strftime("%Y%m%d%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)
    client = SshClient(inventory, out_dir)
    (out_dir / "inventory.json").write_text(json.dumps(inventory.redacted(), indent=1))
    cleaned = _cleanup(client, inventory)
    envs.prepare(client, inventory)
    inv, pf = _preflight(client, inventory, allow_missing, out_dir)
    workers = inv.workload_hosts
    beyond = sorted({e.node for e in spec.churn if e.node >= len(workers)})
    if beyond:  # after the preflight: a dropped host takes its index with it
        raise RemoteTrialError(
            f"[[churn]] names nodes {beyond}; {len(workers)} workload hosts passed the preflight"
        )
    spec = replace(spec, placement=tuple(h.region for h in workers))
    results: dict[str, Any] = {
        "spec": spec_echo(spec),
        "arms": {},
        "command": command,
        "node_cmd": [f"p2pnode bootstrap | join --invite ... (on {len(inv.hosts)} hosts)"],
        "hosts": "inventory",
        "inventory": inv.redacted(),
        "run_id": run_id,
        "cleanup": cleaned,
        "machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    results["spec"]["max_delay_ms"] = 0.0  # real links, no emulated delay
    for arm in arms:
        results["arms"][arm] = result = run_arm(spec, inv, client, run_id, arm, out_dir)
        if "rtt_ms" in result and not pf.rtt_ms:
            pf.rtt_ms, pf.reachability = result["rtt_ms"], result["reachability"]
            _write_preflight(out_dir, pf)
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    results["preflight"] = pf.to_json()
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    write_report(results, out_dir)
    return results


def _write_preflight(out_dir: Path, pf: preflight.Preflight) -> None:
    data = pf.to_json()
    (out_dir / "preflight.json").write_text(json.dumps(data, indent=1))
    text = preflight.table(data)
    (out_dir / "preflight.md").write_text(text)
    print(text, file=sys.stderr, flush=True)
