"""vLLM 0.33 KV cache events (msgpack over ZMQ) translated into OUR block events.

One file on purpose: the wire schema below, the structs that decode it (msgspec, declared as
vLLM declares its own, with our bounds) and the translator to our block events are checked
against each other in one reading (the decoder reads bytes from another process, so its limits
must match the schema exactly).

Wire schema, read from vLLM 0.33.0's own source (``vllm/distributed/kv_events.py`` in the
``vllm==0.33.0`` wheel; the publisher is ``ZmqEventPublisher`` in the same file, the events are
built in ``vllm/v1/core/block_pool.py``):

- A ZMQ PUB message is three frames ``(topic, seq, payload)``: ``seq`` is an 8-byte big-endian
  counter per publisher, ``payload`` one msgspec-msgpack encoded ``KVEventBatch``.
- ``KVEventBatch`` is ``array_like``: ``[ts: float, events: list, data_parallel_rank: int]``
  (the publisher sets its rank; msgspec writes a None rank as nil; a 2-array is accepted too).
- Events are NOT array_like but tagged structs: a map whose first key is ``"type"`` (the class
  name), then the fields in declaration order; fields with defaults are left out when equal to
  them (a plain request's BlockStored carries ``extra_keys = [None] * n`` and ``group_idx=0``). ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, [extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality,
  ownership, session_id, lookahead_token_ids]. ``BlockRemoved``: block_hashes, medium,
  [group_idx, locality, ownership]. ``AllBlocksCleared``: no fields.
- A block hash (``ExternalBlockHash``) is an int (the low 64 bits of vLLM's sha256, the default
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the raw 32 bytes (when that variable is 0).
- Replay: a DEALER sends ``(b"", start_seq)`` to the ROUTER ``replay_endpoint``; it answers one
  ``(b"", topic, seq, payload)`` per buffered batch with ``seq >= start_seq``, then
  ``(b"", b"", -1 as 8 signed bytes, b"")``.

Contract:
- ``decode_batch(payload, max_bytes=...)`` -> ``VllmEventBatch``: size checked before decoding,
  then msgspec decodes it into the structs below, vLLM's own declarations with our bounds: exact
  schema (unknown fields, wrong types, out-of-range values refused).
  Every failure is a ``VllmEventError`` (``OversizedBatch``, ``MalformedBatch``,
  ``UnsupportedBlockSize``); nothing else escapes.
- ``VllmEventTranslator(model_id)``: ``feed(payload)`` / ``apply(batch)`` -> list of OUR
  ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``. vLLM's hashes are never trusted as
  ours: each stored block's OUR chained hash is recomputed from its ``token_ids``, chained from
  the OUR hash that its ``parent_block_hash`` was mapped to (a dict vLLM hash -> our hashes, kept
  for live blocks only). vLLM block sizes that are multiples of ``BLOCK_SIZE`` are re-blocked
  (one vLLM block -> ``block_size // 16`` of ours); other sizes raise ``UnsupportedBlockSize``
  (run vLLM with ``--block-size 16``).
- Our hashes are reference counted over the vLLM hashes that contain them, so a block is only
  reported removed when no live vLLM block holds those tokens any more.
- Skipped, counted in ``stats``, never advertised: another medium (CPU offload tier) or KV cache
  group, blocks whose hash depends on more than the tokens (LoRA, multimodal or cache_salt
  extra keys) and their descendants, removals of unknown hashes.
- A store whose parent is unknown (events missed) raises ``UnknownParent`` before ANY event of
  its batch is applied (``on_unknown_parent="raise"``, the default), or is skipped and counted
  (``"skip"``, what a live subscriber wants: one orphan must not drop a batch's removals).
- ``AllBlocksCleared`` empties the map.
- ``ZmqEventSubscriber`` (pyzmq imported lazily; vLLM nodes only) receives ``(seq, payload)`` in
  order, catching up through the replay socket at start and on every sequence gap.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from p2pnode.errors import P2PNodeError
from p2pnode.inference.blockhash import (
    BLOCK_SIZE,
    ROOT_HASH,
    AllBlocksCleared,
    BlockEvent,
    BlockRemoved,
    BlockStored,
    block_hashes,
    cached_prefix_tokens,
    model_salt,
)

VLLM_VERSION = "0.33.0"
DEFAULT_MAX_BATCH_BYTES = 8 << 20
MAX_HASH_BYTES = 64
MAX_STR_LEN = 4096
MAX_BLOCK_SIZE = 1 << 16
MAX_TOKEN_ID = (1 << 32) - 1  # our block hash packs token ids as uint32
MAX_FOREIGN = 1 << 20
END_SEQ = -1

VllmHash = int | bytes


class VllmEventError(P2PNodeError, ValueError):
    """A vLLM KV event payload was refused; the message says what was wrong."""

    reason = "vllm_event_error"


class OversizedBatch(VllmEventError):
    reason = "oversized_batch"


class MalformedBatch(VllmEventError):
    reason = "malformed_batch"


class UnsupportedBlockSize(VllmEventError):
    reason = "unsupported_block_size"


class UnknownParent(VllmEventError):
    """A stored block chains to a vLLM hash this translator never saw (events were missed)."""

    reason = "unknown_parent"


# --------------------------------------------------------------------------- decoded events
# vLLM's own structs (``vllm/distributed/kv_events.py``), declared the same way, so msgspec
# reads exactly what vLLM writes; the bounds below are ours (vLLM trusts its own bytes, we
# read them from another process). ``forbid_unknown_fields``: a field a newer vLLM adds is
# refused, not silently dropped, so a schema change shows up as an error naming it.

# an int: any msgpack int fits (int64 or uint64), so it needs no bound of ours
_Hash = int | Annotated[bytes, Meta(min_length=1, max_length=MAX_HASH_BYTES)]
_TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
_Str = Annotated[str, Meta(max_length=MAX_STR_LEN)]
_Index = Annotated[int, Meta(ge=0, lt=1 << 31)]


class _Event(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True, gc=False):
    pass


class VllmBlockStored(_Event, tag="BlockStored"):
    block_hashes: tuple[_Hash, ...]
    parent_block_hash: _Hash | None
    token_ids: tuple[_TokenId, ...]
    block_size: Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE)]
    lora_id: Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)] | None
    medium: _Str | None
    lora_name: _Str | None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: _Index | None = None
    kv_cache_spec_kind: _Str | None = None
    kv_cache_spec_sliding_window: _Index | None = None
    locality: _Str | None = None
    ownership: _Str | None = None
    session_id: _Str | None = None
    lookahead_token_ids: tuple[tuple[_TokenId, ...], ...] | None = None

    @property
    def plain(self) -> bool:
        """True when vLLM's hash depends on the tokens alone (no LoRA, mm, salt, embeds)."""
        if self.lora_id is not None or self.lora_name is not None:
            return False
        return self.extra_keys is None or all(k is None for k in self.extra_keys)


class VllmBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: tuple[_Hash, ...]
    medium: _Str | None
    group_idx: _Index | None = None
    locality: _Str | None = None
    ownership: _Str | None = None


class VllmAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


class VllmEventBatch(
    msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True, gc=False
):
    ts: float
    events: tuple[VllmEvent, ...]
    data_parallel_rank: _Index | None = None


# --------------------------------------------------------------------------- decoding

_DECODER = msgspec.msgpack.Decoder(VllmEventBatch)


def _check(batch: VllmEventBatch) -> None:
    """What the types cannot say: a finite time, one extra key per block, whole blocks of
    ours."""
    if not math.isfinite(batch.ts):
        raise MalformedBatch(f"KVEventBatch.ts must be a finite number, got {batch.ts!r}")
    for ev in batch.events:
        if not isinstance(ev, VllmBlockStored):
            continue
        if ev.extra_keys is not None and len(ev.extra_keys) != len(ev.block_hashes):
            raise MalformedBatch("BlockStored.extra_keys must hold one entry per block hash")
        if ev.block_size % BLOCK_SIZE:
            raise UnsupportedBlockSize(
                f"vLLM block_size {ev.block_size} is not a multiple of {BLOCK_SIZE}: our digests "
                f"cannot be derived from it; start vLLM with --block-size {BLOCK_SIZE}"
            )


def decode_batch(payload: bytes, *, max_bytes: int = DEFAULT_MAX_BATCH_BYTES) -> VllmEventBatch:
    """Decode one ZMQ payload (see the module contract); raises ``VllmEventError`` only."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise MalformedBatch(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > max_bytes:
        raise OversizedBatch(
            f"KV event batch of {len(payload)} bytes exceeds {max_bytes}; raise max_bytes if "
            "vLLM really sends batches this large"
        )
    payload = bytes(payload)
    try:
        batch = _DECODER.decode(payload)
    except msgspec.ValidationError as exc:  # the schema: msgspec names the path, e.g. $[1][0]
        raise MalformedBatch(
            f"not a vLLM {VLLM_VERSION} KVEventBatch: {exc} (this decoder follows that "
            "version's schema; pin it or update inference/vllm/events.py)"
        ) from None
    except Exception as exc:  # every other decoder failure (format, utf-8, depth) is ours too
        raise MalformedBatch(f"not a msgpack KVEventBatch: {type(exc).__name__}: {exc}") from None
    _check(batch)
    return batch


# --------------------------------------------------------------------------- translation


class VllmEventTranslator:
    """Maps one vLLM engine's KV events onto OUR block hashes for ``model_id``.

    Not thread-safe: feed it from one thread (the engine's trio thread).
    """

    def __init__(
        self,
        model_id: str,
        *,
        group_idx: int = 0,
        media: Iterable[str | None] = ("GPU", None),
        on_unknown_parent: Literal["raise", "skip"] = "raise",
        max_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    ) -> None:
        if on_unknown_parent not in ("raise", "skip"):
            raise ValueError("on_unknown_parent must be 'raise' or 'skip'")
        self.model_id = model_id
        self.salt = model_salt(model_id)
        self.group_idx = group_idx
        self.media = frozenset(media)
        self.on_unknown_parent = on_unknown_parent
        self.max_bytes = max_bytes
        self._map: dict[VllmHash, tuple[int, ...]] = {}
        self._refs: dict[int, int] = {}
        self._foreign: set[VllmHash] = set()
        self.stats = dict.fromkeys(
            (
                "batches",
                "stored_blocks",
                "removed_blocks",
                "unknown_removed",
                "unknown_parent",
                "foreign",
                "other_medium",
                "other_group",
                "unmappable",
                "conflicts",
                "clears",
            ),
            0,
        )

    def __len__(self) -> int:
        """vLLM block hashes currently mapped."""
        return len(self._map)

    # -- views --------------------------------------------------------------------------

    def cached_block_hashes(self) -> set[int]:
        return set(self._refs)

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens``' longest prefix held, in whole blocks (what a digest says)."""
        return cached_prefix_tokens(block_hashes(tokens, self.salt), self._refs.__contains__)

    def our_hashes(self, vllm_hash: VllmHash) -> tuple[int, ...] | None:
        return self._map.get(vllm_hash)

    # -- feeding ------------------------------------------------------------------------

    def feed(self, payload: bytes) -> list[BlockEvent]:
        """Decode and apply one ZMQ payload; raises ``VllmEventError`` (state untouched)."""
        return self.apply(decode_batch(payload, max_bytes=self.max_bytes))

    def apply(self, batch: VllmEventBatch) -> list[BlockEvent]:
        if self.on_unknown_parent == "raise":
            self._check_parents(batch.events)
        self.stats["batches"] += 1
        out: list[BlockEvent] = []
        for ev in batch.events:
            if isinstance(ev, VllmBlockStored):
                produced = self._store(ev)
            elif isinstance(ev, VllmBlockRemoved):
                produced = self._remove(ev)
            else:
                produced = self._clear()
            if produced is not None:
                out.append(produced)
        return out

    def _ours(self, group_idx: int | None, medium: str | None) -> bool:
        if medium not in self.media:
            self.stats["other_medium"] += 1
            return False
        if (group_idx or 0) != self.group_idx:
            self.stats["other_group"] += 1
            return False
        return True

    def _check_parents(self, events: Sequence[VllmEvent]) -> None:
        """Raise ``UnknownParent`` if applying ``events`` in order would meet one, changing nothing."""
        added: set[VllmHash] = set()
        gone: set[VllmHash] = set()
        cleared = False
        for i, ev in enumerate(events):
            if isinstance(ev, VllmAllBlocksCleared):
                cleared, added, gone = True, set(), set()
            elif isinstance(ev, VllmBlockRemoved):
                gone.update(ev.block_hashes)
                added.difference_update(ev.block_hashes)
            elif (
                ev.parent_block_hash is not None
                and ev.medium in self.media
                and (ev.group_idx or 0) == self.group_idx
            ):
                p = ev.parent_block_hash
                live = p in added or (
                    not cleared and p not in gone and (p in self._map or p in self._foreign)
                )
                if not live:
                    self.stats["unknown_parent"] += 1
                    raise UnknownParent(
                        f"event {i}: BlockStored chains to vLLM block {p!r}, which was never "
                        "stored or was removed: events were missed; resubscribe with replay "
                        "or reset vLLM's prefix cache"
                    )
                gone.difference_update(ev.block_hashes)
                added.update(ev.block_hashes)
            else:
                gone.difference_update(ev.block_hashes)
                added.update(ev.block_hashes)

    def _mark_foreign(self, hashes: Iterable[VllmHash]) -> None:
        for h in hashes:
            if len(self._foreign) >= MAX_FOREIGN:
                return
            self._foreign.add(h)

    def _store(self, ev: VllmBlockStored) -> BlockEvent | None:
        if not self._ours(ev.group_idx, ev.medium):
            return None
        parent = ev.parent_block_hash
        if not ev.plain or (parent is not None and parent in self._foreign):
            self.stats["foreign"] += len(ev.block_hashes)
            self._mark_foreign(ev.block_hashes)
            return None
        if len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
            # vLLM skips null blocks (sliding window, mamba) in the hashes but not in the tokens:
            # which tokens belong to which hash is then unknown.
            self.stats["unmappable"] += len(ev.block_hashes)
            self._mark_foreign(ev.block_hashes)
            return None
        if parent is None:
            start = ROOT_HASH
        elif parent in self._map:
            start = self._map[parent][-1]
        else:
            self.stats["unknown_parent"] += 1
            return None
        chain = block_hashes(ev.token_ids, self.salt, start_parent=start)
        per = ev.block_size // BLOCK_SIZE
        for i, h in enumerate(ev.block_hashes):
            ours = tuple(chain[i * per : (i + 1) * per])
            known = self._map.get(h)
            if known is not None:
                if known != ours:
                    self.stats["conflicts"] += 1
                continue
            self._foreign.discard(h)
            self._map[h] = ours
            for o in ours:
                self._refs[o] = self._refs.get(o, 0) + 1
        self.stats["stored_blocks"] += len(ev.block_hashes)
        if not chain:
            return None
        return BlockStored(tuple(chain), None if parent is None else start)

    def _remove(self, ev: VllmBlockRemoved) -> BlockEvent | None:
        if not self._ours(ev.group_idx, ev.medium):
            return None
        gone: list[int] = []
        for h in ev.block_hashes:
            if h in self._foreign:
                self._foreign.discard(h)
                continue
            ours = self._map.pop(h, None)
            if ours is None:
                self.stats["unknown_removed"] += 1
                continue
            self.stats["removed_blocks"] += 1
            for o in ours:
                n = self._refs[o] - 1
                if n:
                    self._refs[o] = n
                else:
                    del self._refs[o]
                    gone.append(o)
        return BlockRemoved(tuple(gone)) if gone else None

    def _clear(self) -> BlockEvent:
        self._map.clear()
        self._refs.clear()
        self._foreign.clear()
        self.stats["clears"] += 1
        return AllBlocksCleared()


# --------------------------------------------------------------------------- ZMQ subscriber


class ZmqEventSubscriber:
    """Receives vLLM's KV event batches in sequence order, catching up through replay.

    ``receive(timeout_s)`` returns ``[(seq, payload), ...]`` (possibly empty), each seq once and
    increasing. The first call (and every gap) asks the replay socket for everything from the
    next expected seq, so batches published before this subscriber connected are not lost (while
    vLLM still buffers them: ``buffer_steps``). Without a replay endpoint a gap is only counted
    (``stats["lost"]``). Payload sizes are checked by ``decode_batch``, not here: the publisher
    is this node's own vLLM process, and a ZMQ size limit would reset the connection and lose
    the batches after it. Blocking; run it in a worker thread (``run``).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = 2.0,
    ) -> None:
        try:
            import zmq
        except ImportError as exc:
            raise VllmEventError(
                "subscribing to vLLM KV events needs pyzmq: pip install pyzmq==27.3.0"
            ) from exc
        self._zmq = zmq
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.next_seq = 0
        self.stats = dict.fromkeys(("received", "replayed", "duplicates", "lost", "bad"), 0)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)
        self._caught_up = False

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> ZmqEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _parse(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats["bad"] += 1
            return None
        return int.from_bytes(frames[1], "big", signed=True), frames[2]

    def _catch_up(self) -> list[tuple[int, bytes]]:
        """Everything the publisher still buffers from ``next_seq`` on (bounded by time)."""
        if self._replay is None:
            return []
        zmq = self._zmq
        self._replay.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
        out: list[tuple[int, bytes]] = []
        while self._replay.poll(int(self.replay_timeout_s * 1000), zmq.POLLIN):
            frames = self._replay.recv_multipart()
            parsed = self._parse(frames[1:]) if frames and frames[0] == b"" else None
            if parsed is None:
                self.stats["bad"] += 1
                continue
            seq, payload = parsed
            if seq == END_SEQ:
                return out
            if seq >= self.next_seq:
                self._accept(seq, payload, out)
                self.stats["replayed"] += 1
        return out  # timed out: what came is kept; a later gap asks again

    def _accept(self, seq: int, payload: bytes, out: list[tuple[int, bytes]]) -> None:
        if seq > self.next_seq:
            self.stats["lost"] += seq - self.next_seq
        out.append((seq, payload))
        self.next_seq = seq + 1

    def receive(self, timeout_s: float) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        if not self._caught_up:
            self._caught_up = True
            out.extend(self._catch_up())
        zmq = self._zmq
        if not self._sub.poll(int(timeout_s * 1000), zmq.POLLIN):
            return out
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            parsed = self._parse(frames)
            if parsed is None:
                continue
            seq, payload = parsed
            self.stats["received"] += 1
            if seq < self.next_seq:
                self.stats["duplicates"] += 1
                continue
            if seq > self.next_seq and self._replay is not None:
                out.extend(self._catch_up())
                if seq < self.next_seq:
                    continue
            self._accept(seq, payload, out)

    def run(self, sink: Callable[[list[tuple[int, bytes]]], None], stop: threading.Event) -> None:
        """Deliver batches to ``sink`` until ``stop`` is set (checked every 100 ms)."""
        while not stop.is_set():
            got = self.receive(0.1)
            if got:
                sink(got)
