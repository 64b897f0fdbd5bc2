"""A peer's bad input costs its stream, never the node.

py-libp2p runs every inbound stream's handler (its own: identify, Kademlia, gossipsub, relay;
and ours) inside the connection's task group, so an exception a handler does not catch ends
the connection's tasks and, through the host's service, the whole node. One malformed
gossipsub RPC did exactly that in a 64-node trial (see ``safepubsub.py`` for that handler's
own fix). ``contain_stream_errors(host)`` wraps the host's common stream handler: an
``Exception`` out of any handler is logged with the protocol and peer, counted, and the
stream is reset; the node and its other streams carry on. Cancellation still propagates.

Contract: ``contain_stream_errors(host, counters)`` once per host, after the host exists and
before it serves; ``counters["stream_handler_errors"]`` counts the contained errors.
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import suppress

import trio
from libp2p.abc import IHost, INetStream

__all__ = ["contain_stream_errors"]

logger = logging.getLogger(__name__)

RESET_TIMEOUT_S = 2.0


def contain_stream_errors(host: IHost, counters: Counter[str]) -> None:
    """Errors out of inbound stream handlers reset that stream only (module doc)."""
    network = host.get_network()
    inner = network.common_stream_handler  # type: ignore[attr-defined]

    async def contained(stream: INetStream) -> None:
        try:
            await inner(stream)
        except Exception as exc:
            counters["stream_handler_errors"] += 1
            logger.warning(
                "a %s stream from %s failed (%r); that stream is reset, the node goes on",
                stream.get_protocol() or "not yet negotiated",
                stream.muxed_conn.peer_id,
                exc,
            )
            with trio.move_on_after(RESET_TIMEOUT_S), suppress(Exception):
                await stream.reset()

    network.set_stream_handler(contained)  # type: ignore[attr-defined]
