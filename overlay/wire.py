"""The one wire format of p2pnode: length-prefixed CBOR frames and declarative messages.

One file on purpose: every byte a peer sends is framed and schema-checked here, so the
whole decoding surface (frames, then the declarative messages on top of them) is reviewed in one
reading.

Frames. A frame is a 4-byte big-endian unsigned body length followed by a CBOR body holding
plain data only (see ``p2pnode.identity.plaincbor``: no semantic tags, str/bytes map keys,
bounded nesting, no trailing bytes). ``limit`` always bounds the BODY length in bytes; use
``PROTOCOL_LIMITS[protocol]``. Readers reject a declared length over ``limit`` before reading
the body, loop on short reads, return ``None`` on a clean EOF before a frame, and raise
``TruncatedFrame`` on EOF inside one. Streams (``seams.FrameReader`` / ``FrameWriter``) are
libp2p-style ``async read(n)`` / ``async write(data)`` (EOF = ``b""`` or any ``EOFError``, e.g.
libp2p's ``StreamEOF``) or trio ``receive_some`` / ``send_all``. Stream resets and other
transport errors propagate unchanged. Readers have no deadline of their own: wrap calls in
``trio.fail_after`` against slow peers.

Messages. ``@message("name")`` registers a frozen dataclass. ``to_wire(msg)`` gives
``{"t": name, field: value, ...}`` (tuples/frozensets as arrays, nested messages as maps without
``"t"``); ``from_wire(obj, *allowed)`` checks the tag is one of ``allowed`` (any registered
message if none given), every required field is present, no unknown field is, every type is
exact (bool is not int; float accepts int; floats must be finite) and every declared bound
holds (``field(metadata=bounded(max_len=..., ge=..., le=..., item_max_len=...))``).
Supported field types: bool, int, float, str, bytes, None, X | None, list[X], tuple[X, ...],
tuple[X, Y], frozenset[X], dict[str | bytes, X], nested @message classes, typing.Any (any plain
value). Fields with a default may be absent on the wire.

Errors: every failure is a ``WireError``: ``FrameTooLarge``, ``MalformedFrame``,
``TruncatedFrame``, ``SchemaError`` (with ``.message_name`` and ``.field``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from p2pnode.errors import P2PNodeError
from p2pnode.identity import plaincbor

if TYPE_CHECKING:
    from p2pnode.overlay.seams import FrameReader, FrameWriter

KiB = 1024
MiB = 1024 * KiB
HEADER_SIZE = 4
MAX_LIMIT = 64 * MiB
MAX_DEPTH = plaincbor.DEFAULT_MAX_DEPTH
READ_CHUNK = 1 * MiB

PROTOCOL_LIMITS: dict[str, int] = {
    "/p2pnode/digest/1": 256 * KiB,
    "/p2pnode/forward/1": 4 * MiB,
    "/p2pnode/verify/1": 1 * MiB,
    "/p2pnode/control/1": 64 * KiB,
    "/p2pnode/bench/1": 16 * MiB,
    "/p2pnode/audit/1": 1 * MiB,
    "/p2pnode/tokenizer/1": 1 * MiB,  # files travel in chunks of 512 KiB
}


class WireError(P2PNodeError):
    """Base class of every wire-format failure."""

    reason = "wire_error"


class FrameTooLarge(WireError):
    """A frame body is (or claims to be) longer than the limit."""

    reason = "frame_too_large"


class MalformedFrame(WireError):
    """The frame bytes are not one valid plain-CBOR item."""

    reason = "malformed_frame"


class TruncatedFrame(WireError):
    """The input ended inside a frame."""

    reason = "truncated_frame"


class SchemaError(WireError):
    """A decoded value does not match the message schema (or a message cannot be encoded)."""

    reason = "schema_error"

    def __init__(self, text: str, *, message_name: str | None = None, field: str | None = None):
        where = ""
        if message_name is not None:
            where = f"message {message_name!r}"
            if field:
                where += f" field {field!r}"
            where += ": "
        super().__init__(where + text)
        self.message_name = message_name
        self.field = field


def limit_for(protocol: str) -> int:
    """The body limit of ``protocol``; ``WireError`` naming the known ones if unknown."""
    try:
        return PROTOCOL_LIMITS[protocol]
    except KeyError:
        raise WireError(
            f"no frame limit for protocol {protocol!r}; known: {sorted(PROTOCOL_LIMITS)} "
            "(add it to PROTOCOL_LIMITS)"
        ) from None


def _check_limit(limit: int) -> None:
    if type(limit) is not int or not 0 < limit <= MAX_LIMIT:
        raise WireError(f"frame limit must be an int in (0, {MAX_LIMIT}], got {limit!r}")


# ---------------------------------------------------------------------------------- frames


def encode_frame(obj: object, *, limit: int) -> bytes:
    """Header + canonical CBOR body of plain data ``obj``; ``FrameTooLarge`` over ``limit``."""
    _check_limit(limit)
    try:
        body = plaincbor.encode(obj, max_depth=MAX_DEPTH)
    except plaincbor.PlainCBORError as exc:
        raise MalformedFrame(f"cannot encode frame: {exc}") from exc
    if len(body) > limit:
        raise FrameTooLarge(f"frame body is {len(body)} bytes, over the limit of {limit}")
    return len(body).to_bytes(HEADER_SIZE, "big") + body


def decode_frame(data: bytes | bytearray | memoryview, *, limit: int) -> object:
    """Decode exactly one whole frame (header included) from ``data``."""
    _check_limit(limit)
    if len(data) < HEADER_SIZE:
        raise TruncatedFrame(f"{len(data)} bytes cannot hold the {HEADER_SIZE}-byte frame header")
    length = int.from_bytes(data[:HEADER_SIZE], "big")
    if length > limit:
        raise FrameTooLarge(f"frame declares a {length}-byte body, over the limit of {limit}")
    end = HEADER_SIZE + length
    if len(data) < end:
        raise TruncatedFrame(
            f"frame declares {length} body bytes but only {len(data) - HEADER_SIZE} follow"
        )
    if len(data) > end:
        raise MalformedFrame(f"{len(data) - end} bytes follow the frame")
    return _decode_body(memoryview(data)[HEADER_SIZE:end])


def _decode_body(body: bytes | bytearray | memoryview) -> object:
    try:
        return plaincbor.decode(body, max_depth=MAX_DEPTH)
    except plaincbor.PlainCBORError as exc:
        raise MalformedFrame(str(exc)) from exc


def _receiver(stream: FrameReader) -> Callable[[int], Awaitable[bytes]]:
    read = getattr(stream, "read", None)
    if read is not None:
        return read
    receive_some = getattr(stream, "receive_some", None)
    if receive_some is not None:
        return receive_some
    raise WireError(f"{type(stream).__name__} has neither async read(n) nor receive_some(n)")


def _sender(stream: FrameWriter) -> Callable[[bytes], Awaitable[None]]:
    write = getattr(stream, "write", None)
    if write is not None:
        return write
    send_all = getattr(stream, "send_all", None)
    if send_all is not None:
        return send_all
    raise WireError(f"{type(stream).__name__} has neither async write(data) nor send_all(data)")


async def _read_exact(
    recv: Callable[[int], Awaitable[bytes]], n: int, *, eof_ok: bool
) -> bytearray | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = await recv(min(n - len(buf), READ_CHUNK))
        except EOFError:  # libp2p's StreamEOF derives from EOFError
            chunk = b""
        if not chunk:
            if eof_ok and not buf:
                return None
            raise TruncatedFrame(f"stream ended after {len(buf)} of {n} expected bytes")
        if len(chunk) > n - len(buf):
            raise WireError(
                f"stream returned {len(chunk)} bytes when at most {n - len(buf)} were asked"
            )
        buf += chunk
    return buf


async def read_frame(stream: FrameReader, *, limit: int) -> object | None:
    """Read one frame; ``None`` on a clean EOF before its first byte (see module doc)."""
    _check_limit(limit)
    recv = _receiver(stream)
    header = await _read_exact(recv, HEADER_SIZE, eof_ok=True)
    if header is None:
        return None
    length = int.from_bytes(header, "big")
    if length > limit:
        raise FrameTooLarge(f"peer declared a {length}-byte frame body, over the limit of {limit}")
    body = await _read_exact(recv, length, eof_ok=False)
    assert body is not None
    return _decode_body(body)


async def write_frame(stream: FrameWriter, obj: object, *, limit: int) -> None:
    """Encode ``obj`` (raising before anything is sent if it is invalid or too big) and send it."""
    frame = encode_frame(obj, limit=limit)
    await _sender(stream)(frame)


# -------------------------------------------------------------------------------- messages

_BOUNDS_KEY = "p2pnode.wire.bounds"


@dataclass(frozen=True)
class Bounds:
    """Per-field limits. ``*_len`` count items/chars/bytes; ``ge``/``le`` bound numbers;
    ``item_*`` apply to the elements (or dict values) of a container field."""

    min_len: int | None = None
    max_len: int | None = None
    ge: float | None = None
    le: float | None = None
    item_min_len: int | None = None
    item_max_len: int | None = None
    item_ge: float | None = None
    item_le: float | None = None

    def items(self) -> Bounds | None:
        inner = Bounds(self.item_min_len, self.item_max_len, self.item_ge, self.item_le)
        return None if inner == Bounds() else inner


def bounded(**limits: float | None) -> dict[str, Bounds]:
    """Field metadata declaring bounds: ``field(metadata=bounded(max_len=64))``."""
    try:
        return {_BOUNDS_KEY: Bounds(**limits)}  # type: ignore[arg-type]
    except TypeError as exc:
        names = [f.name for f in dataclasses.fields(Bounds)]
        raise WireError(f"bounded() takes only {names}: {exc}") from exc


def bounded_field(*, default: Any = dataclasses.MISSING, **limits: float | None) -> Any:
    """Shorthand for ``dataclasses.field(default=..., metadata=bounded(**limits))``."""
    return dataclasses.field(default=default, metadata=bounded(**limits))


class _Ctx:
    """Where a check is, for error messages."""

    __slots__ = ("message", "path")

    def __init__(self, message: str, path: str) -> None:
        self.message = message
        self.path = path

    def at(self, suffix: str) -> _Ctx:
        return _Ctx(self.message, self.path + suffix)

    def fail(self, text: str) -> SchemaError:
        return SchemaError(text, message_name=self.message, field=self.path)


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


class _Node:
    """A compiled field type. ``decode`` takes wire data, ``encode`` takes Python values."""

    def decode(self, value: Any, ctx: _Ctx) -> Any:
        raise NotImplementedError

    def encode(self, value: Any, ctx: _Ctx) -> Any:
        raise NotImplementedError


def _check_len(n: int, bounds: Bounds | None, ctx: _Ctx) -> None:
    if bounds is None:
        return
    if bounds.max_len is not None and n > bounds.max_len:
        raise ctx.fail(f"length {n} is over the maximum {bounds.max_len}")
    if bounds.min_len is not None and n < bounds.min_len:
        raise ctx.fail(f"length {n} is under the minimum {bounds.min_len}")


def _check_range(x: float, bounds: Bounds | None, ctx: _Ctx) -> None:
    if bounds is None:
        return
    if bounds.ge is not None and not x >= bounds.ge:
        raise ctx.fail(f"{x} is below the minimum {bounds.ge}")
    if bounds.le is not None and not x <= bounds.le:
        raise ctx.fail(f"{x} is above the maximum {bounds.le}")


class _Bool(_Node):
    def decode(self, value: Any, ctx: _Ctx) -> bool:
        if type(value) is not bool:
            raise ctx.fail(f"expected bool, got {_describe(value)}")
        return value

    encode = decode


class _Int(_Node):
    def __init__(self, bounds: Bounds | None) -> None:
        self.bounds = bounds

    def decode(self, value: Any, ctx: _Ctx) -> int:
        if type(value) is not int:
            raise ctx.fail(f"expected int, got {_describe(value)}")
        if not -(2**64) <= value < 2**64:
            raise ctx.fail("int is outside the 64-bit CBOR range")
        _check_range(value, self.bounds, ctx)
        return value

    encode = decode


class _Float(_Node):
    def __init__(self, bounds: Bounds | None) -> None:
        self.bounds = bounds

    def decode(self, value: Any, ctx: _Ctx) -> float:
        if type(value) not in (int, float):
            raise ctx.fail(f"expected float, got {_describe(value)}")
        try:
            number = float(value)
        except OverflowError:
            raise ctx.fail("number is out of float range") from None
        if not math.isfinite(number):
            raise ctx.fail(f"expected a finite float, got {number}")
        _check_range(number, self.bounds, ctx)
        return number

    encode = decode


class _Str(_Node):
    def __init__(self, bounds: Bounds | None) -> None:
        self.bounds = bounds

    def decode(self, value: Any, ctx: _Ctx) -> str:
        if type(value) is not str:
            raise ctx.fail(f"expected str, got {_describe(value)}")
        _check_len(len(value), self.bounds, ctx)
        return value

    encode = decode


class _Bytes(_Node):
    def __init__(self, bounds: Bounds | None) -> None:
        self.bounds = bounds

    def decode(self, value: Any, ctx: _Ctx) -> bytes:
        if type(value) is not bytes:
            raise ctx.fail(f"expected bytes, got {_describe(value)}")
        _check_len(len(value), self.bounds, ctx)
        return value

    def encode(self, value: Any, ctx: _Ctx) -> bytes:
        if isinstance(value, bytearray | memoryview):
            value = bytes(value)
        return self.decode(value, ctx)


class _NoneType(_Node):
    def decode(self, value: Any, ctx: _Ctx) -> None:
        if value is not None:
            raise ctx.fail(f"expected None, got {_describe(value)}")

    encode = decode


class _Optional(_Node):
    def __init__(self, inner: _Node) -> None:
        self.inner = inner

    def decode(self, value: Any, ctx: _Ctx) -> Any:
        return None if value is None else self.inner.decode(value, ctx)

    def encode(self, value: Any, ctx: _Ctx) -> Any:
        return None if value is None else self.inner.encode(value, ctx)


class _Any(_Node):
    def decode(self, value: Any, ctx: _Ctx) -> Any:
        try:
            plaincbor.check_plain(value, max_depth=MAX_DEPTH)
        except plaincbor.PlainCBORError as exc:
            raise ctx.fail(str(exc)) from None
        return value

    encode = decode


class _Seq(_Node):
    """list[X], tuple[X, ...] and frozenset[X]; arrays on the wire."""

    def __init__(self, item: _Node, out: type, bounds: Bounds | None) -> None:
        self.item, self.out, self.bounds = item, out, bounds

    def _items(self, value: Any, ctx: _Ctx, encode: bool) -> list[Any]:
        accepted = (list, tuple, set, frozenset) if encode else (list, tuple)
        if not isinstance(value, accepted):
            raise ctx.fail(f"expected an array, got {_describe(value)}")
        _check_len(len(value), self.bounds, ctx)
        convert = self.item.encode if encode else self.item.decode
        return [convert(item, ctx.at(f"[{i}]")) for i, item in enumerate(value)]

    def decode(self, value: Any, ctx: _Ctx) -> Any:
        items = self._items(value, ctx, encode=False)
        if self.out is frozenset:
            result = frozenset(items)
            if len(result) != len(items):
                raise ctx.fail("set contains duplicate items")
            return result
        return self.out(items)

    def encode(self, value: Any, ctx: _Ctx) -> list[Any]:
        items = self._items(value, ctx, encode=True)
        if self.out is frozenset:
            # Unorderable items keep their order: any order is a valid set encoding.
            with contextlib.suppress(TypeError):
                items.sort()
        return items


class _FixedTuple(_Node):
    def __init__(self, items: list[_Node]) -> None:
        self.items = items

    def _convert(self, value: Any, ctx: _Ctx, encode: bool) -> list[Any]:
        if not isinstance(value, list | tuple):
            raise ctx.fail(f"expected an array, got {_describe(value)}")
        if len(value) != len(self.items):
            raise ctx.fail(f"expected {len(self.items)} items, got {len(value)}")
        return [
            (node.encode if encode else node.decode)(item, ctx.at(f"[{i}]"))
            for i, (node, item) in enumerate(zip(self.items, value, strict=True))
        ]

    def decode(self, value: Any, ctx: _Ctx) -> tuple[Any, ...]:
        return tuple(self._convert(value, ctx, encode=False))

    def encode(self, value: Any, ctx: _Ctx) -> list[Any]:
        return self._convert(value, ctx, encode=True)


class _Dict(_Node):
    def __init__(self, key: _Node, value: _Node, bounds: Bounds | None) -> None:
        self.key, self.value, self.bounds = key, value, bounds

    def _convert(self, value: Any, ctx: _Ctx, encode: bool) -> dict[Any, Any]:
        if not isinstance(value, dict):
            raise ctx.fail(f"expected a map, got {_describe(value)}")
        _check_len(len(value), self.bounds, ctx)
        key_conv = self.key.encode if encode else self.key.decode
        value_conv = self.value.encode if encode else self.value.decode
        out = {}
        for k, v in value.items():
            sub = ctx.at(f"[{k!r:.40}]")
            out[key_conv(k, sub)] = value_conv(v, sub)
        return out

    def decode(self, value: Any, ctx: _Ctx) -> dict[Any, Any]:
        return self._convert(value, ctx, encode=False)

    def encode(self, value: Any, ctx: _Ctx) -> dict[Any, Any]:
        return self._convert(value, ctx, encode=True)


class _Nested(_Node):
    def __init__(self, cls: type) -> None:
        self.cls = cls

    def decode(self, value: Any, ctx: _Ctx) -> Any:
        if not isinstance(value, dict):
            raise ctx.fail(f"expected a {_NAMES[self.cls]!r} map, got {_describe(value)}")
        return _decode_fields(self.cls, value, ctx.message, ctx.path + ".", skip_tag=False)

    def encode(self, value: Any, ctx: _Ctx) -> dict[str, Any]:
        if type(value) is not self.cls:
            raise ctx.fail(f"expected a {self.cls.__name__}, got {_describe(value)}")
        return _encode_fields(value, ctx.message, ctx.path + ".")


@dataclass(frozen=True)
class _FieldSpec:
    name: str
    node: _Node
    required: bool


_MESSAGES: dict[str, type] = {}
_NAMES: dict[type, str] = {}
_SPECS: dict[type, tuple[_FieldSpec, ...]] = {}
_C = TypeVar("_C", bound=type)


def message(name: str) -> Callable[[_C], _C]:
    """Register a frozen dataclass (made one if it is a plain class) as wire message ``name``."""
    if not isinstance(name, str) or not name or len(name) > 64:
        raise WireError(f"message name must be a non-empty str of <= 64 chars, got {name!r}")

    def register(cls: _C) -> _C:
        if not dataclasses.is_dataclass(cls):
            cls = dataclass(frozen=True)(cls)  # type: ignore[assignment]
        elif not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise WireError(f"@message({name!r}) needs @dataclass(frozen=True) on {cls.__name__}")
        if any(f.name == "t" for f in dataclasses.fields(cls)):
            raise WireError(f"message {name!r}: field name 't' is reserved for the type tag")
        previous = _MESSAGES.get(name)
        if previous is not None and _qualified(previous) != _qualified(cls):
            raise WireError(f"message name {name!r} is already used by {_qualified(previous)}")
        if previous is not None:  # the same class re-imported (e.g. a reloaded module)
            _NAMES.pop(previous, None)
            _SPECS.pop(previous, None)
        _MESSAGES[name] = cls
        _NAMES[cls] = name
        # A forward reference to a class defined later is compiled on first use instead.
        with contextlib.suppress(_Unresolved):
            _spec(cls)
        return cls

    return register


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class _Unresolved(WireError):
    """A field annotation names a class that does not exist (yet)."""


def _spec(cls: type) -> tuple[_FieldSpec, ...]:
    spec = _SPECS.get(cls)
    if spec is None:
        name = _NAMES[cls]
        try:
            hints = typing.get_type_hints(cls)
        except NameError as exc:
            raise _Unresolved(f"message {name!r}: cannot resolve a field type: {exc}") from exc
        specs = []
        for f in dataclasses.fields(cls):
            bounds = f.metadata.get(_BOUNDS_KEY)
            node = _compile(hints[f.name], bounds, f"message {name!r} field {f.name!r}")
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            specs.append(_FieldSpec(f.name, node, required))
        spec = _SPECS[cls] = tuple(specs)
    return spec


def _compile(tp: Any, bounds: Bounds | None, where: str) -> _Node:
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    def no(*names: str) -> None:
        for attr in names:
            if bounds is not None and getattr(bounds, attr) is not None:
                raise WireError(f"{where}: bound {attr} does not apply to {tp}")

    if origin in (typing.Union, types.UnionType):
        others = [a for a in args if a is not type(None)]
        if len(others) != 1 or len(args) != 2:
            raise WireError(f"{where}: only X | None unions are supported, got {tp}")
        return _Optional(_compile(others[0], bounds, where))
    item_fields = ("item_min_len", "item_max_len", "item_ge", "item_le")
    if tp is bool:
        no("min_len", "max_len", "ge", "le", *item_fields)
        return _Bool()
    if tp is int or tp is float:
        no("min_len", "max_len", *item_fields)
        return _Int(bounds) if tp is int else _Float(bounds)
    if tp is str or tp is bytes:
        no("ge", "le", *item_fields)
        return _Str(bounds) if tp is str else _Bytes(bounds)
    if tp is type(None):
        return _NoneType()
    if tp is Any:
        return _Any()
    if tp in _NAMES:
        if bounds is not None:
            raise WireError(f"{where}: bounds do not apply to a nested message")
        return _Nested(tp)
    items = bounds.items() if bounds is not None else None
    if origin in (list, frozenset) and len(args) == 1:
        no("ge", "le")
        return _Seq(_compile(args[0], items, where), origin, bounds)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        no("ge", "le")
        return _Seq(_compile(args[0], items, where), tuple, bounds)
    if origin is tuple and args and Ellipsis not in args:
        if bounds is not None:
            raise WireError(f"{where}: bounds do not apply to a fixed-size tuple")
        return _FixedTuple([_compile(a, None, where) for a in args])
    if origin is dict and len(args) == 2 and args[0] in (str, bytes):
        no("ge", "le")
        return _Dict(_compile(args[0], None, where), _compile(args[1], items, where), bounds)
    raise WireError(f"{where}: unsupported field type {tp} (see the p2pnode.overlay.wire doc)")


def _encode_fields(msg: Any, name: str, prefix: str) -> dict[str, Any]:
    return {
        f.name: f.node.encode(getattr(msg, f.name), _Ctx(name, prefix + f.name))
        for f in _spec(type(msg))
    }


def _decode_fields(
    cls: type, obj: dict[Any, Any], name: str, prefix: str, *, skip_tag: bool
) -> Any:
    """``cls`` built from map ``obj``; errors name message ``name`` (the outermost one)."""
    spec = _spec(cls)
    known = {f.name for f in spec}
    for key in obj:
        if key not in known and not (skip_tag and key == "t"):
            raise SchemaError(
                f"unknown field {key!r:.60}", message_name=name, field=prefix + str(key)[:60]
            )
    kwargs = {}
    for f in spec:
        if f.name in obj:
            kwargs[f.name] = f.node.decode(obj[f.name], _Ctx(name, prefix + f.name))
        elif f.required:
            raise SchemaError("required field is missing", message_name=name, field=prefix + f.name)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a message's own __post_init__ checks
        raise SchemaError(
            f"rejected by {cls.__name__}: {exc}", message_name=name, field=prefix.rstrip(".")
        ) from exc


def to_wire(msg: Any) -> dict[str, Any]:
    """``{"t": name, ...fields}`` for a registered message; ``SchemaError`` if a field is off."""
    name = _NAMES.get(type(msg))
    if name is None:
        raise SchemaError(f"{type(msg).__name__} is not a registered @message class")
    return {"t": name, **_encode_fields(msg, name, "")}


def from_wire(obj: object, *allowed_types: type) -> Any:
    """The message in wire value ``obj``, which must be one of ``allowed_types`` (if given)."""
    for cls in allowed_types:
        if cls not in _NAMES:
            raise SchemaError(f"{cls!r} is not a registered @message class")
    if not isinstance(obj, dict):
        raise SchemaError(f"expected a message map with a 't' tag, got {_describe(obj)}")
    tag = obj.get("t")
    if not isinstance(tag, str):
        raise SchemaError(f"message type tag 't' must be a str, got {_describe(tag)}")
    cls = _MESSAGES.get(tag)
    if cls is None:
        raise SchemaError(f"unknown message type {tag[:64]!r}")
    if allowed_types and cls not in allowed_types:
        expected = sorted(_NAMES[c] for c in allowed_types)
        raise SchemaError(f"message type {tag!r} is not allowed here; expected one of {expected}")
    return _decode_fields(cls, obj, tag, "", skip_tag=True)


def message_name(cls: type) -> str:
    """The wire name of a registered message class."""
    try:
        return _NAMES[cls]
    except KeyError:
        raise SchemaError(f"{cls!r} is not a registered @message class") from None


def registered_messages() -> dict[str, type]:
    """A copy of the name -> class registry."""
    return dict(_MESSAGES)
