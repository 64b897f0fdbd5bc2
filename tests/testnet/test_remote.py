"""Pieces of trials on an inventory that run without root or sshd: the generated ssh_config,
the hold wrapper (a node dies with its session), the cleanup pass, the code fingerprint's
package list, the RTT matrix and each role's command line. The whole run over SSH is
tests/system/test_inventory_ssh.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from p2pnode.testnet.remote import hold, preflight, probe
from p2pnode.testnet.remote.controller import node_args
from p2pnode.testnet.remote.inventory import parse_inventory
from p2pnode.testnet.remote.ssh import SshClient, rpath
from p2pnode.testnet.spec import builtin_spec_path, load_spec

from testkit import wait_until_blocking

ROOT = Path(__file__).resolve().parents[2]
INVENTORY = {
    "ssh": {"identity_file": "/keys/id", "config": "/home/me/.ssh/config"},
    "env": {"python": "/venv/bin/python"},
    "host": [
        {"name": "boot", "address": "10.0.0.1", "role": "bootstrap", "user": "u"},
        {"name": "gw", "address": "10.0.0.2", "role": "relay", "user": "u"},
        {"name": "lab", "address": "192.168.1.2", "role": "serving", "jump": "gw", "user": "u"},
        {"name": "home", "address": "192.168.1.2", "role": "light", "user": "v",
         "jump": "v@bastion.example:2222"},
    ],
}  # fmt: skip


def test_ssh_config_jumps_and_settings(tmp_path):
    client = SshClient(parse_inventory(INVENTORY), tmp_path)
    text = client.config.read_text()
    blocks = {b.split("\n", 1)[0]: b for b in text.split("\n\n")}
    assert "ProxyJump p2p-gw" in blocks["Host p2p-lab"]
    assert "ProxyJump v@bastion.example:2222" in blocks["Host p2p-home"]
    # Two hosts on 192.168.1.2 behind different sites: told apart in known_hosts by name.
    assert "HostKeyAlias p2p-lab" in blocks["Host p2p-lab"]
    assert "HostKeyAlias p2p-home" in blocks["Host p2p-home"]
    assert "ProxyJump" not in blocks["Host p2p-boot"]
    assert "BatchMode yes" in text and 'IdentityFile "/keys/id"' in text
    assert text.rstrip().endswith('Include "/home/me/.ssh/config"')  # the user's fills in
    argv = client.argv(parse_inventory(INVENTORY).host("lab"), "true", forward=(5000, 8731))
    assert argv[:3] == ["ssh", "-F", str(client.config)]
    assert "127.0.0.1:5000:127.0.0.1:8731" in argv
    assert rpath("~/trials/a b") == "\"$HOME\"/'trials/a b'"


def _hold(tmp_path: Path, run: str, code: str, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "p2pnode.testnet.remote.hold", "--run", run, *extra,
            "--dir", str(tmp_path / "node"), "--", sys.executable, "-c", code]  # fmt: skip
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_node_stops_when_its_session_ends(tmp_path):
    proc = _hold(tmp_path, "r1", "import time\nwhile True: time.sleep(1)")
    try:
        line = proc.stdout.readline()
        pid = int(line.split("pid ")[1].split()[0])
        info = json.loads((tmp_path / "node" / hold.PID_FILE).read_text())
        assert info == {"pid": pid, "run": "r1"}
        assert _alive(pid)
        proc.stdin.write(".")  # a heartbeat keeps it
        proc.stdin.flush()
        proc.stdin.close()  # the session ends
        assert proc.wait(timeout=hold.STOP_GRACE_S + 30) != 0
        wait_until_blocking(lambda: not _alive(pid), 30.0, "the node process gone")
        assert not (tmp_path / "node" / hold.PID_FILE).exists()
        assert "the SSH session closed" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_silent_session_stops_the_node(tmp_path):
    """A link that hangs without closing: no heartbeat byte for --silence-s."""
    proc = _hold(tmp_path, "r3", "import time\nwhile True: time.sleep(1)", "--silence-s", "1")
    try:
        pid = int(proc.stdout.readline().split("pid ")[1].split()[0])
        assert proc.wait(timeout=hold.STOP_GRACE_S + 30) != 0  # stdin still open
        wait_until_blocking(lambda: not _alive(pid), 30.0, "the node process gone")
        assert "no heartbeat for 1 s" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_wrapper_ends_with_the_node(tmp_path):
    proc = _hold(tmp_path, "r2", "raise SystemExit(3)")
    try:
        assert proc.wait(timeout=60) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cleanup_kills_leftovers_of_their_run_only(tmp_path):
    code = "import time\nwhile True: time.sleep(1)"
    leftover = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                                env={**os.environ, hold.RUN_ENV: "old"})  # fmt: skip
    stranger = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        for name, proc, run in (("a", leftover, "old"), ("b", stranger, "other")):
            d = tmp_path / "old" / name
            d.mkdir(parents=True)
            (d / hold.PID_FILE).write_text(json.dumps({"pid": proc.pid, "run": run}))
        killed = hold.cleanup(tmp_path)
        assert killed == [{"pid": leftover.pid, "run": "old", "node": "a"}]
        assert leftover.wait(timeout=30) < 0
        assert stranger.poll() is None  # its pid file's run id is not in its environment
    finally:
        for proc in (leftover, stranger):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_fingerprint_covers_every_package_of_the_distribution():
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(probe.PACKAGES) == sorted(packages["packages"])
    assert probe.code_fingerprint() == probe.code_fingerprint()
    assert len(probe.code_fingerprint()) == 16


def test_rtt_matrix_rows_and_table():
    names = {"P1": "a", "P2": "b", "P3": "c"}
    peers = {
        "a": [{"peer_id": "P2", "rtt_ms": 12.34}, {"peer_id": "P9", "rtt_ms": 1.0}],
        "b": [{"peer_id": "P1", "rtt_ms": None}],
        "c": None,  # did not answer
    }
    rtt = preflight.rtt_matrix(peers, names)
    assert rtt == {"a": {"b": 12.3, "c": None}, "b": {"a": None, "c": None}, "c": None}
    status = {"a": {"reachability": {"verdict": "public"}}, "b": {}, "c": None}
    assert preflight.reachability(status) == {"a": "public", "b": "unknown", "c": "unknown"}
    controller = {"version": "0", "fingerprint": "f", "commit": None, "hostname": "me"}
    pf = preflight.Preflight(controller, {"a": preflight.HostCheck("a", "eu", "serving")})
    pf.rtt_ms = rtt
    text = preflight.table(pf.to_json())
    assert "| a | eu | serving | FAILED |" in text
    assert "| c | no answer | no answer |  |" in text


def test_each_role_runs_the_command_a_user_types():
    inv = parse_inventory(INVENTORY)
    spec = load_spec(builtin_spec_path("chat-lan"))
    boot = node_args(inv.host("boot"), spec, "routing", "", "H")
    assert boot[0] == "bootstrap" and "--invite" not in boot
    relay = node_args(inv.host("gw"), spec, "routing", "INV", "H")
    assert relay[:3] == ["join", "--invite", "INV"] and "--relay-hop" in relay
    lab = node_args(inv.host("lab"), spec, "baseline", "INV", "H")
    assert "--no-routing" in lab and lab[lab.index("--engine") + 1] == "emulated"
    assert lab[lab.index("--cache-budget-tokens") + 1] == str(spec.node.cache_budget_tokens)
    light = node_args(inv.host("home"), spec, "routing", "INV", "H")
    assert light[light.index("--model") + 1] == "none" and "--engine" not in light


def test_results_page_lists_a_run_on_hosts_beside_the_local_one(tmp_path):
    from p2pnode.testnet.report import page

    runs = []
    for k, hosts in enumerate(("local", "inventory")):
        d = tmp_path / hosts
        d.mkdir()
        results = {"spec": {"name": "chat-lan"}, "arms": {"routing": {}}, "hosts": hosts,
                   "started": f"2026-12-07T00:0{k}:00Z"}  # fmt: skip
        (d / "results.json").write_text(json.dumps(results))
        runs.append(d)
    assert sorted(page.load_runs(runs)) == ["chat-lan", "chat-lan (hosts)"]


def test_a_wheel_of_the_checkout_runs_the_same_code(tmp_path):
    """What ``env create`` installs on a host (envs.build_wheel) has the controller's
    fingerprint: the preflight's same-code check holds across install methods."""
    from p2pnode.testnet.remote import envs

    wheel = envs.build_wheel(tmp_path / "wheel")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--target", str(target), str(wheel)], check=True, timeout=300)  # fmt: skip
    code = (
        "from p2pnode.testnet.remote import probe; print(probe.__file__, probe.code_fingerprint())"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, timeout=120, cwd=tmp_path)  # fmt: skip
    where, fingerprint = done.stdout.split()
    assert where.startswith(str(target))  # the wheel's copy, not the checkout
    assert fingerprint == probe.code_fingerprint()
