"""The node's local HTTP API (an ASGI app served by hypercorn inside the node's trio loop).

Now: ``GET /status`` (JSON: identity, addresses, peers, engine) and ``GET /peers``.
The OpenAI-compatible endpoints and ``/metrics`` mount on the same app.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


def build_app(status: Callable[[], dict[str, Any]]) -> Starlette:
    async def get_status(request: Request) -> JSONResponse:
        return JSONResponse(status())

    async def get_peers(request: Request) -> JSONResponse:
        return JSONResponse(status().get("peers", []))

    return Starlette(routes=[Route("/status", get_status), Route("/peers", get_peers)])


async def serve_api(
    app: Starlette, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``app`` until cancelled; ``task_status.started`` gets ``"http://host:port"``.

    The socket is bound here (port 0 picks a free one) and handed to hypercorn by file
    descriptor, so the caller learns the real port before any request arrives.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot listen for the HTTP API on {host}:{port} ({exc.strerror}); "
            "choose another --api-port (0 picks a free one)"
        ) from None
    sock.listen(128)
    sock.set_inheritable(True)
    bound = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 1.0
    try:
        task_status.started(f"http://{host}:{bound}")
        await serve(app, config, shutdown_trigger=trio.sleep_forever)
    finally:
        sock.close()
