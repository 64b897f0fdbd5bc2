"""Start a trial's nodes as separate OS processes on this machine, and stop them all.

One file on purpose: planning the nodes' addresses, starting them (forked, on
loopback or in namespaces), waiting for the overlay and stopping them share ``RunningTrial``'s
state; what counts as formed is judged apart, in ``formation.py``.

Contract:
- ``with launch_trial(spec, arm, workdir) as trial:`` starts one bootstrap node and
  ``spec.node_count`` serving nodes (``node_cmd``), each in its own home
  under ``workdir/<arm>/``, each listening on its own loopback IP of its region (``wan.node_ip``)
  started through ``testnet/run/node.py`` from a ``TrialNode`` plan (``NodeSettings`` values:
  the spec's ``[node]`` settings, ``backend`` from the compute mode and ``routing`` by arm; the
  spec and region, so its libp2p connections carry the spec's delays; an ``Adversary`` for a
  node the spec's ``[[adversary]]`` names), written as ``trial-node.json`` in its home. It waits for every ``runtime.json`` and for the overlay to form
  (``formation.formation_missing``: every serving node sees every other one up in ``GET /status``, or with
  bounded connections at least its low watermark of them less one, the up links make one
  graph, and for the routing arm each node holds a cache view of every peer it sees up), all
  bounded by ``start_timeout_s`` (``LaunchError`` with the tail of the failing node's log
  otherwise). A spec with ``[nodes] formation = "settled"`` starts instead once the
  formation deficit has not fallen for ``formation_settle_s`` (or at the start limit, if any
  link formed), with ``trial.formation`` (``FormationState.to_json()``) and a warning saying
  how far the overlay got; the wait prints its progress every ``PROGRESS_EVERY_S``. Leaving
  the block (also on Ctrl-C or an error) sends SIGTERM to every process, SIGKILL after
  ``STOP_GRACE_S``, and copies each node's log to ``workdir/<arm>/logs/``.
- ``trial.apis`` (base URLs, node order), ``trial.peer_ids``, ``trial.nodes`` (``NodeProc``),
  ``trial.leave(i, kill=False)`` / ``trial.join(i)`` for churn: leave stops node i cleanly
  (SIGTERM, SIGKILL after the grace period), ``kill=True`` SIGKILLs it at once; a joining
  departed node reuses its home, so its peer id; joining index ``len(trial.nodes)`` starts a
  NEW node (fresh home and identity, the region of ``spec.churn_new_nodes()``), appended to
  ``trial.nodes``. Every node started is stopped when the block ends.
- ``node_cmd`` (default ``python -m p2pnode.testnet.run.node``) is the command line a node's
  plan file is appended to (another build of the node, a profiler wrapper). With the default command,
  emulated nodes on this host's loopback are forked from a fork server that imported the
  node's modules once (``testnet/run/zygote.py``): same processes, a fraction of the start-up CPU.
- Emulated compute loads only the tokenizer (no torch, ~130 MB per node process); real
  compute pins ``torch_threads`` via its settings and ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from p2pnode.errors import P2PNodeError
from p2pnode.testnet.netns import wan
from p2pnode.testnet.netns.namespaces import Testbed, require_netns
from p2pnode.testnet.run.formation import FormationState, describe, formation_state
from p2pnode.testnet.run.node import Adversary, TrialNode
from p2pnode.testnet.run.zygote import ForkedProc, Zygote
from p2pnode.testnet.spec import TrialSpec

STOP_GRACE_S = 15.0
# p2pnode itself, through the trial's entry point that injects the spec's WAN delays first
# (testnet/run/node.py); the product's node assembly knows nothing of emulated WANs.
NODE_CMD = (sys.executable, "-m", "p2pnode.testnet.run.node")
POLL_S = 0.25
# Trials of more nodes than this start them STAGGER_S apart: 64 joins at one instant all hit
# the bootstrap's handshakes at once on 2 cores, and joiners whose dials timed out there stayed
# alone for minutes.
STAGGER_ABOVE = 16
STAGGER_S = 0.25


class LaunchError(P2PNodeError, RuntimeError):
    """A trial's processes did not come up; the message holds the reason and log tail."""

    reason = "launch_failed"


@dataclass
class NodeProc:
    name: str
    region: str
    ip: str
    home: Path
    plan: TrialNode  # what the node process runs: its settings, WAN and adversary
    env: dict[str, str]
    cmd: list[str] = field(default_factory=lambda: list(NODE_CMD))
    proc: subprocess.Popen | ForkedProc | None = None
    info: dict[str, Any] | None = None
    log_files: list[Path] = field(default_factory=list)
    zygote: Zygote | None = None  # forks the node instead of starting an interpreter

    @property
    def api(self) -> str:
        if self.info is None:
            raise LaunchError(f"{self.name} has not started")
        return str(self.info["api"])

    @property
    def peer_id(self) -> str:
        if self.info is None:
            raise LaunchError(f"{self.name} has not started")
        return str(self.info["peer_id"])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        path = self.log_files[-1] if self.log_files else None
        try:
            return path.read_text(errors="replace")[-n:] if path else ""
        except FileNotFoundError:
            return ""


def _spawn(node: NodeProc) -> None:
    node.home.mkdir(parents=True, exist_ok=True)
    (node.home / "runtime.json").unlink(missing_ok=True)
    log_path = node.home / f"node-{len(node.log_files)}.log"
    node.log_files.append(log_path)
    args = [str(node.plan.write(node.home / "trial-node.json"))]
    if node.zygote is not None and tuple(node.cmd) == NODE_CMD:
        log_path.touch()
        node.proc = node.zygote.spawn(args, node.env, log_path)
        node.info = None
        return
    with log_path.open("wb") as log:
        node.proc = subprocess.Popen(
            [*node.cmd, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=node.env,
            start_new_session=True,  # Ctrl-C reaches only the launcher, which stops them in order
        )
    node.info = None


def _wait_runtime(node: NodeProc, deadline: float) -> None:
    path = node.home / "runtime.json"
    while time.monotonic() < deadline:
        if node.proc is None or node.proc.poll() is not None:
            code = node.proc.returncode if node.proc else None
            raise LaunchError(f"{node.name} exited with {code}:\n{node.log_tail()}")
        try:
            info = json.loads(path.read_text())
            if info.get("pid") == node.proc.pid and info.get("api"):
                node.info = info
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(POLL_S)
    raise LaunchError(f"{node.name} wrote no runtime.json in time; log tail:\n{node.log_tail()}")


def _stop(nodes: list[NodeProc]) -> None:
    for node in nodes:
        if node.alive():
            node.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for node in nodes:
        if node.proc is None:
            continue
        try:
            node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait(timeout=5)


def node_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _free_port(ip: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((ip, 0))
        return sock.getsockname()[1]


def _provision(network_home: Path, node: NodeProc) -> None:
    """A closed network's member, made before it starts: its key and a membership signed by
    the network key in ``network_home`` (what an invite redeemed at the bootstrap gives it; made
    here because every process starts at once, before the bootstrap listens)."""
    from p2pnode.identity import NodeKey
    from p2pnode.identity.memberhome import MemberHome
    from p2pnode.identity.membership import Issuer, issue_membership, load_network_key

    network_key = load_network_key(network_home)
    assert network_key is not None, "the trial's bootstrap holds the network key"
    node.home.mkdir(parents=True, exist_ok=True)
    peer_id = NodeKey.load_or_create(node.home).peer_id
    cred = issue_membership(Issuer(network_key), peer_id, now=time.time())
    MemberHome(node.home).save_membership(cred.raw)


def _close_network(bootstraps: Sequence[NodeProc]) -> None:
    """Make the trial's network closed: the first bootstrap's home gets the network key, the
    others a copy (each bootstrap a key holder, as an operator running several would)."""
    from p2pnode.identity.membership import NETWORK_KEY_FILE, load_or_create_network_key

    first = bootstraps[0]
    load_or_create_network_key(first.home)
    for b in bootstraps:
        b.plan.settings["open"] = False
        if b is not first:
            b.home.mkdir(parents=True, exist_ok=True)
            shutil.copy2(first.home / NETWORK_KEY_FILE, b.home / NETWORK_KEY_FILE)


def _prepare_bootstrap(bootstrap: NodeProc, *, default_port: bool = False) -> str:
    """Create the bootstrap's key and pick its port (``default_port``: it listens on the
    default 0.0.0.0:4101 of its own namespace); returns its full multiaddr."""
    from p2pnode.identity import NodeKey

    key = NodeKey.load_or_create(bootstrap.home)
    if default_port:
        return f"/ip4/{bootstrap.ip}/tcp/4101/p2p/{key.peer_id}"
    port = _free_port(bootstrap.ip)
    bootstrap.plan.settings["listen"] = [f"/ip4/{bootstrap.ip}/tcp/{port}"]
    return f"/ip4/{bootstrap.ip}/tcp/{port}/p2p/{key.peer_id}"


@dataclass
class RunningTrial:
    spec: TrialSpec
    arm: str
    root: Path
    bootstrap: NodeProc
    nodes: list[NodeProc]
    extra_bootstraps: list[NodeProc] = field(default_factory=list)
    formed_s: float = 0.0
    formation: dict[str, Any] = field(default_factory=dict)  # FormationState.to_json()
    warnings: list[str] = field(default_factory=list)

    @property
    def apis(self) -> list[str]:
        return [n.api for n in self.nodes]

    @property
    def peer_ids(self) -> list[str]:
        return [n.peer_id for n in self.nodes]

    # churn: where new nodes come from
    bootstrap_addr: str = ""
    log_level: str = "info"
    node_cmd: Sequence[str] = NODE_CMD

    def leave(self, i: int, *, kill: bool = False) -> None:
        """Node i leaves: SIGTERM (SIGKILL after the grace period), or SIGKILL at once."""
        node = self.nodes[i]
        if kill and node.alive():
            node.proc.kill()
            node.proc.wait(timeout=10)
            return
        _stop([node])

    def add_new_node(self, i: int) -> NodeProc:
        """Plan new node ``i`` (the next index) and append it to ``nodes``; not started."""
        regions = dict(self.spec.churn_new_nodes())
        if i != len(self.nodes) or i not in regions:
            raise LaunchError(f"node{i} is not the next new node of the spec's [[churn]] joins")
        node = plan_new_node(
            self.spec, self.arm, self.root.parent, i, regions[i],
            log_level=self.log_level, node_cmd=self.node_cmd,
        )  # fmt: skip
        node.plan.settings["bootstrap"] = [self.bootstrap_addr]
        node.zygote = self.bootstrap.zygote
        if self.spec.network.kind == "closed":
            _provision(self.bootstrap.home, node)
        self.nodes.append(node)
        return node

    def join(self, i: int, timeout_s: float = 120.0) -> None:
        """Node i (re)joins with its old home (same peer id), or, for ``i == len(nodes)``, a
        new node starts; waits for its runtime file (its API answers)."""
        if self.start_node(i):
            self.wait_ready(i, timeout_s)

    def start_node(self, i: int) -> bool:
        """Churn: start node i (new when ``i == len(nodes)``) without waiting; False when it
        already runs. Quick (one process spawn), so a caller can never leave one unstopped."""
        if i == len(self.nodes):
            self.add_new_node(i)
        node = self.nodes[i]
        if node.alive():
            return False
        _spawn(node)
        return True

    def wait_ready(self, i: int, timeout_s: float = 120.0) -> None:
        """Churn: wait until node i has written its runtime file (its API answers)."""
        _wait_runtime(self.nodes[i], time.monotonic() + timeout_s)

    def statuses(self) -> list[dict[str, Any] | None]:
        """Every node's ``GET /status`` (None where it does not answer in 5 s), asked a few at
        a time: one by one, a starved 128-node swarm took minutes a poll."""

        def one(node: NodeProc) -> dict[str, Any] | None:
            try:
                return httpx.get(node.api + "/status", timeout=5.0).json()
            except (httpx.HTTPError, ValueError, LaunchError):
                return None

        with ThreadPoolExecutor(max_workers=STATUS_POLLERS) as pool:
            return list(pool.map(one, self.nodes))


def _mesh_state(trial: RunningTrial, need_views: bool) -> FormationState:
    names = [node.name for node in trial.nodes]
    return formation_state(names, trial.peer_ids, trial.statuses(), need_views)


PROGRESS_EVERY_S = 15.0
STATUS_POLLERS = 8  # GET /status requests in flight while the launcher polls the nodes
SETTLE_PROGRESS = 0.05  # a fall of the formation deficit by this share counts as progress


def _wait_mesh(trial: RunningTrial, deadline: float, limit_s: float) -> None:
    """Every node sees every other up; for the routing arm also holds a cache view of each.

    Views depend on gossip (empty caches publish small digests), so they get a bounded grace
    period after the peers are up; a trial that starts without them says so in ``warnings``.
    With ``formation = "settled"`` the wait also ends once the formation deficit has not
    fallen for ``formation_settle_s`` (or at the start limit), and the trial starts with the
    overlay as it stands, recorded in ``trial.formation`` and ``warnings``.
    """
    need_views = trial.arm == "routing"
    spec = trial.spec
    view_grace_s = 5.0 + 4 * spec.node.gossip_interval + 4 * spec.max_delay_ms() / 1e3
    settled = spec.formation == "settled"
    peers_up_at: float | None = None
    best, best_at = None, time.monotonic()
    state = None
    shown_at = time.monotonic()
    while time.monotonic() < deadline:
        state = _mesh_state(trial, need_views)
        trial.formation = state.to_json()
        missing = state.missing
        if not missing:
            return
        now = time.monotonic()
        if now - shown_at >= PROGRESS_EVERY_S:  # a big swarm forms for minutes: show it
            shown_at = now
            line = f"{describe(state.to_json())}, {state.silent} silent"
            print(f"[{trial.arm}] forming: {line}", file=sys.stderr, flush=True)
        if all("cache view" in m for m in missing):
            peers_up_at = peers_up_at or now
            if now - peers_up_at > view_grace_s:
                trial.warnings.append(
                    f"started without full cache views after {view_grace_s:.0f} s: "
                    + "; ".join(missing)
                )
                return
        # Progress is a new low by a margin: links trimmed and dialed again make the deficit
        # jitter, and a jitter must not keep a settled trial waiting until its start limit.
        if best is None or state.deficit < best * (1 - SETTLE_PROGRESS):
            best, best_at = state.deficit, now
        elif settled and now - best_at > spec.formation_settle_s:
            _start_unformed(trial, state, f"no progress for {spec.formation_settle_s:.0f} s")
            return
        for node in trial.nodes:
            if not node.alive():
                raise LaunchError(f"{node.name} died while the overlay formed:\n{node.log_tail()}")
        time.sleep(0.5)
    if settled and state is not None and state.parts < state.nodes - state.silent:
        _start_unformed(trial, state, f"the start limit of {limit_s:.0f} s")
        return
    detail = "; ".join(state.missing) if state is not None else "not checked yet"
    raise LaunchError(f"the overlay did not form within {limit_s:.0f} s: {detail}")


def _start_unformed(trial: RunningTrial, state: FormationState, why: str) -> None:
    trial.warnings.append(
        f"started before the overlay formed ({why}): {describe(state.to_json())}; "
        + "; ".join(state.missing[:12])
    )


def plan_nodes(
    spec: TrialSpec,
    arm: str,
    root: Path,
    *,
    log_level: str = "info",
    node_cmd: Sequence[str] = NODE_CMD,
    addressing: str = "loopback",
):
    """The bootstrap nodes (the first is the trial's bootstrap) and serving node definitions
    of one arm (not started)."""
    spec_path = str(spec.path) if spec.path else ""
    if not spec_path:
        raise LaunchError("the spec must come from a file (load_spec): nodes read it for their WAN")
    per_region: dict[str, int] = {}

    def next_ip(region: str) -> str:
        k = per_region.get(region, 0)
        per_region[region] = k + 1
        return wan.node_ip(spec, region, k, addressing)

    base = root / arm
    bootstraps = [
        _bootstrap_node(spec, base, k, region, next_ip(region), log_level, node_cmd, spec_path)
        for k, region in enumerate(spec.bootstrap_regions())
    ]
    nodes = [
        _serving_node(spec, arm, base, i, region, next_ip(region), log_level, node_cmd)
        for i, region in enumerate(spec.placement)
    ]
    return bootstraps, nodes


def _bootstrap_node(
    spec: TrialSpec,
    base: Path,
    k: int,
    region: str,
    boot_ip: str,
    log_level: str,
    node_cmd: Sequence[str],
    spec_path: str,
) -> NodeProc:
    name = "bootstrap" if k == 0 else f"bootstrap{k}"
    boot_home = base / name
    boot_home.mkdir(parents=True, exist_ok=True)
    settings = {
        "home": str(boot_home),
        "listen": [f"/ip4/{boot_ip}/tcp/0"],
        "api_port": 0,
        "log_level": log_level,
        # what `p2pnode bootstrap` runs: discovery only
        "model": "none",
        "role": ["bootstrap"],
        "open": True,  # False for a closed network (_close_network)
    }
    return NodeProc(
        name=name,
        region=region,
        ip=boot_ip,
        home=boot_home,
        plan=TrialNode(settings, spec_path, region),
        env=node_env(1),
        cmd=list(node_cmd),
    )


def plan_new_node(
    spec: TrialSpec,
    arm: str,
    root: Path,
    index: int,
    region: str,
    *,
    log_level: str = "info",
    node_cmd: Sequence[str] = NODE_CMD,
) -> NodeProc:
    """Churn: a node that joins during the trial (not started, no --bootstrap yet). Its IP
    follows the initial nodes (and the bootstrap) of its region and earlier new nodes there."""
    k = sum(r == region for r in spec.placement) + (spec.bootstrap_region == region)
    k += sum(r == region for j, r in spec.churn_new_nodes() if j < index)
    ip = wan.node_ip(spec, region, k)
    return _serving_node(spec, arm, root / arm, index, region, ip, log_level, node_cmd)


def _serving_node(
    spec: TrialSpec,
    arm: str,
    base: Path,
    i: int,
    region: str,
    ip: str,
    log_level: str,
    node_cmd: Sequence[str],
) -> NodeProc:
    s = spec.node
    spec_path = str(spec.path)
    home = base / f"node{i}"
    settings = {
        "home": str(home),
        "listen": [f"/ip4/{ip}/tcp/0"],
        "api_port": 0,
        "model": spec.model,
        "backend": spec.backend,
        "routing": arm == "routing",
        "log_level": log_level,
        **dataclasses.asdict(s),  # the spec's [node] table holds NodeSettings fields
    }
    liar = spec.adversary_of(i)
    adversary = None
    if liar is not None:  # testnet/run/node.py hands it to the node as an extension
        rate = {} if liar.rate is None else {"rate": liar.rate}
        adversary = Adversary(liar.kind, forge=liar.forge_digest, **rate)
    plan = TrialNode(settings, spec_path, region, adversary)
    env = node_env(s.torch_threads)
    return NodeProc(f"node{i}", region, ip, home, plan, env, list(node_cmd))


# Trials on namespace hosts: this namespace joins the hosts' bridge here, so the driver
# reaches every node's HTTP API (bound to the host's own address) directly.
DRIVER_LEG = f"{wan.NETNS_NET.broadcast_address - 1}/{wan.NETNS_NET.prefixlen}"


def _onto_testbed(spec: TrialSpec, nodes: list[NodeProc]) -> Testbed:
    """Each node in a namespace of its own with its region's address; its command runs in
    there with the default listen address (0.0.0.0:4101) and its API on the host address."""
    reason = require_netns(nat=False)
    if reason is not None:
        raise LaunchError(f"--hosts netns: {reason}")
    if spec.churn_new_nodes():
        raise LaunchError("--hosts netns: churn joins of new nodes are not supported there yet")
    prefix = wan.NETNS_NET.prefixlen
    bed = Testbed(
        {n.name: "public" for n in nodes},
        addresses={n.name: f"{n.ip}/{prefix}" for n in nodes},
        root_leg=DRIVER_LEG,
    ).build()
    for node in nodes:
        node.plan.settings.pop("listen")  # the default: 0.0.0.0:4101 in its namespace
        node.plan.settings.update(api_host=node.ip, api_port=NETNS_API_PORT, **NETNS_API)
        node.cmd = bed.cmd(node.name, node.cmd)
    return bed


NETNS_API_PORT = 8731
# The API listens on the host's address (the driver is outside the namespace): no key, on a
# testbed that nothing but the trial can reach.
NETNS_API = {"api_insecure": True}


@contextmanager
def launch_trial(
    spec: TrialSpec,
    arm: str,
    workdir: Path,
    *,
    start_timeout_s: float | None = None,
    log_level: str = "info",
    node_cmd: Sequence[str] = NODE_CMD,
    hosts: str = "local",
) -> Iterator[RunningTrial]:
    """Start one arm's processes, wait for the overlay, stop everything on exit (module doc)."""
    if arm not in ("routing", "baseline"):
        raise LaunchError(f"arm {arm!r}: use routing or baseline")
    if hosts not in ("local", "netns"):
        raise LaunchError(f"hosts {hosts!r}: use local (this host's loopback) or netns")
    if start_timeout_s is None:
        # many round trips per dial (multistream, Noise, yamux): scale with the worst link
        start_timeout_s = 90.0 + 10 * spec.node_count + 40 * spec.max_delay_ms() / 1000.0
    from p2pnode.inference.models import default_model_path

    if spec.model == "default":
        default_model_path()  # convert once here, not in every node at the same time
    addressing = "netns" if hosts == "netns" else "loopback"
    bootstraps, nodes = plan_nodes(
        spec, arm, workdir, log_level=log_level, node_cmd=node_cmd, addressing=addressing
    )
    bootstrap, extra = bootstraps[0], bootstraps[1:]
    bed = _onto_testbed(spec, [*bootstraps, *nodes]) if hosts == "netns" else None
    trial = RunningTrial(
        spec, arm, workdir / arm, bootstrap, nodes, extra, log_level=log_level, node_cmd=node_cmd
    )
    started = time.monotonic()
    deadline = started + start_timeout_s
    zygote = None
    try:
        if spec.compute == "emulated" and tuple(node_cmd) == NODE_CMD and bed is None:
            # Emulated nodes import the same modules: fork them from one process that did.
            zygote = Zygote.start(node_env(1))
            for node in [*bootstraps, *nodes]:
                node.zygote = zygote
        # The bootstrap's address is known before it runs (its key is made here, its port
        # picked free), so every process starts at once: start-up is mostly imports and
        # model loading, and nodes retry the bootstrap until it listens.
        addrs = [_prepare_bootstrap(b, default_port=bed is not None) for b in bootstraps]
        addr = trial.bootstrap_addr = addrs[0]
        if spec.network.kind == "closed":
            _close_network(bootstraps)
            for node in nodes:
                _provision(bootstrap.home, node)
        _spawn(bootstrap)
        for other in extra:  # the other bootstraps link with the first
            other.plan.settings["bootstrap"] = [addr]
            _spawn(other)
        for k, node in enumerate(nodes):
            node.plan.settings["bootstrap"] = [addrs[spec.bootstrap_of(node.region)]]
            if k and len(nodes) > STAGGER_ABOVE:
                time.sleep(STAGGER_S)
            _spawn(node)
        for b in bootstraps:
            _wait_runtime(b, deadline)
        for node in nodes:
            _wait_runtime(node, deadline)
        _wait_mesh(trial, deadline, start_timeout_s)
        trial.formed_s = time.monotonic() - started
        yield trial
    finally:
        everyone = [*bootstraps, *trial.nodes]  # churn: nodes that joined meanwhile too
        _stop(everyone)
        logs = workdir / arm / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for node in everyone:
            for k, path in enumerate(node.log_files):
                if path.is_file():
                    suffix = "" if k == 0 else f".{k}"
                    shutil.copyfile(path, logs / f"{node.name}{suffix}.log")
        if bed is not None:
            bed.close()
        if zygote is not None:
            zygote.close()
