"""Screenshots of the console for the docs: a 4-node loopback cluster, seen from node 0.

Run: ``.venv/bin/python docs/console_screenshots.py`` (needs Chromium and chromium-driver).
Node 2 first holds a long system prompt in its cache, so a chat with that prompt sent to node
0 is forwarded there (the decision panel shows why); a short chat typed into the page's chat
box streams from node 0. Writes docs/console.png (the whole page) and
docs/console-decisions.png (the decision panel), reduced to 128 colours to stay small.
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import httpx
import trio
from PIL import Image

from p2pnode.inference.blockhash import BLOCK_SIZE, block_hashes
from p2pnode.inference.models import load_model
from p2pnode.testing.apicluster import api_cluster
from p2pnode.testing.browser import chromium, console_errors, missing_browser

DOCS = Path(__file__).resolve().parent
SYSTEM = [{"role": "system", "content": "You are a terse assistant who answers in one line. " * 40}]


def save_png(png: bytes, path: Path, crop: tuple[int, int, int, int] | None = None) -> None:
    img = Image.open(io.BytesIO(png)).convert("RGB")
    if crop is not None:
        img = img.crop(crop)
    img.quantize(colors=128).save(path, optimize=True)
    print(f"wrote {path} ({path.stat().st_size // 1024} KiB, {img.width}x{img.height})")


async def main() -> None:
    problem = missing_browser()
    if problem is not None:
        sys.exit(f"cannot take screenshots: {problem}")
    loaded = load_model(None)
    async with api_cluster(loaded, 4) as nodes, httpx.AsyncClient(timeout=120) as http:
        front, holder = nodes[0], nodes[2]
        system_ids = holder.engine.encode_chat(SYSTEM)
        await holder.engine.generate(system_ids, {"max_tokens": 2})
        hashes = block_hashes(system_ids, front.service.salt)
        full = len(system_ids) // BLOCK_SIZE * BLOCK_SIZE
        with trio.fail_after(120):  # gossip is slow when the 2 cores are shared
            while (  # noqa: ASYNC110 (views change on gossip; no event to wait on)
                front.service.views.cached_prefix_tokens(
                    holder.node.peer_id, hashes, front.engine.model_id
                )
                < full
            ):
                await trio.sleep(0.1)
        with chromium(1400, 1750) as driver:
            run = trio.to_thread.run_sync
            await run(driver.get, front.url + "/")
            for question in ("Name a prime number.", "Name a planet."):
                body = {"messages": [*SYSTEM, {"role": "user", "content": question}]}
                r = await http.post(
                    f"{front.url}/v1/chat/completions", json={**body, "max_tokens": 8}
                )
                print(question, "->", r.headers.get("x-p2pnode-served-by"), r.status_code)
            script = (
                "document.getElementById('chat-max').value = 24;"
                "document.getElementById('chat-input').value = 'Say hello in one sentence.';"
                "document.getElementById('chat-send').click();"
            )
            await run(driver.execute_script, script)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                done = await run(
                    driver.execute_script,
                    "return !!document.querySelector('#chat-log .msg.assistant.done');",
                )
                if done:
                    break
                await trio.sleep(0.2)
            await trio.sleep(4.0)  # a few history points and a swarm refresh
            errors = await run(console_errors, driver)
            if errors:
                print("browser console errors:", errors)
            save_png(await run(driver.get_screenshot_as_png), DOCS / "console.png")
            rect = await run(
                driver.execute_script,
                "const r = document.getElementById('decisions-section').getBoundingClientRect();"
                "return [r.left, r.top, r.right, r.bottom];",
            )
            png = await run(driver.get_screenshot_as_png)
            save_png(png, DOCS / "console-decisions.png", tuple(int(x) for x in rect))


if __name__ == "__main__":
    trio.run(main)
