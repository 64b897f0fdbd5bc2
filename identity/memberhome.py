"""What a node of a closed network keeps in its home: its membership, the revocations it
knows, the uses of the invites it redeemed, and revocations handed over by ``p2pnode revoke``.

Why files: a member restarted must not need a new invite, a revoked peer must stay revoked
after a restart, and an invite of N uses must not give N more after one.

Contract (``MemberHome(home)``; every write is atomic: temp file + rename, mode 0600):
- ``membership`` / ``save_membership(raw)``: ``home/membership`` (signed bytes) or None.
- ``revocations()`` / ``save_revocations(raws)``: ``home/revocations`` (CBOR list of signed
  revocations, at most ``MAX_REVOCATIONS``; the verifier decides which are valid).
- ``GrantLedger`` (``home/invite_uses``): ``redeem(nonce, peer_id, max_uses) -> bool`` counts
  distinct peers per invite, persisted before it answers; the same peer redeeming again is
  not a new use (a joiner that lost its membership file).
- The revoke inbox: ``post_revocation(raw)`` (the CLI) drops a file in ``home/revoke-inbox/``;
  ``take_posted()`` (the running node) returns and removes them, so no two writers ever share
  one file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from p2pnode.identity import plaincbor
from p2pnode.identity.membership import MAX_CREDENTIAL_SIZE

__all__ = ["MAX_REVOCATIONS", "GrantLedger", "MemberHome"]

MEMBERSHIP_FILE = "membership"
REVOCATIONS_FILE = "revocations"
USES_FILE = "invite_uses"
INBOX_DIR = "revoke-inbox"
MAX_REVOCATIONS = 4096
MAX_GRANTS = 4096
MAX_INBOX = 64


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)


def _read(path: Path, limit: int) -> bytes | None:
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        return None
    return data if len(data) <= limit else None


class MemberHome:
    """The closed-network files of one node's home (module contract)."""

    def __init__(self, home: Path) -> None:
        self.home = Path(home)

    @property
    def membership(self) -> bytes | None:
        return _read(self.home / MEMBERSHIP_FILE, MAX_CREDENTIAL_SIZE)

    def save_membership(self, raw: bytes) -> None:
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        _write(self.home / MEMBERSHIP_FILE, raw)

    def revocations(self) -> list[bytes]:
        data = _read(self.home / REVOCATIONS_FILE, MAX_REVOCATIONS * (MAX_CREDENTIAL_SIZE + 8))
        if data is None:
            return []
        try:
            items = plaincbor.decode(data)
        except plaincbor.PlainCBORError:
            return []
        if not isinstance(items, list):
            return []
        return [r for r in items[:MAX_REVOCATIONS] if isinstance(r, bytes)]

    def save_revocations(self, raws: list[bytes]) -> None:
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        _write(self.home / REVOCATIONS_FILE, plaincbor.encode(list(raws[:MAX_REVOCATIONS])))

    def post_revocation(self, raw: bytes) -> Path:
        inbox = self.home / INBOX_DIR
        inbox.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = inbox / f"{secrets.token_hex(8)}.rev"
        _write(path, raw)
        return path

    def take_posted(self) -> list[bytes]:
        inbox = self.home / INBOX_DIR
        try:
            names = sorted(p for p in inbox.iterdir() if p.suffix == ".rev")[:MAX_INBOX]
        except FileNotFoundError:
            return []
        out = []
        for path in names:
            data = _read(path, MAX_CREDENTIAL_SIZE)
            path.unlink(missing_ok=True)
            if data is not None:
                out.append(data)
        return out


class GrantLedger:
    """Uses of the invites this node redeemed, persisted in ``home/invite_uses``."""

    def __init__(self, home: Path | None) -> None:
        # No home (tests, in-memory nodes): counted for this run only.
        self._path = Path(home) / USES_FILE if home is not None else None
        self._uses: dict[bytes, list[str]] = {}
        data = _read(self._path, 1 << 24) if self._path is not None else None
        if data is not None:
            try:
                loaded = plaincbor.decode(data)
            except plaincbor.PlainCBORError:
                loaded = {}
            if isinstance(loaded, dict):
                for nonce, peers in loaded.items():
                    if isinstance(nonce, bytes) and isinstance(peers, list):
                        self._uses[nonce] = [p for p in peers if isinstance(p, str)]

    def used(self, nonce: bytes) -> int:
        return len(self._uses.get(nonce, ()))

    def redeem(self, nonce: bytes, peer_id: str, max_uses: int | None) -> bool:
        """Count ``peer_id``'s use of invite ``nonce``; False when its uses are spent."""
        peers = self._uses.get(nonce, [])
        if peer_id in peers:
            return True
        if max_uses is not None and len(peers) >= max_uses:
            return False
        if nonce not in self._uses and len(self._uses) >= MAX_GRANTS:
            return False
        self._uses[nonce] = [*peers, peer_id]
        if self._path is None:
            return True
        self._path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _write(self._path, plaincbor.encode(self._uses))
        return True
