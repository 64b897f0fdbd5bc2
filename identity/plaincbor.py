"""Safe CBOR for untrusted bytes: plain data only.

Contract:
- ``encode(obj)`` writes canonical CBOR (sorted map keys, shortest forms) of *plain data*:
  ``None``, ``bool``, ``int`` in [-2**64, 2**64 - 1], ``float``, ``str``, ``bytes``,
  ``list``/``tuple`` and ``dict`` whose keys are ``str`` or ``bytes``, nested at most
  ``max_depth`` containers deep. Anything else raises ``PlainCBORError``.
- ``decode(data)`` returns the same plain data (arrays as ``list``, maps as ``dict``) and raises
  ``PlainCBORError`` for everything else: semantic tags of any number (no datetimes, bignums,
  shared references, sets, regexes...), ``undefined`` and simple values, map keys other than
  text/byte strings (int keys would allow hash-collision floods), duplicate map keys,
  indefinite-length items, invalid UTF-8, nesting deeper than ``max_depth``, truncated input
  and trailing bytes. No other exception type escapes (``MemoryError`` aside).

The caller bounds the input size before calling ``decode``: decoding cost is linear in it.
This module is shared by envelopes (here) and by ``p2pnode.overlay.wire`` frames.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping
from typing import Any

import cbor2

from p2pnode.errors import P2PNodeError

DEFAULT_MAX_DEPTH = 32
_INT_MIN = -(2**64)
_INT_MAX = 2**64 - 1


class PlainCBORError(P2PNodeError, ValueError):
    """The value cannot be encoded as, or the bytes do not decode to, plain CBOR data."""

    reason = "not_plain_cbor"


class _RejectTag(Exception):
    pass


def _reject_tag(*_args: object) -> Any:
    raise _RejectTag("semantic tags are not accepted")


class _EveryTag(Mapping[int, Any]):
    """Overrides cbor2's built-in decoder for every tag number, so all tags are refused."""

    def __getitem__(self, key: int) -> Any:
        return _reject_tag

    def __contains__(self, key: object) -> bool:
        return True

    def get(self, key: object, default: Any = None) -> Any:
        return _reject_tag

    def __iter__(self) -> Iterator[int]:
        return iter(())

    def __len__(self) -> int:
        return 0


_EVERY_TAG = _EveryTag()
_SCALARS = (str, bytes, float, bool, type(None))


def check_plain(obj: object, *, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
    """Raise ``PlainCBORError`` unless ``obj`` is plain data as defined in the module doc."""
    # Iterative so that hostile nesting cannot hit Python's recursion limit.
    stack: list[tuple[object, int]] = [(obj, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, _SCALARS):
            continue
        if isinstance(value, int):
            if not _INT_MIN <= value <= _INT_MAX:
                raise PlainCBORError(f"integer {value} is outside the 64-bit CBOR range")
            continue
        if depth >= max_depth:
            raise PlainCBORError(f"containers are nested deeper than {max_depth}")
        if isinstance(value, list | tuple):
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str | bytes):
                    raise PlainCBORError(
                        f"map key {key!r} is a {type(key).__name__}; only str or bytes keys "
                        "are allowed (encode int-keyed maps as lists of pairs)"
                    )
                stack.append((item, depth + 1))
        else:
            raise PlainCBORError(
                f"{type(value).__name__} is not plain data (allowed: None, bool, int, float, "
                "str, bytes, list, tuple, dict with str/bytes keys)"
            )


def encode(obj: object, *, max_depth: int = DEFAULT_MAX_DEPTH) -> bytes:
    """Canonical CBOR of plain data; ``PlainCBORError`` if ``obj`` is not plain."""
    check_plain(obj, max_depth=max_depth)
    try:
        return cbor2.dumps(obj, canonical=True)
    except (cbor2.CBORError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise PlainCBORError(f"cannot encode value: {exc}") from exc


def decode(data: bytes | bytearray | memoryview, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Decode exactly one plain CBOR item spanning all of ``data``; ``PlainCBORError`` if not."""
    if not data:
        raise PlainCBORError("empty input: expected one CBOR item")
    fp = io.BytesIO(data)
    try:
        decoder = cbor2.CBORDecoder(
            fp,
            semantic_decoders=_EVERY_TAG,
            tag_hook=_reject_tag,
            max_depth=max_depth,
            allow_indefinite=False,
            allow_duplicate_keys=False,
            strict_hashable_types=True,
        )
        value = decoder.decode()
    except (cbor2.CBORError, _RejectTag) as exc:
        raise PlainCBORError(f"invalid CBOR: {_describe(exc)}") from exc
    except (ValueError, TypeError, OverflowError, RecursionError, EOFError, IndexError) as exc:
        raise PlainCBORError(f"invalid CBOR: {type(exc).__name__}: {exc}") from exc
    if fp.tell() != len(data):
        raise PlainCBORError(f"{len(data) - fp.tell()} trailing bytes after the CBOR item")
    _check_decoded(value, max_depth)
    return value


def _describe(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, _RejectTag) or isinstance(exc, _RejectTag):
        return f"{exc} (semantic tags are not accepted)"
    return str(exc)


def _check_decoded(value: object, max_depth: int) -> None:
    try:
        check_plain(value, max_depth=max_depth + 1)
    except PlainCBORError as exc:
        # Only undefined and simple values get here: the decoder options refuse the rest.
        raise PlainCBORError(f"invalid CBOR: {exc}") from exc
