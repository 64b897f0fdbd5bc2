"""What the services of a served model need of the overlay node they run on.

Why: forwarding (``forward.py``), digest gossip (``antientropy.py``), challenges
(``probation.py``) and their composition root (``service.py``) use six things of an
``OverlayNode`` (``node.py``). Written down here, that is the whole seam: a test can hand them
a smaller node, and a change to the node assembly that breaks it fails the conformance test
(tests/overlay/test_node.py), not a request at run time.

Contract:
- ``OverlayHost``: ``peer_id`` (our base58 id), ``peers`` (the ``PeerTable`` of liveness and
  failures), ``pubsub`` (``PubSub``: gossipsub topics), ``set_stream_handler(protocol,
  handler)`` (serve a protocol; the handler's errors never escape), and ``open_stream(peer_id,
  protocol, timeout=)`` (dial if needed; raises ``PeerUnreachable``), and
  ``swap_digests_on_hello(give, take)`` (each new link's hello carries ``give()``, our sealed
  cache digests, and hands the checked peer's to ``take(peer_id, digests)``).
- ``PubSub`` / ``Subscription``: the gossipsub calls they make; a subscription yields
  py-libp2p's ``rpc_pb2.Message`` (``data``, ``from_id``).
- Streams: ``Stream`` is the part of a libp2p ``INetStream`` that protocol code reads, writes
  and closes through (``read(n)`` returns up to ``n`` bytes, ``b""`` or ``EOFError`` at the
  end). Code that needs more of a stream (its ``muxed_conn`` for the remote peer id, ``reset``)
  takes an ``INetStream``. The frame codec (``wire.py``) also takes trio byte streams:
  ``FrameReader`` / ``FrameWriter``, so a test can hand it ``trio.testing.memory_stream_pair()``.
- ``Membership``: who belongs to a closed network (``net/members.py``, the node's
  ``membership``): ``closed`` (False in an open network, where ``is_member`` is always False)
  and ``is_member(peer_id)`` (its signed membership was verified in the hello and is not
  revoked; our own id counts). In a closed network every connected peer passed that check
  before any other protocol ran, so the trust code may trust members from their first answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeAlias, runtime_checkable

import trio
from libp2p.abc import INetStream
from libp2p.pubsub.pb import rpc_pb2

from p2pnode.overlay.peers import PeerTable

StreamHandler = Callable[[INetStream], Awaitable[None]]


class ByteReader(Protocol):
    async def read(self, n: int, /) -> bytes: ...


class ByteWriter(Protocol):
    async def write(self, data: bytes, /) -> None: ...


class Stream(ByteReader, ByteWriter, Protocol):
    """What protocol code needs of a libp2p stream (see the module contract)."""

    async def close(self) -> None: ...


FrameReader: TypeAlias = ByteReader | trio.abc.ReceiveStream
FrameWriter: TypeAlias = ByteWriter | trio.abc.SendStream


class Subscription(Protocol):
    """One gossipsub topic subscription (py-libp2p's ``ISubscriptionAPI`` has it)."""

    async def get(self) -> rpc_pb2.Message: ...


class PubSub(Protocol):
    """The gossipsub calls the services make (py-libp2p's ``Pubsub`` has them)."""

    async def subscribe(self, topic_id: str) -> Subscription: ...

    async def unsubscribe(self, topic_id: str) -> None: ...

    async def publish(self, topic_id: str, data: bytes) -> None: ...

    def set_topic_expiry(
        self,
        topic: str,
        issued_at: Callable[[bytes], float | None],
        max_age_s: float,
        on_expired: Callable[[str], None] | None = None,
    ) -> None: ...


@runtime_checkable
class OverlayHost(Protocol):
    """The overlay node as the services of a served model see it (see the module contract)."""

    peer_id: str
    peers: PeerTable
    pubsub: PubSub

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None: ...

    async def open_stream(
        self,
        peer_id: str,
        protocol: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109  # the node's own limit when None
    ) -> INetStream: ...

    def swap_digests_on_hello(
        self,
        give: Callable[[], tuple[bytes, ...]],
        take: Callable[[str, tuple[bytes, ...]], None],
    ) -> None: ...


@runtime_checkable
class Membership(Protocol):
    """Who belongs to a closed network (see the module contract)."""

    @property
    def closed(self) -> bool: ...

    def is_member(self, peer_id: str) -> bool: ...
