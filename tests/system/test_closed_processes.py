"""A closed network across real ``p2pnode`` processes: ``bootstrap`` (closed by default),
``invite``, ``join --bootstrap INVITE``, refusals in one clear line, and ``revoke``."""

from __future__ import annotations

import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from p2pnode.bootstrap.invite import make_invite
from p2pnode.identity.membership import Issuer, issue_grant, load_network_key
from p2pnode.overlay.net.config import VERSION

from testkit import wait_until

P2PNODE = [sys.executable, "-m", "p2pnode.bootstrap.cli"]
JOIN = ["join", "--model", "none", "--api-port", "0", "--listen", "/ip4/127.0.0.1/tcp/0"]


def _cli(args: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*P2PNODE, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def _status(api: str) -> dict:
    return httpx.get(api + "/status", timeout=2.0).json()


def _error_line(out: subprocess.CompletedProcess) -> str:
    """The one line a refused join ends with (click's ``Error: ...``)."""
    assert out.returncode != 0, out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    return out.stderr.strip().splitlines()[-1]


@pytest.mark.slow
async def test_invite_join_refusals_and_revoke(tmp_path: Path, node_processes) -> None:
    boot_home = tmp_path / "boot"
    boot = node_processes.spawn(["bootstrap"], boot_home)
    boot_info = node_processes.runtime(boot_home, boot)
    assert boot_info["closed"] is True
    assert stat.S_IMODE((boot_home / "network_key").stat().st_mode) == 0o600

    invite = _cli(["invite", "--home", str(boot_home), "--uses", "1"])
    assert invite.returncode == 0, invite.stderr
    text = invite.stdout.strip()
    member_home = tmp_path / "member"
    member = node_processes.spawn(["join", "--model", "none", "--bootstrap", text], member_home)
    member_info = node_processes.runtime(member_home, member)
    assert member_info["closed"] is True and (member_home / "membership").exists()
    await wait_until(
        lambda: (
            member_info["peer_id"]
            in {p["peer_id"] for p in _status(boot_info["api"])["peers"] if p["state"] == "up"}
        ),
        20,
        "the bootstrap sees the member up",
    )

    # The invite's one use is spent: another joiner is told so, in one line.
    spent = _cli([*JOIN, "--bootstrap", text, "--home", str(tmp_path / "second")])
    assert "uses are spent" in _error_line(spent), spent.stderr
    # An expired invite is refused before anything is dialed.
    # (made here with the bootstrap's key, as `invite --expires` would have, a minute ago)
    grant = issue_grant(
        Issuer(load_network_key(boot_home)), boot_info["peer_id"], ttl=1, now=time.time() - 60
    )
    expired = make_invite(
        "main", VERSION, boot_info["addrs"], network_key=grant.network, grant=grant.raw
    )
    late = _cli([*JOIN, "--bootstrap", expired, "--home", str(tmp_path / "late")])
    assert "invite has expired" in _error_line(late), late.stderr
    # A damaged invite, and a plain address without a membership.
    damaged = _cli([*JOIN, "--bootstrap", text[:-12], "--home", str(tmp_path / "damaged")])
    assert "damaged" in _error_line(damaged) or "cut short" in _error_line(damaged)
    stranger = _cli(
        [*JOIN, "--bootstrap", boot_info["addrs"][0], "--home", str(tmp_path / "stranger")]
    )
    assert "no membership of this closed network" in _error_line(stranger), stranger.stderr

    # Restarted with a plain address, the member reuses the membership in its home.
    member.terminate()
    member.wait(timeout=15)
    member = node_processes.spawn(
        ["join", "--model", "none", "--bootstrap", boot_info["addrs"][0]], member_home
    )
    member_info = node_processes.runtime(member_home, member)
    assert member_info["closed"] is True
    await wait_until(
        lambda: (
            boot_info["peer_id"]
            in {p["peer_id"] for p in _status(member_info["api"])["peers"] if p["state"] == "up"}
        ),
        20,
        "the restarted member is back in",
    )

    revoked = _cli(["revoke", "--home", str(boot_home), member_info["peer_id"]])
    assert revoked.returncode == 0, revoked.stderr
    await wait_until(
        lambda: member_info["peer_id"] in _status(boot_info["api"])["refused"],
        10,
        "the bootstrap refuses the revoked member",
    )
    assert (boot_home / "revocations").exists()


@pytest.mark.slow
async def test_a_second_bootstrap_joins_as_admin_and_invites(
    tmp_path: Path, node_processes
) -> None:
    first_home, second_home, member_home = tmp_path / "b1", tmp_path / "b2", tmp_path / "m"
    first = node_processes.spawn(["bootstrap"], first_home)
    first_info = node_processes.runtime(first_home, first)
    admin_invite = _cli(["invite", "--home", str(first_home), "--admin", "--uses", "1"])
    assert admin_invite.returncode == 0, admin_invite.stderr
    second = node_processes.spawn(
        ["bootstrap", "--bootstrap", admin_invite.stdout.strip()], second_home
    )
    second_info = node_processes.runtime(second_home, second)
    assert second_info["closed"] and not (second_home / "network_key").exists()
    # The admin member invites; its joiner is a member for the first bootstrap too.
    invite = _cli(["invite", "--home", str(second_home)])
    assert invite.returncode == 0, invite.stderr
    no_admins = _cli(["invite", "--home", str(second_home), "--admin"])
    assert "cannot make admins" in _error_line(no_admins)
    member = node_processes.spawn(
        ["join", "--model", "none", "--bootstrap", invite.stdout.strip()], member_home
    )
    member_info = node_processes.runtime(member_home, member)
    await wait_until(
        lambda: (
            member_info["peer_id"]
            in {p["peer_id"] for p in _status(first_info["api"])["peers"] if p["state"] == "up"}
        ),
        20,
        "the first bootstrap admits the member the admin invited",
    )
