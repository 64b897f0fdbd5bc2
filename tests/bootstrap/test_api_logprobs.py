"""Log-probabilities and cached-token usage at the HTTP API, served locally and forwarded.

Real parts: the SmolLM2 model, two overlay nodes on 127.0.0.1 with their routers and HTTP APIs
(``testnet.apicluster``). Node 0 is a routing-only front (it tokenizes but its router has no
engine), so everything sent to it is forwarded to node 1; node 1 serves what it gets itself.
The reference is one plain forward of the model over prompt + answer, log-softmax at each
position: the engine's incremental, cached and batched computation must match it within 1e-4.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import torch

from p2pnode.inference.sampling import SamplingParams, TokenLogprob, token_logprob
from p2pnode.testing.apicluster import api_cluster

N = 6
PROMPT = "The capital of France is"
TOL = 1e-4


def reference(loaded: Any, prompt: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-softmax of one uncached forward over prompt + tokens, at each generated token."""
    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    return [token_logprob(logits[len(prompt) - 1 + i], t, top) for i, t in enumerate(tokens)]


def test_token_logprob_is_the_log_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    lp = token_logprob(logits, 2, 2)
    expected = torch.log_softmax(logits, -1)
    assert lp.token == 2 and abs(lp.logprob - float(expected[2])) < 1e-6
    assert [t for t, _ in lp.top] == [0, 1]
    assert abs(lp.top[0][1] - float(expected[0])) < 1e-6
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


async def test_engine_stream_carries_logprobs(loaded) -> None:
    from p2pnode.inference.engine import open_engine

    async with open_engine(loaded, calibrate_cost=False, torch_threads=1) as engine:
        prompt = engine.encode(PROMPT)
        stream = engine.stream(prompt, SamplingParams(max_tokens=N, logprobs=2))
        seen = []
        async for token in stream:
            seen.append(stream.logprobs[len(seen)])  # there by the time the token is
            assert seen[-1].token == token
        result = stream.result
        assert result.logprobs == seen and len(seen) == len(result.tokens)
        ref = reference(loaded, prompt, result.tokens, 2)
        for got, want in zip(seen, ref, strict=True):
            assert abs(got.logprob - want.logprob) < TOL
            assert got.top[0][0] == got.token  # greedy: the chosen token is the best one
        plain = await engine.generate(prompt, SamplingParams(max_tokens=N))
        assert plain.logprobs is None and plain.tokens == result.tokens


def check_completion(
    loaded: Any, engine: Any, prompt: list[int], answer: list[int], body: dict[str, Any]
) -> None:
    lps = body["choices"][0]["logprobs"]
    assert len(lps["token_logprobs"]) == body["usage"]["completion_tokens"] == len(answer)
    assert lps["tokens"] == [engine.tokenizer.decode([t]) for t in answer]
    ref = reference(loaded, prompt, answer, 3)
    for i, want in enumerate(ref):
        assert abs(lps["token_logprobs"][i] - want.logprob) < TOL, (i, lps, want)
        top = lps["top_logprobs"][i]
        assert len(top) == 3
        assert max(top.items(), key=lambda kv: kv[1])[0] == lps["tokens"][i]  # greedy
        for t, v in want.top:
            assert abs(top[engine.tokenizer.decode([t])] - v) < TOL
    assert lps["text_offset"][0] == 0


async def test_logprobs_local_and_forwarded_equal_the_model(loaded) -> None:
    async with api_cluster(loaded, 2, serving=[False, True]) as (front, server):
        engine = server.engine
        prompt = engine.encode(PROMPT)
        request = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "logprobs": 3}
        async with httpx.AsyncClient(timeout=60) as http:
            local = await http.post(f"{server.url}/v1/completions", json=request)
            forwarded = await http.post(f"{front.url}/v1/completions", json=request)
        assert local.status_code == forwarded.status_code == 200, (local.text, forwarded.text)
        local_body, fwd_body = local.json(), forwarded.json()
        assert local_body["p2pnode"]["served_locally"] is True
        assert fwd_body["p2pnode"]["served_by"] == server.node.peer_id
        assert fwd_body["p2pnode"]["served_locally"] is False
        answer = (await engine.generate(prompt, SamplingParams(max_tokens=N))).tokens
        check_completion(loaded, engine, prompt, answer, local_body)
        check_completion(loaded, engine, prompt, answer, fwd_body)

        # The second run of the same prompt on node 1 hit its prefix cache: usage says so,
        # in OpenAI's field and in our header.
        cached = fwd_body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == int(forwarded.headers["x-p2pnode-cached-tokens"]) == len(prompt) - 1
        assert local_body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        # Streamed (forwarded): each chunk has the logprobs of its tokens, offsets run on.
        tokens, values, offsets = [], [], []
        async with (
            httpx.AsyncClient(timeout=60) as http,
            http.stream(
                "POST", f"{front.url}/v1/completions", json={**request, "stream": True}
            ) as stream,
        ):
            async for line in stream.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    if choice["logprobs"] is not None:
                        tokens += choice["logprobs"]["tokens"]
                        values += choice["logprobs"]["token_logprobs"]
                        offsets += choice["logprobs"]["text_offset"]
        whole = fwd_body["choices"][0]["logprobs"]
        assert tokens == whole["tokens"] and offsets == whole["text_offset"]
        assert all(abs(x - y) < TOL for x, y in zip(values, whole["token_logprobs"], strict=True))


async def test_chat_logprobs_through_the_openai_client(loaded) -> None:
    async with api_cluster(loaded, 2, serving=[False, True]) as (front, server):
        engine = server.engine
        messages = [{"role": "user", "content": "Say hello in one short sentence."}]
        prompt = engine.encode_chat(messages)
        async with openai.AsyncOpenAI(
            base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=60
        ) as client:
            chat = await client.chat.completions.create(
                model=engine.model_id,
                messages=messages,
                max_tokens=N,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
            )
            content = chat.choices[0].logprobs.content
            assert len(content) == chat.usage.completion_tokens
            answer = (await engine.generate(prompt, SamplingParams(max_tokens=N))).tokens
            ref = reference(loaded, prompt, answer, 2)
            for got, want, tid in zip(content, ref, answer, strict=True):
                assert got.token == engine.tokenizer.decode([tid])
                assert got.bytes == list(got.token.encode())
                assert abs(got.logprob - want.logprob) < TOL
                assert [t.token for t in got.top_logprobs][0] == got.token
                assert len(got.top_logprobs) == 2
            # A prompt the serving node never saw: nothing of it was cached there.
            assert chat.usage.prompt_tokens_details.cached_tokens == 0

            # Streamed: each chunk carries the logprobs of its tokens; together the same list.
            stream = await client.chat.completions.create(
                model=engine.model_id,
                messages=messages,
                max_tokens=N,
                temperature=0,
                logprobs=True,
                stream=True,
                stream_options={"include_usage": True},
            )
            streamed = []
            usage = None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.logprobs is not None and choice.logprobs.content:
                        streamed += choice.logprobs.content
            assert [c.token for c in streamed] == [c.token for c in content]
            assert all(
                abs(a.logprob - b.logprob) < TOL for a, b in zip(streamed, content, strict=True)
            )
            # The same prompt again: all of it but the last token comes from the prefix cache.
            assert usage is not None
            assert usage.prompt_tokens_details.cached_tokens == len(prompt) - 1

        async with httpx.AsyncClient(timeout=30) as http:
            bad = await http.post(
                f"{front.url}/v1/chat/completions",
                json={"messages": messages, "top_logprobs": 2, "max_tokens": 1},
            )
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"
            bad = await http.post(
                f"{front.url}/v1/completions", json={"prompt": "x", "logprobs": 99}
            )
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"
            plain = await http.post(
                f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}
            )
            assert json.loads(plain.text)["choices"][0]["logprobs"] is None
