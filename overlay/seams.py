"""What the services of a served model need of the overlay node they run on.

Why: forwarding (``forward.py``), digest gossip (``antientropy.py``), challenges
(``probation.py``) and their composition root (``service.py``) use five things of an
``OverlayNode`` (``node.py``). Written down here, that is the whole seam: a test can hand them
a smaller node, and a change to the node assembly that breaks it fails the conformance test
(tests/overlay/test_node.py), not a request at run time.

Contract:
- ``OverlayHost``: ``peer_id`` (our base58 id), ``peers`` (the ``PeerTable`` of liveness and
  failures), ``pubsub`` (``PubSub``: gossipsub topics), ``set_stream_handler(protocol,
  handler)`` (serve a protocol; the handler's errors never escape), and ``open_stream(peer_id,
  protocol, timeout=)`` (dial if needed; raises ``PeerUnreachable``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from libp2p.abc import INetStream

from p2pnode.overlay.peers import PeerTable

StreamHandler = Callable[[INetStream], Awaitable[None]]


class PubSub(Protocol):
    """The gossipsub calls the services make (py-libp2p's ``Pubsub`` has them)."""

    async def subscribe(self, topic_id: str) -> Any: ...  # an async iterator of messages

    async def unsubscribe(self, topic_id: str) -> None: ...

    async def publish(self, topic_id: str, data: bytes) -> None: ...


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
