"""Assembly of one node: key, engine (optional), overlay, HTTP API, runtime file.

``run_node(settings)`` runs until SIGINT/SIGTERM, then shuts down in order (API, overlay,
engine) and removes its runtime file. Start-up problems raise ``NodeStartError`` with a message
meant for the person at the terminal, never a traceback. The HTTP port answers from the start:
``/health`` says 503 "loading" until the node's app takes over (``health.StartingApp``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CollectorRegistry

from p2pnode import __version__
from p2pnode.bootstrap._runtime import remove_runtime, write_runtime
from p2pnode.bootstrap.api import build_app, serve_api
from p2pnode.bootstrap.config import NodeSettings
from p2pnode.bootstrap.extension import NodeExtension
from p2pnode.bootstrap.health import StartingApp
from p2pnode.bootstrap.status import process_status, routing_status
from p2pnode.errors import P2PNodeError
from p2pnode.identity import IdentityError, NodeKey

if TYPE_CHECKING:
    from p2pnode.overlay.cache.views import PeerViews
    from p2pnode.overlay.serve.service import RoutedService
    from p2pnode.overlay.trust.audit import AuditConfig
    from p2pnode.overlay.trust.book import TrustBook

log = logging.getLogger("p2pnode.node")


class NodeStartError(P2PNodeError, RuntimeError):
    """The node could not start; the message says what to change."""

    reason = "node_start_failed"


async def _load_engine(settings: NodeSettings, stack: AsyncExitStack):
    """The inference engine, or None for ``--model none``. Imported lazily: torch is heavy."""
    if settings.model == "none":
        return None
    from p2pnode.inference import open_engine
    from p2pnode.inference.models import ModelLoadError, load_light_model, load_model

    path = None if settings.model == "default" else settings.model
    if settings.engine == "vllm":
        return await _open_vllm(settings, path, stack)
    # Emulated compute needs the tokenizer and the sizes, not the weights: no torch, no
    # transformers, a few tens of MB instead of ~0.35 GB per node.
    emulated = settings.backend == "emulated"
    log.info(
        "loading model %s%s", settings.model, " (tokenizer only: emulated)" if emulated else ""
    )
    try:
        if emulated:
            loaded = await trio.to_thread.run_sync(load_light_model, path)
        else:
            loaded = await trio.to_thread.run_sync(lambda: load_model(path, dtype=settings.dtype))
            log.info("model %s runs on %s", loaded.model_id, loaded.compute)
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


async def _open_vllm(settings: NodeSettings, path: str | None, stack: AsyncExitStack):
    from p2pnode.inference.models import ModelLoadError
    from p2pnode.inference.vllm.compat import VllmBuildError
    from p2pnode.inference.vllm.engine import open_vllm_engine

    log.info("starting vLLM on model %s", settings.model)
    try:
        return await stack.enter_async_context(
            open_vllm_engine(
                path,
                max_batch=settings.max_batch,
                cache_budget_tokens=settings.cache_budget_tokens,
            )
        )
    except (VllmBuildError, ModelLoadError, ValueError) as exc:
        raise NodeStartError(f"--engine vllm: {exc}") from None


async def _verifier_model(engine, settings: NodeSettings):
    """The engine's model; a vLLM engine has none in this process, so the verifier loads its
    own (torch; vLLM offers no way to score draft tokens from its prefix cache)."""
    if getattr(engine.loaded, "model", None) is not None:
        return engine.loaded
    from p2pnode.inference.models import load_model

    path = None if settings.model == "default" else settings.model
    return await trio.to_thread.run_sync(lambda: load_model(path, dtype=settings.dtype))


def _swarm_models(settings, node, key, service, registry):
    """Every model of the swarm on this node (``overlay/serve/swarm.py``): the routed service
    of each model peers serve, beside this node's own (``service``; None on a light node)."""
    from p2pnode.overlay.cache.antientropy import AntiEntropy, AntiEntropyConfig
    from p2pnode.overlay.cache.views import PeerViews
    from p2pnode.overlay.limits import PeerLimiter
    from p2pnode.overlay.routing.router import RouterConfig
    from p2pnode.overlay.serve.service import RoutedService
    from p2pnode.overlay.serve.swarm import SwarmModels

    ae_config = AntiEntropyConfig(
        interval_s=settings.gossip_interval, topic_budget_msgs_per_s=settings.gossip_budget
    )
    if service is not None:
        trust, limiter, antientropy = service.trust, service.limiter, None
    else:
        trust, _ = _trust_and_audit(settings, registry)
        limiter = PeerLimiter()
        antientropy = AntiEntropy(
            node, key, PeerViews(), config=ae_config, registry=registry, limiter=limiter
        )
    # A node without the model cannot audit an answer, so its services use only members of
    # a closed network (RoutedService's rule for a service with no engine).
    is_member = node.membership.is_member if node.membership.closed else None

    def make_router(model: str, ae: AntiEntropy, views: PeerViews) -> RoutedService:
        return RoutedService(
            node,
            key,
            None,
            model_id=model,
            views=views,
            antientropy=ae,
            router_config=RouterConfig(),
            trust=trust,
            limiter=limiter,
            is_member=is_member,
        )

    return SwarmModels(
        node,
        primary=service,
        antientropy=antientropy,
        make_router=make_router,
        tokenizer_dir=settings.home / "tokenizers",
    )


def _serve_tokenizer(node, engine) -> None:
    """Hand this model's tokenizer files to light nodes (``overlay/serve/tokenizers.py``)."""
    from p2pnode.overlay.serve.tokenizers import TOKENIZER_PROTOCOL, ServedFiles, TokenizerServer

    loaded = getattr(engine, "loaded", None)
    path = getattr(loaded, "path", None)
    if path is None:  # vLLM keeps its model in another process
        return
    files = {engine.model_id: ServedFiles(path, loaded.weights, loaded.id_note)}
    node.set_stream_handler(TOKENIZER_PROTOCOL, TokenizerServer(lambda: files).handle)


def _lock_home(home: Path) -> int:
    """Hold ``<home>/node.lock`` for the life of the process: two nodes on one home would
    share one key, i.e. one peer id, and overwrite each other's runtime file."""
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(home / "node.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise NodeStartError(
            f"another p2pnode node (pid {holder}) is running with home {home}; give this one "
            "its own --home (each node needs its own key and peer id)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _check_ports(settings: NodeSettings) -> None:
    """Fail before the model loads when a port is taken, naming the flag that moves it."""
    from p2pnode.overlay.net.addrs import ip_port

    for addr in settings.listen:
        endpoint = ip_port(addr)
        if endpoint is not None and endpoint[1] != 0 and not _port_free(*endpoint):
            ip, port = endpoint
            family = "ip6" if ":" in ip else "ip4"
            raise NodeStartError(
                f"port {port} ({addr}) is already in use, maybe by another node on this "
                f"machine; give this node another one, e.g. --listen /{family}/{ip}/tcp/{port + 1}"
            )
    if settings.api_port != 0 and not _port_free(settings.api_host, settings.api_port):
        raise NodeStartError(
            f"the HTTP API port {settings.api_host}:{settings.api_port} is already in use, "
            f"maybe by another node on this machine; give this node --api-port "
            f"{settings.api_port + 1} (0 picks a free one)"
        )


async def _keep_runtime(home: Path, info: Callable[[], dict[str, Any]]) -> None:
    """Keep the runtime file current: addresses change as dial-backs confirm a public one
    and relay reservations come and go (``p2pnode id`` and ``invite`` read it)."""
    last = info()
    while True:
        await trio.sleep(2.0)
        now = info()
        if now != last:
            write_runtime(home, now)
            last = now


def _trust_and_audit(
    settings: NodeSettings, registry: CollectorRegistry
) -> tuple[TrustBook, AuditConfig]:
    """The trust book, restored from the node's home, and the audit settings."""
    from p2pnode.overlay.trust.audit import AuditConfig
    from p2pnode.overlay.trust.book import TrustBook
    from p2pnode.overlay.trust.store import TRUST_FILE, load_trust

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


async def run_node(
    settings: NodeSettings,
    *,
    extensions: Sequence[NodeExtension] = (),
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    timeouts = {
        "ping_timeout": settings.ping_timeout,
        "connect_timeout": settings.connect_timeout,
        "dial_timeout": settings.connect_timeout + 2.0,
        "health_ping_timeout": 2.0 * settings.ping_timeout,
    }
    if settings.model == "none":  # before any thread starts: see share_one_heap
        from p2pnode.inference.models import share_one_heap

        share_one_heap()
    lock = _lock_home(settings.home)
    try:
        await _run_locked(settings, timeouts, extensions, task_status)
    finally:
        os.close(lock)


async def _run_locked(
    settings: NodeSettings,
    timeouts: dict[str, float],
    extensions: Sequence[NodeExtension],
    task_status,
) -> None:
    """Role by role: the API (503 while the rest loads), a closed network's membership, engine,
    overlay node, NAT traversal, services; then the verifier, the services and the app run."""
    _check_ports(settings)
    try:
        key = NodeKey.load_or_create(settings.home)
    except (IdentityError, OSError) as exc:
        raise NodeStartError(f"cannot load the node key from {settings.home}: {exc}") from None
    async with AsyncExitStack() as stack:
        starting = StartingApp()  # /health answers 503 while the model loads
        api_nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(api_nursery.cancel_scope.cancel)
        api = await api_nursery.start(serve_api, starting, settings.api_host, settings.api_port)
        from p2pnode.bootstrap.closed import closed_network

        closed = await closed_network(settings, key)
        engine = await _load_engine(settings, stack)
        node = await _open_node(settings, key, engine, closed, timeouts, stack)
        nat = await _Nat.open(node, settings, stack)
        registry = CollectorRegistry()
        service = _routed_service(settings, node, key, engine, registry)
        routes = settings.routing and "bootstrap" not in settings.role  # the swarm's models too
        swarm = _swarm_models(settings, node, key, service, registry) if routes else None
        if engine is not None:
            _serve_tokenizer(node, engine)
        parts = _Parts(settings, node, api, closed, engine, nat, service, swarm)
        # The API stops first (its graceful shutdown runs while the overlay and engine close).
        stack.callback(api_nursery.cancel_scope.cancel)
        async with trio.open_nursery() as nursery:
            await nursery.start(nat.reachability.run)
            verifier = await _start_verifier(settings, node, engine, service, nursery)
            if service is not None:  # then what the caller adds, and its trust kept on disk
                from p2pnode.overlay.trust.store import TRUST_FILE, keep_trust_saved

                await nursery.start(service.run)
                for extension in extensions:
                    extension.service_started(service, nursery)
                nursery.start_soon(keep_trust_saved, service.trust, settings.home / TRUST_FILE)
            if swarm is not None:
                await nursery.start(swarm.run)
            app = build_app(
                parts.status,
                service=service,
                engine=engine,
                registry=registry,
                api_key=settings.api_key or None,
                swarm=swarm,
            )
            if verifier is not None:
                app.state.console.watch_verifier(verifier)
                app.state.metrics.live.verifier = verifier  # p2pnode_verifier_* on /metrics
            starting.serve(app)
            nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
            write_runtime(settings.home, parts.runtime())
            stack.callback(remove_runtime, settings.home)
            nursery.start_soon(_keep_runtime, settings.home, parts.runtime)
            log.info("node %s up", node.peer_id)
            for addr in node.addrs:
                log.info("  listening on %s", addr)
            log.info("  HTTP API on %s", api)
            task_status.started(node)


async def _open_node(settings, key, engine, closed, timeouts, stack: AsyncExitStack):
    """The overlay node (libp2p host, DHT, gossip, peer table), or a ``NodeStartError``."""
    from p2pnode.overlay.net.hello import NetworkMismatch
    from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node

    config = OverlayConfig(
        key=key,
        listen_addrs=list(settings.listen),
        bootstrap=list(settings.bootstrap),
        announce=list(settings.announce),
        network=settings.network,
        models=[engine.model_id] if engine is not None else [],
        roles=set(settings.role),
        capacity={"max_batch": float(settings.max_batch)},
        ping_interval=settings.ping_interval,
        gossip_heartbeat=settings.gossip_interval,
        gossip_degree=settings.gossip_degree,
        records_budget=min(OverlayConfig.records_budget, settings.gossip_budget),
        conn_low=settings.min_connections if settings.max_connections else 0,
        conn_high=settings.max_connections,
        closed=closed,
        **timeouts,
    )
    try:
        return await stack.enter_async_context(open_overlay_node(config))
    except OSError as exc:
        why = f"cannot listen on {settings.listen}: {exc}; choose another --listen"
        raise NodeStartError(why) from None
    except NetworkMismatch as exc:
        raise NodeStartError(str(exc)) from None


@dataclass
class _Nat:
    """NAT traversal: relays (sought when dial-backs show this node unreachable, offered to
    members when reachable); a direct path (DCUtR) for NAT'd peers that met through a relay."""

    relay: Any
    reachability: Any
    punch: Any

    @classmethod
    async def open(cls, node, settings: NodeSettings, stack: AsyncExitStack) -> _Nat:
        from p2pnode.overlay.net.holepunch import open_hole_punching
        from p2pnode.overlay.net.reachability import ReachabilityService
        from p2pnode.overlay.net.relay import open_relay

        hop = {"auto": "auto", "on": True, "off": False}[settings.relay_hop]
        relay = await stack.enter_async_context(
            open_relay(node, relays=settings.relay, hop=hop, auto=True, limiter=node.limiter)
        )
        reachability = ReachabilityService(node, limiter=node.limiter)
        reachability.on_change.append(relay.on_reachability)
        punch = await stack.enter_async_context(
            open_hole_punching(
                node, public_ips=lambda: sorted(set(reachability.observed_ips.values()))
            )
        )
        return cls(relay, reachability, punch)


def _routed_service(settings, node, key, engine, registry) -> RoutedService | None:
    """This node's own model, routed, audited and trusted; None on a node without one."""
    if engine is None:
        return None
    from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
    from p2pnode.overlay.routing.router import RouterConfig
    from p2pnode.overlay.serve.service import RoutedService
    from p2pnode.overlay.trust.challenge import ChallengeConfig

    trust, audit_config = _trust_and_audit(settings, registry)
    remote = RouterConfig.max_remote_attempts if settings.routing else 0
    return RoutedService(
        node,
        key,
        engine,
        router_config=RouterConfig(max_remote_attempts=remote),
        antientropy_config=AntiEntropyConfig(
            interval_s=settings.gossip_interval, topic_budget_msgs_per_s=settings.gossip_budget
        ),
        pushback_high=settings.pushback_threshold,
        registry=registry,
        trust=trust,
        audit_config=audit_config,
        challenge_config=ChallengeConfig(enabled=settings.probation_challenges),
        advertise_min_uses=settings.advertise_min_uses,
        # Members of a closed network are trusted from their first answer.
        is_member=node.membership.is_member if node.membership.closed else None,
    )


async def _start_verifier(settings, node, engine, service, nursery: trio.Nursery):
    """Role "verifier" (None without it or a model): serves ``/p2pnode/verify/1``."""
    if engine is None or "verifier" not in settings.role:
        return None
    from p2pnode.speculation.advert import VerifierAdvert
    from p2pnode.speculation.protocol import serve_verifier
    from p2pnode.speculation.verify import BatchedVerifier

    verifier = BatchedVerifier(await _verifier_model(engine, settings))
    await nursery.start(verifier.run)
    # One per-peer budget for everything a peer can make this node do.
    limiter = service.limiter if service is not None else None
    serve_verifier(node, verifier, limiter=limiter)
    if service is not None:  # its cache and queue in the digests edges follow
        advert = VerifierAdvert(node.peer_id, verifier, settings.advertise_min_uses)
        service.advertise(advert.builder)
    return verifier


@dataclass
class _Parts:
    """What one node runs, as ``/status`` and the runtime file report it."""

    settings: NodeSettings
    node: Any
    api: str
    closed: Any
    engine: Any
    nat: _Nat
    service: RoutedService | None
    swarm: Any

    def status(self) -> dict[str, Any]:
        node, settings, swarm, nat = self.node, self.settings, self.swarm, self.nat
        return {
            "version": __version__,
            "peer_id": node.peer_id,
            "addrs": list(node.addrs),
            "roles": sorted(settings.role),
            "model": self.engine.model_id if self.engine is not None else None,
            "swarm_models": swarm.listing() if swarm is not None else {},
            **{k: v for k, v in node.status().items() if k not in {"peer_id", "addrs"}},
            "routing": routing_status(self.service, swarm),
            "relay": nat.relay.status(),
            "reachability": nat.reachability.status(),
            "holepunch": nat.punch.status(),
            "network": settings.network,
            "closed": self.closed is not None,
            "process": process_status(),
        }

    def runtime(self) -> dict[str, Any]:
        return {
            "peer_id": self.node.peer_id,
            "addrs": list(self.node.addrs),
            "api": self.api,
            "network": self.settings.network,
            "closed": self.closed is not None,  # `p2pnode invite` and `revoke` read it
            "reachability": self.nat.reachability.verdict,
        }
