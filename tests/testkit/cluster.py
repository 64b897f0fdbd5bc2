"""``overlay_nodes(n)``: real overlay nodes on 127.0.0.1 that already see each other.

Unlike conftest's ``overlay_network`` fixture (which returns as soon as the nodes are up), this
waits for the full mesh of connections and first RTTs, and yields the keys too (anti-entropy
and the routed service sign with them).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import trio

from p2pnode.identity import NodeKey
from p2pnode.overlay.net.node import OverlayConfig, OverlayNode, open_overlay_node


@contextlib.asynccontextmanager
async def overlay_nodes(
    n: int, models: list[str] | None = None
) -> AsyncIterator[tuple[list[NodeKey], list[OverlayNode]]]:
    """``n`` real overlay nodes on 127.0.0.1, all bootstrapped from the first; their signed
    records name ``models`` as served."""
    keys = [NodeKey.generate() for _ in range(n)]
    served = list(models or [])
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(
            open_overlay_node(OverlayConfig(key=keys[0], models=served))
        )
        nodes = [first]
        for key in keys[1:]:
            cfg = OverlayConfig(key=key, bootstrap=[first.addrs[0]], models=served)
            nodes.append(await stack.enter_async_context(open_overlay_node(cfg)))
        with trio.fail_after(10):  # full mesh of connections and first RTTs within 10 s
            while not all(len(nd.peers.up_peers()) == n - 1 for nd in nodes):  # noqa: ASYNC110
                await trio.sleep(0.05)
        yield keys, nodes
