"""The console's routes: the page at ``/``, its static files, and ``/console/api/*``.

JSON: ``/console/api/swarm``, ``/console/api/node``, ``/console/api/decisions?limit=N``,
``/console/api/speculation``, ``/console/api/snapshot`` (all of them and ``/health`` at once).
SSE: ``/console/api/events`` sends ``event: decision`` as each routed request completes,
``event: node`` every second (a history point) and ``event: swarm`` every ``SWARM_EVERY_S``.
Shapes: docs/console.md.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from p2pnode.bootstrap.console.feed import ConsoleFeed

NODE_EVERY_S = 1.0
SWARM_EVERY_S = 2.0
MAX_DECISIONS = 200
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def _static(name: str) -> bytes | None:
    if "/" in name or name.startswith("."):
        return None
    f = resources.files("p2pnode.bootstrap.console").joinpath("static", name)
    return f.read_bytes() if f.is_file() else None


def _sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def console_routes(feed: ConsoleFeed, health: Callable[[], dict[str, Any]]) -> list[Route]:
    async def page(request: Request) -> Response:
        body = _static("index.html")
        assert body is not None, "the console's index.html is missing from the package"
        return Response(body, media_type="text/html; charset=utf-8")

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        body = _static(name)
        kind = next((t for ext, t in _TYPES.items() if name.endswith(ext)), None)
        if body is None or kind is None:
            return JSONResponse({"error": {"message": f"no console file {name!r}"}}, 404)
        return Response(body, media_type=f"{kind}; charset=utf-8")

    async def swarm(request: Request) -> JSONResponse:
        return JSONResponse(feed.swarm())

    async def node(request: Request) -> JSONResponse:
        return JSONResponse(feed.node())

    async def decisions(request: Request) -> JSONResponse:
        raw = request.query_params.get("limit", "50")
        if not raw.isdigit():
            return JSONResponse(
                {"error": {"message": f"limit must be a whole number, got {raw!r}"}}, 400
            )
        return JSONResponse(feed.recent_decisions(min(int(raw), MAX_DECISIONS)))

    async def speculation(request: Request) -> JSONResponse:
        return JSONResponse(feed.speculation())

    async def snapshot(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "health": health(),
                "swarm": feed.swarm(),
                "node": feed.node(),
                "decisions": feed.recent_decisions(50),
                "speculation": feed.speculation(),
            }
        )

    async def events(request: Request) -> StreamingResponse:
        async def stream() -> AsyncIterator[bytes]:
            recv = feed.subscribe()
            try:
                yield b"retry: 2000\n\n"
                yield _sse("swarm", feed.swarm())
                next_node = next_swarm = trio.current_time()
                while True:
                    now = trio.current_time()
                    if now >= next_node:
                        point = feed.sample()
                        if point is not None:
                            yield _sse("node", point)
                        next_node = now + NODE_EVERY_S
                    if now >= next_swarm:
                        yield _sse("swarm", feed.swarm())
                        yield _sse("speculation", feed.speculation())
                        next_swarm = now + SWARM_EVERY_S
                    record = None
                    with trio.move_on_at(min(next_node, next_swarm)):
                        record = await recv.receive()
                    if record is not None:  # yielded outside the cancel scope
                        yield _sse("decision", record)
            finally:
                feed.unsubscribe(recv)

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    return [
        Route("/", page),
        Route("/console/static/{name}", static),
        Route("/console/api/swarm", swarm),
        Route("/console/api/node", node),
        Route("/console/api/decisions", decisions),
        Route("/console/api/speculation", speculation),
        Route("/console/api/snapshot", snapshot),
        Route("/console/api/events", events),
    ]
