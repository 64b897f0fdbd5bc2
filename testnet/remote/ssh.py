"""The system OpenSSH client, driven for a trial: one generated ssh_config per run.

Why OpenSSH and not a Python SSH library: the client a researcher already uses reads their
keys, agent, ``~/.ssh/config`` (``[ssh] config`` includes it), jump hosts and known hosts as
it always does, adds no dependency, and forwards the node's API with ``-L`` in the same
session that runs the node, so the tunnel lives and dies with it.

Contract:
- ``SshClient(inventory, run_dir)`` writes ``run_dir/ssh_config``: one ``Host p2p-<name>``
  block per inventory host (address, user, port, ``ProxyJump`` through another host's block
  or the given destination; hosts behind a jump are known by their block name in known_hosts,
  as private addresses repeat across sites), then the inventory's ``[ssh]`` settings and
  ``BatchMode`` (never a password prompt), keep-alives and ``ExitOnForwardFailure``.
- ``run(host, command, timeout)`` runs a shell command line there -> stdout
  (``SshError`` with stderr's tail on failure or timeout); ``start(host, command, log,
  forward=(local_port, remote_port))`` starts a session (stdin a pipe: the controller's
  heartbeat, see ``hold.py``) whose output goes to ``log``.
- ``pipe(host, command)``: a session whose stdin and stdout are text pipes (the probe's
  clock exchange).
- ``rpath(path)`` quotes a remote path for the remote shell, ``~/...`` as ``"$HOME"/...``.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from p2pnode.errors import P2PNodeError
from p2pnode.testnet.remote.inventory import Host, Inventory

__all__ = ["SshClient", "SshError", "alias", "rpath", "ssh_available"]


class SshError(P2PNodeError, RuntimeError):
    """An SSH command failed or timed out; the message names the host and the reason."""

    reason = "ssh_failed"


def ssh_available() -> str | None:
    """None when the OpenSSH client is installed, else what to install."""
    if shutil.which("ssh") is None:
        return "trials on an inventory need the OpenSSH client `ssh` (Debian: openssh-client)"
    return None


def alias(host: Host) -> str:
    return f"p2p-{host.name}"


def rpath(path: str) -> str:
    """A remote path for the remote shell: ``~`` expands to the login's home there."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def _config_text(inv: Inventory) -> str:
    names = {h.name for h in inv.hosts}
    lines = ["# written by p2pnode testnet for one run; see testnet/remote/ssh.py", ""]
    for h in inv.hosts:
        lines += [f"Host {alias(h)}", f"  HostName {h.address}", f"  User {h.user}"]
        lines.append(f"  Port {h.port}")
        if h.jump:
            jump = f"p2p-{h.jump}" if h.jump in names else h.jump
            lines += [f"  ProxyJump {jump}", f"  HostKeyAlias {alias(h)}"]
        lines.append("")
    o = inv.ssh
    lines.append("Host *")
    lines += ["  BatchMode yes", f"  StrictHostKeyChecking {o.strict_host_keys}"]
    lines.append(f"  ConnectTimeout {max(1, round(o.connect_timeout_s))}")
    # A dead link is noticed in ~15 s here; the remote side notices by the heartbeat.
    lines += ["  ServerAliveInterval 5", "  ServerAliveCountMax 3", "  ExitOnForwardFailure yes"]
    lines += ["  LogLevel ERROR"]
    if o.identity_file:
        path = Path(o.identity_file).expanduser()
        lines += [f'  IdentityFile "{path}"', "  IdentitiesOnly yes"]
    if o.known_hosts:
        lines.append(f'  UserKnownHostsFile "{Path(o.known_hosts).expanduser()}"')
    if o.config:  # last: the user's own settings fill in what is not set above
        lines += ["", f'Include "{Path(o.config).expanduser()}"']
    return "\n".join(lines) + "\n"


class SshClient:
    def __init__(self, inventory: Inventory, run_dir: Path) -> None:
        self.inventory = inventory
        run_dir.mkdir(parents=True, exist_ok=True)
        self.config = run_dir / "ssh_config"
        self.config.write_text(_config_text(inventory))

    def argv(
        self, host: Host, command: str, *, forward: tuple[int, int] | None = None
    ) -> list[str]:
        args = ["ssh", "-F", str(self.config), "-o", "ForwardAgent=no"]
        if forward is not None:
            local, remote = forward
            args += ["-L", f"127.0.0.1:{local}:127.0.0.1:{remote}"]
        return [*args, alias(host), "--", command]

    def run(
        self, host: Host, command: str, *, timeout: float = 60.0, stdin: bytes | None = None
    ) -> str:
        try:
            done = subprocess.run(
                self.argv(host, command),
                input=stdin,
                capture_output=True,
                timeout=timeout,
                stdin=None if stdin is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise SshError(f"{host.name}: no answer over SSH within {timeout:.0f} s") from None
        if done.returncode != 0:
            err = done.stderr.decode(errors="replace").strip()[-1500:]
            what = "SSH connection failed" if done.returncode == 255 else "command failed"
            raise SshError(f"{host.name}: {what} (exit {done.returncode}): {err}")
        return done.stdout.decode(errors="replace")

    def pipe(self, host: Host, command: str) -> subprocess.Popen:
        """A session with its stdin and stdout as pipes (text, line-buffered)."""
        return subprocess.Popen(
            self.argv(host, command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,
        )

    def start(
        self, host: Host, command: str, log: Path, *, forward: tuple[int, int] | None = None
    ) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            return subprocess.Popen(
                self.argv(host, command, forward=forward),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the controller, which tears down
            )


def python_command(host: Host, module: str, args: Sequence[str]) -> str:
    """``<host's python> -m module args`` as a remote shell command line."""
    return " ".join([rpath(host.env.interpreter), "-m", module, *map(shlex.quote, args)])
