"""Cache digests: the compact, signed summary of one node's prefix cache for one model.

One file (~560 lines) on purpose: the format and ``DigestBuilder``, its only producer, share the
delta rules (last operation per fingerprint; a delta is valid on every state between its base and
its version), which stay true only when stated and enforced in one place.

Contract:
- A digest names the cached block hashes of one (node, model) by *fingerprints*: the top
  ``fp_bits`` bits of each 64-bit chained block hash (``fingerprint``). With the default 32 bits a
  lookup of a block the peer does not hold matches by chance with probability ``n / 2**32``
  (2e-6 for 10k cached blocks); a false match only makes a routing estimate wrong, never an answer.
  ``fp_bits=64`` makes the digest exact.
- Fingerprint sets travel sorted and Golomb-Rice coded (``encode_fingerprints``); the choice was
  made on measurement (``bench/digest_bench.py``, 10k blocks): 2.5 bytes per cached block for
  32-bit fingerprints, against 8 for raw hashes, 7.7 for varint deltas of full hashes and 6.5 for
  Rice-coded full hashes. A Bloom filter at 1 % FP is smaller (1.2 B) but cannot express
  removals, so it allows no deltas, and its 1 % FP per block is 4000x the fingerprints'.
- A ``Digest`` is either *full* (``base_version is None``: ``added`` is the whole set) or a
  *delta* from ``base_version`` to ``version``: apply ``cleared`` (empty the set), then remove
  ``removed`` and add ``added``. Deltas carry only the last operation per fingerprint, so a delta
  ``base -> version`` is also correct on any state between ``base`` and ``version``.
- ``version`` is monotone per (process, model) and 0 is the empty set (a delta from 0 is the
  whole state: receivers apply it as full); ``epoch`` is fixed per process and grows across
  restarts (microsecond start time plus 16 random bits), so a restart is detected and an older
  epoch is recognised as stale.
- On the wire a digest is an identity envelope of kind ``"digest"``; the signer is the origin.
  ``open_digest`` raises ``DigestError`` whose ``reason`` (one of ``DROP_REASONS``) names why it was
  dropped, for counting.
- ``DigestBuilder`` follows an engine's ``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` events
  (register ``builder.on_event`` with ``engine.add_block_listener``) and produces full digests and
  deltas since any recent version.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from p2pnode.errors import P2PNodeError
from p2pnode.inference.blockhash import (
    BLOCK_HASH_VERSION,
    AllBlocksCleared,
    BlockEvent,
    BlockRemoved,
    BlockStored,
)
from p2pnode.overlay.limits import MAX_DIGEST_BYTES

if TYPE_CHECKING:
    from p2pnode.identity import NodeKey

DIGEST_FORMAT = 1
DIGEST_KIND = "digest"
DEFAULT_FP_BITS = 32
MIN_FP_BITS = 16
MAX_SET_COUNT = 1 << 20
MAX_MODEL_ID_LEN = 256
# A digest describes the cache "now": gossip arrives within seconds, a pulled one within a round
# trip. Older envelopes are replays or hopelessly stale.
DEFAULT_MAX_AGE_S = 120.0

DROP_REASONS = (
    "oversized",
    "malformed",
    "bad_signature",
    "expired",
    "unknown_kind",
    "wrong_signer",
    "unsupported",
    "stale",
    "self",
    "wrong_model",
    "rate_limited",  # over a per-peer digest limit (overlay/limits.py)
)


class DigestError(P2PNodeError):
    """A digest was refused; ``reason`` is one of ``DROP_REASONS`` (used as a metric label).

    ``reason`` is set per refusal, not per class: an envelope refused by ``p2pnode.identity``
    passes on that error's own ``reason`` (``bad_signature``, ``expired``, ...)."""

    reason = "digest_error"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason  # type: ignore[misc]  # per refusal: see the docstring


class MalformedDigest(DigestError):
    reason = "malformed"

    def __init__(self, message: str) -> None:
        super().__init__(MalformedDigest.reason, message)


# --------------------------------------------------------------------------- fingerprints


def fingerprint(block_hash: int, fp_bits: int = DEFAULT_FP_BITS) -> int:
    """Top ``fp_bits`` bits of a 64-bit block hash (order preserving, uniform)."""
    return block_hash >> (64 - fp_bits)


def _rice_cost(gaps: list[int], k: int) -> int:
    return sum(g >> k for g in gaps) + len(gaps) * (k + 1)


def encode_fingerprints(values: Iterable[int], fp_bits: int) -> tuple[int, int, bytes]:
    """Sorted-set Golomb-Rice coding: ``(count, k, data)``. Values must lie in ``[0, 2**fp_bits)``."""
    ordered = sorted(set(values))
    if not ordered:
        return 0, 0, b""
    if ordered[0] < 0 or ordered[-1] >= 1 << fp_bits:
        raise ValueError(f"fingerprint out of range for {fp_bits} bits")
    gaps = [ordered[0]] + [b - a - 1 for a, b in zip(ordered, ordered[1:], strict=False)]
    # Rice parameter near log2(mean gap * ln 2) is optimal for uniform sets; try its neighbours.
    mean = max(1.0, (1 << fp_bits) / len(ordered))
    k0 = max(0, int(math.log2(mean * math.log(2))))
    k = min((c for c in (k0 - 1, k0, k0 + 1) if 0 <= c < 64), key=lambda c: _rice_cost(gaps, c))
    fmt = f"0{k}b"
    parts = []
    for g in gaps:
        q = g >> k
        parts.append("1" * q + "0" + (format(g & ((1 << k) - 1), fmt) if k else ""))
    bits = "".join(parts)
    pad = -len(bits) % 8
    bits += "0" * pad
    return len(ordered), k, int(bits, 2).to_bytes(len(bits) // 8, "big")


def decode_fingerprints(count: int, k: int, data: bytes, fp_bits: int) -> list[int]:
    """Inverse of ``encode_fingerprints``; raises ``MalformedDigest`` on any inconsistency."""
    if count == 0:
        if data:
            raise MalformedDigest("empty fingerprint set with trailing data")
        return []
    if count < 0 or not 0 <= k < 64 or count > MAX_SET_COUNT or count * (k + 1) > len(data) * 8:
        raise MalformedDigest(f"fingerprint set header inconsistent (count={count}, k={k})")
    nbits = len(data) * 8
    bits = bin(int.from_bytes(data, "big") | (1 << nbits))[3:]
    limit = 1 << fp_bits
    out: list[int] = []
    pos = 0
    prev = -1
    for _ in range(count):
        z = bits.find("0", pos)
        if z < 0 or z + 1 + k > nbits:
            raise MalformedDigest("fingerprint set truncated")
        q = z - pos
        r = int(bits[z + 1 : z + 1 + k], 2) if k else 0
        pos = z + 1 + k
        prev = prev + 1 + ((q << k) | r)
        if prev >= limit:
            raise MalformedDigest(f"fingerprint exceeds {fp_bits} bits")
        out.append(prev)
    if nbits - pos >= 8 or "1" in bits[pos:]:
        raise MalformedDigest("fingerprint set has trailing data")
    return out


# --------------------------------------------------------------------------- digest value


@dataclass(frozen=True, slots=True)
class LoadInfo:
    """Load and calibrated speed a node advertises with every digest."""

    queue_depth: int = 0
    est_wait_s: float = 0.0
    push_back: bool = False
    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0


@dataclass(frozen=True, slots=True)
class Digest:
    peer_id: str
    model_id: str
    epoch: int
    version: int
    base_version: int | None
    fp_bits: int
    added: frozenset[int]
    removed: frozenset[int]
    cleared: bool
    load: LoadInfo
    # Issue time from the envelope (sender's clock); 0.0 until sealed/opened.
    timestamp: float = 0.0

    @property
    def is_full(self) -> bool:
        return self.base_version is None


def _pack_set(values: frozenset[int], fp_bits: int) -> list[Any]:
    count, k, data = encode_fingerprints(values, fp_bits)
    return [count, k, data]


def digest_to_payload(d: Digest) -> dict[str, Any]:
    """The CBOR-ready payload (the signer is the envelope's, so the peer id is not repeated)."""
    return {
        "f": DIGEST_FORMAT,
        "hv": BLOCK_HASH_VERSION,
        "m": d.model_id,
        "e": d.epoch,
        "n": d.version,
        "b": d.base_version,
        "fb": d.fp_bits,
        "c": d.cleared,
        "a": _pack_set(d.added, d.fp_bits),
        "r": _pack_set(d.removed, d.fp_bits),
        "q": d.load.queue_depth,
        "w": float(d.load.est_wait_s),
        "pb": d.load.push_back,
        "cp": float(d.load.prefill_s_per_token),
        "cd": float(d.load.decode_s_per_token),
    }


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in obj:
        raise MalformedDigest(f"field {key!r} missing")
    value = obj[key]
    # bool is an int subclass: refuse it where an int is expected, and vice versa.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise MalformedDigest(f"field {key!r} has type bool")
    if not isinstance(value, kind):
        raise MalformedDigest(f"field {key!r} has type {type(value).__name__}")
    return value


def _nonneg_float(obj: dict[str, Any], key: str) -> float:
    value = float(_field(obj, key, (int, float)))
    if not math.isfinite(value) or value < 0 or value > 1e6:
        raise MalformedDigest(f"field {key!r} out of range: {value}")
    return value


def _unpack_set(
    obj: dict[str, Any], key: str, fp_bits: int, max_count: int = MAX_SET_COUNT
) -> frozenset[int]:
    packed = _field(obj, key, list)
    if len(packed) != 3:
        raise MalformedDigest(f"field {key!r} must be [count, k, bytes]")
    count, k, data = packed
    if isinstance(count, bool) or isinstance(k, bool):
        raise MalformedDigest(f"field {key!r} has bool counts")
    if not (isinstance(count, int) and isinstance(k, int) and isinstance(data, bytes)):
        raise MalformedDigest(f"field {key!r} must be [int, int, bytes]")
    if count < 0:
        raise MalformedDigest(f"field {key!r} has a negative count")
    if count > max_count:  # checked before decoding: decoding costs ~0.5 us per fingerprint
        raise DigestError("oversized", f"field {key!r} holds {count} > {max_count} fingerprints")
    return frozenset(decode_fingerprints(count, k, data, fp_bits))


def digest_from_payload(
    payload: object, *, peer_id: str, timestamp: float, max_fingerprints: int = MAX_SET_COUNT
) -> Digest:
    """Validate a decoded payload strictly; raises ``DigestError`` (reason malformed/unsupported)."""
    if not isinstance(payload, dict):
        raise MalformedDigest("payload is not a map")
    known = {"f", "hv", "m", "e", "n", "b", "fb", "c", "a", "r", "q", "w", "pb", "cp", "cd"}
    extra = set(payload) - known
    if extra:
        raise MalformedDigest(f"unknown fields {sorted(map(str, extra))}")
    if _field(payload, "f", int) != DIGEST_FORMAT:
        raise DigestError("unsupported", f"digest format {payload['f']} (this node speaks 1)")
    if _field(payload, "hv", int) != BLOCK_HASH_VERSION:
        raise DigestError("unsupported", f"block hash version {payload['hv']}")
    model_id = _field(payload, "m", str)
    if not 0 < len(model_id) <= MAX_MODEL_ID_LEN:
        raise MalformedDigest("model id empty or too long")
    epoch = _field(payload, "e", int)
    version = _field(payload, "n", int)
    base = payload.get("b")
    if "b" not in payload or (
        base is not None and (isinstance(base, bool) or not isinstance(base, int))
    ):
        raise MalformedDigest("field 'b' must be null or an int")
    if not (0 <= epoch < 1 << 64 and 0 <= version < 1 << 63):
        raise MalformedDigest("epoch or version out of range")
    if base is not None and not 0 <= base <= version:
        raise MalformedDigest(f"delta base {base} not in [0, {version}]")
    fp_bits = _field(payload, "fb", int)
    if not MIN_FP_BITS <= fp_bits <= 64:
        raise DigestError("unsupported", f"fingerprint width {fp_bits} bits")
    cleared = _field(payload, "c", bool)
    added = _unpack_set(payload, "a", fp_bits, max_fingerprints)
    removed = _unpack_set(payload, "r", fp_bits, max_fingerprints)
    if base is None and (removed or cleared):
        raise MalformedDigest("a full digest carries no removals")
    if added & removed:
        raise MalformedDigest("a fingerprint is both added and removed")
    queue_depth = _field(payload, "q", int)
    if not 0 <= queue_depth < 1 << 31:
        raise MalformedDigest("queue depth out of range")
    load = LoadInfo(
        queue_depth=queue_depth,
        est_wait_s=_nonneg_float(payload, "w"),
        push_back=_field(payload, "pb", bool),
        prefill_s_per_token=_nonneg_float(payload, "cp"),
        decode_s_per_token=_nonneg_float(payload, "cd"),
    )
    return Digest(
        peer_id=peer_id,
        model_id=model_id,
        epoch=epoch,
        version=version,
        base_version=base,
        fp_bits=fp_bits,
        added=added,
        removed=removed,
        cleared=cleared,
        load=load,
        timestamp=timestamp,
    )


def seal_digest(key: NodeKey, digest: Digest, *, now: float | None = None) -> bytes:
    """Sign ``digest`` with the node key (an ``identity.NodeKey``); raises DigestError if too big."""
    from p2pnode.identity import seal

    data = seal(key, DIGEST_KIND, digest_to_payload(digest), now=now)
    if len(data) > MAX_DIGEST_BYTES:
        raise DigestError(
            "oversized",
            f"digest of {len(data)} bytes exceeds {MAX_DIGEST_BYTES}; lower fp_bits or the cache size",
        )
    return data


def open_digest(
    data: bytes,
    *,
    max_age: float = DEFAULT_MAX_AGE_S,
    now: float | None = None,
    max_size: int = MAX_DIGEST_BYTES,
    expected_peer: str | None = None,
    max_fingerprints: int = MAX_SET_COUNT,
) -> Digest:
    """Verify and decode a sealed digest; raises ``DigestError`` with the drop reason.
    ``max_size`` and ``max_fingerprints`` (per set) are the receiver's limits (overlay/limits.py)."""
    from p2pnode import identity

    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedDigest("digest is not bytes")
    if len(data) > max_size:
        raise DigestError("oversized", f"{len(data)} bytes > limit {max_size}")
    try:
        opened = identity.open_envelope(
            bytes(data), DIGEST_KIND, max_age=max_age, now=now, max_size=max_size
        )
    except identity.IdentityError as exc:
        # The identity error's reason is the drop reason (a digest signed as another kind
        # fails as ``bad_signature``: the domain tag differs); any other is ``malformed``.
        reason = exc.reason if exc.reason in DROP_REASONS else MalformedDigest.reason
        raise DigestError(reason, str(exc)) from None
    if expected_peer is not None and opened.peer_id != expected_peer:
        raise DigestError("wrong_signer", f"signed by {opened.peer_id}, expected {expected_peer}")
    return digest_from_payload(
        opened.payload,
        peer_id=opened.peer_id,
        timestamp=opened.timestamp,
        max_fingerprints=max_fingerprints,
    )


# --------------------------------------------------------------------------- builder


def new_epoch() -> int:
    """Per-process epoch: grows across restarts (µs clock), random low bits break ties."""
    return ((time.time_ns() // 1000) << 16 | secrets.randbits(16)) & ((1 << 64) - 1)


@dataclass(frozen=True, slots=True)
class _Change:
    version: int
    cleared: bool
    added: frozenset[int]
    removed: frozenset[int]


class DigestBuilder:
    """Follows one engine's block events for one model; cuts versions and builds digests.

    Not thread-safe: call from the trio thread that runs the engine listener (the engine calls
    listeners synchronously). Memory: the current hash set plus at most ``max_log`` changes.
    """

    def __init__(
        self,
        peer_id: str,
        model_id: str,
        *,
        fp_bits: int = DEFAULT_FP_BITS,
        epoch: int | None = None,
        load_fn: Callable[[], LoadInfo] | None = None,
        max_log: int = 256,
        max_log_fingerprints: int = 200_000,
    ) -> None:
        if not MIN_FP_BITS <= fp_bits <= 64:
            raise ValueError(f"fp_bits must be in [{MIN_FP_BITS}, 64], got {fp_bits}")
        self.peer_id = peer_id
        self.model_id = model_id
        self.fp_bits = fp_bits
        self.epoch = new_epoch() if epoch is None else epoch
        self.load_fn = load_fn or LoadInfo
        self._hashes: set[int] = set()
        self._refs: dict[int, int] = {}  # fingerprint -> number of held hashes sharing it
        self._version = 0
        self._pending_added: set[int] = set()
        self._pending_removed: set[int] = set()
        self._pending_cleared = False
        self._log: deque[_Change] = deque()
        self._log_fps = 0
        self._max_log = max_log
        self._max_log_fps = max_log_fingerprints
        self._floor = 0  # oldest base version a delta can start from

    @property
    def version(self) -> int:
        return self._version

    @property
    def pending(self) -> bool:
        """Changes received since the last ``cut`` (they go into the next version)."""
        return bool(self._pending_added or self._pending_removed or self._pending_cleared)

    @property
    def fingerprints(self) -> frozenset[int]:
        return frozenset(self._refs)

    def __len__(self) -> int:
        return len(self._hashes)

    # -- events ---------------------------------------------------------------------------

    def on_event(self, event: BlockEvent) -> None:
        if isinstance(event, BlockStored):
            for h in event.hashes:
                self._add(h)
        elif isinstance(event, BlockRemoved):
            for h in event.hashes:
                self._remove(h)
        elif isinstance(event, AllBlocksCleared):
            self._hashes.clear()
            self._refs.clear()
            self._pending_added.clear()
            self._pending_removed.clear()
            self._pending_cleared = True
        else:
            raise TypeError(f"not a block event: {event!r}")

    def sync(self, hashes: Iterable[int]) -> None:
        """Reconcile with the engine's exact set (``engine.cached_block_hashes()``)."""
        target = set(hashes)
        for h in self._hashes - target:
            self._remove(h)
        for h in target - self._hashes:
            self._add(h)

    def _add(self, h: int) -> None:
        if h in self._hashes:
            return
        self._hashes.add(h)
        fp = fingerprint(h, self.fp_bits)
        n = self._refs.get(fp, 0)
        self._refs[fp] = n + 1
        if n == 0:
            self._pending_removed.discard(fp)
            self._pending_added.add(fp)

    def _remove(self, h: int) -> None:
        if h not in self._hashes:
            return
        self._hashes.discard(h)
        fp = fingerprint(h, self.fp_bits)
        n = self._refs[fp] - 1
        if n:
            self._refs[fp] = n
            return
        del self._refs[fp]
        self._pending_added.discard(fp)
        self._pending_removed.add(fp)

    # -- versions and digests -------------------------------------------------------------

    def cut(self) -> int:
        """Seal pending changes into a new version (no-op when nothing changed)."""
        if not (self._pending_added or self._pending_removed or self._pending_cleared):
            return self._version
        self._version += 1
        change = _Change(
            self._version,
            self._pending_cleared,
            frozenset(self._pending_added),
            frozenset(self._pending_removed),
        )
        self._pending_added.clear()
        self._pending_removed.clear()
        self._pending_cleared = False
        self._log.append(change)
        self._log_fps += len(change.added) + len(change.removed)
        while self._log and (len(self._log) > self._max_log or self._log_fps > self._max_log_fps):
            old = self._log.popleft()
            self._log_fps -= len(old.added) + len(old.removed)
            self._floor = old.version
        return self._version

    def _digest(
        self, base: int | None, added: Iterable[int], removed: Iterable[int], cleared: bool
    ) -> Digest:
        return Digest(
            peer_id=self.peer_id,
            model_id=self.model_id,
            epoch=self.epoch,
            version=self._version,
            base_version=base,
            fp_bits=self.fp_bits,
            added=frozenset(added),
            removed=frozenset(removed),
            cleared=cleared,
            load=self.load_fn(),
        )

    def full(self) -> Digest:
        self.cut()
        return self._digest(None, self._refs, (), False)

    def delta_since(self, base: int) -> Digest:
        """Changes from ``base`` to now; a full digest when ``base`` is older than the log."""
        self.cut()
        if base < self._floor or base > self._version:
            return self.full()
        added: set[int] = set()
        removed: set[int] = set()
        cleared = False
        for change in self._log:
            if change.version <= base:
                continue
            if change.cleared:
                cleared = True
                added.clear()
                removed.clear()
            # Keep only the last operation per fingerprint.
            added -= change.removed
            removed -= change.added
            added |= change.added
            removed |= change.removed
        return self._digest(base, added, removed, cleared)


def with_load(digest: Digest, load: LoadInfo) -> Digest:
    return replace(digest, load=load)
