"""vLLM KV events -> our block events: real payloads in vLLM 0.33's wire schema, no GPU needed.

Payloads are built two independent ways: by hand with msgpack following the layout read from
vLLM 0.33.0's ``vllm/distributed/kv_events.py``, and (when msgspec is installed, as on every
vLLM node) with msgspec Structs declared exactly as in that file; both must give the same bytes.
vLLM's block hashes are emulated (sha256 chains, as vLLM's default) since only their identity
matters to the translator.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pnode.inference.blockhash import (
    BLOCK_SIZE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_hashes,
    cached_prefix_tokens,
    model_salt,
)
from p2pnode.inference.vllm.events import (
    MalformedBatch,
    OversizedBatch,
    UnknownParent,
    UnsupportedBlockSize,
    VllmEventError,
    VllmEventTranslator,
    decode_batch,
)
from p2pnode.overlay.cache.digest import DigestBuilder, fingerprint

MODEL_ID = "SmolLM2-135M-Instruct@0123456789abcdef"
REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------ vLLM-shaped payloads


def vllm_hashes(
    tokens: list[int], block_size: int, *, ints: bool = True, seed: bytes = b""
) -> list:
    """Chained per-block hashes the way vLLM makes them: sha256 over (parent, block tokens);
    published as the low 64 bits (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default) or raw."""
    out, parent = [], hashlib.sha256(b"vllm-none-hash" + seed).digest()
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + repr(tokens[i : i + block_size]).encode()).digest()
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1) if ints else parent)
    return out


def stored(
    hashes: list,
    parent: Any,
    tokens: list[int],
    block_size: int = BLOCK_SIZE,
    *,
    medium: str | None = "GPU",
    lora_id: int | None = None,
    lora_name: str | None = None,
    extra_keys: list | None = "plain",  # type: ignore[assignment]
    group_idx: int | None = 0,
    **optional: Any,
) -> dict:
    """A BlockStored map as msgspec writes it: tag first, fields in declaration order, fields
    with defaults left out when equal to them (vLLM sends one None per block as extra_keys)."""
    if extra_keys == "plain":
        extra_keys = [None] * len(hashes)
    ev = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": medium,
        "lora_name": lora_name,
    }
    defaults = {"extra_keys": extra_keys, "group_idx": group_idx}
    defaults |= {k: optional.get(k) for k in _STORED_TAIL}
    ev |= {k: v for k, v in defaults.items() if v is not None}
    return ev


_STORED_TAIL = (
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)


def removed(hashes: list, *, medium: str | None = "GPU", group_idx: int | None = 0) -> dict:
    ev = {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}
    if group_idx is not None:
        ev["group_idx"] = group_idx
    return ev


CLEARED = {"type": "AllBlocksCleared"}


def _array_header(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")


def _pack_event(ev: dict) -> bytes:
    body = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in ev.items())
    if ev["type"] == "BlockStored":
        # msgspec sizes a struct's map header for its largest possible field count: BlockStored
        # has 15 fields + the tag, so it always gets a map16 header, however many are omitted.
        return b"\xde" + len(ev).to_bytes(2, "big") + body
    return bytes([0x80 | len(ev)]) + body


def batch(*events: dict, ts: float = 1_700_000_000.25, rank: int | None = 0) -> bytes:
    """KVEventBatch is array_like: [ts, events, data_parallel_rank]; msgspec writes a None rank
    as nil rather than omitting it (measured with msgspec 0.22)."""
    out = b"\x93" + msgpack.packb(float(ts))
    out += _array_header(len(events)) + b"".join(_pack_event(e) for e in events)
    return out + msgpack.packb(rank)


def sequence_events(tokens: list[int], prompt_len: int, *, ints: bool = True) -> list[dict]:
    """What vLLM's block pool emits while serving ``tokens`` (prompt + output minus the last
    token, the ones with KV): one store of the prompt's full blocks at prefill, then one store
    per block filled during decoding, each chained to the previous block."""
    hs = vllm_hashes(tokens, BLOCK_SIZE, ints=ints)
    first = prompt_len // BLOCK_SIZE
    evs = [stored(hs[:first], None, tokens[: first * BLOCK_SIZE])] if first else []
    for i in range(first, len(hs)):
        parent = hs[i - 1] if i else None
        evs.append(stored([hs[i]], parent, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]))
    return evs


TOKENS = [(7 + 13 * i) % 49152 for i in range(70)]  # 4 full blocks + 6 tokens


# ------------------------------------------------------------------ schema fidelity


try:
    import msgspec
except ImportError:  # every vLLM node has it (a vLLM dependency); CPU nodes may not
    msgspec = None

if msgspec is not None:
    # Declared exactly as vLLM 0.33.0's vllm/distributed/kv_events.py (ExternalBlockHash =
    # bytes | int, from vllm/v1/core/kv_cache_utils.py); only the class names differ.

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class VBlockStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None
        lookahead_token_ids: list[list[int]] | None = None

    class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(EventBatch):
        events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


def test_handmade_payloads_are_byte_identical_to_vllms_msgspec_encoding() -> None:
    if msgspec is None:
        pytest.skip("msgspec (a vLLM dependency) is not installed")
    S, R, C = VBlockStored, VBlockRemoved, VAllBlocksCleared
    hs = vllm_hashes(TOKENS, 16)
    raw = vllm_hashes(TOKENS, 16, ints=False)
    cases = [
        (
            [S(hs[:2], None, TOKENS[:32], 16, None, "GPU", None, [None, None], 0)],
            [stored(hs[:2], None, TOKENS[:32])],
        ),
        (
            [
                S([raw[2]], raw[1], TOKENS[32:48], 16, None, "GPU", None, [None], 0),
                R([raw[2]], "GPU", 0),
                C(),
            ],
            [stored([raw[2]], raw[1], TOKENS[32:48]), removed([raw[2]]), CLEARED],
        ),
        (
            [S([hs[0]], None, TOKENS[:16], 16, 3, None, "ad", [("ad",)], None, session_id="s")],
            [
                stored(
                    [hs[0]],
                    None,
                    TOKENS[:16],
                    medium=None,
                    lora_id=3,
                    lora_name="ad",
                    extra_keys=[["ad"]],
                    group_idx=None,
                    session_id="s",
                )
            ],
        ),
    ]
    for structs, maps in cases:
        for rank in (0, None):
            ours = batch(*maps, rank=rank)
            theirs = msgspec.msgpack.encode(KVEventBatch(1_700_000_000.25, structs, rank))
            assert ours == theirs
            assert decode_batch(theirs) == decode_batch(ours)
    # And what vLLM's own decoder reads back from our bytes is what we meant.
    back = msgspec.msgpack.decode(batch(*cases[0][1]), type=KVEventBatch)
    assert back.events[0].block_hashes == hs[:2] and back.data_parallel_rank == 0


def test_decoded_fields() -> None:
    hs = vllm_hashes(TOKENS, 16, ints=False)
    b = decode_batch(batch(stored(hs[:1], None, TOKENS[:16]), removed(hs[:1]), CLEARED, rank=2))
    assert b.data_parallel_rank == 2 and b.ts == 1_700_000_000.25
    s = b.events[0]
    assert s.block_hashes == (hs[0],) and s.parent_block_hash is None and s.plain
    assert s.token_ids == tuple(TOKENS[:16]) and s.block_size == 16 and s.medium == "GPU"
    assert b.events[1].block_hashes == (hs[0],) and type(b.events[2]).__name__.endswith("Cleared")


# ------------------------------------------------------------------ translation


@pytest.mark.parametrize("ints", [True, False])
def test_hashes_equal_ours_for_the_whole_sequence(ints: bool) -> None:
    salt = model_salt(MODEL_ID)
    expected = block_hashes(TOKENS, salt)
    tr = VllmEventTranslator(MODEL_ID)
    got: list[int] = []
    for ev in sequence_events(TOKENS, prompt_len=40, ints=ints):  # one batch per step, as vLLM
        (out,) = tr.feed(batch(ev))
        assert isinstance(out, BlockStored)
        assert out.parent == (got[-1] if got else None)
        got.extend(out.hashes)
    assert got == expected and tr.cached_block_hashes() == set(expected)
    assert tr.cached_prefix_len(TOKENS) == 64 == len(TOKENS) // BLOCK_SIZE * BLOCK_SIZE
    assert tr.cached_prefix_len(TOKENS[:40] + [1] * 40) == 32  # diverges inside block 3
    assert tr.stats["stored_blocks"] == 4 and tr.stats["unknown_parent"] == 0


def test_whole_sequence_in_one_batch_and_repeated_stores_are_idempotent() -> None:
    tr = VllmEventTranslator(MODEL_ID)
    evs = sequence_events(TOKENS, prompt_len=70)
    out = tr.feed(batch(*evs, *evs))  # vLLM re-announces blocks reused from the cache
    assert [e.hashes for e in out] == [tuple(block_hashes(TOKENS, model_salt(MODEL_ID)))] * 2
    assert len(tr) == 4 and tr.stats["conflicts"] == 0


def test_larger_vllm_blocks_are_reblocked_and_odd_sizes_refused() -> None:
    salt = model_salt(MODEL_ID)
    hs32 = vllm_hashes(TOKENS, 32)
    tr = VllmEventTranslator(MODEL_ID)
    (a,) = tr.feed(batch(stored(hs32[:1], None, TOKENS[:32], 32)))
    (b,) = tr.feed(batch(stored(hs32[1:2], hs32[0], TOKENS[32:64], 32)))
    assert a.hashes + b.hashes == tuple(block_hashes(TOKENS, salt))
    assert tr.our_hashes(hs32[1]) == b.hashes
    (gone,) = tr.feed(batch(removed(hs32[1:2])))
    assert gone == BlockRemoved(b.hashes)
    with pytest.raises(UnsupportedBlockSize, match="--block-size 16"):
        tr.feed(batch(stored(vllm_hashes(TOKENS, 24)[:1], None, TOKENS[:24], 24)))


def test_removal_clear_and_unknown_removal() -> None:
    salt = model_salt(MODEL_ID)
    ours = block_hashes(TOKENS, salt)
    hs = vllm_hashes(TOKENS, 16)
    tr = VllmEventTranslator(MODEL_ID)
    tr.feed(batch(*sequence_events(TOKENS, 64)))
    # vLLM evicts the tail first; an unknown hash is counted and ignored.
    out = tr.feed(batch(removed([hs[3], 12345]), removed([hs[2]])))
    assert out == [BlockRemoved((ours[3],)), BlockRemoved((ours[2],))]
    assert tr.stats["unknown_removed"] == 1 and tr.cached_prefix_len(TOKENS) == 32
    assert tr.feed(batch(CLEARED)) == [AllBlocksCleared()]
    assert len(tr) == 0 and tr.cached_block_hashes() == set() and tr.cached_prefix_len(TOKENS) == 0
    # After a clear, old hashes are unknown: removing them changes nothing.
    assert tr.feed(batch(removed(hs[:2]))) == [] and tr.stats["unknown_removed"] == 3


def test_same_tokens_under_two_vllm_hashes_are_removed_only_when_both_go() -> None:
    # e.g. a partial block promoted to a full one, or two hash seeds: same tokens, two hashes.
    a = vllm_hashes(TOKENS, 16, seed=b"a")[:2]
    b = vllm_hashes(TOKENS, 16, seed=b"b")[:2]
    tr = VllmEventTranslator(MODEL_ID)
    tr.feed(batch(stored(a, None, TOKENS[:32]), stored(b, None, TOKENS[:32])))
    assert tr.feed(batch(removed(a))) == []
    assert tr.cached_prefix_len(TOKENS) == 32
    (out,) = tr.feed(batch(removed(b)))
    assert set(out.hashes) == set(block_hashes(TOKENS[:32], model_salt(MODEL_ID)))


def test_lora_salted_offloaded_and_other_group_blocks_are_never_advertised() -> None:
    hs = vllm_hashes(TOKENS, 16)
    tr = VllmEventTranslator(MODEL_ID)
    out = tr.feed(
        batch(
            stored(hs[:1], None, TOKENS[:16], lora_id=1, lora_name="ad"),
            stored(hs[1:2], hs[0], TOKENS[16:32]),  # child of a LoRA block: skipped quietly
            stored(hs[:1], None, TOKENS[:16], extra_keys=[["salt"]]),  # cache_salt
            stored(hs[2:3], None, TOKENS[:16], medium="CPU"),
            stored(hs[3:4], None, TOKENS[:16], group_idx=1),
        )
    )
    assert out == [] and tr.cached_block_hashes() == set()
    assert tr.stats["foreign"] == 3 and tr.stats["unknown_parent"] == 0
    assert tr.stats["other_medium"] == 1 and tr.stats["other_group"] == 1
    assert tr.feed(batch(removed(hs[:2]))) == [] and tr.stats["unknown_removed"] == 0


def test_unknown_parent_raises_before_changing_anything() -> None:
    hs = vllm_hashes(TOKENS, 16)
    tr = VllmEventTranslator(MODEL_ID)
    orphan = batch(stored(hs[:1], None, TOKENS[:16]), stored(hs[2:3], hs[1], TOKENS[32:48]))
    with pytest.raises(UnknownParent, match="events were missed"):
        tr.feed(orphan)
    assert len(tr) == 0 and tr.stats["batches"] == 0
    # A parent stored earlier in the same batch resolves; one removed earlier does not.
    tr.feed(batch(stored(hs[:1], None, TOKENS[:16]), stored(hs[1:2], hs[0], TOKENS[16:32])))
    with pytest.raises(UnknownParent):
        tr.feed(batch(removed(hs[1:2]), stored(hs[2:3], hs[1], TOKENS[32:48])))
    assert tr.cached_prefix_len(TOKENS) == 32
    # A live subscriber skips the orphan and keeps the rest of the batch.
    skip = VllmEventTranslator(MODEL_ID, on_unknown_parent="skip")
    (out,) = skip.feed(orphan)
    assert out.hashes == tuple(block_hashes(TOKENS[:16], model_salt(MODEL_ID)))
    assert skip.stats["unknown_parent"] == 1 and len(skip) == 1


# ------------------------------------------------------------------ malformed input

VALID = batch(*sequence_events(TOKENS, 40))


def _bad_payloads() -> list[tuple[str, bytes]]:
    hs = vllm_hashes(TOKENS, 16)
    ok = stored(hs[:1], None, TOKENS[:16])

    def with_(**kv: Any) -> bytes:
        return batch({**ok, **kv})

    def without(key: str) -> bytes:
        return batch({k: v for k, v in ok.items() if k != key})

    pk = msgpack.packb
    return [
        ("empty", b""),
        ("reserved byte", b"\xc1"),
        ("truncated", VALID[: len(VALID) // 2]),
        ("trailing bytes", VALID + b"\x00"),
        ("not an array", pk({"ts": 1.0, "events": []})),
        ("array too long", pk([1.0, [], 0, 0])),
        ("array too short", pk([1.0])),
        ("ts bool", pk([True, []])),
        ("ts nan", pk([float("nan"), []])),
        ("events not a list", pk([1.0, {}])),
        ("rank negative", pk([1.0, [], -1])),
        ("event not a map", pk([1.0, [["BlockStored"]]])),
        ("array-like event (old vLLM)", pk([1.0, [["BlockStored", [1], None, [1] * 16, 16]]])),
        ("unknown type", batch({"type": "BlockMoved", "block_hashes": []})),
        ("missing field", without("token_ids")),
        ("unknown field", with_(priority=1)),
        ("token id negative", with_(token_ids=[-1] * 16)),
        ("token id > 32 bits", with_(token_ids=[1 << 32] * 16)),
        ("token id bool", with_(token_ids=[True] * 16)),
        ("token id float", with_(token_ids=[1.0] * 16)),
        ("hash bool", with_(block_hashes=[True])),
        ("hash str", with_(block_hashes=["abc"])),
        ("hash bytes too long", with_(block_hashes=[b"x" * 65])),
        ("block_size 0", with_(block_size=0)),
        ("block_size str", with_(block_size="16")),
        ("medium int", with_(medium=1)),
        ("extra_keys wrong length", with_(extra_keys=[None, None])),
        ("group_idx negative", with_(group_idx=-2)),
        ("cleared with fields", batch({"type": "AllBlocksCleared", "x": 1})),
        ("ext type", pk([1.0, []])[:1] + b"\xd4\x01\x00" + pk([])),
        ("int map key", pk([1.0, [{1: 2}]])),
        ("invalid utf-8 str", b"\x92\xcb" + b"\x00" * 8 + b"\x91\x81\xa4type\xa2\xff\xfe"),
        ("deep nesting", b"\x91" * 100_000 + b"\xc0"),
        ("huge array header", b"\x92\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff"),
    ]


@pytest.mark.parametrize("name,payload", _bad_payloads(), ids=[n for n, _ in _bad_payloads()])
def test_malformed_payloads_raise_our_error(name: str, payload: bytes) -> None:
    tr = VllmEventTranslator(MODEL_ID)
    with pytest.raises(MalformedBatch):
        tr.feed(payload)
    assert len(tr) == 0


def test_oversized_and_non_bytes_payloads() -> None:
    with pytest.raises(OversizedBatch):
        decode_batch(VALID, max_bytes=len(VALID) - 1)
    assert decode_batch(VALID, max_bytes=len(VALID)).events
    with pytest.raises(MalformedBatch):
        decode_batch("text")  # type: ignore[arg-type]


@settings(
    max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.tuples(st.integers(0, len(VALID) - 1), st.binary(min_size=1, max_size=8)).map(
            lambda m: VALID[: m[0]] + m[1] + VALID[m[0] + len(m[1]) :]
        ),
    )
)
def test_fuzzed_payloads_only_raise_our_errors(payload: bytes) -> None:
    tr = VllmEventTranslator(MODEL_ID, on_unknown_parent="skip")
    with contextlib.suppress(VllmEventError):  # our errors are the allowed outcome
        tr.feed(payload)
    assert tr.stats["batches"] <= 1


# ------------------------------------------------------------------ against the CPU engine


async def test_digest_from_vllm_events_matches_the_cpu_engines(loaded) -> None:
    from p2pnode.inference.engine import open_engine

    prompt_text = (
        "Here is a long list of fruits, in alphabetical order, with no repeats: apple, apricot, "
        "banana, blackberry, blueberry, cherry, coconut, date, elderberry, fig,"
    )
    async with open_engine(loaded, calibrate_cost=False, max_batch=1) as engine:
        cpu_digest = DigestBuilder("cpu-node", engine.model_id, fp_bits=64)
        engine.add_block_listener(cpu_digest.on_event)
        prompt = engine.encode(prompt_text)
        result = await engine.generate(prompt, {"max_tokens": 24})
        seq = prompt + result.tokens
        queries = [
            prompt,
            seq,
            prompt[:20] + [5] * 30,
            seq[:-3] + engine.encode(" and grapes"),
            engine.encode("Something else entirely, not cached at all, at any length."),
        ]
        engine_lens = [engine.cached_prefix_len(q) for q in queries]
        engine_hashes = engine.cached_block_hashes()

    # The same request served by vLLM: KV exists for prompt + output minus the last token.
    tr = VllmEventTranslator(engine.model_id)
    vllm_digest = DigestBuilder("gpu-node", engine.model_id, fp_bits=64)
    for ev in sequence_events(seq[:-1], len(prompt)):
        for ours in tr.feed(batch(ev)):
            vllm_digest.on_event(ours)

    salt = model_salt(engine.model_id)
    assert tr.cached_block_hashes() == engine_hashes
    assert vllm_digest.full().added == cpu_digest.full().added
    for q, exact in zip(queries, engine_lens, strict=True):
        hs = block_hashes(q, salt)
        via_digest = cached_prefix_tokens(
            hs, lambda h: fingerprint(h, 64) in vllm_digest.fingerprints
        )
        # A digest speaks in whole blocks; the engine's radix tree in exact tokens.
        assert via_digest == exact // BLOCK_SIZE * BLOCK_SIZE == tr.cached_prefix_len(q)
    assert engine_lens[1] >= 48 and engine_lens[4] < BLOCK_SIZE  # the test has teeth


# ------------------------------------------------------------------ no vLLM on CPU nodes

_IMPORT_ALL = textwrap.dedent(
    """
    import importlib, importlib.util, pkgutil, sys
    from pathlib import Path
    import p2pnode
    names = []
    for sub in ("identity", "overlay", "inference", "speculation", "bootstrap", "testnet"):
        pkg = importlib.import_module(f"p2pnode.{sub}")
        names.append(pkg.__name__)
        for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            importlib.import_module(info.name)
            names.append(info.name)
    for path in sorted(Path(sys.argv[1]).rglob("test_*.py")):
        spec = importlib.util.spec_from_file_location("cpu_suite_" + path.parent.name + "_" + path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # as pytest's importlib mode does
        spec.loader.exec_module(module)
        names.append(path.name)
    bad = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
    print(len(names), "modules imported; vllm modules:", bad)
    sys.exit(1 if bad else 0)
    """
)


def test_importing_every_module_and_the_cpu_tests_never_imports_vllm(tmp_path: Path) -> None:
    # A stand-in `vllm` first on the path makes any import of it visible here, where the real
    # one is not installed (on a GPU node the real one would be found the same way).
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("IMPORTED_BY_ACCIDENT = True\n")
    # The tests' own helper package (tests/testkit/) is on pytest's path; give it here too.
    path = os.pathsep.join([str(tmp_path), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, str(REPO / "tests")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "vllm modules: []" in proc.stdout
    assert int(proc.stdout.split()[0]) > 40  # every package really was walked


# ------------------------------------------------------------------ ZMQ, as vLLM publishes


class _VllmLikePublisher:
    """vLLM 0.33's ZmqEventPublisher wire behaviour: PUB (topic, seq, payload) and a ROUTER
    replaying buffered batches from a requested seq, then the END marker."""

    def __init__(self, zmq: Any) -> None:
        self.zmq = zmq
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=100)
        self.seq = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def publish(self, payload: bytes, *, drop_live: bool = False) -> None:
        with self.lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
            if not drop_live:
                self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def _serve_replay(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            with self.lock:
                items = [(s, p) for s, p in self.buffer if s >= start_seq]
            for s, p in items:
                self.router.send_multipart((client, b"", b"", s.to_bytes(8, "big"), p))
            self.router.send_multipart(
                (client, b"", b"", (-1).to_bytes(8, "big", signed=True), b"")
            )

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def test_zmq_subscriber_catches_up_through_replay() -> None:
    zmq = pytest.importorskip("zmq")
    from p2pnode.inference.vllm.events import ZmqEventSubscriber

    evs = sequence_events(TOKENS, 16)  # 4 single-store batches
    pub = _VllmLikePublisher(zmq)
    try:
        pub.publish(batch(evs[0]))  # before anyone subscribed: only replay has it
        sub = ZmqEventSubscriber(
            f"tcp://127.0.0.1:{pub.port}", replay_endpoint=f"tcp://127.0.0.1:{pub.replay_port}"
        )
        with sub:
            got = sub.receive(0.2)
            assert [s for s, _ in got] == [0]
            time.sleep(0.3)  # let the SUB connection settle (ZMQ's slow-joiner window)
            pub.publish(batch(evs[1]))
            pub.publish(batch(evs[2]), drop_live=True)  # lost on PUB, still in the buffer
            pub.publish(batch(evs[3]))
            deadline = time.monotonic() + 10
            while sub.next_seq < 4 and time.monotonic() < deadline:
                got += sub.receive(0.2)
        assert [s for s, _ in got] == [0, 1, 2, 3]
        assert sub.stats["replayed"] >= 2 and sub.stats["lost"] == 0
        tr = VllmEventTranslator(MODEL_ID)
        hashes = [h for _, p in got for ev in tr.feed(p) for h in ev.hashes]
        assert hashes == block_hashes(TOKENS, model_salt(MODEL_ID))
    finally:
        pub.close()
