"""``GET /health``: liveness, and readiness once the model is loaded and the overlay joined.

Contract:
- ``health_state(engine=..., node=..., loading=False)`` -> ``{"status", "live", "ready",
  "model", "overlay"}``: ``model`` is ``"loaded"``, ``"loading"`` or ``"none"`` (a node that
  serves no model is ready without one); ``overlay`` is ``"joined"`` (no bootstrap peers
  configured: this node starts the swarm; otherwise a live connection to at least one peer;
  the peer table's "up" is not enough, it trusts a bootstrap peer before any connection),
  ``"joining"`` or ``"none"`` (no overlay). ``ready`` = model not loading and overlay not
  joining; ``status`` is ``"ok"`` when ready, else ``"starting"``. Of the engine only its
  presence counts; of the node, what ``OverlayMember`` states.
- ``health_response(state)``: 200 when ready, 503 (with ``retry-after``) otherwise; the body is
  the state either way, so a load balancer and a person read the same thing.
- ``StartingApp``: the ASGI app a node serves on its HTTP port while it starts (the model can
  take a minute): ``/health`` answers 503 ``"model": "loading"``, every other path 503 in
  OpenAI's error shape. ``serve(app)`` hands every later request to the node's real app.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from libp2p.abc import IHost

    from p2pnode.overlay import OverlayConfig


class OverlayMember(Protocol):
    """The overlay node, as readiness reads it: the bootstrap peers it was configured with
    (``config.bootstrap``) and its libp2p host's live connections."""

    @property
    def config(self) -> OverlayConfig: ...

    @property
    def host(self) -> IHost: ...


def health_state(
    *, engine: object | None = None, node: OverlayMember | None = None, loading: bool = False
) -> dict[str, Any]:
    model = "loading" if loading else ("loaded" if engine is not None else "none")
    if node is None:
        overlay = "none"
    elif not node.config.bootstrap or node.host.get_connected_peers():
        overlay = "joined"
    else:
        overlay = "joining"
    ready = model != "loading" and overlay != "joining"
    return {
        "status": "ok" if ready else "starting",
        "live": True,
        "ready": ready,
        "model": model,
        "overlay": overlay,
    }


def health_response(state: dict[str, Any]) -> JSONResponse:
    if state["ready"]:
        return JSONResponse(state)
    return JSONResponse(state, status_code=503, headers={"retry-after": "1"})


class StartingApp:
    """See the module contract."""

    def __init__(self) -> None:
        self._app: ASGIApp | None = None

    def serve(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._app is not None:
            await self._app(scope, receive, send)
        elif scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]  # "startup" or "shutdown"
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        elif scope["type"] == "http":
            if scope["path"] == "/health":
                response = health_response(health_state(loading=True))
            else:
                error = {
                    "message": "the node is still starting (loading its model); retry shortly "
                    "or watch GET /health",
                    "type": "server_error",
                    "param": None,
                    "code": "starting",
                }
                response = JSONResponse(
                    {"error": error}, status_code=503, headers={"retry-after": "1"}
                )
            await response(scope, receive, send)
