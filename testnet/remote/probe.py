"""What a host says about itself before a trial: ``python -m p2pnode.testnet.remote.probe``.

Prints one JSON object: ``hostname``, ``version``, ``fingerprint`` (``code_fingerprint()``), ``commit`` (of the git
checkout the code runs from, if any), ``python``, ``platform``, ``cpus``, ``memory_bytes``.
The controller runs the same function on itself: two hosts with one fingerprint run the
same p2pnode code, however it was installed (a wheel, an editable checkout). Then, for each
line it reads on stdin, it prints its clock (``time.time()``) at once: the controller times
these exchanges alone, so neither SSH's handshake nor Python's start-up skews the offset.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# The packages of the distribution (pyproject.toml's [tool.setuptools] packages; a test keeps
# the two lists equal). Each one's own .py files are hashed, so an editable checkout and the
# wheel built from it give one fingerprint.
PACKAGES = (
    "p2pnode",
    "p2pnode.identity",
    "p2pnode.datasets",
    "p2pnode.overlay",
    "p2pnode.overlay.net",
    "p2pnode.overlay.net.patches",
    "p2pnode.overlay.cache",
    "p2pnode.overlay.trust",
    "p2pnode.overlay.routing",
    "p2pnode.overlay.serve",
    "p2pnode.inference",
    "p2pnode.inference._cpu",
    "p2pnode.inference.vllm",
    "p2pnode.speculation",
    "p2pnode.bootstrap",
    "p2pnode.bootstrap.api",
    "p2pnode.bootstrap.console",
    "p2pnode.testing",
    "p2pnode.testnet",
    "p2pnode.testnet.run",
    "p2pnode.testnet.workload",
    "p2pnode.testnet.adversary",
    "p2pnode.testnet.report",
    "p2pnode.testnet.netns",
    "p2pnode.testnet.remote",
    "p2pnode.testnet.sim",
)


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def code_fingerprint() -> str:
    digest = hashlib.sha256()
    for name in PACKAGES:
        where = _package_dir(name)
        digest.update(f"[{name}]".encode())
        if where is None:
            continue
        for path in sorted(where.glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def code_commit() -> str | None:
    """The commit of the git checkout p2pnode runs from (``+dirty`` with local changes)."""
    where = _package_dir("p2pnode.testnet")
    if where is None:
        return None
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10)  # fmt: skip
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip()[:12] + ("+dirty" if dirty.stdout.strip() else "")


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def describe() -> dict[str, Any]:
    from p2pnode import __version__

    return {
        "hostname": socket.gethostname(),
        "version": __version__,
        "fingerprint": code_fingerprint(),
        "commit": code_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
    }


def main() -> None:
    print(json.dumps(describe()), flush=True)
    for _line in sys.stdin:
        print(repr(time.time()), flush=True)


if __name__ == "__main__":
    main()
