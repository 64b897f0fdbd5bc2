"""Trust kept in the node's home, so a restart does not forgive a liar.

Contract:
- ``load_trust(book, path)`` folds ``path`` (JSON written by ``save_trust``) into ``book`` and
  returns how many peers it restored; a missing file restores nothing. A file that is not
  valid is renamed to ``<name>.bad`` (kept for a look, never silently overwritten) and
  nothing is restored, with a warning saying so.
- ``save_trust(book, path)`` writes atomically (temporary file + rename, mode 0600).
- ``await keep_trust_saved(book, path, interval_s=30)`` saves every ``interval_s`` and once
  more when cancelled (the node's shutdown).
- A new key is a new identity: it starts on probation (``overlay/trust/audit.py``) whatever the
  old key did, so coming back under a new key buys a liar nothing but a fresh probation.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import trio

from p2pnode.overlay.trust.book import TrustBook

log = logging.getLogger("p2pnode.overlay.trust.store")

TRUST_FILE = "trust.json"
_FORMAT = 1


def load_trust(book: TrustBook, path: Path) -> int:
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return 0
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"not a trust file of format {_FORMAT}")
        peers = data.get("peers")
        if not isinstance(peers, dict):
            raise ValueError("no 'peers' object")
        return book.restore(peers)
    except ValueError as exc:
        bad = path.with_name(path.name + ".bad")
        path.replace(bad)
        log.warning("trust file %s is not valid (%s): moved to %s, starting fresh", path, exc, bad)
        return 0


def save_trust(book: TrustBook, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    body = json.dumps({"format": _FORMAT, "peers": book.export()}, sort_keys=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(body)
    tmp.replace(path)


async def keep_trust_saved(book: TrustBook, path: Path, interval_s: float = 30.0) -> None:
    try:
        while True:
            await trio.sleep(interval_s)
            save_trust(book, path)
    finally:
        save_trust(book, path)  # synchronous: runs even when the node is being cancelled
