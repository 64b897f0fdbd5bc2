"""Feeding bytes to the handlers of network decoders, for the fuzz tests and bench/fuzz_long.py.

A handler under test takes a stream; ``feed`` gives it the server end of a trio in-memory pair
whose client end already sent the input and closed, then returns what the handler wrote back
and what it raised. ``read_frames`` splits that reply into decoded frames, ``frame_bytes``
makes one valid frame of a message, and ``StubNode`` stands in for the node a client or
anti-entropy opens its streams on. ``BytesStream`` and ``run_now`` read frames without an
event loop (a stream that never blocks completes its coroutine in one ``send``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import trio
import trio.testing

from p2pnode.overlay.peers import PeerTable
from p2pnode.overlay.wire import encode_frame, read_frame, to_wire

__all__ = ["BytesStream", "StubNode", "feed", "frame_bytes", "read_frames", "run_now"]


class BytesStream:
    """A libp2p-style stream over fixed bytes whose read(n) returns at most ``chunk`` bytes and
    never suspends, so a coroutine over it completes in one ``send``: no event loop per example.
    (The trio in-memory stream path is covered in tests/overlay/test_wire.py.)"""

    def __init__(self, data: bytes, chunk: int) -> None:
        self.data, self.pos, self.chunk = data, 0, chunk

    async def read(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + min(n, self.chunk)]
        self.pos += len(out)
        return out


def run_now(coro: Coroutine[Any, Any, Any]) -> Any:
    """The result of ``coro``, which must finish without suspending."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("read_frame suspended on a stream that never blocks")


async def feed(
    handler: Callable[[Any], Awaitable[object]], data: bytes, timeout_s: float = 60.0
) -> tuple[bytes, Exception | None]:
    """Run ``handler(stream)`` on the server end of a stream pair whose client end sent
    ``data`` and closed; returns (what the handler wrote, the exception it raised or None).
    A handler still running after ``timeout_s`` is a hang: ``trio.TooSlowError``."""
    client, server = trio.testing.memory_stream_pair()
    await client.send_all(data)
    await client.send_eof()
    raised = None
    with trio.fail_after(timeout_s):
        try:
            await handler(server)
        except Exception as exc:
            raised = exc
    await server.send_eof()
    out = bytearray()
    while chunk := await client.receive_some(1 << 16):
        out += chunk
    return bytes(out), raised


def read_frames(data: bytes, limit: int) -> list[object]:
    """The decoded frames of a handler's reply (``WireError`` if one is malformed)."""
    stream = BytesStream(data, 1 << 20)
    out = []
    for _ in range(len(data) // 4 + 1):
        obj = run_now(read_frame(stream, limit=limit))
        if obj is None:
            return out
        out.append(obj)
    raise AssertionError("more frames than bytes")


def frame_bytes(msg: Any, limit: int) -> bytes:
    """``msg`` as one length-prefixed wire frame."""
    return encode_frame(to_wire(msg), limit=limit)


class StubNode:
    """The node attributes anti-entropy's ingest and pull and the forward client use (its peer
    table too);
    ``open_stream`` hands out a prepared stream (a peer's reply), or fails without one."""

    def __init__(self, peer_id: str, reply: Any = None) -> None:
        self.peer_id = peer_id
        self.reply = reply
        self.peers = PeerTable()  # no round trips measured: pulls take their floor limit

    async def open_stream(self, peer_id: str, protocol: str, **kw: Any) -> Any:
        if self.reply is None:
            raise OSError("no stream prepared")
        return self.reply
