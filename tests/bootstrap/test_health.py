"""``GET /health``: 503 while the node loads its model or has not joined the overlay, 200 after.

Real parts: ``run_node`` itself (model load, overlay, API on a real port) polled over HTTP, and
real overlay nodes for the "joining" state.
"""

from __future__ import annotations

import socket

import httpx
import trio

from p2pnode.bootstrap.config import NodeSettings
from p2pnode.bootstrap.health import health_state
from p2pnode.bootstrap.node import run_node
from p2pnode.identity import NodeKey
from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_health_is_503_while_the_model_loads_then_200(tmp_path) -> None:
    port = free_port()
    settings = NodeSettings(
        home=tmp_path,
        listen=["/ip4/127.0.0.1/tcp/0"],
        api_port=port,
        cache_budget_tokens=2048,
        torch_threads=1,
    ).validate()
    seen: list[tuple[int, dict]] = []
    starting_error = None
    async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=5) as http:
        nursery.start_soon(run_node, settings)
        url = f"http://127.0.0.1:{port}"
        with trio.fail_after(180):
            while not seen or seen[-1][0] != 200:
                try:
                    r = await http.get(f"{url}/health")
                except httpx.TransportError:  # the port is not bound yet
                    await trio.sleep(0.02)
                    continue
                seen.append((r.status_code, r.json()))
                if r.status_code == 503 and starting_error is None:
                    models = await http.get(f"{url}/v1/models")
                    starting_error = (models.status_code, models.json()["error"]["code"])
                await trio.sleep(0.02)
        ready = await http.get(f"{url}/v1/models")
        nursery.cancel_scope.cancel()
    first_status, first = seen[0]
    assert first_status == 503, seen[:3]
    assert first["model"] == "loading" and first["ready"] is False and first["live"] is True
    assert starting_error == (503, "starting")
    last_status, last = seen[-1]
    assert last == {
        "status": "ok",
        "live": True,
        "ready": True,
        "model": "loaded",
        "overlay": "joined",  # no bootstrap peers: this node starts the swarm
    }
    assert ready.status_code == 200 and ready.json()["data"]


async def test_overlay_readiness_needs_a_peer_when_bootstrapping() -> None:
    async with open_overlay_node(OverlayConfig(key=NodeKey.generate())) as first:
        peer_id = first.peer_id
    # A bootstrap address where nothing listens: this node cannot join and is not ready.
    gone = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{peer_id}"
    lonely_cfg = OverlayConfig(key=NodeKey.generate(), bootstrap=[gone], connect_timeout=1.0)
    async with open_overlay_node(lonely_cfg) as lonely:
        state = health_state(node=lonely)
        assert state["overlay"] == "joining" and state["ready"] is False
        assert state["model"] == "none" and state["status"] == "starting"
    async with open_overlay_node(OverlayConfig(key=NodeKey.generate())) as a:
        cfg = OverlayConfig(key=NodeKey.generate(), bootstrap=[a.addrs[0]])
        async with open_overlay_node(cfg) as b:
            with trio.fail_after(20):
                while not b.peers.up_peers():  # noqa: ASYNC110 (no event for peer-table changes)
                    await trio.sleep(0.05)
            assert health_state(node=b)["overlay"] == "joined"
            assert health_state(node=b, engine=object())["ready"] is True
