"""A fork server for a trial's node processes: import once, fork each node.

Why: an emulated node spends most of its start-up CPU importing (libp2p alone ~0.7 s on an
idle core) and parsing the tokenizer; 64 nodes starting at once on 2 shared cores spent a
minute doing the same imports 64 times before any of them could join. Forked from a process
that has done it, a node is serving in a fraction of a second, and the imported pages stay
shared between the nodes (copy-on-write) instead of being private to each.

Contract:
- ``Zygote.start(env)`` starts ``python -m p2pnode.testnet.run.zygote SOCKET`` with ``env``; it
  imports the node's modules and loads the light model (``PRELOAD``), then answers on a Unix
  socket. No trio loop, thread or connection exists in it before it forks.
- ``zygote.spawn(argv, env, log_path, cwd)`` -> ``ForkedProc``: a child that runs
  ``p2pnode.testnet.run.node.main(argv)`` (the trial node entry point; ``entry`` names another
  module whose ``main(argv)`` runs instead, e.g. ``p2pnode.bootstrap.cli``, the plain ``p2pnode``
  command line) in its own session, with
  ``env`` as its environment and stdout/stderr appended to ``log_path``. ``ForkedProc`` has
  the ``subprocess.Popen`` surface the launcher uses (``pid``, ``poll``, ``wait``,
  ``send_signal``, ``terminate``, ``kill``, ``returncode``); it follows the child through a
  pidfd (it is the zygote's child, not ours) and reads its exit status from the file the
  zygote writes when it reaps it.
- ``zygote.close()`` stops the server (children it forked keep running until stopped).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from p2pnode.errors import P2PNodeError

# What every emulated node imports anyway; a real-compute node would add torch, which is
# never loaded here (fork after torch's thread pools start is unsafe).
PRELOAD = (
    "p2pnode.testnet.run.node",
    "p2pnode.testnet.netns.wan",
    "p2pnode.bootstrap.config",
    "p2pnode.bootstrap.cli",  # the plain command line, for benchmarks that fork it
    "p2pnode.bootstrap.node",
    "p2pnode.bootstrap.api",
    "p2pnode.overlay.net.node",
    "p2pnode.overlay.serve.forward",
    "p2pnode.overlay.serve.service",
    "p2pnode.overlay.net.relay",
    "p2pnode.overlay.net.reachability",
    "p2pnode.overlay.cache.antientropy",
    "p2pnode.overlay.trust.audit",
    "p2pnode.inference.engine",
    "p2pnode.inference.tokenizer",
    "hypercorn.trio",
)


# The module whose ``main(argv)`` a forked child runs unless ``spawn`` names another. A name,
# not an import: the fork server runs the trials' node and the product's command line alike,
# and neither becomes an import of this module (the command line imports the trials).
TRIAL_NODE = "p2pnode.testnet.run.node"


class ZygoteError(P2PNodeError, RuntimeError):
    """The fork server did not start or refused a request; the message says why."""

    reason = "zygote_failed"


class ForkedProc:
    """A node forked by the zygote, with the ``Popen`` surface the launcher uses."""

    def __init__(self, pid: int, exit_file: Path) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exit_file = exit_file
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._fd = None  # already gone and reaped

    def _exited(self, timeout: float) -> bool:
        if self._fd is None:
            return True
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout))
        return bool(ready)

    def _collect(self) -> int:
        deadline = time.monotonic() + 2.0  # the zygote writes the status as it reaps
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                self.returncode = int(self._exit_file.read_text())
                break
            time.sleep(0.02)
        else:
            self.returncode = -1  # reaped without a word: unknown status
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        return self._collect() if self._exited(0.0) else None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if not self._exited(1e9 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self._collect()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._fd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._fd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """Client of one fork server (see the module contract)."""

    def __init__(self, proc: subprocess.Popen, path: Path, workdir: Path) -> None:
        self.proc = proc
        self.path = path
        self.workdir = workdir
        self._n = 0

    @classmethod
    def start(cls, env: Mapping[str, str], timeout_s: float = 120.0) -> Zygote:
        workdir = Path(tempfile.mkdtemp(prefix="p2pnode-zygote-"))
        path = workdir / "zygote.sock"
        log = (workdir / "zygote.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "p2pnode.testnet.run.zygote", str(path)],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                tail = (workdir / "zygote.log").read_text(errors="replace")[-2000:]
                raise ZygoteError(f"the node fork server did not start:\n{tail}")
            time.sleep(0.05)
        return cls(proc, path, workdir)

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        cwd: Path | None = None,
        *,
        entry: str = TRIAL_NODE,
    ) -> ForkedProc:
        self._n += 1
        exit_file = self.workdir / f"exit-{self._n}"
        request = {
            "argv": list(argv),
            "env": dict(env),
            "log": str(log_path),
            "cwd": str(cwd or Path.cwd()),
            "exit_file": str(exit_file),
            "entry": entry,
        }
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30.0)
            sock.connect(str(self.path))
            sock.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(sock.makefile("rb").readline() or b"{}")
        if "pid" not in reply:
            raise ZygoteError(f"the node fork server refused: {reply.get('error', reply)}")
        return ForkedProc(int(reply["pid"]), exit_file)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            self.path.unlink()


# ---------------------------------------------------------------------------- server side


def _child(request: dict, server: socket.socket) -> None:
    """In the forked child: become the node (never returns)."""
    code = 1
    try:
        server.close()
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(request["cwd"])
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - own streams
        os.environ.clear()
        os.environ.update(request["env"])
        main = importlib.import_module(request.get("entry") or TRIAL_NODE).main
        sys.argv = ["p2pnode", *request["argv"]]
        main(request["argv"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child must never return into the server
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(exit_files: dict[int, str]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = exit_files.pop(pid, None)
        if path is not None:
            with contextlib.suppress(OSError):
                Path(path).write_text(str(os.waitstatus_to_exitcode(status)))


def serve(path: str) -> None:
    for name in PRELOAD:
        __import__(name)
    from p2pnode.inference.models import ModelLoadError, preload_light_model

    with contextlib.suppress(ModelLoadError):
        preload_light_model(None)  # the default model's tokenizer, shared by every child
    exit_files: dict[int, str] = {}
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    server.bind(tmp)
    server.listen(64)
    os.rename(tmp, path)  # the client waits for the name: bound and listening by then
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        ready, _, _ = select.select([server], [], [], 0.5)
        _reap(exit_files)
        if not ready:
            continue
        conn, _ = server.accept()
        with conn:
            try:
                request = json.loads(conn.makefile("rb").readline())
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    _child(request, server)
                exit_files[pid] = request["exit_file"]
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            except (OSError, ValueError, KeyError) as exc:
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"error": repr(exc)}).encode() + b"\n")


if __name__ == "__main__":
    serve(sys.argv[1])
