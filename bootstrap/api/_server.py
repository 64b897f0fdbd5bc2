"""Serving the app: hypercorn inside the node's trio loop, on a socket bound here.

Contract:
- ``serve_api(app, host, port, task_status=...)`` serves until cancelled and hands
  ``"http://host:port"`` (the real port, also when 0 asked for a free one) to
  ``task_status.started`` before any request can arrive.
- Cancellation is a graceful shutdown: open requests get ``SHUTDOWN_GRACE_S``.
- A port that cannot be bound is an ``OSError`` that says to choose another ``--api-port``.
"""

from __future__ import annotations

import os
import socket

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette

SHUTDOWN_GRACE_S = 1.0  # open requests get this long when the node stops
KEEP_ALIVE_S = 75.0  # idle seconds before the server closes a keep-alive connection


async def serve_api(
    app: Starlette, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``app`` until cancelled; ``task_status.started`` gets ``"http://host:port"``.

    The socket is bound here (port 0 picks a free one) and handed to hypercorn as a duplicate
    file descriptor (hypercorn closes its copy, we close ours), so the caller learns the real
    port before any request arrives. Cancellation becomes hypercorn's graceful shutdown (open
    requests get ``SHUTDOWN_GRACE_S``) instead of a cancel that the app's lifespan task would
    report as a failure.
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
    bound = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{os.dup(sock.fileno())}"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = SHUTDOWN_GRACE_S
    # Longer than any client's idle keep-alive (httpx, the OpenAI SDK's transport: 5 s, which
    # is also hypercorn's default): the client always drops an idle connection first, so a
    # request is never written into one the server is closing at that instant ("server
    # disconnected without sending a response", seen once in a trial).
    config.keep_alive_timeout = KEEP_ALIVE_S
    shutdown = trio.Event()
    # Shielded: hypercorn must see the shutdown trigger, not the caller's cancellation; the
    # deadline set at shutdown bounds the wait if a connection never finishes.
    server_scope = trio.CancelScope(shield=True)

    async def run_server() -> None:
        with server_scope:
            await serve(app, config, shutdown_trigger=shutdown.wait)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_server)
            task_status.started(f"http://{host}:{bound}")
            try:
                await trio.sleep_forever()
            finally:
                shutdown.set()
                server_scope.deadline = trio.current_time() + SHUTDOWN_GRACE_S + 2.0
    finally:
        sock.close()
