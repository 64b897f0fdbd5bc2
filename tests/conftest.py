"""Shared fixtures. `overlay_network(n, ...)` starts n real overlay nodes on 127.0.0.1.

The fixture returns an async context manager factory (not the nodes themselves): trio nurseries
must be entered and exited in the same task, which a pytest-trio fixture task is not.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from p2pnode.identity import NodeKey
from p2pnode.overlay.node import OverlayConfig, OverlayNode, open_overlay_node


@contextlib.asynccontextmanager
async def _overlay_network(
    n: int, *, chain: bool = False, models: dict[int, list[str]] | None = None, **config: Any
) -> AsyncIterator[list[OverlayNode]]:
    """n nodes; node i>0 bootstraps from node 0, or from node i-1 when `chain`."""
    models = models or {}
    async with contextlib.AsyncExitStack() as stack:
        nodes: list[OverlayNode] = []
        for i in range(n):
            bootstrap = [] if i == 0 else [nodes[i - 1 if chain else 0].addrs[0]]
            cfg = OverlayConfig(
                key=NodeKey.generate(), bootstrap=bootstrap, models=models.get(i, []), **config
            )
            nodes.append(await stack.enter_async_context(open_overlay_node(cfg)))
        yield nodes


@pytest.fixture
def overlay_network() -> Callable[..., contextlib.AbstractAsyncContextManager[list[OverlayNode]]]:
    return _overlay_network
