"""Fuzzing every decoder of untrusted bytes: random and mutated-valid inputs may only raise our
own error types (WireError / IdentityError), never crash with anything else, and never hang."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pnode.identity import (
    IdentityError,
    NodeKey,
    new_node_record,
    open_envelope,
    seal,
    sign_node_record,
    verify_node_record,
)
from p2pnode.overlay.wire import (
    WireError,
    bounded,
    decode_frame,
    encode_frame,
    from_wire,
    message,
    read_frame,
    to_wire,
)

KEY = NodeKey.from_seed(b"\x07" * 32)
NOW = time.time()
LIMIT = 4096

# 2000 examples per decoder keeps this file under ~40 s on 2 shared cores; the deadline
# is generous (a single decode takes well under 1 ms) so that only a real hang trips it.
FUZZ = settings(
    max_examples=2000,
    deadline=timedelta(milliseconds=500),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@message("fuzz-inner")
@dataclass(frozen=True)
class FuzzInner:
    k: str = field(metadata=bounded(max_len=8))


@message("fuzz-msg")
@dataclass(frozen=True)
class FuzzMsg:
    n: int = field(metadata=bounded(ge=0, le=100))
    x: float
    s: str
    b: bytes = field(metadata=bounded(max_len=8))
    hashes: list[int]
    caps: dict[str, float]
    pair: tuple[int, str]
    roles: frozenset[str]
    inner: FuzzInner
    opt: int | None = None


VALID_MSG = FuzzMsg(
    1, 2.5, "s", b"b", [1, 2], {"a": 1.0}, (1, "x"), frozenset({"r"}), FuzzInner("k")
)
VALID_FRAME = encode_frame(to_wire(VALID_MSG), limit=LIMIT)
VALID_ENVELOPE = seal(KEY, "digest", {"blocks": [1, 2, 3], "m": "model"}, now=NOW)
VALID_RECORD = sign_node_record(
    KEY, new_node_record(KEY, ["/ip4/127.0.0.1/tcp/1"], ["m"], ["router"], {"slots": 2}, "0.1")
)


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` with a few random flips, insertions, deletions, or a truncation."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


def inputs(valid: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=600), mutated(valid))


_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
_keys = st.text(max_size=6) | st.binary(max_size=4)
# Two levels of containers by hand: much cheaper to draw than st.recursive.
_shallow = _leaves | st.lists(_leaves, max_size=4) | st.dictionaries(_keys, _leaves, max_size=4)
plain_values = (
    _shallow
    | st.lists(_shallow, max_size=3)
    | st.dictionaries(_keys | st.sampled_from(["t", "k", "n"]), _shallow, max_size=3)
)


@FUZZ
@given(inputs(VALID_FRAME))
def test_decode_frame_only_wire_errors(data: bytes) -> None:
    try:
        obj = decode_frame(data, limit=LIMIT)
    except WireError:
        return
    # Whatever decodes must also go through the schema layer cleanly.
    with contextlib.suppress(WireError):
        from_wire(obj, FuzzMsg)


class _BytesStream:
    """A libp2p-style stream over fixed bytes whose read(n) returns at most ``chunk`` bytes and
    never suspends, so a coroutine over it completes in one ``send``: no event loop per example.
    (The trio in-memory stream path is covered in test_wire.py.)"""

    def __init__(self, data: bytes, chunk: int) -> None:
        self.data, self.pos, self.chunk = data, 0, chunk

    async def read(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + min(n, self.chunk)]
        self.pos += len(out)
        return out


def _run_now(coro: Any) -> Any:
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("read_frame suspended on a stream that never blocks")


@FUZZ
@given(inputs(VALID_FRAME), st.integers(1, 64))
def test_read_frame_only_wire_errors(data: bytes, chunk: int) -> None:
    stream = _BytesStream(data, chunk)
    # Bounded: every frame read consumes at least its 4-byte header.
    for _ in range(len(data) // 4 + 2):
        try:
            if _run_now(read_frame(stream, limit=LIMIT)) is None:
                return
        except WireError:
            return
    raise AssertionError("more frames than the input can hold")


def _wire_mutations(obj: dict[str, Any]) -> st.SearchStrategy[Any]:
    keys = sorted(obj) + ["zz", "inner"]
    return st.one_of(
        plain_values,
        st.builds(lambda k, v: {**obj, k: v}, st.sampled_from(keys), plain_values),
        st.builds(lambda k: {a: b for a, b in obj.items() if a != k}, st.sampled_from(keys)),
    )


@FUZZ
@given(_wire_mutations(to_wire(VALID_MSG)))
def test_from_wire_only_schema_errors(obj: Any) -> None:
    try:
        msg = from_wire(obj, FuzzMsg)
    except WireError:
        return
    assert to_wire(msg)["t"] == "fuzz-msg"  # anything accepted re-encodes


@FUZZ
@given(inputs(VALID_ENVELOPE))
def test_open_envelope_only_identity_errors(data: bytes) -> None:
    try:
        opened = open_envelope(data, "digest", now=NOW)
    except IdentityError:
        return
    # Mutations that survive must not have changed anything signed.
    assert opened.payload == {"blocks": [1, 2, 3], "m": "model"}


@FUZZ
@given(inputs(VALID_RECORD))
def test_verify_node_record_only_identity_errors(data: bytes) -> None:
    try:
        record = verify_node_record(data)
    except IdentityError:
        return
    assert record.peer_id == KEY.peer_id
