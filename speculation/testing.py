"""Test doubles for speculation (like ``trio.testing``): production modules never import this.

Contract: ``inprocess_transport(verifier, one_way_delay_s=...)`` yields an ``InProcessTransport``,
a ``VerifierTransport`` (``edge.py``) to a ``BatchedVerifier`` in this process behind a FIFO
link with a userspace one-way delay (``trio.sleep``) on each direction, like a stream. Results
and leads come back in the verifier's commit order; a ``VerifierError`` comes back raised.
The caller runs ``verifier.run`` in a nursery, as with ``protocol.serve_verifier``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from p2pnode.speculation._blocks import Block, BlockResult, Lead, SamplingOptions
from p2pnode.speculation._errors import VerifierError
from p2pnode.speculation.verify import BatchedVerifier

__all__ = ["InProcessTransport", "inprocess_transport"]


class InProcessTransport:
    """A verifier in this process behind a FIFO link with a one-way delay in each direction."""

    def __init__(self, verifier: BatchedVerifier, nursery: trio.Nursery, one_way_delay_s: float):
        self.verifier = verifier
        self.max_block = verifier.max_block
        self.delay = one_way_delay_s
        self._nursery = nursery
        self._up_send, self._up_recv = trio.open_memory_channel[tuple[float, Block]](math.inf)
        self._down_send, self._down_recv = trio.open_memory_channel[tuple[float, object]](math.inf)
        self._sid: str | None = None
        self._server = trio.CancelScope()

    async def open(self, prompt: list[int], options: SamplingOptions, *, lead: int = 0) -> int:
        await trio.sleep(self.delay)
        self._sid = await self.verifier.open_session(
            prompt, options, self.verifier.model_id, lead=lead, on_lead=self._down
        )
        await trio.sleep(self.delay)
        self._nursery.start_soon(self._serve)
        return self.verifier.sessions[self._sid].lead

    def _down(self, answer: object) -> None:
        self._down_send.send_nowait((trio.current_time() + self.delay, answer))

    async def _serve(self) -> None:
        with self._server:
            async for arrive_at, block in self._up_recv:
                await trio.sleep_until(arrive_at)
                try:
                    answer: object = await self.verifier.verify(self._sid, block)
                except VerifierError as exc:
                    answer = exc
                self._down(answer)

    async def send_block(self, block: Block) -> None:
        self._up_send.send_nowait((trio.current_time() + self.delay, block))

    async def receive_result(self) -> BlockResult | Lead:
        arrive_at, answer = await self._down_recv.receive()
        await trio.sleep_until(arrive_at)
        if isinstance(answer, VerifierError):
            raise answer
        return answer  # type: ignore[return-value]

    async def close(self) -> None:
        self._server.cancel()
        if self._sid is not None:
            self.verifier.close_session(self._sid)


@asynccontextmanager
async def inprocess_transport(
    verifier: BatchedVerifier, *, one_way_delay_s: float = 0.0
) -> AsyncIterator[InProcessTransport]:
    async with trio.open_nursery() as nursery:
        yield InProcessTransport(verifier, nursery, one_way_delay_s)
        nursery.cancel_scope.cancel()
