"""Tests of p2pnode.overlay.wire: frames (bytes and trio in-memory streams) and message schemas."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

import cbor2
import pytest
import trio
import trio.testing
from libp2p.network.stream.exceptions import StreamEOF

from p2pnode.overlay.wire import (
    PROTOCOL_LIMITS,
    FrameTooLarge,
    MalformedFrame,
    SchemaError,
    TruncatedFrame,
    WireError,
    bounded,
    bounded_field,
    decode_frame,
    encode_frame,
    from_wire,
    limit_for,
    message,
    message_name,
    read_frame,
    to_wire,
    write_frame,
)

KiB, MiB = 1024, 1024 * 1024


# --------------------------------------------------------------------------- frames

PLAIN_VALUES = [
    None,
    True,
    0,
    -1,
    2**64 - 1,
    -(2**64),
    1.5,
    "héllo",
    b"\x00\xff",
    [],
    {},
    {"a": [1, {"b": b"x"}], b"k": None},
    [[[[1]]]],
]


@pytest.mark.parametrize("value", PLAIN_VALUES)
def test_frame_round_trip(value: Any) -> None:
    frame = encode_frame(value, limit=1 * KiB)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert decode_frame(frame, limit=1 * KiB) == value


def test_tuple_encodes_as_array() -> None:
    assert decode_frame(encode_frame((1, "a"), limit=64), limit=64) == [1, "a"]


def test_frame_too_large() -> None:
    with pytest.raises(FrameTooLarge):
        encode_frame(b"x" * 100, limit=100)  # 100 bytes + 2-byte CBOR header > 100
    frame = encode_frame(b"x" * 100, limit=200)
    with pytest.raises(FrameTooLarge):
        decode_frame(frame, limit=101)
    # The declared length alone decides: no body needs to be present.
    with pytest.raises(FrameTooLarge):
        decode_frame((2**32 - 1).to_bytes(4, "big"), limit=1 * MiB)


def test_truncated_and_trailing() -> None:
    frame = encode_frame({"a": 1}, limit=64)
    for cut in (0, 3, 4, len(frame) - 1):
        with pytest.raises(TruncatedFrame):
            decode_frame(frame[:cut], limit=64)
    with pytest.raises(MalformedFrame, match="follow"):
        decode_frame(frame + b"\x00", limit=64)


def _raw_frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"", "empty"),
        (b"\xff", "break"),
        (b"\x82\x01", "premature"),
        (b"\x01\x02", "trailing"),
        (b"\xc1\x00", "tag"),  # epoch datetime
        (b"\xc2\x41\x01", "tag"),  # bignum
        (b"\xd8\x1c\x80", "tag"),  # shareable (value sharing)
        (b"\xd9\x01\x02\x80", "tag"),  # set
        (b"\xd9\x99\x99\x00", "tag"),  # unknown tag
        (b"\xf7", "undefined"),
        (b"\xf0", "simple"),
        (b"\xa1\x01\x02", "key"),  # int map key
        (b"\xa2\x61a\x01\x61a\x02", "uplicate"),
        (b"\x5f\x41\x00\xff", "indefinite"),
        (b"\x62\xff\xfe", "string"),  # invalid UTF-8
        (b"\x81" * 100 + b"\x00", "depth"),
        (b"\x5b\x7f\xff\xff\xff\xff\xff\xff\xff", "premature"),  # claims 2**63 bytes
    ],
)
def test_malformed_bodies(body: bytes, why: str) -> None:
    with pytest.raises(MalformedFrame, match=f"(?i){why}"):
        decode_frame(_raw_frame(body), limit=1 * KiB)


def _nested_list(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "value", [{1, 2}, 2**64, -(2**64) - 1, object(), {1: "a"}, _nested_list(40)]
)
def test_encode_rejects_non_plain(value: Any) -> None:
    with pytest.raises(MalformedFrame):
        encode_frame(value, limit=1 * KiB)


def test_limits() -> None:
    assert PROTOCOL_LIMITS["/p2pnode/digest/1"] == 256 * KiB
    assert PROTOCOL_LIMITS["/p2pnode/forward/1"] == 4 * MiB
    assert PROTOCOL_LIMITS["/p2pnode/verify/1"] == 1 * MiB
    assert PROTOCOL_LIMITS["/p2pnode/control/1"] == 64 * KiB
    assert PROTOCOL_LIMITS["/p2pnode/bench/1"] == 16 * MiB
    assert limit_for("/p2pnode/forward/1") == 4 * MiB
    with pytest.raises(WireError, match="PROTOCOL_LIMITS"):
        limit_for("/nope/1")
    for bad in (0, -1, 2**40, 1.5):
        with pytest.raises(WireError):
            encode_frame(1, limit=bad)


# -------------------------------------------------------------------------- streams


class Libp2pStyle:
    """libp2p's stream surface (read(n) may return fewer bytes; StreamEOF at the end) over trio.

    Caps each read at a random size so that large frames arrive in many partial reads."""

    def __init__(self, stream: trio.abc.Stream, max_chunk: int, seed: int = 0) -> None:
        self.stream, self.max_chunk, self.reads = stream, max_chunk, 0
        self.rng = random.Random(seed)

    async def read(self, n: int) -> bytes:
        self.reads += 1
        data = await self.stream.receive_some(min(n, self.rng.randint(1, self.max_chunk)))
        if not data:
            raise StreamEOF("stream closed")
        return data

    async def write(self, data: bytes) -> None:
        await self.stream.send_all(data)


async def test_stream_round_trip_then_clean_eof() -> None:
    left, right = trio.testing.memory_stream_pair()
    values = [{"t": "x", "n": i, "b": b"z" * i} for i in range(20)]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                for v in values:
                    await write_frame(left, v, limit=64 * KiB)
                await left.send_eof()

            nursery.start_soon(send)
            got = []
            while (frame := await read_frame(right, limit=64 * KiB)) is not None:
                got.append(frame)
                assert len(got) <= len(values)
    assert got == values


async def test_8_mib_frame_in_many_partial_reads() -> None:
    left, right = trio.testing.memory_stream_pair()
    reader = Libp2pStyle(right, max_chunk=64 * KiB, seed=1)
    payload = {"blob": random.Random(2).randbytes(8 * MiB)}
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                await write_frame(Libp2pStyle(left, 1), payload, limit=16 * MiB)
                await left.send_eof()

            nursery.start_soon(send)
            got = await read_frame(reader, limit=16 * MiB)
            assert await read_frame(reader, limit=16 * MiB) is None  # StreamEOF = clean end
    assert got == payload
    # libp2p's own read_exactly gives up after 100 partial reads; this needed many more.
    assert reader.reads > 200


async def test_truncated_mid_header_and_mid_body() -> None:
    frame = encode_frame({"a": b"x" * 100}, limit=1 * KiB)
    for cut in (2, 4, 50):
        left, right = trio.testing.memory_stream_pair()
        await left.send_all(frame[:cut])
        await left.send_eof()
        with trio.fail_after(5), pytest.raises(TruncatedFrame):
            await read_frame(Libp2pStyle(right, 7), limit=1 * KiB)


async def test_oversized_header_rejected_before_body() -> None:
    left, right = trio.testing.memory_stream_pair()
    # Only the header is sent and the stream stays open: a reader waiting for the body would
    # hang until fail_after fires, so raising FrameTooLarge proves the body was never awaited.
    await left.send_all((8 * MiB).to_bytes(4, "big"))
    with trio.fail_after(5), pytest.raises(FrameTooLarge):
        await read_frame(right, limit=1 * MiB)


async def test_malformed_frame_over_stream() -> None:
    left, right = trio.testing.memory_stream_pair()
    await left.send_all(_raw_frame(b"\xc1\x00"))
    with trio.fail_after(5), pytest.raises(MalformedFrame):
        await read_frame(right, limit=1 * KiB)


async def test_write_frame_too_large_sends_nothing() -> None:
    left, right = trio.testing.memory_stream_pair()
    with pytest.raises(FrameTooLarge):
        await write_frame(left, b"x" * 2 * KiB, limit=1 * KiB)
    await left.send_eof()
    with trio.fail_after(5):
        assert await read_frame(right, limit=1 * KiB) is None


async def test_not_a_stream() -> None:
    with pytest.raises(WireError, match="read"):
        await read_frame(object(), limit=10)


# ------------------------------------------------------------------------- messages


@message("test-wire-inner")
@dataclass(frozen=True)
class Inner:
    k: str = bounded_field(max_len=8)
    v: float = 0.0


@message("test-wire-all")
@dataclass(frozen=True)
class AllTypes:
    flag: bool
    count: int = field(metadata=bounded(ge=0, le=1000))
    ratio: float = field(metadata=bounded(ge=0.0, le=1.0))
    name: str = field(metadata=bounded(min_len=1, max_len=16))
    raw: bytes = field(metadata=bounded(max_len=4))
    hashes: list[int] = field(metadata=bounded(max_len=3, item_ge=0))
    path: tuple[str, ...] = field(metadata=bounded(item_max_len=5))
    pair: tuple[int, str]
    roles: frozenset[str]
    caps: dict[str, float] = field(metadata=bounded(max_len=2, item_le=10.0))
    inner: Inner
    inners: list[Inner]
    maybe: int | None = None
    extra: Any = None


@message("test-wire-other")
@dataclass(frozen=True)
class Other:
    n: int


def _all_types() -> AllTypes:
    return AllTypes(
        flag=True,
        count=7,
        ratio=0.5,
        name="abc",
        raw=b"\x01\x02",
        hashes=[1, 2**64 - 1],
        path=("a", "bc"),
        pair=(3, "x"),
        roles=frozenset({"router", "edge"}),
        caps={"slots": 4.0},
        inner=Inner("k", 1.5),
        inners=[Inner("a"), Inner("b", 2.0)],
        maybe=None,
        extra={"free": [1, "form"]},
    )


def test_message_round_trip_through_a_frame() -> None:
    msg = _all_types()
    wire = to_wire(msg)
    assert wire["t"] == "test-wire-all" and wire["roles"] == ["edge", "router"]
    assert wire["inner"] == {"k": "k", "v": 1.5}
    back = from_wire(decode_frame(encode_frame(wire, limit=4 * KiB), limit=4 * KiB), AllTypes)
    assert back == msg
    assert isinstance(back.path, tuple) and isinstance(back.roles, frozenset)
    assert message_name(AllTypes) == "test-wire-all"
    assert from_wire({"t": "test-wire-other", "n": 1}) == Other(1)  # no filter: any message


def test_float_accepts_int_and_defaults_may_be_absent() -> None:
    wire = to_wire(_all_types())
    wire["ratio"] = 1
    del wire["maybe"], wire["extra"]
    back = from_wire(wire, AllTypes)
    assert back.ratio == 1.0 and type(back.ratio) is float and back.maybe is None


@pytest.mark.parametrize(
    ("change", "field_name"),
    [
        ({"flag": 1}, "flag"),
        ({"count": True}, "count"),
        ({"count": 1.0}, "count"),
        ({"count": 1001}, "count"),
        ({"count": -1}, "count"),
        ({"ratio": "0.5"}, "ratio"),
        ({"ratio": float("nan")}, "ratio"),
        ({"ratio": float("inf")}, "ratio"),
        ({"ratio": 1.5}, "ratio"),
        ({"name": ""}, "name"),
        ({"name": "x" * 17}, "name"),
        ({"name": b"abc"}, "name"),
        ({"raw": "ab"}, "raw"),
        ({"raw": b"12345"}, "raw"),
        ({"hashes": [1, 2, 3, 4]}, "hashes"),
        ({"hashes": [1, -1]}, "hashes[1]"),
        ({"hashes": [1, "2"]}, "hashes[1]"),
        ({"hashes": {"a": 1}}, "hashes"),
        ({"path": ["abcdef"]}, "path[0]"),
        ({"pair": [1]}, "pair"),
        ({"pair": ["x", 1]}, "pair[0]"),
        ({"roles": ["a", "a"]}, "roles"),
        ({"caps": {"a": 1.0, "b": 1.0, "c": 1.0}}, "caps"),
        ({"caps": {"a": 11.0}}, "caps['a']"),
        ({"caps": {b"a": 1.0}}, "caps[b'a']"),
        ({"inner": {"k": "x", "zz": 1}}, "inner.zz"),
        ({"inner": {"k": "x" * 9}}, "inner.k"),
        ({"inner": [1]}, "inner"),
        ({"inners": [{"k": "a"}, {"v": 1.0}]}, "inners[1].k"),
        ({"maybe": "x"}, "maybe"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_schema_violations_name_message_and_field(change: dict, field_name: str) -> None:
    wire = {**to_wire(_all_types()), **change}
    with pytest.raises(SchemaError) as info:
        from_wire(wire, AllTypes)
    assert info.value.message_name == "test-wire-all"
    assert info.value.field == field_name


def test_missing_field_and_type_tags() -> None:
    wire = to_wire(_all_types())
    del wire["count"]
    with pytest.raises(SchemaError, match="missing") as info:
        from_wire(wire, AllTypes)
    assert info.value.field == "count"
    for bad in ([1], {"n": 1}, {"t": 5, "n": 1}, {"t": "no-such-message"}):
        with pytest.raises(SchemaError):
            from_wire(bad, Other)
    with pytest.raises(SchemaError, match="not allowed"):
        from_wire({"t": "test-wire-other", "n": 1}, AllTypes, Inner)
    with pytest.raises(SchemaError, match="registered"):
        from_wire({"t": "test-wire-other", "n": 1}, dict)


def test_to_wire_checks_fields() -> None:
    with pytest.raises(SchemaError) as info:
        to_wire(dataclasses.replace(_all_types(), count=5000))
    assert info.value.field == "count"
    with pytest.raises(SchemaError):
        to_wire(dataclasses.replace(_all_types(), inner="not an Inner"))
    with pytest.raises(SchemaError):
        to_wire(dataclasses.replace(_all_types(), extra={1, 2}))
    with pytest.raises(SchemaError, match="registered"):
        to_wire({"t": "x"})


def test_post_init_errors_become_schema_errors() -> None:
    @message("test-wire-checked")
    @dataclass(frozen=True)
    class Checked:
        lo: int
        hi: int

        def __post_init__(self) -> None:
            if self.lo > self.hi:
                raise ValueError("lo must not exceed hi")

    assert from_wire({"t": "test-wire-checked", "lo": 1, "hi": 2}) == Checked(1, 2)
    with pytest.raises(SchemaError, match="lo must not exceed hi"):
        from_wire({"t": "test-wire-checked", "lo": 3, "hi": 2})


def test_declaration_errors() -> None:
    with pytest.raises(WireError, match="frozen"):

        @message("test-wire-mutable")
        @dataclass
        class Mutable:
            a: int

    with pytest.raises(WireError, match="reserved"):

        @message("test-wire-t")
        @dataclass(frozen=True)
        class HasT:
            t: str

    with pytest.raises(WireError, match="already used"):

        @message("test-wire-other")
        @dataclass(frozen=True)
        class Clash:
            n: int

    with pytest.raises(WireError, match="unsupported"):

        @message("test-wire-unsupported")
        @dataclass(frozen=True)
        class Unsupported:
            a: dict[int, int]

    with pytest.raises(WireError, match="does not apply"):

        @message("test-wire-misbound")
        @dataclass(frozen=True)
        class Misbound:
            a: int = field(metadata=bounded(max_len=3))

    with pytest.raises(WireError, match="bounded"):
        bounded(maxlen=3)


def test_plain_class_becomes_frozen_dataclass() -> None:
    @message("test-wire-plain")
    class Plain:
        a: int
        b: str = "x"

    assert dataclasses.is_dataclass(Plain)
    assert from_wire({"t": "test-wire-plain", "a": 1}) == Plain(1, "x")


def test_wire_dict_is_plain_cbor() -> None:
    # What to_wire produces must survive any CBOR decoder, not only ours.
    wire = to_wire(_all_types())
    assert cbor2.loads(cbor2.dumps(wire)) == wire
