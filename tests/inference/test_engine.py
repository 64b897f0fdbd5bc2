"""Engine tests on the real default model (SmolLM2-135M fp32), short prompts, one model load."""

from __future__ import annotations

import contextlib
import functools
import time

import pytest
import torch
import trio

from p2pnode.inference import (
    EmptyPrompt,
    EngineClosed,
    InvalidParams,
    InvalidToken,
    PromptTooLong,
    SamplingParams,
    open_engine,
    probs_from_logits,
)
from p2pnode.inference._backend import HFBackend
from p2pnode.inference.blockhash import (
    BlockRemoved,
    BlockStored,
    block_hashes,
    cached_prefix_tokens,
    model_salt,
)
from p2pnode.inference.models import ShapeOnlyModel
from p2pnode.inference.radix import RadixCache

from testkit import models, wait_until

N_NEW = 8
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def loaded(loaded):
    """The shared model (tests/conftest.py); these tests run torch on 2 threads."""
    torch.set_num_threads(2)
    return loaded


def hf_greedy(loaded, prompt: list[int], n: int) -> list[int]:
    """Plain transformers greedy loop: the reference the engine must reproduce."""
    return models.hf_greedy(loaded.model, set(loaded.eos_token_ids), prompt, n)


def engine(loaded, **kw):
    kw.setdefault("calibrate_cost", False)
    return open_engine(loaded, **kw)


LONG_PROMPT = [(5 + 13 * i) % 5000 for i in range(640)]


@contextlib.asynccontextmanager
async def busy_emulated(loaded, *, max_batch: int, chat_tokens: int):
    """An emulated engine (2 ms a prompt token, 64-token chunks) with one request decoding
    ``chat_tokens``: it keeps every prefill at ``prefill_chunk`` tokens a step."""
    async with engine(loaded, backend="emulated", max_batch=max_batch, prefill_chunk=64) as eng:
        c = eng.cost
        c.prefill_s_per_token, c.decode_s_per_token, c.overhead_s = 2e-3, 1e-3, 0.0
        prompt = [(11 + 7 * i) % 5000 for i in range(20)]
        chat = eng.stream(prompt, SamplingParams(max_tokens=chat_tokens))
        await chat.__anext__()
        yield eng
        await chat.aclose()


async def test_greedy_with_and_without_cache_equals_hf_loop(loaded) -> None:
    prompt = loaded.tokenizer.encode("Question: what is two plus two? Answer:")
    ref = hf_greedy(loaded, prompt, N_NEW)
    async with engine(loaded) as eng:
        miss = await eng.generate(prompt, SamplingParams(max_tokens=N_NEW))
        hit = await eng.generate(prompt, SamplingParams(max_tokens=N_NEW))
        longer = prompt + eng.encode(" Four.")
        ext = await eng.generate(longer, SamplingParams(max_tokens=N_NEW))
    assert miss.tokens == ref and miss.cached_tokens == 0
    assert hit.tokens == ref and hit.cached_tokens == len(prompt) - 1
    assert ext.cached_tokens >= len(prompt)
    assert ext.tokens == hf_greedy(loaded, longer, N_NEW)
    assert miss.prompt_tokens == len(prompt) and miss.ttft_s <= miss.total_s


def test_cached_prefix_logits_match_full_recompute(loaded) -> None:
    tok = loaded.tokenizer
    prefix = tok.encode("A long shared system prompt about geography and history. " * 3)
    suffix = tok.encode("Which river flows through Paris?")
    backend = HFBackend(loaded.model)
    tree = RadixCache(loaded.model_id)
    with torch.inference_mode():
        full = backend.new_state(None, 0)
        ref = backend.extend(full, prefix + suffix)
        first = backend.new_state(None, 0)
        backend.extend(first, prefix)
        tree.insert(prefix, lambda b, e: backend.export_kv(first, b, e))
        m = tree.match(prefix + suffix)
        assert m.length == len(prefix)
        reused = backend.new_state(tree.gather(m), m.length)
        got = backend.extend(reused, suffix)
    # fp32 with a different split of the same sums (prefix K/V computed separately, other matmul
    # shapes) rounds differently: ~5e-5 on logits of magnitude ~20. 1e-3 keeps a wide margin yet
    # any wrong position or KV slice shows up as differences of order 1 or more.
    assert (got - ref).abs().max().item() < 1e-3
    assert int(got.argmax()) == int(ref.argmax())


async def test_tiny_budget_evicts_and_still_serves_correctly(loaded) -> None:
    prompts = [loaded.tokenizer.encode(p + " " + p) for p in PROMPTS]
    refs = [hf_greedy(loaded, p, 4) for p in prompts]
    events: list = []
    async with engine(loaded, cache_budget_tokens=24) as eng:
        eng.add_block_listener(events.append)
        for p, ref in zip(prompts + prompts[:1], refs + refs[:1], strict=True):
            res = await eng.generate(p, SamplingParams(max_tokens=4))
            assert res.tokens == ref
            assert eng.tree.num_tokens <= 24  # nothing is pinned between requests
        assert eng.tree.evicted_tokens > 0
        replay: set[int] = set()  # what a listener rebuilds from the events, in order
        for e in events:
            if isinstance(e, BlockStored):
                replay.update(e.hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.hashes) <= replay
                replay.difference_update(e.hashes)
        assert any(isinstance(e, BlockRemoved) for e in events)  # evictions were announced
        assert replay == eng.cached_block_hashes()


async def test_inflight_prefix_is_pinned(loaded) -> None:
    tok = loaded.tokenizer
    async with engine(loaded, cache_budget_tokens=1) as eng:
        long_prompt = eng.encode_chat([{"role": "user", "content": "Write a poem about the sea."}])
        other = tok.encode("List three colours of the rainbow, separated by commas please.")
        eng.tree.max_tokens = len(long_prompt) + 4
        stream = eng.stream(long_prompt, SamplingParams(max_tokens=12))
        first = await stream.__anext__()  # prompt is prefilled, inserted and pinned now
        assert first not in loaded.eos_token_ids  # still running: its prompt must stay pinned
        seen = [first]
        await eng.generate(other, SamplingParams(max_tokens=2))  # pushes the tree over budget
        assert eng.cached_prefix_len(long_prompt) == len(long_prompt)
        assert eng.cached_prefix_len(other) < len(other)  # the unpinned one was evicted
        seen += [t async for t in stream]
        assert stream.result is not None and stream.result.tokens == seen


async def test_block_hash_chain_matches_tree(loaded) -> None:
    prompt = loaded.tokenizer.encode("In the beginning there was a long prompt. " * 5)
    assert len(prompt) >= 40
    events: list = []
    async with engine(loaded) as eng:
        eng.add_block_listener(events.append)
        await eng.generate(prompt, SamplingParams(max_tokens=2))
        hashes = block_hashes(prompt, model_salt(eng.model_id))
        cached = eng.cached_block_hashes()
        assert set(hashes) <= cached
        n = cached_prefix_tokens(hashes, cached.__contains__)
        assert n == eng.cached_prefix_len(prompt) // 16 * 16 == len(prompt) // 16 * 16
        stored = [h for e in events if isinstance(e, BlockStored) for h in e.hashes]
        assert stored[: len(hashes)] == hashes and set(stored) == cached


async def test_concurrent_requests_match_solo_runs(loaded) -> None:
    params = SamplingParams(max_tokens=N_NEW)
    async with engine(loaded, max_batch=4) as eng:
        prompts = [eng.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        alone = [(await eng.generate(p, params)).tokens for p in prompts]
        eng.tree.clear()
        steps_before = eng.steps
        together: dict[int, list[int]] = {}

        async def run(i: int) -> None:
            together[i] = (await eng.generate(prompts[i], params)).tokens

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(run, i)
        # Batched: about N_NEW + 3 prefill steps, not 3 * (N_NEW + 1) one-by-one steps.
        assert eng.steps - steps_before <= N_NEW + 4
    assert all(len(t) == N_NEW for t in alone)  # chat prompts: no early EOS, a real comparison
    assert [together[i] for i in range(len(prompts))] == alone


async def test_bad_inputs_get_clear_errors_and_engine_keeps_serving(loaded) -> None:
    async with engine(loaded) as eng:
        ok = eng.encode("Hello")
        cases = [
            ([], None, EmptyPrompt),
            ([eng.vocab_size], None, InvalidToken),
            ([-1], None, InvalidToken),
            (["a"], None, InvalidToken),
            ("Hello", None, InvalidToken),
            (ok * (eng.context_length // len(ok) + 1), None, PromptTooLong),
            (ok, {"max_tokens": eng.context_length}, PromptTooLong),
            (ok, {"max_tokens": 0}, InvalidParams),
            (ok, {"temperature": -0.1}, InvalidParams),
            (ok, {"top_p": 0.0}, InvalidParams),
            (ok, {"top_p": 1.5}, InvalidParams),
            (ok, {"beam_width": 3}, InvalidParams),
            (ok, {"stop_token_ids": [-3]}, InvalidParams),
        ]
        for prompt, params, err in cases:
            with pytest.raises(err):
                await eng.generate(prompt, params)
        res = await eng.generate(ok, {"max_tokens": 3})
        assert len(res.tokens) == 3 and res.finish_reason == "length"


async def test_seeded_sampling_is_reproducible_and_stop_ids_stop(loaded) -> None:
    prompt = loaded.tokenizer.encode("My favourite animal is")
    p = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=1234)
    async with engine(loaded) as eng:
        a = await eng.generate(prompt, p)
        b = await eng.generate(prompt, p)
        assert a.tokens == b.tokens
        stop = a.tokens[1]
        c = await eng.generate(prompt, SamplingParams(**{**p.__dict__, "stop_token_ids": (stop,)}))
        assert c.finish_reason == "stop" and c.tokens[-1] == stop and stop not in c.tokens[:-1]


def test_probs_from_logits_transform() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    greedy = probs_from_logits(logits, 0.0, 1.0)
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    full = probs_from_logits(logits, 1.0, 1.0)
    assert torch.allclose(full, torch.softmax(logits, -1))
    top = probs_from_logits(logits, 1.0, 0.7)  # softmax ~ [.64, .24, .09, .03]: keeps 2
    assert (top[0, 2:] == 0).all() and abs(float(top.sum()) - 1.0) < 1e-6
    assert probs_from_logits(logits, 1.0, 1e-6)[0, 0] == 1.0


async def test_emulated_backend_keeps_real_tree(loaded) -> None:
    prompt = loaded.tokenizer.encode("An emulated request with a prefix long enough. " * 2)
    async with engine(loaded, backend="emulated") as eng:
        eng.cost.prefill_s_per_token, eng.cost.decode_s_per_token = 1e-4, 1e-3
        a = await eng.generate(prompt, SamplingParams(max_tokens=5))
        b = await eng.generate(prompt, SamplingParams(max_tokens=5))
        assert a.tokens == b.tokens and len(a.tokens) == 5
        assert b.cached_tokens == len(prompt) - 1
        assert eng.cached_block_hashes()
        assert eng.estimated_wait_s() == 0.0 and eng.queue_depth == 0
        # The emulated hardware keeps one speed: observed forwards (its own sleeps plus
        # scheduling lag) must not ratchet the cost it sleeps.
        assert (eng.cost.prefill_s_per_token, eng.cost.decode_s_per_token) == (1e-4, 1e-3)


async def test_score_on_a_cached_prefix_equals_a_full_teacher_forced_pass(loaded) -> None:
    """``Engine.score``: the logits for each answer token, from one prefill on the cached
    prefix, equal those of a full pass of the model over prompt + answer (what an audit
    compares); the answer positions are computed even when they are cached."""
    from p2pnode.inference.scoring import EmulatedScorer, ModelScorer

    prompt = loaded.tokenizer.encode("A prompt whose prefix the engine will hold. " * 8)
    async with engine(loaded) as eng:
        answer = (await eng.generate(prompt, SamplingParams(max_tokens=6))).tokens
        wrong = [answer[0], (answer[1] + 1) % loaded.vocab_size, *answer[2:]]
        reference = ModelScorer(loaded.model).logits(prompt, wrong)
        before = eng.totals["cached_tokens"]
        rows = await eng.score(prompt, wrong)
        assert rows.shape == reference.shape
        assert torch.allclose(rows, reference, atol=1e-3)
        assert eng.totals["cached_tokens"] - before == len(prompt) - 1  # on the cached prefix
        with pytest.raises(EmptyPrompt):
            await eng.score(prompt, [])
        with pytest.raises(InvalidToken):
            await eng.score(prompt, [loaded.vocab_size])
    async with engine(loaded, backend="emulated") as eng:
        eng.cost.prefill_s_per_token, eng.cost.decode_s_per_token = 1e-5, 1e-4
        answer = (await eng.generate(prompt, SamplingParams(max_tokens=4))).tokens
        rows = await eng.score(prompt, answer)
        ref = EmulatedScorer(loaded.vocab_size, eng.backend.eos_token_id, eng.cost)
        expected = ref.logits(prompt, answer)
        assert [r.argmax() for r in rows] == [r.argmax() for r in expected] == answer


async def test_queued_requests_sharing_a_prefix_count_it_once(loaded) -> None:
    shared = [(7 + 13 * i) % 5000 for i in range(200)]
    prompts = [shared + [100 + k] * 16 for k in range(3)]
    async with engine(loaded, backend="emulated", max_batch=1) as eng:
        c = eng.cost
        c.prefill_s_per_token, c.decode_s_per_token, c.overhead_s = 1e-3, 1e-3, 0.0
        # No checkpoint between the submissions and the estimate: all three still wait.
        streams = [eng.stream(p, SamplingParams(max_tokens=1)) for p in prompts]
        # The first pays the shared 200 tokens, the others only their 16-token suffixes
        # (counting each as a miss would say 648 ms); none runs yet, so no decode is ahead.
        assert eng.estimated_wait_s() == pytest.approx((216 + 16 + 16) * 1e-3, abs=1e-9)
        for st in streams:
            await st.aclose()


async def test_a_short_request_behind_a_long_prefill_waits_a_chunk_not_the_backlog(
    loaded,
) -> None:
    """Prefills share steps round robin: a request needing one chunk, admitted while a long
    prompt is being prefilled, waits for about one chunk of it, and its estimate says so,
    where the bound for any request counts the whole backlog."""
    async with busy_emulated(loaded, max_batch=4, chat_tokens=400) as eng:
        long = eng.stream(LONG_PROMPT, SamplingParams(max_tokens=1))
        await trio.sleep(0.05)  # its prefill has started
        bound = eng.estimated_wait_s()
        short_wait = eng.estimated_wait_s(16)
        assert bound > 0.9  # most of 640 tokens at 2 ms
        assert short_wait < 0.3 * bound
        done: list[str] = []

        async def run(name: str, stream) -> None:
            async for _ in stream:
                pass
            done.append(name)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "long", long)
            short = eng.stream(
                [(3 + 17 * i) % 5000 for i in range(17)], SamplingParams(max_tokens=1)
            )
            nursery.start_soon(run, "short", short)
        assert done == ["short", "long"]  # the one-chunk request did not queue behind it
        assert short.result.total_s < bound
        assert time.perf_counter() - t0 >= short.result.total_s


async def test_a_burst_sharing_a_new_prefix_computes_it_once(loaded) -> None:
    """Three requests that share a prefix nobody has cached arrive together: one computes
    it, the other two wait for its blocks and reuse them; every answer is still the
    plain reference loop's."""
    tok = loaded.tokenizer
    shared = tok.encode("Notes on the rivers of Europe and the towns along them. " * 12)
    assert len(shared) >= 120
    prompts = [shared + tok.encode(q) for q in (" The Danube", " The Rhine flows", " Seine:")]
    want = [hf_greedy(loaded, p, 4) for p in prompts]
    params = SamplingParams(max_tokens=4)
    async with engine(loaded, max_batch=4) as eng:
        results: dict[int, object] = {}

        async def run(i: int) -> None:
            results[i] = await eng.generate(prompts[i], params)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(run, i)
        whole = len(shared) // 16 * 16
        cached = sorted(results[i].cached_tokens for i in range(3))
        assert cached[0] == 0 and cached[1] >= whole  # whichever came first computed it
        assert eng.totals["prompt_tokens"] - eng.totals["cached_tokens"] < len(shared) + 40
    assert [results[i].tokens for i in range(3)] == want


async def test_a_request_held_for_a_running_prefill_keeps_its_place_and_lets_others_in(
    loaded,
) -> None:
    """Held back for the first 320 tokens of a 640-token prefill, a request is admitted once
    those are in the tree (before the long one ends); one that shares nothing runs meanwhile;
    one that shares under a block is not held at all."""
    async with busy_emulated(loaded, max_batch=5, chat_tokens=800) as eng:
        streams = {
            "long": eng.stream(LONG_PROMPT, SamplingParams(max_tokens=1)),
            "half": eng.stream(LONG_PROMPT[:320] + [77] * 16, SamplingParams(max_tokens=1)),
            "other": eng.stream(
                [(3 + 17 * i) % 5000 for i in range(17)], SamplingParams(max_tokens=1)
            ),
            "sliver": eng.stream(LONG_PROMPT[:10] + [88] * 30, SamplingParams(max_tokens=1)),
        }
        done: list[str] = []

        async def run(name: str) -> None:
            async for _ in streams[name]:
                pass
            done.append(name)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for name in streams:
                    nursery.start_soon(run, name)
    res = {name: st.result for name, st in streams.items()}
    assert res["half"].cached_tokens == 320  # all of the shared part, computed once
    assert res["sliver"].cached_tokens == 0  # 10 shared tokens: not worth a wait
    assert done.index("half") < done.index("long")
    assert done.index("other") < done.index("half")


async def test_long_prefill_is_chunked_between_decode_steps(loaded) -> None:
    async with engine(loaded, prefill_chunk=64) as eng:
        short = eng.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
        long_prompt = eng.encode("Facts about rivers, lakes and seas. " * 40)[:256]
        a = eng.stream(short, SamplingParams(max_tokens=10))
        a_tokens = [await a.__anext__()]
        b = eng.stream(long_prompt, SamplingParams(max_tokens=2))
        b_first = None
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:

                async def read_b() -> None:
                    nonlocal b_first
                    b_first = await b.__anext__()
                    async for _ in b:
                        pass

                nursery.start_soon(read_b)
                while b_first is None:
                    a_tokens.append(await a.__anext__())
                tokens_while_b_prefilled = len(a_tokens) - 1
                a_tokens += [t async for t in a]
        # 256 tokens in 64-token chunks = 4 scheduler steps, each also decoding the short request.
        assert tokens_while_b_prefilled >= 3
        assert a.result is not None and a.result.tokens == a_tokens


async def test_shutdown_fails_inflight_requests_cleanly(loaded) -> None:
    async with engine(loaded) as eng:
        prompt = eng.encode_chat([{"role": "user", "content": "Count from one to fifty."}])
        stream = eng.stream(prompt, SamplingParams(max_tokens=50))
        await stream.__anext__()
    with pytest.raises(EngineClosed):
        async for _ in stream:
            pass
    with pytest.raises(EngineClosed):
        eng.stream(prompt)


async def test_the_cpu_engine_offers_what_the_routing_layer_uses() -> None:
    from p2pnode.inference.serving import ServingEngine

    async with open_engine(
        ShapeOnlyModel(model_id="seam-check"), backend="emulated", calibrate_cost=False,
        torch_threads=None,
    ) as engine:  # fmt: skip
        assert isinstance(engine, ServingEngine)


async def test_an_idle_engine_measures_again_and_keeps_the_faster_figures(loaded) -> None:
    # A start-up calibration taken while other processes held the cores makes the node look
    # slow to its router, which then forwards everything and never serves a request that
    # would correct it: an idle engine measures again and keeps the faster of each figure.
    from p2pnode.inference.costmodel import calibrate, recalibrate_when_idle

    async with engine(loaded) as eng:
        c = eng.cost
        c.prefill_s_per_token, c.decode_s_per_token, c.overhead_s = 1.0, 1.0, 0.5
        c.calibrated = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(
                    recalibrate_when_idle, eng, idle_s=0.05, first_after_s=0.05, max_after_s=0.1
                )
            )
            await wait_until(
                lambda: c.prefill_s_per_token < 1.0 and c.decode_s_per_token < 1.0,
                120,
                "the idle engine measured itself again",
                detail=lambda: str(c.as_dict()),
            )
            nursery.cancel_scope.cancel()
        assert c.prefill_s_per_token < 0.1 and c.decode_s_per_token < 0.5, c.as_dict()
        # Measuring again never makes a figure slower than one it already has.
        c.prefill_s_per_token, c.decode_s_per_token = 1e-7, 1e-7
        await calibrate(eng, keep_faster=True)
        assert (c.prefill_s_per_token, c.decode_s_per_token) == (1e-7, 1e-7)
        # And the engine still serves what it served before.
        prompt = [(3 + 11 * i) % 5000 for i in range(40)]
        got = (await eng.generate(prompt, {"max_tokens": 4})).tokens
        assert got == hf_greedy(loaded, prompt, 4)
