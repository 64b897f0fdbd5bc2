"""The runtime file a running node writes into its home, so local commands can find it.

``<home>/runtime.json`` holds the pid, peer id, full multiaddrs and the local HTTP API address.
It is removed on clean shutdown; a stale one (pid gone) is reported as "not running".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RUNTIME_FILE = "runtime.json"


def write_runtime(home: Path, info: dict[str, Any]) -> Path:
    path = home / RUNTIME_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **info}, indent=2))
    tmp.replace(path)
    return path


def remove_runtime(home: Path) -> None:
    (home / RUNTIME_FILE).unlink(missing_ok=True)


def read_runtime(home: Path) -> dict[str, Any] | None:
    """The running node's info, or None when no node runs with this home."""
    try:
        info = json.loads((home / RUNTIME_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    try:
        os.kill(int(info["pid"]), 0)
    except (ProcessLookupError, KeyError, ValueError):
        return None
    except PermissionError:
        pass
    return info
