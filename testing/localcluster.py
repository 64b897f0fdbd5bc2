"""Routed services with emulated engines on overlay nodes open in this process.

Contract: ``async with emulated_routed_services(overlays, model=..., prefill_s=...,
decode_s=...) as services:`` opens one emulated engine per overlay node (the real radix tree,
forwards replaced by the given per-token costs) and runs a ``RoutedService`` on each, in the
order of ``overlays``; leaving the block stops the services, then the engines. ``rtt_s`` fixes
every router's round-trip estimate (one process has no real WAN to measure); further keywords
go to ``RoutedService``. The overlays stay open: the caller owns them.

``loopback_overlays(n)`` opens ``n`` overlay nodes on 127.0.0.1 (node i > 0 bootstraps from node
0; pings patient enough for a loaded machine) and closes them on exit.

``forge_liar(liar, victim, prefill_s=..., decode_s=...)`` turns one of those services into a
lying peer (the trust benchmark and tests use it).

Shared by the routing and trust benchmarks and the cluster tests, so all measure the same setup.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import trio
from prometheus_client import CollectorRegistry

from p2pnode.inference.engine import open_engine
from p2pnode.overlay.cache.digest import DigestBuilder, LoadInfo
from p2pnode.overlay.serve.service import RoutedService


@contextlib.asynccontextmanager
async def loopback_overlays(n: int) -> AsyncIterator[list[Any]]:
    from p2pnode.identity import NodeKey
    from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node

    async with contextlib.AsyncExitStack() as stack:
        nodes: list[Any] = []
        for i in range(n):
            cfg = OverlayConfig(
                key=NodeKey.generate(),
                bootstrap=[nodes[0].addrs[0]] if i else [],
                ping_timeout=5.0,
                health_ping_timeout=10.0,
            )
            nodes.append(await stack.enter_async_context(open_overlay_node(cfg)))
        yield nodes


@contextlib.asynccontextmanager
async def emulated_routed_services(
    overlays: Sequence[Any],
    *,
    model: Any,
    prefill_s: float,
    decode_s: float,
    overhead_s: float = 0.01,
    cache_budget_tokens: int = 4096,
    rtt_s: float | None = None,
    **service_kw: Any,
) -> AsyncIterator[list[RoutedService]]:
    async with contextlib.AsyncExitStack() as stack:
        engines = []
        for _ in overlays:  # every engine before the services' nursery: scopes must nest
            engine = await stack.enter_async_context(
                open_engine(
                    model,
                    backend="emulated",
                    calibrate_cost=False,
                    torch_threads=None,
                    cache_budget_tokens=cache_budget_tokens,
                )
            )
            cost = engine.cost  # frozen by the emulated engine: these are its sleeps
            cost.prefill_s_per_token, cost.decode_s_per_token = prefill_s, decode_s
            cost.overhead_s = overhead_s
            engines.append(engine)
        async with trio.open_nursery() as nursery:
            services = []
            for overlay, engine in zip(overlays, engines, strict=True):
                svc = RoutedService(
                    overlay, overlay.config.key, engine, registry=CollectorRegistry(), **service_kw
                )
                if rtt_s is not None:
                    svc.router.rtt_s = lambda _peer, rtt=rtt_s: rtt
                await nursery.start(svc.run)
                services.append(svc)
            yield services
            nursery.cancel_scope.cancel()


def forge_liar(
    liar: RoutedService, victim: str, *, prefill_s: float, decode_s: float, speedup: float = 10
) -> None:
    """From now on ``liar`` gossips a digest of the prefixes its view says ``victim`` holds,
    signed with its own key, and advertises ``speedup`` x the given speeds with an empty queue.

    Only fingerprints travel in digests, so it forges 64-bit "hashes" whose top bits are the
    stolen fingerprints; its own anti-entropy then publishes, deltas and serves pulls of the
    forgery (a new, later epoch, so receivers replace its honest view)."""
    view = liar.views.get(victim, liar.model_id)
    if view is None:
        raise ValueError(f"{liar.node.peer_id} has no view of {victim} to steal from yet")
    lie = LoadInfo(prefill_s_per_token=prefill_s / speedup, decode_s_per_token=decode_s / speedup)
    forged = DigestBuilder(liar.node.peer_id, liar.model_id, fp_bits=view.fp_bits)
    forged.load_fn = lambda: lie
    forged.sync(fp << (64 - view.fp_bits) for fp in view.fingerprints)
    liar.antientropy.builders[liar.model_id] = forged
