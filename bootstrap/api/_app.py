"""The node's HTTP app: routes, model cards, and the wiring of the API's parts.

Contract: ``build_app(status, ...)`` -> the Starlette app the package face describes. Each
request is read (``_params.read_json``), checked (``ModelNames.check``, ``parse_job``),
admitted and run (``JobRunner``), and answered as one body (``_bodies``) or a stream
(``_sse.EventStream``); every ``ApiError`` becomes its JSON answer, and every request is
counted by endpoint and status (a stream counts itself when it ends).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from p2pnode.bootstrap.api._bodies import completion_body, render_logprobs
from p2pnode.bootstrap.api._errors import ApiError, error_from_exception
from p2pnode.bootstrap.api._params import Job, ModelNames, parse_job, pick_model, read_json
from p2pnode.bootstrap.api._runner import JobRunner
from p2pnode.bootstrap.api._seams import ApiEngine, ApiModels, ApiService
from p2pnode.bootstrap.api._sse import EventStream
from p2pnode.bootstrap.health import health_response, health_state
from p2pnode.bootstrap.metrics import NodeMetrics
from p2pnode.errors import P2PNodeError
from p2pnode.inference.sampling import TokenLogprob

Handler = Callable[[Request], Awaitable[Response]]


def build_app(
    status: Callable[[], dict[str, Any]],
    *,
    service: ApiService | None = None,
    engine: ApiEngine | None = None,
    registry: CollectorRegistry | None = None,
    model_name: str | None = None,
    metrics: NodeMetrics | None = None,
    max_pending: int = 64,
    health: Callable[[], dict[str, Any]] | None = None,
    console: bool = True,
    api_key: str | None = None,
    swarm: ApiModels | None = None,
) -> Starlette:
    """The node's HTTP app (see the package contract).

    ``api_key``: every request must carry it as a bearer token (``bootstrap/auth.py``).

    ``swarm``: every model the swarm serves; requests may then name any of them (those this
    node does not run go to their own routed service, with their tokenizer fetched from a
    peer), and ``/v1/models`` lists them all with how many nodes serve each.

    ``service``: the node's ``RoutedService`` (its ``engine`` is used when ``engine`` is not
    given). ``registry``: the one passed to ``RoutedService``; a fresh one when None.
    ``metrics``: an existing ``NodeMetrics`` for that registry (built here otherwise).
    ``health``: the state ``/health`` reports (``health.health_state`` of the engine and the
    service's node when None). ``console``: serve the web console at ``/`` and its JSON/SSE
    endpoints under ``/console/`` (``console/``).
    """
    if engine is None and service is not None:
        engine = service.engine
    node = getattr(service, "node", None)  # the overlay node, for health, metrics, console
    if metrics is None:
        metrics = NodeMetrics(
            registry if registry is not None else CollectorRegistry(),
            node=node,
            engine=engine,
            service=service,
        )
    runner = JobRunner(service=service, engine=engine, metrics=metrics, max_pending=max_pending)
    metrics.live.inflight = lambda: runner.pending
    model_id = service.model_id if service is not None else getattr(engine, "model_id", None)
    names = ModelNames.of(model_id, model_name)
    created = int(time.time())

    def counted(endpoint: str, handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as exc:
                response = exc.response()
            if not isinstance(response, EventStream):  # a stream counts itself when done
                metrics.count_request(endpoint, response.status_code)
            return response

        return wrapped

    async def get_status(request: Request) -> JSONResponse:
        return JSONResponse(status())

    health_of = health or (lambda: health_state(engine=engine, node=node))

    async def get_health(request: Request) -> JSONResponse:
        return health_response(health_of())

    async def get_peers(request: Request) -> JSONResponse:
        return JSONResponse(status().get("peers", []))

    async def get_metrics(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {
            "id": names.name,
            "object": "model",
            "created": created,
            "owned_by": "p2pnode",
            "p2pnode": {"model_id": names.model_id},
        }

    def swarm_card(model: str, nodes: int, local: str | None) -> dict[str, Any]:
        p2p = {"model_id": model, "nodes": nodes, "local": model == local}
        return {"id": model, "object": "model", "created": created, "owned_by": "p2pnode"} | {
            "p2pnode": p2p
        }

    async def list_models(request: Request) -> JSONResponse:
        if swarm is not None:
            local, listing = swarm.local_model, swarm.listing()
            data = [swarm_card(m, n, local) for m, n in listing.items()]
        else:
            data = [model_card()] if names.model_id is not None else []
        return JSONResponse({"object": "list", "data": data})

    async def get_model(request: Request) -> JSONResponse:
        if swarm is not None:
            listing = swarm.listing()
            model = pick_model(request.path_params["model"], listing, swarm.local_model)
            return JSONResponse(swarm_card(model, listing[model], swarm.local_model))
        names.check(request.path_params["model"])
        return JSONResponse(model_card())

    async def checked_job(body: dict[str, Any], chat: bool) -> Job:
        if swarm is None:
            return parse_job(body, chat=chat, model=names.check(body.get("model")), engine=engine)
        model = pick_model(body.get("model"), swarm.listing(), swarm.local_model)
        if model == swarm.local_model:
            return parse_job(body, chat=chat, model=model, engine=engine)
        try:
            text = await swarm.text(model)
        except P2PNodeError as exc:
            raise ApiError(
                503,
                f"cannot get the tokenizer of {model} from the nodes that serve it: {exc}",
                type="server_error",
                code="no_tokenizer",
            ) from None
        job = parse_job(body, chat=chat, model=model, engine=text)
        job.service = await swarm.service(model)
        if job.service is None:
            raise ApiError(503, f"no node serves {model} any more", code="no_route")
        job.engine = text
        return job

    def completions(chat: bool) -> Handler:
        async def handle(request: Request) -> Response:
            body = await read_json(request)
            job = await checked_job(body, chat)
            runner.admit()
            if job.stream:
                return EventStream(runner, job)
            try:
                out = await runner.run(job, _ignore_text)
            except Exception as exc:
                raise error_from_exception(exc, job.prompt_param) from None
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            headers = {
                "x-p2pnode-served-by": out.served_by or "",
                "x-p2pnode-cached-tokens": str(out.cached_tokens or 0),
            }
            logprobs = render_logprobs(job, out.logprobs, runner.text_of(job))
            return JSONResponse(completion_body(job, rid, out, logprobs), headers=headers)

        return handle

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        code = "not_found" if exc.status_code == 404 else "method_not_allowed"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, message, code=code).response()

    routes = [
        Route("/health", counted("/health", get_health)),
        Route("/status", counted("/status", get_status)),
        Route("/peers", counted("/peers", get_peers)),
        Route("/metrics", counted("/metrics", get_metrics)),
        Route("/v1/models", counted("/v1/models", list_models)),
        Route("/v1/models/{model:path}", counted("/v1/models/{model}", get_model)),
        Route(
            "/v1/completions",
            counted("/v1/completions", completions(chat=False)),
            methods=["POST"],
        ),
        Route(
            "/v1/chat/completions",
            counted("/v1/chat/completions", completions(chat=True)),
            methods=["POST"],
        ),
    ]
    feed = None
    if console:
        from p2pnode.bootstrap.console import ConsoleFeed, console_routes

        feed = ConsoleFeed(status, service=service, engine=engine, metrics=metrics)
        runner.on_outcome = feed.record_outcome
        routes += console_routes(feed, health_of)
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    if api_key:
        from p2pnode.bootstrap.auth import BearerAuth

        app.add_middleware(BearerAuth, api_key=api_key)
    app.state.metrics = metrics
    app.state.api = runner
    app.state.console = feed
    return app


async def _ignore_text(text: str, logprobs: list[TokenLogprob]) -> None:
    return None
