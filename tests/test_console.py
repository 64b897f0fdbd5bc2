"""The web console: its JSON/SSE endpoints, and the page itself in a real headless Chromium.

Real parts: loopback clusters of full nodes (SmolLM2, overlay, router, HTTP API;
``testnet.apicluster``), the console's own files as the package ships them, and Debian's
Chromium driven by selenium through chromedriver. The browser test skips, saying why, only
where Chromium, its driver or selenium is missing (``make setup`` installs them as root).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from p2pnode.inference.sampling import SamplingParams
from p2pnode.testnet.apicluster import api_cluster

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1800",
)
CHAT_TOKENS = 12


@pytest.fixture(scope="module")
def loaded():
    from p2pnode.inference.models import load_model

    return load_model(None)


async def wait_for(predicate, limit_s: float, what: str) -> None:
    with trio.fail_after(limit_s):
        while not predicate():  # noqa: ASYNC110 (state owned by other parts has no event)
            await trio.sleep(0.05)


# --------------------------------------------------------------------------- JSON and SSE


async def read_event(lines: AsyncIterator[str], kind: str) -> dict[str, Any]:
    """The data of the next ``event: kind`` from an SSE response's lines."""
    event = None
    async for line in lines:
        if line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: ") and event == kind:
            return json.loads(line[len("data: ") :])
    raise AssertionError(f"the event stream ended before an {kind!r} event")


async def test_console_endpoints_describe_swarm_node_and_decisions(loaded) -> None:
    async with (
        api_cluster(loaded, 2) as (a, b),
        httpx.AsyncClient(base_url=a.url, timeout=60) as http,
    ):
        page = await http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/console/static/console.js" in page.text
        for name in ("console.js", "console.css"):
            assert (await http.get(f"/console/static/{name}")).status_code == 200
        assert (await http.get("/console/static/../api.py")).status_code == 404
        assert (await http.get("/console/static/nothing.js")).status_code == 404

        swarm = (await http.get("/console/api/swarm")).json()
        assert swarm["self"]["peer_id"] == a.node.peer_id
        (peer,) = swarm["peers"]
        assert peer["peer_id"] == b.node.peer_id and peer["state"] == "up"
        assert peer["rtt_ms"] is not None and peer["connection"] == "direct"
        assert peer["trust"]["usable"] is True
        assert swarm["links"] == [
            {"a": a.node.peer_id, "b": b.node.peer_id, "rtt_ms": peer["rtt_ms"]}
        ]

        async with http.stream("GET", "/console/api/events") as events:
            assert events.headers["content-type"].startswith("text/event-stream")
            lines = events.aiter_lines()
            assert (await read_event(lines, "swarm"))["self"]["peer_id"] == a.node.peer_id
            answer = await http.post(
                "/v1/completions",
                json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            )
            assert answer.status_code == 200
            with trio.fail_after(20):
                pushed = await read_event(lines, "decision")
        assert pushed["id"] == answer.json()["p2pnode"]["routing"]["request_id"]
        assert pushed["served_by"] == answer.headers["x-p2pnode-served-by"]
        assert pushed["generated_tokens"] == 4 and pushed["why"]
        by_peer = {c["peer_id"]: c for c in pushed["candidates"]}
        assert set(by_peer) == {"local", b.node.peer_id}
        assert sum(c["chosen"] for c in pushed["candidates"]) == 1
        for c in pushed["candidates"]:
            parts = c["network_s"] + c["queue_s"] + c["overhead_s"] + c["prefill_s"]
            assert abs(parts + c["decode_s"] - c["total_s"]) < 1e-5
        assert by_peer["local"]["network_s"] == 0.0 and by_peer[b.node.peer_id]["network_s"] > 0
        decisions = (await http.get("/console/api/decisions?limit=5")).json()
        assert decisions == [pushed]
        assert (await http.get("/console/api/decisions?limit=x")).status_code == 400

        await trio.sleep(1.0)  # points are at most one a second: the next one is after it
        node = (await http.get("/console/api/node")).json()
        assert node["peer_id"] == a.node.peer_id and node["history"]
        assert node["totals"]["generated_tokens"] == a.engine.totals["generated_tokens"]
        point = node["history"][-1]
        assert point["cache_tokens"] == a.engine.tree.num_tokens
        snapshot = (await http.get("/console/api/snapshot")).json()
        assert snapshot["health"]["ready"] is True
        assert snapshot["speculation"] == {"verifier": None, "edge": []}


# --------------------------------------------------------------------------- the browser


def _browser_or_skip() -> tuple[Any, Any]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (Debian: chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    return webdriver, Service


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    webdriver, Service = _browser_or_skip()
    profile = tempfile.mkdtemp(prefix="p2pnode-chromium-")
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium must not look for drivers online
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = None
    try:
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        if driver is not None:
            driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def console_errors(driver: Any) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


async def test_console_in_chromium_shows_peers_and_streams_a_chat(loaded, tmp_path) -> None:
    async with api_cluster(loaded, 3) as nodes:
        a = nodes[0]
        others = {n.node.peer_id for n in nodes[1:]}
        with chromium() as driver:
            run = trio.to_thread.run_sync

            def js(script: str, *args: Any) -> Any:
                return driver.execute_script(script, *args)

            try:
                await run(driver.get, a.url + "/")
                assert "p2pnode console" in await run(lambda: driver.title)

                def peers_shown() -> set[str]:
                    rows = js(
                        "return [...document.querySelectorAll('#peers-table tbody tr')]"
                        ".map(r => [r.dataset.peer, r.children[1].textContent]);"
                    )
                    return {peer for peer, state in rows if state == "up"}

                shown: set[str] = set()
                with trio.fail_after(30):
                    while shown != others:
                        shown = await run(peers_shown)
                        await trio.sleep(0.2)
                graph_nodes = await run(
                    js, "return document.querySelectorAll('#overlay-graph circle').length;"
                )
                assert graph_nodes == 3  # this node and its two peers

                # Count the assistant text's updates: streamed text arrives in several.
                await run(
                    js,
                    """
                    window.__partials = [];
                    new MutationObserver((ms) => {
                        for (const m of ms) {
                            const t = m.target;
                            if (t.nodeType === 1 && t.matches('.msg.assistant .text')) {
                                window.__partials.push(t.textContent.length);
                            }
                        }
                    }).observe(document.getElementById('chat-log'),
                               {subtree: true, childList: true, characterData: true});
                    document.getElementById('chat-max').value = arguments[0];
                    document.getElementById('chat-input').value = arguments[1];
                    document.getElementById('chat-send').click();
                    """,
                    CHAT_TOKENS,
                    "Name a color.",
                )
                done = None
                with trio.fail_after(90):
                    while not done:
                        done = await run(
                            js,
                            "const m = document.querySelector('#chat-log .msg.assistant.done,"
                            " #chat-log .msg.error');"
                            " return m && [m.className, m.querySelector('.text').textContent,"
                            " window.__partials];",
                        )
                        await trio.sleep(0.2)
                classes, text, partials = done
                assert "error" not in classes, text
                messages = [{"role": "user", "content": "Name a color."}]
                prompt = a.engine.encode_chat(messages)
                ref = await a.engine.generate(prompt, SamplingParams(max_tokens=CHAT_TOKENS))
                assert text == a.engine.decode(ref.tokens)
                # Streamed: the page showed shorter text before the whole answer.
                assert partials and partials[-1] == len(text), partials
                assert len({n for n in partials if n > 0}) >= 2, partials

                # The routing decision of that chat reaches the page over the event stream.
                decisions = 0
                with trio.fail_after(20):
                    while decisions < 1:
                        decisions = await run(
                            js, "return document.querySelectorAll('#decisions .decision').length;"
                        )
                        await trio.sleep(0.2)
                errors = await run(console_errors, driver)
                assert not errors, errors
            except BaseException:
                shot = Path(tmp_path) / "console-failure.png"
                with contextlib.suppress(Exception):
                    driver.save_screenshot(str(shot))
                    print(f"screenshot of the failing console: {shot}")
                raise
