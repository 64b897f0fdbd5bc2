"""Signed envelopes: one format for everything a node signs.

Wire form (canonical CBOR map)::

    {"v": 1, "body": bstr, "signer": bstr(32), "sig": bstr(64)}
    body = canonical CBOR of [kind: str, timestamp: float (unix s), payload: plain data]
    sig  = Ed25519(signer, b"p2pnode/v1/" + kind + b"\\0" + body)

The signature covers ``body`` exactly as sent, so the verifier never re-encodes anything, and
the domain tag makes a signature for one kind useless as any other kind (or as a signature of
something outside this protocol).

Contract of ``open_envelope``: checks, in this order, size (before decoding), kind registered,
CBOR and field types, the expected signer, the signature, the body, then the timestamp window;
and raises ``EnvelopeTooLarge``/``MalformedEnvelope``, ``UnknownKind``, ``WrongSigner``,
``BadSignature``, ``ExpiredEnvelope`` (all ``IdentityError``). Payloads are plain data
(see ``p2pnode.identity.plaincbor``). ``peek_timestamp`` reads the stamp without verifying
anything, for dropping what is too old before paying for the checks.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

from p2pnode.identity import plaincbor
from p2pnode.identity.errors import (
    BadSignature,
    EnvelopeTooLarge,
    ExpiredEnvelope,
    IdentityError,
    MalformedEnvelope,
    UnknownKind,
    WrongSigner,
)
from p2pnode.identity.keys import (
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    NodeKey,
    peer_id_from_public_key,
    verify_signature,
)

ENVELOPE_VERSION = 1
DOMAIN_PREFIX = b"p2pnode/v1/"
MAX_FUTURE_SKEW = 60.0
DEFAULT_MAX_AGE = 300.0
DEFAULT_MAX_SIZE = 1 << 20

KINDS: frozenset[str] = frozenset(
    {
        "node-record",
        "digest",
        "digest-pull",
        "forward-request",
        "forward-response",
        "verify-open",
        "verify-block",
        "verify-result",
        "push-back",
    }
)
_registered: set[str] = set()
_KIND_RE = re.compile(r"[a-z0-9][a-z0-9.-]{0,62}")
_ENVELOPE_KEYS = frozenset({"v", "body", "signer", "sig"})


def register_kind(name: str) -> None:
    """Allow envelopes of kind ``name`` (lowercase letters, digits, '-', '.'; <= 63 chars)."""
    if not isinstance(name, str) or not _KIND_RE.fullmatch(name):
        raise UnknownKind(
            f"invalid envelope kind {name!r}: use 1-63 chars of [a-z0-9.-], starting alphanumeric"
        )
    _registered.add(name)


def known_kinds() -> frozenset[str]:
    """``KINDS`` plus every kind added with ``register_kind``."""
    return KINDS | _registered


def _require_kind(kind: object) -> str:
    if not isinstance(kind, str) or (kind not in KINDS and kind not in _registered):
        raise UnknownKind(
            f"envelope kind {kind!r} is not registered; known: {sorted(known_kinds())} "
            "(call register_kind() at import time to add one)"
        )
    return kind


def domain_tag(kind: str) -> bytes:
    """The bytes prefixed to a body before signing it as ``kind``."""
    return DOMAIN_PREFIX + kind.encode() + b"\0"


@dataclass(frozen=True)
class Opened:
    """A verified envelope: ``signer`` is the raw public key, ``peer_id`` its libp2p id."""

    kind: str
    payload: Any
    signer: bytes
    peer_id: str
    timestamp: float


def seal(key: NodeKey, kind: str, payload: Any, *, now: float | None = None) -> bytes:
    """Sign ``payload`` (plain data) as ``kind`` with ``key``, stamped ``now`` (default: now)."""
    _require_kind(kind)
    timestamp = float(time.time() if now is None else now)
    if not math.isfinite(timestamp):
        raise MalformedEnvelope(f"timestamp must be finite, got {timestamp}")
    try:
        body = plaincbor.encode([kind, timestamp, payload])
    except plaincbor.PlainCBORError as exc:
        raise MalformedEnvelope(f"payload of kind {kind!r} cannot be sealed: {exc}") from exc
    sig = key.sign(domain_tag(kind) + body)
    return plaincbor.encode(
        {"v": ENVELOPE_VERSION, "body": body, "signer": key.public_key, "sig": sig}
    )


def peek_timestamp(data: bytes, max_size: int = DEFAULT_MAX_SIZE) -> float | None:
    """The timestamp an envelope claims, UNVERIFIED (None when ``data`` is no envelope): only
    to drop what is too old to be worth verifying, never to accept anything."""
    if len(data) > max_size:
        return None
    try:
        outer = plaincbor.decode(data)
        body = outer.get("body") if isinstance(outer, dict) else None
        decoded = plaincbor.decode(body) if isinstance(body, bytes) else None
    except plaincbor.PlainCBORError:
        return None
    if not (isinstance(decoded, list) and len(decoded) == 3):
        return None
    timestamp = decoded[1]
    return timestamp if isinstance(timestamp, float) and math.isfinite(timestamp) else None


def open_envelope(
    data: bytes,
    kind: str,
    *,
    max_age: float = DEFAULT_MAX_AGE,
    now: float | None = None,
    max_size: int = DEFAULT_MAX_SIZE,
    expected_signer: bytes | None = None,
) -> Opened:
    """Verify ``data`` as an envelope of ``kind`` and return its contents (see module doc)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedEnvelope(f"envelope must be bytes, got {type(data).__name__}")
    if len(data) > max_size:
        raise EnvelopeTooLarge(f"envelope is {len(data)} bytes, over the {max_size}-byte limit")
    _require_kind(kind)
    if not max_age > 0:  # also refuses NaN
        raise IdentityError(f"max_age must be a positive number of seconds, got {max_age}")
    outer = _decode(data, "envelope")
    if not isinstance(outer, dict) or set(outer) != _ENVELOPE_KEYS:
        keys = sorted(map(str, outer)) if isinstance(outer, dict) else type(outer).__name__
        raise MalformedEnvelope(
            f"envelope must be a map with keys {sorted(_ENVELOPE_KEYS)}: {keys}"
        )
    if type(outer["v"]) is not int or outer["v"] != ENVELOPE_VERSION:
        raise MalformedEnvelope(f"unsupported envelope version {outer['v']!r}")
    body, signer, sig = outer["body"], outer["signer"], outer["sig"]
    if not isinstance(body, bytes):
        raise MalformedEnvelope("envelope body must be a byte string")
    if not isinstance(signer, bytes) or len(signer) != PUBLIC_KEY_SIZE:
        raise MalformedEnvelope(f"envelope signer must be a {PUBLIC_KEY_SIZE}-byte public key")
    if not isinstance(sig, bytes) or len(sig) != SIGNATURE_SIZE:
        raise MalformedEnvelope(f"envelope signature must be {SIGNATURE_SIZE} bytes")
    if expected_signer is not None and signer != expected_signer:
        raise WrongSigner(
            f"{kind!r} envelope signed by {peer_id_from_public_key(signer)}, expected "
            f"{_peer_id_or_hex(expected_signer)}"
        )
    try:
        verify_signature(signer, sig, domain_tag(kind) + body)
    except BadSignature as exc:
        raise BadSignature(
            f"signature does not verify as a {kind!r} envelope (tampered, signed for another "
            "kind, or not signed by the key it names)"
        ) from exc
    decoded = _decode(body, "envelope body")
    if not (isinstance(decoded, list) and len(decoded) == 3):
        raise MalformedEnvelope("envelope body must be [kind, timestamp, payload]")
    body_kind, timestamp, payload = decoded
    if body_kind != kind:
        raise MalformedEnvelope(f"envelope body names kind {body_kind!r}, expected {kind!r}")
    if not isinstance(timestamp, float) or not math.isfinite(timestamp):
        raise MalformedEnvelope("envelope timestamp must be a finite float")
    _check_time(kind, timestamp, max_age, time.time() if now is None else now)
    return Opened(kind, payload, signer, peer_id_from_public_key(signer), timestamp)


def _decode(data: bytes | bytearray | memoryview, what: str) -> Any:
    try:
        return plaincbor.decode(data)
    except plaincbor.PlainCBORError as exc:
        raise MalformedEnvelope(f"{what}: {exc}") from exc


def _check_time(kind: str, timestamp: float, max_age: float, now: float) -> None:
    age = now - timestamp
    if age > max_age:
        raise ExpiredEnvelope(
            f"{kind!r} envelope is {age:.1f} s old, over max_age={max_age:.0f} s "
            "(or the clocks differ: check NTP)"
        )
    if -age > MAX_FUTURE_SKEW:
        raise ExpiredEnvelope(
            f"{kind!r} envelope is stamped {-age:.1f} s in the future, over the "
            f"{MAX_FUTURE_SKEW:.0f} s allowed skew (check the sender's clock)"
        )


def _peer_id_or_hex(pub: bytes) -> str:
    try:
        return peer_id_from_public_key(pub)
    except IdentityError:
        return repr(pub)
