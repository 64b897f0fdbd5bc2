"""Assembly of one node: key, engine (optional), overlay, HTTP API, runtime file.

``run_node(settings)`` runs until SIGINT/SIGTERM, then shuts down in order (API, overlay,
engine) and removes its runtime file. Start-up problems raise ``NodeStartError`` with a message
meant for the person at the terminal, never a traceback.
"""

from __future__ import annotations

import logging
import signal
from contextlib import AsyncExitStack
from typing import Any

import trio
from prometheus_client import CollectorRegistry

from p2pnode import __version__
from p2pnode.bootstrap._runtime import remove_runtime, write_runtime
from p2pnode.bootstrap.api import build_app, serve_api
from p2pnode.bootstrap.config import NodeSettings
from p2pnode.identity import IdentityError, NodeKey

log = logging.getLogger("p2pnode.node")


class NodeStartError(RuntimeError):
    """The node could not start; the message says what to change."""


async def _load_engine(settings: NodeSettings, stack: AsyncExitStack):
    """The inference engine, or None for ``--model none``. Imported lazily: torch is heavy."""
    if settings.model == "none":
        return None
    from p2pnode.inference import open_engine
    from p2pnode.inference.models import ModelLoadError, load_model

    path = None if settings.model == "default" else settings.model
    log.info("loading model %s", settings.model)
    try:
        loaded = await trio.to_thread.run_sync(load_model, path)
    except ModelLoadError as exc:
        raise NodeStartError(str(exc)) from None
    return await stack.enter_async_context(
        open_engine(
            loaded,
            cache_budget_tokens=settings.cache_budget_tokens,
            max_batch=settings.max_batch,
            backend=settings.backend,
            torch_threads=settings.torch_threads,
        )
    )


def _routing_status(service) -> dict[str, Any]:
    if service is None:
        return {}
    views = {
        view.peer_id: {
            "model": view.model_id,
            "version": view.version,
            "blocks": len(view.fingerprints),
            "queue_depth": view.load.queue_depth,
            "push_back": view.load.push_back,
            "age_s": round(service.views.info_age_s(view.peer_id, view.model_id) or 0.0, 3),
        }
        for view in service.views.views()
    }
    local = service.local_load() if service.engine is not None else None
    return {
        "enabled": service.router.config.max_remote_attempts > 0,
        "views": views,
        "queue_depth": local.queue_depth if local else None,
        "push_back": local.push_back if local else None,
        "cached_tokens": service.engine.tree.num_tokens if service.engine is not None else None,
    }


def _trust_and_audit(settings: NodeSettings, registry: CollectorRegistry) -> tuple[Any, Any]:
    """The trust book, restored from the node's home, and the audit settings."""
    from p2pnode.overlay.audit import AuditConfig
    from p2pnode.overlay.trust import TrustBook
    from p2pnode.overlay.trust_store import TRUST_FILE, load_trust

    trust = TrustBook(registry=registry)
    restored = load_trust(trust, settings.home / TRUST_FILE)
    if restored:
        log.info("trust in %d peers restored from %s", restored, settings.home / TRUST_FILE)
    audit = AuditConfig(
        probation_answers=settings.probation_answers,
        trusted_rate=settings.audit_rate,
        budget_share=settings.audit_budget,
    )
    return trust, audit


async def _stop_on_signal(cancel_scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            cancel_scope.cancel()
            return


async def run_node(settings: NodeSettings, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    from p2pnode.overlay.node import OverlayConfig, open_overlay_node

    timeouts = {
        "ping_timeout": settings.ping_timeout,
        "connect_timeout": settings.connect_timeout,
        "dial_timeout": settings.connect_timeout + 2.0,
        "health_ping_timeout": 2.0 * settings.ping_timeout,
    }
    if settings.wan_spec:
        from p2pnode.testnet import wan

        try:
            wan.install(settings.wan_spec, settings.region)
            suggested = wan.suggested_timeouts(settings.wan_spec, settings.region)
        except (wan.WanError, OSError, ValueError) as exc:
            raise NodeStartError(f"cannot emulate the WAN of {settings.wan_spec}: {exc}") from None
        timeouts = {k: max(v, suggested.get(k, 0.0)) for k, v in timeouts.items()}

    try:
        key = NodeKey.load_or_create(settings.home)
    except (IdentityError, OSError) as exc:
        raise NodeStartError(f"cannot load the node key from {settings.home}: {exc}") from None
    async with AsyncExitStack() as stack:
        engine = await _load_engine(settings, stack)
        config = OverlayConfig(
            key=key,
            listen_addrs=list(settings.listen),
            bootstrap=list(settings.bootstrap),
            models=[engine.model_id] if engine is not None else [],
            roles=set(settings.role),
            capacity={"max_batch": float(settings.max_batch)},
            ping_interval=settings.ping_interval,
            gossip_heartbeat=settings.gossip_interval,
            **timeouts,
        )
        try:
            node = await stack.enter_async_context(open_overlay_node(config))
        except OSError as exc:
            raise NodeStartError(f"cannot listen on {settings.listen}: {exc}") from None
        # NAT traversal (issue 8): every node can dial peers behind NAT through a relay
        from p2pnode.overlay.relay import open_relay

        relay = await stack.enter_async_context(
            open_relay(node, relays=settings.relay, hop=settings.relay_hop)
        )

        registry = CollectorRegistry()
        service = None
        if engine is not None:
            from p2pnode.overlay.antientropy import AntiEntropyConfig
            from p2pnode.overlay.forward import RoutedService
            from p2pnode.overlay.router import RouterConfig

            trust, audit_config = _trust_and_audit(settings, registry)
            service = RoutedService(
                node,
                key,
                engine,
                router_config=RouterConfig(
                    max_remote_attempts=RouterConfig.max_remote_attempts if settings.routing else 0
                ),
                antientropy_config=AntiEntropyConfig(interval_s=settings.gossip_interval),
                pushback_high=settings.pushback_threshold,
                registry=registry,
                trust=trust,
                audit_config=audit_config,
                advertise_min_uses=settings.advertise_min_uses,
            )

        def status() -> dict[str, Any]:
            overlay_status = node.status()
            return {
                "version": __version__,
                "peer_id": node.peer_id,
                "addrs": list(node.addrs),
                "roles": sorted(settings.role),
                "model": engine.model_id if engine is not None else None,
                **{k: v for k, v in overlay_status.items() if k not in {"peer_id", "addrs"}},
                "routing": _routing_status(service),
                "relay": relay.status(),
            }

        async with trio.open_nursery() as nursery:
            if service is not None:
                await nursery.start(service.run)
                from p2pnode.overlay.trust_store import TRUST_FILE, keep_trust_saved

                nursery.start_soon(keep_trust_saved, service.trust, settings.home / TRUST_FILE)
            if engine is not None and "verifier" in settings.role:
                from p2pnode.speculation.protocol import serve_verifier
                from p2pnode.speculation.verify import BatchedVerifier

                verifier = BatchedVerifier(engine.loaded)  # the engine's model, not a 2nd load
                await nursery.start(verifier.run)
                # One per-peer budget for everything a peer can make this node do.
                limiter = service.limiter if service is not None else None
                serve_verifier(node, verifier, limiter=limiter)
            app = build_app(
                status,
                service=service,
                engine=engine,
                registry=registry,
                api_key=settings.api_key or None,
            )
            api = await nursery.start(serve_api, app, settings.api_host, settings.api_port)
            nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
            write_runtime(
                settings.home, {"peer_id": node.peer_id, "addrs": list(node.addrs), "api": api}
            )
            stack.callback(remove_runtime, settings.home)
            log.info("node %s up", node.peer_id)
            for addr in node.addrs:
                log.info("  listening on %s", addr)
            log.info("  HTTP API on %s", api)
            task_status.started(node)
