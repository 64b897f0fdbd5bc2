"""The web console: its JSON/SSE endpoints, and the page itself in a real headless Chromium.

Real parts: loopback clusters of full nodes (SmolLM2, overlay, router, HTTP API;
``testnet.apicluster``), the console's own files as the package ships them, and Debian's
Chromium driven by selenium through chromedriver. The browser test skips, saying why, only
where Chromium, its driver or selenium is missing (``make setup`` installs them as root).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio

from p2pnode.inference.sampling import SamplingParams
from p2pnode.testing.apicluster import api_cluster
from p2pnode.testing.browser import chromium, console_errors, missing_browser

CHAT_TOKENS = 12


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
        assert peer["trust"]["state"] == "member"  # api_cluster is a closed network
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


async def test_console_in_chromium_shows_peers_and_streams_a_chat(loaded, tmp_path) -> None:
    problem = missing_browser()
    if problem is not None:
        pytest.skip(problem)
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


# --------------------------------------------------------------------------- the "why" sentence


def estimate(peer: str, total: float, *, cached: int = 0, skipped: str | None = None) -> Any:
    from p2pnode.overlay.routing.router import CandidateEstimate

    local = peer == "local"
    return CandidateEstimate(
        peer_id=peer,
        is_local=local,
        cached_tokens=cached,
        view_cached_tokens=cached,
        rtt_s=0.0 if local else 0.01,
        transfer_s=0.0 if local else 0.001,
        wait_s=0.0,
        prefill_s=total / 2,
        decode_s=total / 2 - (0.0 if local else 0.031),
        overhead_s=0.0,
        total_s=total,
        skipped=skipped,
    )


def decision(chosen: str, reason: str, *candidates: Any) -> Any:
    from p2pnode.overlay.routing.router import RoutingDecision

    return RoutingDecision(
        request_id="r1",
        model_id="m",
        prompt_tokens=100,
        max_tokens=8,
        chosen=chosen,
        reason=reason,
        margin_s=0.05,
        candidates=tuple(sorted(candidates, key=lambda c: c.total_s)),
        attempts=(chosen,),
        local_total_s=next(c.total_s for c in candidates if c.is_local),
    )


def test_why_sentence_names_the_numbers_behind_each_reason() -> None:
    from p2pnode.bootstrap.console.feed import candidate_record, explain
    from p2pnode.overlay.serve.service import Attempt

    peer = "12D3KooWPeerAAAAAAAAAAAAAAAAAAAAAAAAAAAA11111111"
    ok = [Attempt(peer, "ok", 8, 0.4)]
    d = decision(peer, "remote_faster", estimate("local", 2.0), estimate(peer, 0.5, cached=96))
    text = explain(d, ok, peer, "me")
    assert "0.500 s against 2.000 s here" in text and "96 of 100" in text
    assert "saves 1.500 s" in text and "network +0.031 s" in text
    record = candidate_record(d.candidates[0], 100, peer)
    assert record["chosen"] and abs(record["network_s"] - 0.031) < 1e-9
    assert abs(record["prefill_saved_s"] - 96 * 0.25 / 4) < 1e-9

    slower = decision(
        "local", "remote_saving_below_margin", estimate("local", 1.0), estimate(peer, 1.2)
    )
    assert "every usable peer was estimated slower" in explain(slower, [], "me", "me")
    close = decision(
        "local", "remote_saving_below_margin", estimate("local", 1.0), estimate(peer, 0.98)
    )
    assert "it would save 0.020 s, under the margin" in explain(close, [], "me", "me")
    pushed = decision(
        "local", "local_best", estimate("local", 1.0), estimate(peer, 0.1, skipped="push_back")
    )
    assert "push_back" in explain(pushed, [], "me", "me")
    alone = decision("local", "local_best", estimate("local", 1.0))
    assert "no peer advertises this model" in explain(alone, [], "me", "me")
    failed = [Attempt(peer, "timeout", 2, 3.0), Attempt("local", "ok", 6, 0.5)]
    fell_back = explain(d, failed, "me", "me")
    assert fell_back.endswith("failed (timeout), this node served")


async def test_speculation_panel_reads_a_real_verifier(loaded) -> None:
    from p2pnode.bootstrap.console.feed import ConsoleFeed
    from p2pnode.speculation import BatchedVerifier, Block, EdgeResult, SamplingOptions, SpecStats

    feed = ConsoleFeed(lambda: {"peer_id": "me"})
    assert feed.speculation() == {"verifier": None, "edge": []}
    verifier = BatchedVerifier(loaded)
    feed.watch_verifier(verifier)
    prompt = list(loaded.tokenizer.encode("The capital of France is", add_special_tokens=False))
    with torch.inference_mode():  # the target's own greedy tokens: a draft it accepts in full
        ids = list(prompt)
        for _ in range(6):
            ids.append(int(loaded.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    draft = ids[len(prompt) :]
    async with trio.open_nursery() as nursery:
        await nursery.start(verifier.run)
        sid = await verifier.open_session(prompt, SamplingOptions())
        first = feed.speculation()["verifier"]
        assert [s["sid"] for s in first["sessions"]] == [sid]
        assert first["sessions"][0]["committed_tokens"] == len(prompt)
        assert first["acceptance"] is None  # nothing verified yet
        await trio.sleep(0.6)  # a rate needs two reads at least 0.5 s apart
        r = await verifier.verify(sid, Block(0, len(prompt), prompt[-1], tuple(draft[:3])))
        assert r.accepted == 3
        later = feed.speculation()["verifier"]
        session = later["sessions"][0]
        assert session["committed_tokens"] == len(prompt) + 4
        assert session["tokens_per_s"] is not None and session["tokens_per_s"] > 0
        assert later["acceptance"] == 1.0 and later["stats"]["blocks"] == 1
        assert session["acceptance"] == 1.0 and session["blocks"] == 1
        assert session["lead_tokens"] == 0
        verifier.close_session(sid)
        assert feed.speculation()["verifier"]["sessions"] == []
        nursery.cancel_scope.cancel()

    stats = SpecStats(blocks_verified=2, drafted=8, accepted=6, rejections=1, lead_tokens=3)
    feed.record_edge(EdgeResult("hi", [1] * 9, stats, ["peerA"], seconds=0.5, mode="async"))
    (edge,) = feed.speculation()["edge"]
    assert edge["acceptance"] == 0.75 and edge["lead_tokens"] == 3 and edge["mode"] == "async"
    assert edge["verifiers"] == ["peerA"] and edge["tokens"] == 9


async def test_connection_kind_tells_a_relayed_link_from_a_direct_one() -> None:
    from libp2p.peer.id import ID

    from p2pnode.bootstrap.console.feed import _connection_kind, link_kind
    from p2pnode.identity import NodeKey
    from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
    from p2pnode.overlay.net.relay import open_relay

    keys = [NodeKey.generate() for _ in range(3)]
    async with (
        open_overlay_node(OverlayConfig(key=keys[0])) as r,
        open_relay(r, hop=True),
        open_overlay_node(OverlayConfig(key=keys[1], bootstrap=r.addrs)) as b,
        open_relay(b, relays=r.addrs) as b_relay,
        open_overlay_node(OverlayConfig(key=keys[2])) as a,
        open_relay(a) as a_relay,
    ):
        with trio.fail_after(20):
            await b_relay.wait_reserved()
        assert _connection_kind(a, b.peer_id) == "none"
        assert await a_relay.dial(b_relay.circuit_addrs[0]) == b.peer_id
        # The circuit A dialled is relayed; A may also have dialled B directly since (B is on
        # loopback): the peer's kind is "direct" exactly when one of its links is.
        kinds = [
            link_kind(c) for c in a.host.get_network().get_connections(ID.from_base58(b.peer_id))
        ]
        assert "relayed" in kinds, kinds
        assert _connection_kind(a, b.peer_id) == ("direct" if "direct" in kinds else "relayed")
        to_relay = b.host.get_network().get_connections(ID.from_base58(r.peer_id))
        assert to_relay and {link_kind(c) for c in to_relay} == {"direct"}
        assert _connection_kind(b, r.peer_id) == "direct"
        assert _connection_kind(a, "not a peer id") == "unknown"
