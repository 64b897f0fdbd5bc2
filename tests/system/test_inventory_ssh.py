"""A trial on an inventory of hosts over SSH (needs root: namespaces, and sshd).

Six hosts, each a network namespace running a real OpenSSH server (keys made here, in a temp
dir): a public bootstrap, a public relay, two public serving nodes, and two serving nodes behind
NAT routers (both on 192.168.1.2, as home routers hand out), each reached through its site's
gateway as the SSH jump host (the router namespace runs an sshd too, as a lab's bastion
does). The controller is the user's command, ``p2pnode testnet SPEC --inventory hosts.toml``,
on a chat spec with emulated engines: it must answer every request, write the report and the
preflight (every host reachable, same code, an RTT row from every node), and leave no
p2pnode process in any namespace, also when SIGINT stops it mid-workload or it is killed.

All hosts share this machine's file system, so they run the worktree's own
environment (``[env] python``): the preflight's same-code check passes by construction here;
``create`` (a wheel per host) is not exercised (the namespaces have no package index).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from p2pnode.testnet.netns.namespaces import Testbed, require_netns

from testkit import wait_until_blocking

HOSTS = {"boot": "public", "relay": "public", "pub1": "public", "pub2": "public", "nat1": "nat",
         "nat2": "nat"}  # fmt: skip
ROLES = {"boot": "bootstrap", "relay": "relay", "pub1": "serving", "pub2": "serving",
         "nat1": "serving", "nat2": "serving"}  # fmt: skip
REGIONS = {"boot": "eu", "relay": "eu", "pub1": "eu", "pub2": "us", "nat1": "us", "nat2": "asia"}
SSHD = "/usr/sbin/sshd"
RUN_LIMIT_S = 600.0
SPEC = """
name = "chat-hosts"
seed = 5
compute = "emulated"
model = "default"
arms = ["routing"]
max_duration_s = 300

# On real hosts the links are real: the spec's network only applies to local trials.
[network]
regions = ["lan"]

[[network.links]]
between = ["lan", "lan"]
delay_ms = 1.0

[nodes]
count = 4  # locally; on an inventory its serving hosts are the nodes

[node]
cache_budget_tokens = 4096
gossip_interval = 1.0
max_batch = 4
torch_threads = 1

[workload]
kind = "chat"
sessions = 6
turns = 2
system_prompts = 2
popularity = "uniform"
think_time_s = 0.5
arrival = "poisson"
rate_per_s = 2.0
concurrency = 4
max_tokens = 4
request_timeout_s = 120
"""


def _sshd_config(tmp: Path, name: str) -> Path:
    key = tmp / "hostkeys" / name
    key.parent.mkdir(exist_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    cfg = tmp / f"sshd-{name}.conf"
    cfg.write_text(
        f"Port 22\nHostKey {key}\nPidFile {tmp}/sshd-{name}.pid\n"
        f"AuthorizedKeysFile {tmp}/authorized_keys\nStrictModes no\nUsePAM no\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nAllowTcpForwarding yes\nX11Forwarding no\n"
        "PrintMotd no\nUseDNS no\nLogLevel ERROR\n"
    )
    return cfg


def _p2pnode_pids(namespaces: list[str]) -> dict[str, list[str]]:
    """namespace -> command lines of p2pnode processes in it."""
    found: dict[str, list[str]] = {}
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "p2pnode" in cmd:
                found.setdefault(ns, []).append(f"{pid}: {cmd[:160]}")
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    reason = require_netns()
    if reason is not None:
        pytest.skip(reason)
    if not os.path.exists(SSHD) or shutil.which("ssh") is None:
        pytest.skip("needs OpenSSH: `make setup` installs openssh-server as root")
    tmp = tmp_path_factory.mktemp("ssh-site")
    # A /24 of its own, so that the controller's leg onto the bridge never meets another
    # testbed's routes.
    net = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    addresses = {n: f"{net}.{i}/24" for i, n in enumerate(HOSTS, start=2)}
    bed = Testbed(HOSTS, addresses=addresses, root_leg=f"{net}.254/24")
    sshds: list[subprocess.Popen] = []
    try:
        bed.build()
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
        key = tmp / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        shutil.copy(f"{key}.pub", tmp / "authorized_keys")
        where = {n: bed.ns(n) for n in HOSTS}
        where.update({f"{n}-gw": bed.router_ns(n) for n, kind in HOSTS.items() if kind == "nat"})
        for name, kind in HOSTS.items():  # the testbed's routers drop unsolicited inbound, as
            if kind == "nat":  # home routers do; a site's bastion accepts SSH on its WAN side
                accept = ["iptables", "-I", "INPUT", "-i", "wan0", "-p", "tcp", "--dport", "22",
                          "-j", "ACCEPT"]  # fmt: skip
                subprocess.run(["ip", "netns", "exec", bed.router_ns(name), *accept], check=True)
        for name, ns in where.items():
            argv = ["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(_sshd_config(tmp, name))]
            log = (tmp / f"sshd-{name}.log").open("wb")
            sshds.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        hosts = []
        for name in HOSTS:
            jumped = HOSTS[name] == "nat"
            host = {
                "name": name,
                "address": bed.ip(name),
                "user": "root",
                "region": REGIONS[name],
                "role": ROLES[name],
                "workdir": str(tmp / "hosts" / name),
                **({"jump": f"root@{bed.public_ip(name)}:22"} if jumped else {}),
                **({"engine": "emulated"} if ROLES[name] == "serving" else {}),
            }
            hosts.append(host)
        inventory = tmp / "hosts.toml"
        inventory.write_text(_toml(key, tmp / "known_hosts", hosts))
        spec = tmp / "chat-hosts.toml"
        spec.write_text(SPEC)
        namespaces = list(where.values())
        yield {"tmp": tmp, "inventory": inventory, "spec": spec, "namespaces": namespaces}
    finally:
        for proc in sshds:
            proc.terminate()
        for proc in sshds:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        bed.close()


def _toml(key: Path, known: Path, hosts: list[dict]) -> str:
    lines = [
        "[ssh]",
        f'identity_file = "{key}"',
        f'known_hosts = "{known}"',
        'strict_host_keys = "accept-new"',
        "connect_timeout_s = 30",
        "",
        "[env]",
        f'python = "{sys.executable}"',
    ]
    for h in hosts:
        lines += ["", "[[host]]"] + [f"{k} = {json.dumps(v)}" for k, v in h.items()]
    return "\n".join(lines) + "\n"


def _command(site, out: Path, inventory: Path | None = None) -> list[str]:
    inventory = inventory or site["inventory"]
    return [sys.executable, "-m", "p2pnode.bootstrap.cli", "testnet", str(site["spec"]),
            "--inventory", str(inventory), "--out", str(out)]  # fmt: skip


def _none_left(site) -> None:
    wait_until_blocking(
        lambda: not _p2pnode_pids(site["namespaces"]),
        60.0,
        "no p2pnode process left in any namespace",
        step_s=0.5,
        detail=lambda: json.dumps(_p2pnode_pids(site["namespaces"]), indent=1),
    )


def test_trial_on_an_inventory_over_ssh(site):
    out = site["tmp"] / "run"
    done = subprocess.run(_command(site, out), capture_output=True, text=True,
                          timeout=RUN_LIMIT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    results = json.loads((out / "results.json").read_text())
    arm = results["arms"]["routing"]
    planned = 6 * 2
    assert arm["summary"]["requests"] == planned, arm
    assert arm["summary"]["answered"] == planned, arm["summary"]
    assert not arm["consistency"], arm["consistency"]
    assert results["hosts"] == "inventory"
    assert (out / "report.md").read_text().startswith("#")
    # The preflight: every host reached over SSH, the same code, its clock compared.
    pf = json.loads((out / "preflight.json").read_text())
    assert set(pf["hosts"]) == set(HOSTS)
    for name, check in pf["hosts"].items():
        assert check["reachable"] and not check["problem"], (name, check)
        assert check["clock_offset_ms"] is not None
    assert "| nat1 | us | serving | ok |" in (out / "preflight.md").read_text()
    # An RTT row from every node (it answered /peers), covering every other host.
    assert set(pf["rtt_ms"]) == set(HOSTS)
    for name, row in pf["rtt_ms"].items():
        assert row is not None, f"{name} gave no RTT row"
        assert set(row) == set(HOSTS) - {name}
    assert any(v is not None for row in pf["rtt_ms"].values() for v in row.values())
    for name in HOSTS:
        assert (out / "nodes" / "routing" / "logs" / f"{name}.log").stat().st_size > 0
        assert (out / "routing" / "metrics" / f"{name}.prom").is_file()
    inventory = json.loads((out / "inventory.json").read_text())
    assert inventory["ssh"]["identity_file"] == "(set)"
    _none_left(site)
    # The same spec on this host's loopback: the same results and report format.
    local = site["tmp"] / "local"
    argv = [sys.executable, "-m", "p2pnode.bootstrap.cli", "testnet", str(site["spec"]),
            "--hosts", "local", "--out", str(local)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_LIMIT_S)
    assert done.returncode == 0, done.stderr[-6000:]
    here = json.loads((local / "results.json").read_text())["arms"]["routing"]
    assert set(here["summary"]) == set(arm["summary"])
    assert set(here["chat"]) == set(arm["chat"])
    layout = _layout(out / "report.md")
    assert len(layout) >= 3 and _layout(local / "report.md") == layout


def _layout(report: Path) -> list[str]:
    """A report's headings and table header rows: its format, without its figures."""
    lines = report.read_text().splitlines()
    return [
        line
        for k, line in enumerate(lines)
        if line.startswith("#") or (k + 1 < len(lines) and lines[k + 1].startswith("|---"))
    ]


def _with_ghost(site) -> Path:
    """The inventory plus host "ghost": pub1's address, on a port no sshd listens on."""
    inventory = site["tmp"] / "ghost.toml"
    text = site["inventory"].read_text()
    ghost = text.split("[[host]]")[3].replace('"pub1"', '"ghost"')
    inventory.write_text(f"{text}\n[[host]]{ghost}port = 2222\n")
    return inventory


def test_a_host_failing_preflight_stops_the_run_before_anything_starts(site):
    """A host whose SSH server does not answer (port 2222 is closed there) is named with the
    reason, and no node starts anywhere."""
    inventory = _with_ghost(site)
    out = site["tmp"] / "ghost-run"
    done = subprocess.run(_command(site, out, inventory), capture_output=True, text=True,
                          timeout=RUN_LIMIT_S)  # fmt: skip
    assert done.returncode == 1, done.stderr[-4000:]
    assert "preflight failed on 1 host(s): ghost: unreachable" in done.stderr, done.stderr
    assert "| ghost | eu | serving | FAILED |" in done.stderr  # the table, printed
    assert not (out / "results.json").exists()
    assert not _p2pnode_pids(site["namespaces"])


@pytest.mark.parametrize(
    ("signum", "status"),
    [(signal.SIGINT, 130), (signal.SIGKILL, -signal.SIGKILL)],
    ids=["sigint", "controller-killed"],
)
def test_a_stopped_controller_leaves_no_node(site, signum, status):
    """Ctrl-C tears down in order; a controller killed outright cannot, and its nodes still
    stop: each SSH session's stdin closes with it, and the hold wrapper sees end of file."""
    out = site["tmp"] / f"stopped-{signum}"
    out.mkdir()
    # Forty times the sessions (two arrive a second): the workload would run ~2 minutes, so the
    # signal lands mid-workload however late a loaded machine lets the poll below see the first
    # answer (with four times, once, the whole run ended between that poll and the signal).
    spec = site["tmp"] / "chat-hosts-long.toml"
    spec.write_text(SPEC.replace("sessions = 6", "sessions = 240"))
    log = out.parent / f"stopped-{signum}.log"
    with log.open("wb") as err:
        argv = _command(site, out)
        argv[argv.index(str(site["spec"]))] = str(spec)
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
    try:
        # Mid-workload: the first progress line of the driver.
        wait_until_blocking(
            lambda: proc.poll() is not None or " done (" in log.read_text(errors="replace"),
            RUN_LIMIT_S,
            "the workload under way",
            step_s=0.5,
            detail=lambda: log.read_text(errors="replace")[-3000:],
        )
        assert _p2pnode_pids(site["namespaces"]), "the nodes run before the signal"
        assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
        proc.send_signal(signum)
        assert proc.wait(timeout=120) == status, log.read_text(errors="replace")[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    _none_left(site)


CHURN_SPEC = """
name = "churn-hosts"
seed = 3
compute = "emulated"
arms = ["routing"]
max_duration_s = 120

[network]
regions = ["lan"]
[[network.links]]
between = ["lan", "lan"]
delay_ms = 1.0

[nodes]
count = 4

[node]
cache_budget_tokens = 4096
gossip_interval = 0.5
max_batch = 2
ping_interval = 0.5

[workload]
subjects = 2
per_subject = 5
requests = 40
arrival = "poisson"
rate_per_s = 2.5
concurrency = 4
max_tokens = 2
request_timeout_s = 30

[[churn]]
at_s = 3.0
action = "kill"
node = 1

[[churn]]
at_s = 8.0
action = "join"
node = 1

[[churn]]
at_s = 10.0
action = "leave"
node = 3
"""


def test_churn_on_hosts_kills_stops_and_restarts_remote_nodes(site, monkeypatch):
    """The spec's [[churn]] on remote nodes: pub2 SIGKILLed on its host and started again with
    its home (same peer id), nat2 stopped cleanly; every request answered exactly once. The
    inventory also holds a host that fails the preflight, left out by ``allow_missing``."""
    from p2pnode.testnet.remote.controller import run_inventory_trial
    from p2pnode.testnet.remote.inventory import load_inventory
    from p2pnode.testnet.spec import load_spec
    from p2pnode.testnet.workload import churn

    monkeypatch.setattr(churn, "WATCH_LIMIT_S", 6.0)  # views take 30 s to expire
    spec_path = site["tmp"] / "churn-hosts.toml"
    spec_path.write_text(CHURN_SPEC)
    spec = load_spec(spec_path)
    out = site["tmp"] / "churn-run"
    # With a host that fails the preflight, which --allow-missing 1 lets the run go on without.
    inventory = load_inventory(_with_ghost(site))
    results = run_inventory_trial(spec, inventory, ["routing"], out, allow_missing=1)
    assert results["preflight"]["dropped"] == ["ghost"]
    assert "ghost" not in {h["name"] for h in results["inventory"]["hosts"]}
    arm = results["arms"]["routing"]
    assert "error" not in arm, arm.get("error")
    c = arm["churn"]
    bad = [(r["i"], r["error"], r["attempts"]) for r in
           driver_records(out) if r["status"] != "ok"]  # fmt: skip
    assert c["lost"] == 0 and c["duplicates"] == 0, bad
    assert arm["summary"]["answered"] == spec.workload.requests
    assert {(a["action"], a["node"]) for a in c["applied"]} == {
        ("kill", 1),
        ("join", 1),
        ("leave", 3),
    }
    assert all(a.get("done_after_s") is not None for a in c["applied"] if a["action"] != "join")
    logs = out / "nodes" / "routing" / "ssh"
    assert (logs / "pub2.ssh.log").is_file() and (logs / "pub2.1.ssh.log").is_file()
    _none_left(site)


def driver_records(out: Path) -> list[dict]:
    from p2pnode.testnet.workload import driver

    return driver.read_jsonl(out / "routing" / "requests.jsonl")
