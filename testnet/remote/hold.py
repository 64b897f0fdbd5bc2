"""What a trial node runs under on its host: it lives exactly as long as its SSH session.

``python -m p2pnode.testnet.remote.hold --run RUN --dir DIR -- ARGV...`` starts ARGV (a
``p2pnode`` command) in a session of its own, with its output in ``DIR/node.log`` and its pid,
process group and run id in ``DIR/node.pid``, and ``P2PNODE_TRIAL_RUN=RUN`` in its
environment. It then reads its stdin, which the controller's SSH session feeds with a
heartbeat byte every ``HEARTBEAT_S``: on end of file (the session closed: the controller
stopped, crashed or lost the link), on ``SILENCE_S`` (``--silence-s``) without a byte (a
link that hangs without closing), on SIGTERM / SIGHUP, or when the node exits, it stops the node's process
group (SIGTERM, SIGKILL after ``STOP_GRACE_S``) and exits with the node's status.

``python -m p2pnode.testnet.remote.hold --signal KILL --dir DIR`` sends a signal to the
node's process group (a trial's fault injection: ``kill`` churn events); the wrapper then sees
the node exit and ends its session.

``python -m p2pnode.testnet.remote.hold --cleanup WORKDIR`` is the pass a controller runs
first on every host: any process still running from a pid file under ``WORKDIR/*/*/`` whose
environment carries that file's run id (so a reused pid is never hit) gets its group
SIGKILLed; prints ``{"killed": [...]}``. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HEARTBEAT_S = 2.0
SILENCE_S = 30.0
STOP_GRACE_S = 15.0
RUN_ENV = "P2PNODE_TRIAL_RUN"
PID_FILE = "node.pid"


class _Stop(Exception):
    pass


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(f"signal {signum}")


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
    with contextlib.suppress(ProcessLookupError):  # what the node started, if it lingers
        os.killpg(proc.pid, signal.SIGKILL)


def _watch(proc: subprocess.Popen, silence_s: float) -> str:
    """Block until the node should stop; returns why."""
    last = time.monotonic()
    fd = sys.stdin.fileno()
    while True:
        if proc.poll() is not None:
            return f"the node exited with {proc.returncode}"
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            if not os.read(fd, 4096):
                return "the SSH session closed"
            last = time.monotonic()
        elif time.monotonic() - last > silence_s:
            return f"no heartbeat for {silence_s:g} s"


def hold(run: str, workdir: Path, argv: Sequence[str], silence_s: float = SILENCE_S) -> int:
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGHUP, _raise_stop)
    pid_file = workdir / PID_FILE
    with (workdir / "node.log").open("ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, RUN_ENV: run, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    pid_file.write_text(json.dumps({"pid": proc.pid, "run": run}) + "\n")
    print(f"hold: node pid {proc.pid} (run {run})", flush=True)
    try:
        why = _watch(proc, silence_s)
    except (_Stop, KeyboardInterrupt) as exc:
        why = f"stopped ({exc})"
    print(f"hold: stopping the node: {why}", flush=True)
    _stop_group(proc)
    pid_file.unlink(missing_ok=True)
    return proc.returncode if proc.returncode is not None else 1


def _runs_in(pid: int, run: str) -> bool:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{RUN_ENV}={run}".encode() in env


def cleanup(workdir: Path) -> list[dict[str, object]]:
    killed: list[dict[str, object]] = []
    for pid_file in sorted(workdir.glob(f"*/*/{PID_FILE}")):
        try:
            info = json.loads(pid_file.read_text())
            pid, run = int(info["pid"]), str(info["run"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _runs_in(pid, run):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
                killed.append({"pid": pid, "run": run, "node": pid_file.parent.name})
        pid_file.unlink(missing_ok=True)
    return killed


def signal_node(workdir: Path, name: str) -> int:
    """Send SIG<name> to the node of ``workdir``'s pid file; 1 when none runs there."""
    try:
        info = json.loads((workdir / PID_FILE).read_text())
        pid, run = int(info["pid"]), str(info["run"])
    except (OSError, ValueError, KeyError, TypeError):
        print(f"no running node in {workdir}", file=sys.stderr)
        return 1
    if not _runs_in(pid, run):
        print(f"pid {pid} is not this run's node", file=sys.stderr)
        return 1
    os.killpg(pid, getattr(signal, f"SIG{name}"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2pnode.testnet.remote.hold")
    parser.add_argument("--run", help="the trial's run id")
    parser.add_argument("--dir", help="the node's folder (log, pid file)")
    parser.add_argument("--cleanup", metavar="WORKDIR", help="kill leftovers of earlier runs")
    parser.add_argument("--signal", choices=("KILL", "TERM", "STOP", "CONT"), help="to the node")
    parser.add_argument(
        "--silence-s", type=float, default=SILENCE_S, help="stop after this long without a byte"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.cleanup:
        print(json.dumps({"killed": cleanup(Path(args.cleanup).expanduser())}))
        return 0
    if args.signal and args.dir:
        return signal_node(Path(args.dir).expanduser(), args.signal)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not (args.run and args.dir and command):
        parser.error("give --run, --dir and -- COMMAND (or --cleanup WORKDIR)")
    return hold(args.run, Path(args.dir).expanduser(), command, args.silence_s)


if __name__ == "__main__":
    sys.exit(main())
