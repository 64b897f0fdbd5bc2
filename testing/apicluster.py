"""A loopback cluster of full nodes in this process: real model, overlay, router, HTTP API.

Contract: ``async with api_cluster(loaded, n) as nodes:`` starts ``n`` nodes on 127.0.0.1 (node
i > 0 bootstraps from node 0), each with its own engine on the shared ``loaded`` model (one
torch thread: two OpenMP threads per engine stall each other on 2 shared cores), a
``RoutedService`` and the HTTP API (console included) on a free port; it returns once every
node sees the others up with a measured RTT. ``serving[i] = False`` leaves node i's engine out
of its router (a routing-only front that still tokenizes: every answer is forwarded).
``roles[i]`` sets node i's advertised roles. The nodes form a closed network (each is a member
for the others: ``is_member``), as a swarm started by ``p2pnode bootstrap`` would; ``closed=False``
makes every peer a stranger (open network, probation). Leaving the block stops the APIs and
services first, then the nodes and engines, also on failure.

Shared by the console's browser test, the API tests and ``docs/console_screenshots.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import trio
from prometheus_client import CollectorRegistry

from p2pnode.bootstrap.api import build_app, serve_api
from p2pnode.identity import NodeKey
from p2pnode.inference.engine import open_engine
from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
from p2pnode.overlay.serve.service import RoutedService

MESH_TIMEOUT_S = 60.0
TEARDOWN_SETTLE_S = 0.5


@dataclass
class ApiClusterNode:
    url: str
    engine: Any
    service: RoutedService
    node: Any
    app: Any


@contextlib.asynccontextmanager
async def api_cluster(
    loaded: Any,
    n: int,
    *,
    serving: Sequence[bool] | None = None,
    roles: Sequence[set[str]] | None = None,
    cache_budget_tokens: int = 8192,
    closed: bool = True,
) -> AsyncIterator[list[ApiClusterNode]]:
    serving = list(serving) if serving is not None else [True] * n
    roles = list(roles) if roles is not None else [{"router"}] * n
    ae = AntiEntropyConfig(interval_s=0.3, pull_min_interval_s=0.3)
    async with contextlib.AsyncExitStack() as stack:
        engines: list[Any] = []
        nodes: list[Any] = []
        for i in range(n):  # engines and nodes first: they must outlive the services
            engine = await stack.enter_async_context(
                open_engine(
                    loaded,
                    calibrate_cost=False,
                    torch_threads=1,
                    cache_budget_tokens=cache_budget_tokens,
                )
            )
            # Pings answer late with several real engines on one loop and 2 busy cores: long
            # timeouts keep healthy peers up (see tests/system/test_routing_cluster.py).
            config = OverlayConfig(
                key=NodeKey.generate(),
                bootstrap=[nodes[0].addrs[0]] if i else [],
                models=[engine.model_id] if serving[i] else [],
                roles=set(roles[i]),
                ping_timeout=5.0,
                health_ping_timeout=10.0,
            )
            nodes.append(await stack.enter_async_context(open_overlay_node(config)))
            engines.append(engine)
        # Gossip already in flight lands before the nodes stop: a node whose pubsub closed
        # while its host still reads gossip logs "Nursery is closed to new arrivals".
        stack.push_async_callback(trio.sleep, TEARDOWN_SETTLE_S)
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)  # first on exit: APIs and services stop
        out: list[ApiClusterNode] = []
        members = {x.peer_id for x in nodes}
        for i, (node, engine) in enumerate(zip(nodes, engines, strict=True)):
            registry = CollectorRegistry()
            service = RoutedService(
                node,
                node.config.key,
                engine if serving[i] else None,
                model_id=engine.model_id,
                registry=registry,
                antientropy_config=ae,
                is_member=members.__contains__ if closed else None,
            )
            await nursery.start(service.run)
            app = build_app(node.status, service=service, engine=engine, registry=registry)
            url = await nursery.start(serve_api, app, "127.0.0.1", 0)
            out.append(ApiClusterNode(url, engine, service, node, app))

        def meshed() -> bool:
            return all(
                len(c.node.peers.up_peers()) == n - 1
                and all(c.node.peers.get(p).rtt_ms is not None for p in c.node.peers.up_peers())
                for c in out
            )

        with trio.fail_after(MESH_TIMEOUT_S):
            while not meshed():  # noqa: ASYNC110 (peer tables have no change event to wait on)
                await trio.sleep(0.1)
        yield out
