"""Node records: a node's signed self-description, and the book of the newest one per peer.

Contract:
- ``NodeRecord`` validates its own fields on construction (``InvalidRecord``): bounded counts
  and lengths, roles within ``ROLES``, finite capacities, ``0 <= seq < 2**63``.
- ``sign_node_record`` seals it as a "node-record" envelope stamped with ``record.timestamp``;
  ``verify_node_record`` opens one (default max age 24 h), parses the payload strictly and
  requires the signer's peer id to be ``record.peer_id`` (``WrongSigner``). The returned
  record's ``timestamp`` is the signed envelope timestamp.
- ``seq`` orders records of one peer: ``new_node_record`` uses ``time.time_ns()`` (so it keeps
  growing across restarts, given a sane clock) and never repeats within a process.
- ``RecordBook.accept`` keeps the newest record per peer and raises ``StaleRecord`` for an older
  or replayed one (``seq`` not greater than the known one).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from p2pnode.identity.envelope import open_envelope, seal
from p2pnode.identity.errors import IdentityError, InvalidRecord, StaleRecord, WrongSigner
from p2pnode.identity.keys import NodeKey

NODE_RECORD_KIND = "node-record"
ROLES: frozenset[str] = frozenset({"router", "verifier", "edge", "bootstrap", "relay"})
NODE_RECORD_MAX_AGE = 24 * 3600.0
MAX_ADDRS = 32
MAX_MODELS = 64
MAX_CAPACITY_KEYS = 64
MAX_STR_LEN = 256
MAX_PEER_ID_LEN = 128
MAX_SEQ = 2**63 - 1
_FIELDS = ("peer_id", "addrs", "models", "roles", "capacity", "version", "seq")


@dataclass(frozen=True)
class NodeRecord:
    """What a node says about itself. Build with ``new_node_record``; fields are validated."""

    peer_id: str
    addrs: tuple[str, ...]
    models: tuple[str, ...]
    roles: frozenset[str]
    capacity: dict[str, float]
    version: str
    seq: int
    timestamp: float

    def __post_init__(self) -> None:
        _check_str("peer_id", self.peer_id, MAX_PEER_ID_LEN)
        object.__setattr__(self, "addrs", _str_tuple("addrs", self.addrs, MAX_ADDRS))
        object.__setattr__(self, "models", _str_tuple("models", self.models, MAX_MODELS))
        roles = _str_tuple("roles", self.roles, len(ROLES))
        if len(set(roles)) != len(roles) or not set(roles) <= ROLES:
            raise InvalidRecord(f"roles must be distinct values of {sorted(ROLES)}, got {roles}")
        object.__setattr__(self, "roles", frozenset(roles))
        object.__setattr__(self, "capacity", _capacity(self.capacity))
        _check_str("version", self.version, MAX_STR_LEN)
        if type(self.seq) is not int or not 0 <= self.seq <= MAX_SEQ:
            raise InvalidRecord(f"seq must be an int in [0, 2**63), got {self.seq!r}")
        if type(self.timestamp) not in (int, float) or not math.isfinite(self.timestamp):
            raise InvalidRecord(f"timestamp must be a finite number, got {self.timestamp!r}")
        object.__setattr__(self, "timestamp", float(self.timestamp))

    def to_payload(self) -> dict[str, Any]:
        """The signed payload (plain data); the timestamp travels in the envelope."""
        return {
            "peer_id": self.peer_id,
            "addrs": list(self.addrs),
            "models": list(self.models),
            "roles": sorted(self.roles),
            "capacity": dict(self.capacity),
            "version": self.version,
            "seq": self.seq,
        }


def _check_str(name: str, value: object, max_len: int) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise InvalidRecord(
            f"{name} must be a non-empty str of <= {max_len} chars, got {value!r:.80}"
        )


def _str_tuple(name: str, value: object, max_items: int) -> tuple[str, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidRecord(f"{name} must be a sequence of str, got {type(value).__name__}")
    items = tuple(value)
    if len(items) > max_items:
        raise InvalidRecord(f"{name} has {len(items)} entries, over the limit of {max_items}")
    for item in items:
        _check_str(f"{name} entry", item, MAX_STR_LEN)
    return items


def _capacity(value: object) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise InvalidRecord(f"capacity must be a dict[str, float], got {type(value).__name__}")
    if len(value) > MAX_CAPACITY_KEYS:
        raise InvalidRecord(
            f"capacity has {len(value)} keys, over the limit of {MAX_CAPACITY_KEYS}"
        )
    out: dict[str, float] = {}
    for key, number in value.items():
        _check_str("capacity key", key, MAX_STR_LEN)
        if type(number) not in (int, float) or not math.isfinite(number):
            raise InvalidRecord(f"capacity[{key!r}] must be a finite number, got {number!r:.40}")
        out[key] = float(number)
    return out


_seq_lock = threading.Lock()
_last_seq = 0


def _next_seq() -> int:
    global _last_seq
    with _seq_lock:
        _last_seq = max(time.time_ns(), _last_seq + 1)
        return _last_seq


def new_node_record(
    key: NodeKey,
    addrs: Iterable[str],
    models: Iterable[str],
    roles: Iterable[str],
    capacity: Mapping[str, float],
    version: str,
) -> NodeRecord:
    """A fresh record for ``key``'s node: ``seq`` from the wall clock (ns), timestamp now."""
    return NodeRecord(
        peer_id=key.peer_id,
        addrs=tuple(addrs),
        models=tuple(models),
        roles=frozenset(roles),
        capacity=dict(capacity),
        version=version,
        seq=_next_seq(),
        timestamp=time.time(),
    )


def sign_node_record(key: NodeKey, record: NodeRecord) -> bytes:
    """Seal ``record`` as a "node-record" envelope; ``key`` must be the record's own key."""
    if key.peer_id != record.peer_id:
        raise WrongSigner(f"key {key.peer_id} cannot sign the record of {record.peer_id}")
    return seal(key, NODE_RECORD_KIND, record.to_payload(), now=record.timestamp)


def verify_node_record(
    data: bytes, *, max_age: float = NODE_RECORD_MAX_AGE, now: float | None = None
) -> NodeRecord:
    """Open and check a signed node record (see module doc); raises ``IdentityError``s."""
    opened = open_envelope(data, NODE_RECORD_KIND, max_age=max_age, now=now)
    payload = opened.payload
    if not isinstance(payload, dict) or set(payload) != set(_FIELDS):
        got = sorted(map(str, payload)) if isinstance(payload, dict) else type(payload).__name__
        raise InvalidRecord(f"node record payload must have fields {sorted(_FIELDS)}, got {got}")
    for name in ("addrs", "models", "roles"):
        if not isinstance(payload[name], list):
            raise InvalidRecord(f"node record field {name} must be a list")
    if not isinstance(payload["capacity"], dict):
        raise InvalidRecord("node record field capacity must be a map")
    record = NodeRecord(**payload, timestamp=opened.timestamp)
    if record.peer_id != opened.peer_id:
        raise WrongSigner(
            f"node record claims peer {record.peer_id} but is signed by {opened.peer_id}"
        )
    return record


class RecordBook:
    """The newest accepted ``NodeRecord`` of each peer (not thread-safe; one trio task owns it)."""

    def __init__(self) -> None:
        self._records: dict[str, NodeRecord] = {}

    def accept(self, record: NodeRecord) -> NodeRecord:
        """Store ``record`` if it is newer than the known one; else raise ``StaleRecord``."""
        known = self._records.get(record.peer_id)
        if known is not None and record.seq <= known.seq:
            what = "a replay of" if record.seq == known.seq else "older than"
            raise StaleRecord(
                f"record seq {record.seq} of {record.peer_id} is {what} the known seq {known.seq}"
            )
        self._records[record.peer_id] = record
        return record

    def get(self, peer_id: str) -> NodeRecord | None:
        return self._records.get(peer_id)

    def forget(self, peer_id: str) -> None:
        """Drop a peer's record (e.g. after it left); a later record of any seq is then new."""
        self._records.pop(peer_id, None)

    def records(self) -> list[NodeRecord]:
        return list(self._records.values())

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._records

    @staticmethod
    def select_newest(records: list[NodeRecord]) -> int:
        """Index of the record with the highest ``seq`` (the first one on a tie)."""
        if not records:
            raise IdentityError("select_newest needs at least one record")
        best = 0
        for i, record in enumerate(records):
            if record.seq > records[best].seq:
                best = i
        return best
