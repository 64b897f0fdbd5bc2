"""The ``p2pnode`` CLI across real OS processes: a bootstrap and three ``join`` processes.

They discover each other through the bootstrap only; then one is killed (SIGKILL) and one is
hung (SIGSTOP), and both must be marked down by the survivors within 5 s. Nodes run with
``--model none`` because this test is about membership, not inference (it keeps 4 processes
from loading torch on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from testkit import wait_until_blocking

P2PNODE = [sys.executable, "-m", "p2pnode.bootstrap.cli"]
DETECTION_LIMIT_S = 5.0


def _peer_states(api: str) -> dict[str, str]:
    return {p["peer_id"]: p["state"] for p in httpx.get(api + "/peers", timeout=2.0).json()}


@pytest.mark.slow
def test_join_discover_and_detect_kill_and_hang(tmp_path: Path, node_processes) -> None:
    try:
        boot = node_processes.spawn(["bootstrap", "--open"], tmp_path / "boot")
        boot_info = node_processes.runtime(tmp_path / "boot", boot)
        joiners = []
        for i in range(3):
            home = tmp_path / f"n{i}"
            proc = node_processes.spawn(
                ["join", "--model", "none", "--bootstrap", boot_info["addrs"][0]], home
            )
            joiners.append((proc, home))
        infos = [node_processes.runtime(home, proc) for proc, home in joiners]
        ids = [info["peer_id"] for info in infos]

        def everyone_sees_everyone() -> bool:
            for info in infos:
                states = _peer_states(info["api"])
                others = set(ids) - {info["peer_id"]}
                if not all(states.get(pid) == "up" for pid in others):
                    return False
            return True

        wait_until_blocking(
            everyone_sees_everyone, 30.0, "3 joined nodes seeing each other as up", step_s=0.1
        )

        (killed, _), (hung, _) = joiners[0], joiners[1]
        killed.send_signal(signal.SIGKILL)
        hung.send_signal(signal.SIGSTOP)
        survivor_api = infos[2]["api"]

        def both_down() -> bool:
            states = _peer_states(survivor_api)
            # "down" exactly: a merely "suspect" peer would still be tried by the router.
            return all(states.get(pid) == "down" for pid in ids[:2])

        seconds = wait_until_blocking(
            both_down, DETECTION_LIMIT_S, "killed and hung peers marked down", step_s=0.1
        )
        print(f"killed + hung peers marked down after {seconds:.2f} s")
        assert _peer_states(boot_info["api"]).get(ids[2]) == "up", "the survivor must stay up"
    finally:
        node_processes.stop()
        for proc in node_processes.procs:
            if proc.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM):
                print(f"pid {proc.pid} exited with {proc.returncode}")
    assert os.path.exists(tmp_path / "n2" / "node_key")


def _cli(args: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*P2PNODE, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def test_id_with_the_default_listen_address_prints_dialable_addresses(tmp_path: Path) -> None:
    out = _cli(["id", "--home", str(tmp_path / "home")])
    assert out.returncode == 0, out.stderr
    assert "0.0.0.0" not in out.stdout, out.stdout
    addrs = [line.split(": ", 1)[1] for line in out.stdout.splitlines() if "/p2p/" in line]
    assert addrs and all("/tcp/4101/p2p/12D3KooW" in a for a in addrs), out.stdout
    if not any("/ip4/" in a and "/127." not in a for a in addrs):
        assert all("/127." in a for a in addrs)  # a machine with loopback only
    assert "none of these addresses is public" in out.stdout  # CI machines have no public IP


def test_second_node_on_one_home_or_port_exits_at_once_naming_the_flag(
    tmp_path: Path, node_processes
) -> None:
    home = tmp_path / "first"
    with socket.socket() as probe:  # a free port for the first node to take
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    listen = f"/ip4/127.0.0.1/tcp/{port}"
    first = node_processes.spawn(["bootstrap"], home, listen=listen)
    info = node_processes.runtime(home, first)
    api_port = int(info["api"].rsplit(":", 1)[1])
    cases = [
        (["--home", str(home), "--api-port", "0", "--listen", "/ip4/127.0.0.1/tcp/0"], "--home"),
        (["--home", str(tmp_path / "b"), "--api-port", "0", "--listen", listen], "--listen"),
        (
            ["--home", str(tmp_path / "c"), "--api-port", str(api_port), "--listen",
             "/ip4/127.0.0.1/tcp/0"],
            "--api-port",
        ),
    ]  # fmt: skip
    for args, flag in cases:
        started = time.monotonic()
        out = _cli(["bootstrap", *args], timeout=60)
        assert out.returncode != 0, (args, out.stdout, out.stderr)
        assert flag in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert time.monotonic() - started < 30, "must exit at once, not after a timeout"
    assert first.poll() is None, "the first node keeps running"
    assert not (tmp_path / "b" / "runtime.json").exists()


def test_join_with_an_invite_of_another_network_says_which(tmp_path: Path, node_processes) -> None:
    boot = node_processes.spawn(["bootstrap", "--network", "lab"], tmp_path / "boot")
    node_processes.runtime(tmp_path / "boot", boot)
    invite = _cli(["invite", "--home", str(tmp_path / "boot")])
    assert invite.returncode == 0 and invite.stdout.startswith("p2pnode-invite-1."), invite
    args = ["--model", "none", "--api-port", "0", "--listen", "/ip4/127.0.0.1/tcp/0"]
    wrong = _cli(["join", "--invite", invite.stdout.strip(), "--network", "main", *args,
                  "--home", str(tmp_path / "x")])  # fmt: skip
    assert wrong.returncode != 0 and "contradicts the invite" in wrong.stderr, wrong.stderr
    bootstrap = json.loads((tmp_path / "boot" / "runtime.json").read_text())["addrs"][0]
    other = _cli(["join", "--bootstrap", bootstrap, *args, "--home", str(tmp_path / "y")])
    assert other.returncode != 0, other.stdout
    assert "belongs to network 'lab', this node to 'main'" in other.stderr, other.stderr
    assert "Traceback" not in other.stderr, "a refused join says why, without a traceback"
