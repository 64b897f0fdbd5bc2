"""overlay/net/patches/containment.py on real nodes: a stream handler that raises costs that stream only.
The node's own handlers guard themselves (``OverlayNode.set_stream_handler``); libp2p's
(identify, Kademlia, gossipsub, relay) are registered on the host directly, as here."""

from __future__ import annotations

import contextlib

import trio
from libp2p.custom_types import TProtocol
from libp2p.host.exceptions import StreamFailure
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID

from p2pnode.overlay.net.hello import HELLO_PROTOCOL

from testkit import wait_until
from testkit.cluster import overlay_nodes

BROKEN = "/test/broken/1"


async def test_a_handler_that_raises_resets_its_stream_and_the_node_serves_on() -> None:
    async with overlay_nodes(2) as (_keys, (a, b)):

        async def broken(stream: object) -> None:
            raise ValueError("a handler bug, or input it did not expect")

        a.host.set_stream_handler(TProtocol(BROKEN), broken)
        a_id = ID.from_base58(a.peer_id)
        for _ in range(3):
            # The reset may even beat the end of our side's negotiation (StreamFailure).
            with trio.move_on_after(5), contextlib.suppress(StreamFailure, StreamEOF, StreamReset):
                stream = await b.host.new_stream(a_id, [TProtocol(BROKEN)])
                assert await stream.read(1) == b""  # the reset (or EOF) arrives, no answer
        await wait_until(
            lambda: a.counters["stream_handler_errors"] == 3, 10, "three errors contained"
        )
        # The connection and the node's own protocols still work.
        assert b.peers.is_up(a.peer_id) and a_id in b.host.get_connected_peers()
        hello = await b.host.new_stream(a_id, [TProtocol(HELLO_PROTOCOL)])
        await hello.reset()
        assert a.status()["counters"]["stream_handler_errors"] == 3
