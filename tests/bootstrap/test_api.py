"""The node's OpenAI-compatible HTTP API, end to end.

Real parts only: the SmolLM2 model, real overlay nodes on 127.0.0.1, the API served by hypercorn
on a free port, and the official ``openai`` client (``AsyncOpenAI`` runs on trio through
httpx/anyio). Answers are greedy (temperature 0), so they must equal the engine's own output.
Answers are kept to a few tokens: CPU decode is ~60 ms/token and the 2 cores are shared.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from p2pnode.bootstrap.api import ApiEngine, ApiService, TextAssembler, build_app, serve_api
from p2pnode.identity import NodeKey
from p2pnode.inference.blockhash import BLOCK_SIZE, block_hashes
from p2pnode.inference.engine import Engine, open_engine
from p2pnode.inference.sampling import SamplingParams
from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
from p2pnode.overlay.net.node import OverlayConfig, OverlayNode, open_overlay_node
from p2pnode.overlay.serve.service import RoutedService
from p2pnode.overlay.trust.audit import AuditConfig

from testkit import wait_until

N = 6  # tokens per answer
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Say hello in one short sentence."}]


@dataclass
class ApiNode:
    url: str
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient
    engine: Engine
    service: RoutedService
    node: OverlayNode
    registry: CollectorRegistry


@contextlib.asynccontextmanager
async def api_nodes(loaded, n: int = 1) -> AsyncIterator[list[ApiNode]]:
    """``n`` nodes (engine + overlay + routed service + HTTP API); node i>0 bootstraps from 0."""
    ae = AntiEntropyConfig(interval_s=0.2, pull_min_interval_s=0.3)
    async with contextlib.AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)  # runs first on exit: stops servers
        out: list[ApiNode] = []
        for i in range(n):
            key = NodeKey.generate()
            # One torch thread: on 2 shared, busy cores two OpenMP threads stall each other
            # (measured: 4 tokens took 1.6-6 s with 2 threads, 0.4 s with 1).
            engine = await stack.enter_async_context(
                open_engine(loaded, calibrate_cost=False, torch_threads=1)
            )
            config = OverlayConfig(
                key=key,
                bootstrap=[out[0].node.addrs[0]] if i else [],
                models=[engine.model_id],
            )
            node = await stack.enter_async_context(open_overlay_node(config))
            registry = CollectorRegistry()
            service = RoutedService(
                node,
                key,
                engine,
                registry=registry,
                antientropy_config=ae,
                audit_config=AuditConfig(probation_answers=0),  # the API here, not probation
            )
            await nursery.start(service.run)
            app = build_app(node.status, service=service, registry=registry)
            url = await nursery.start(serve_api, app, "127.0.0.1", 0)
            client = openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60
            )
            http = httpx.AsyncClient(base_url=url, timeout=60)
            stack.push_async_callback(client.close)
            stack.push_async_callback(http.aclose)
            out.append(ApiNode(url, client, http, engine, service, node, registry))
        yield out


async def reference(engine: Engine, prompt_ids: list[int], n: int = N) -> str:
    result = await engine.generate(prompt_ids, SamplingParams(max_tokens=n, temperature=0.0))
    return engine.decode(result.tokens)


def metric(text: str, sample_name: str, **labels: str) -> float:
    """Sum of the samples called ``sample_name`` whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


# --------------------------------------------------------------------------- text assembly


def test_incremental_text_never_splits_characters(loaded) -> None:
    tok = loaded.tokenizer
    text = "Größe 🙂 naïve café ✓ 東京 end"
    ids = tok.encode(text, add_special_tokens=False)

    def decode(t: list[int]) -> str:
        return tok.decode(list(t), skip_special_tokens=True)

    asm = TextAssembler(decode)
    deltas = [asm.push(t) for t in ids] + [asm.finish()]
    assert "".join(deltas) == decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert len(ids) > len([d for d in deltas if d])  # some tokens really were partial characters


def test_stop_string_is_held_back_and_cut(loaded) -> None:
    tok = loaded.tokenizer
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    asm = TextAssembler(lambda t: tok.decode(list(t)), stops=["gam", "zzz"])
    deltas = []
    for t in ids:
        deltas.append(asm.push(t))
        if asm.stopped:
            break
    deltas.append(asm.finish())
    assert asm.stopped and "".join(deltas) == asm.text == "alpha beta "
    # Text that could begin a stop string is not released until it cannot.
    asm2 = TextAssembler(lambda t: tok.decode(list(t)), stops=[" betaX"])
    released = "".join(asm2.push(t) for t in ids[:2])
    assert released == "alpha" and asm2.text == "alpha beta"
    assert released + asm2.finish() == "alpha beta"


# --------------------------------------------------------------------------- endpoints


async def test_completion_and_chat_equal_the_engine_output(loaded) -> None:
    async with api_nodes(loaded) as (a,):
        prompt_ids = a.engine.encode(PROMPT)
        expected = await reference(a.engine, prompt_ids)

        models = await a.client.models.list()
        assert [m.id for m in models.data] == [a.engine.model_id]

        raw = await a.client.completions.with_raw_response.create(
            model=a.engine.model_id, prompt=PROMPT, max_tokens=N, temperature=0
        )
        completion = raw.parse()
        assert completion.choices[0].text == expected
        assert completion.choices[0].finish_reason in {"stop", "length"}
        assert completion.usage.prompt_tokens == len(prompt_ids)
        assert 1 <= completion.usage.completion_tokens <= N
        assert raw.headers["x-p2pnode-served-by"] == a.node.peer_id  # one node: served here
        # The reference run cached this prompt: the exact radix cache reuses all of it but the
        # last token, whose logits the answer needs.
        assert int(raw.headers["x-p2pnode-cached-tokens"]) == len(prompt_ids) - 1
        extra = completion.model_extra["p2pnode"]
        assert extra["served_by"] == a.node.peer_id and extra["served_locally"] is True
        assert extra["routing"]["chosen"] == "local" and extra["routing"]["attempts"]

        by_ids = await a.client.completions.create(
            model=a.engine.model_id, prompt=prompt_ids, max_tokens=N, temperature=0
        )
        assert by_ids.choices[0].text == expected

        chat_ids = a.engine.encode_chat(CHAT)
        chat_expected = await reference(a.engine, chat_ids)
        chat = await a.client.chat.completions.create(
            model=a.engine.model_id, messages=CHAT, max_tokens=N, temperature=0
        )
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content == chat_expected
        assert chat.usage.prompt_tokens == len(chat_ids)
        # The second request reused the prompt that the reference run cached, all but its last
        # token, in our field and in OpenAI's.
        assert chat.model_extra["p2pnode"]["cached_tokens"] == len(chat_ids) - 1
        assert chat.usage.prompt_tokens_details.cached_tokens == len(chat_ids) - 1

        # Chat turns are counted for the router's session look-ahead (overlay/routing/sessions.py):
        # the first turn above, then its second; completions are not chat turns.
        follow_up = [*CHAT, {"role": "assistant", "content": chat_expected},
                     {"role": "user", "content": "And one more?"}]  # fmt: skip
        await a.client.chat.completions.create(
            model=a.engine.model_id, messages=follow_up, max_tokens=2, temperature=0
        )
        assert a.service.sessions.future_turns(0) == pytest.approx(1.0, rel=0.02)
        assert a.service.sessions.future_turns(1) == 0.0


async def test_streaming_chunks_concatenate_to_the_answer(loaded) -> None:
    async with api_nodes(loaded) as (a,):
        expected = await reference(a.engine, a.engine.encode(PROMPT))
        stream = await a.client.completions.create(
            model=a.engine.model_id, prompt=PROMPT, max_tokens=N, temperature=0, stream=True
        )
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason in {"stop", "length"}
        assert chunks[-1].model_extra["p2pnode"]["served_by"] == a.node.peer_id
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

        chat_expected = await reference(a.engine, a.engine.encode_chat(CHAT))
        stream = await a.client.chat.completions.create(
            model=a.engine.model_id,
            messages=CHAT,
            max_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == chat_expected
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1

        # A client that goes away mid-stream frees its engine slot.
        stream = await a.client.completions.create(
            model=a.engine.model_id, prompt=PROMPT, max_tokens=200, temperature=0, stream=True
        )
        async with stream:
            async for _ in stream:
                break
        await wait_until(
            lambda: a.engine.queue_depth == 0, 10, "the abandoned stream's engine slot freed"
        )
        labels = {"endpoint": "/v1/completions", "status": "499"}
        await wait_until(
            lambda: a.registry.get_sample_value("p2pnode_api_requests_total", labels) == 1,
            5,
            "the abandoned request counted with status 499",
        )


async def test_stop_strings_end_the_answer(loaded) -> None:
    async with api_nodes(loaded) as (a,):
        expected = await reference(a.engine, a.engine.encode(PROMPT))
        # The greedy answer to PROMPT is " Paris.\n\nThe answer is:" (several words, a period).
        assert "." in expected and len(expected) > 12, expected
        # A stop string from the middle of the answer (matched on the text, which cancels the
        # generation) and one that never occurs.
        stop = expected[len(expected) // 2 : len(expected) // 2 + 4]
        cut = expected[: expected.find(stop)]
        for stream in (False, True):
            response = await a.client.completions.create(
                model=a.engine.model_id,
                prompt=PROMPT,
                max_tokens=N,
                temperature=0,
                stop=[stop, "never-in-the-answer"],
                stream=stream,
            )
            if stream:
                chunks = [c async for c in response]
                text = "".join(c.choices[0].text for c in chunks)
                finish = chunks[-1].choices[0].finish_reason
            else:
                text, finish = response.choices[0].text, response.choices[0].finish_reason
            assert (text, finish) == (cut, "stop")
        # A one-token stop string stops the engine itself: the routed generation completes
        # (so the serving node is known) instead of being cancelled.
        single = await a.client.completions.create(
            model=a.engine.model_id, prompt=PROMPT, max_tokens=N, temperature=0, stop="."
        )
        assert single.choices[0].text == expected[: expected.find(".")]
        assert single.choices[0].finish_reason == "stop"
        assert single.model_extra["p2pnode"]["served_by"] == a.node.peer_id


async def test_errors_are_openai_style(loaded) -> None:
    async with api_nodes(loaded) as (a,):
        model = a.engine.model_id
        too_long = "hello " * (a.engine.context_length + 10)
        with pytest.raises(openai.BadRequestError) as info:
            await a.client.completions.create(model=model, prompt=too_long, max_tokens=4)
        assert info.value.code == "context_length_exceeded"
        assert "maximum context length is 8192 tokens" in info.value.message
        with pytest.raises(openai.BadRequestError) as info:  # a stream fails before its headers
            await a.client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": too_long}],
                max_tokens=4,
                stream=True,
            )
        assert info.value.code == "context_length_exceeded"
        with pytest.raises(openai.NotFoundError) as info:
            await a.client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)
        assert info.value.code == "model_not_found" and "gpt-5" in info.value.message
        with pytest.raises(openai.BadRequestError) as info:
            await a.client.completions.create(model=model, prompt="hi", temperature=7)
        assert info.value.param == "temperature"
        with pytest.raises(openai.BadRequestError) as info:
            await a.client.completions.create(model=model, prompt=[a.engine.vocab_size + 5])
        assert info.value.param == "prompt" and "vocabulary" in info.value.message
        with pytest.raises(openai.BadRequestError):
            await a.client.chat.completions.create(model=model, messages=[{"role": "x"}])

        bad_json = await a.http.post("/v1/completions", content=b"{not json")
        assert bad_json.status_code == 400
        assert bad_json.json()["error"]["code"] == "invalid_json"
        assert set(bad_json.json()["error"]) == {"message", "type", "param", "code"}
        missing = await a.http.get("/v1/nothing-here")
        assert missing.status_code == 404 and "error" in missing.json()
        wrong_method = await a.http.get("/v1/completions")
        assert wrong_method.status_code == 405
        # No capacity: a node whose router finds nobody to serve (routing-only, no peers) and
        # a node over its in-flight limit both answer 503, streamed or not.
        lonely = RoutedService(a.node, None, None, model_id=model, registry=CollectorRegistry())
        apps = [
            build_app(a.node.status, service=lonely, engine=a.engine),
            build_app(a.node.status, service=a.service, max_pending=0),
        ]
        async with trio.open_nursery() as nursery:
            for app in apps:
                url = await nursery.start(serve_api, app, "127.0.0.1", 0)
                async with openai.AsyncOpenAI(
                    base_url=f"{url}/v1", api_key="unused", max_retries=0
                ) as client:
                    for stream in (False, True):
                        with pytest.raises(openai.InternalServerError) as info:
                            await client.completions.create(
                                model=model, prompt="hi", max_tokens=2, stream=stream
                            )
                        assert info.value.status_code == 503
                        assert info.value.code == "no_capacity"
            nursery.cancel_scope.cancel()

        status = (await a.http.get("/status")).json()
        assert status["peer_id"] == a.node.peer_id
        assert (await a.http.get("/peers")).json() == status["peers"]


async def test_metrics_count_requests_and_tokens(loaded) -> None:
    async with api_nodes(loaded) as (a,):
        before = (await a.http.get("/metrics")).text
        assert metric(before, "p2pnode_api_requests_total") == 0
        first = await a.client.completions.create(
            model=a.engine.model_id, prompt=PROMPT, max_tokens=N, temperature=0
        )
        second = await a.client.completions.create(
            model=a.engine.model_id, prompt=PROMPT, max_tokens=N, temperature=0
        )
        with pytest.raises(openai.NotFoundError):
            await a.client.completions.create(model="nope", prompt="x")
        response = await a.http.get("/metrics")
        assert response.headers["content-type"].startswith("text/plain")
        after = response.text
        done = {"endpoint": "/v1/completions"}
        assert metric(after, "p2pnode_api_requests_total", status="200", **done) == 2
        assert metric(after, "p2pnode_api_requests_total", status="404", **done) == 1
        generated = first.usage.completion_tokens + second.usage.completion_tokens
        assert metric(after, "p2pnode_generated_tokens_total", served="local") == generated
        assert metric(after, "p2pnode_prompt_tokens_total") == 2 * first.usage.prompt_tokens
        # The second identical prompt hits the cache (all but the last prompt token at most).
        assert metric(after, "p2pnode_cached_prompt_tokens_total") >= 1
        assert metric(after, "p2pnode_time_to_first_token_seconds_count") == 2
        assert metric(after, "p2pnode_inter_token_latency_seconds_count") == generated - 2
        # Counters of the router (helper code sharing the registry) and live gauges.
        assert metric(after, "p2pnode_routing_decisions_total") == 2
        assert metric(after, "p2pnode_peers", state="up") == 0
        assert metric(after, "p2pnode_engine_queue_depth") == 0
        assert metric(after, "p2pnode_prefix_cache_tokens") > 0


async def test_engine_and_service_offer_what_the_api_calls(loaded) -> None:
    # The API's seams are Protocols; this checks them by name, so an engine or service that
    # drops or renames a member the API calls fails here rather than in a request.
    async with api_nodes(loaded) as (a,):
        assert isinstance(a.engine, ApiEngine)
        assert isinstance(a.service, ApiService)
        assert not isinstance(a.service, ApiEngine)


async def test_answer_can_be_served_by_a_peer(loaded) -> None:
    async with api_nodes(loaded, 2) as (a, b):
        # Until B's RTT is measured the router assumes a distant peer (1 s).
        await wait_until(
            lambda: getattr(a.node.peers.get(b.node.peer_id), "rtt_ms", None) is not None,
            10,
            "an RTT to node b",
        )
        system = [{"role": "system", "content": "You are a terse assistant. " * 50}]
        system_ids = b.engine.encode_chat(system)
        await b.engine.generate(system_ids, {"max_tokens": 2})  # B now holds the long prefix
        # A runs something too, so both cost models have seen this (busy) machine.
        await a.engine.generate(
            a.engine.encode("Count: one two three four five six seven"), {"max_tokens": 2}
        )
        full_blocks = len(system_ids) // BLOCK_SIZE * BLOCK_SIZE
        hs = block_hashes(system_ids, a.service.salt)
        await wait_until(
            lambda: (
                a.service.views.cached_prefix_tokens(b.node.peer_id, hs, a.engine.model_id)
                >= full_blocks
            ),
            10,
            "node a's view of the prefix node b holds",
        )
        messages = system + [{"role": "user", "content": "Name one prime number."}]
        raw = await a.client.chat.completions.with_raw_response.create(
            model=a.engine.model_id, messages=messages, max_tokens=4, temperature=0
        )
        chat = raw.parse()
        info: dict[str, Any] = chat.model_extra["p2pnode"]
        assert raw.headers["x-p2pnode-served-by"] == b.node.peer_id, info
        assert info["served_locally"] is False and info["routing"]["chosen"] == b.node.peer_id
        # B served it on the system prompt it held: every token the two prompts share.
        prompt_ids = b.engine.encode_chat(messages)
        shared = next(
            i for i, (x, y) in enumerate(zip(system_ids, prompt_ids, strict=False)) if x != y
        )
        assert int(raw.headers["x-p2pnode-cached-tokens"]) == shared > full_blocks - BLOCK_SIZE
        expected = await reference(b.engine, b.engine.encode_chat(messages), 4)
        assert chat.choices[0].message.content == expected
        scrape = (await a.http.get("/metrics")).text
        assert metric(scrape, "p2pnode_generated_tokens_total", served="remote") >= 1
        assert metric(scrape, "p2pnode_forward_attempts_total", outcome="ok") == 1
        assert metric(scrape, "p2pnode_peers", state="up") == 1
