"""The batched verifier (speculation/verify.py): batching equals single and full recompute, refusals,
the lead and its budget, prompt lookup in lead steps, the prefix cache of sessions.

Real parts only: the default SmolLM2 target (fp32) and its W4A16 draft, real loopback libp2p nodes.
"""

from __future__ import annotations

import pytest
import torch
import trio
from prometheus_client import CollectorRegistry
from transformers import DynamicCache

from p2pnode.bootstrap.metrics import NodeMetrics
from p2pnode.inference._cpu import fastpath as _fastpath
from p2pnode.speculation import (
    BadBlock,
    BadRequest,
    BatchedVerifier,
    Block,
    Lead,
    SamplingOptions,
    SessionLimit,
    UnknownSession,
    VerifierFull,
    WrongModel,
    remote_generate,
    speculative_generate,
    target_generate,
    verify_greedy,
)
from p2pnode.speculation._batching import Session
from p2pnode.speculation.testing import inprocess_transport


def _reference_verify(target, prefix: list[int], block: list[int]) -> tuple[int, int]:
    """Full recompute (no cache) of the target over prefix + block, then greedy verification."""
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([prefix + block])).logits[0]
    return verify_greedy(logits[len(prefix) - 1 :], block)


async def _run_blocks(verifier: BatchedVerifier, prompts, blocks) -> list[list[tuple[int, int]]]:
    results: list[list[tuple[int, int]]] = [[] for _ in prompts]

    async def one(i: int, sid: str) -> None:
        length, last = len(prompts[i]), prompts[i][-1]
        for number, toks in enumerate(blocks[i]):
            r = await verifier.verify(sid, Block(number, length, last, tuple(toks)))
            results[i].append((r.accepted, r.next_token))
            length, last = r.committed_len, r.next_token

    async with trio.open_nursery() as nursery:
        await nursery.start(verifier.run)
        sids = [await verifier.open_session(p, SamplingOptions()) for p in prompts]
        async with trio.open_nursery() as inner:
            for i, sid in enumerate(sids):
                inner.start_soon(one, i, sid)
        nursery.cancel_scope.cancel()
    return results


async def test_batched_verification_equals_single_and_full_recompute(target, prompts) -> None:
    sessions = [prompts[0], prompts[2], prompts[0][-1:]]  # cache lengths 36, 30 and 0
    refs = [target_generate(target, p, 7) for p in sessions]
    blocks = []  # block 1 partly right, block 2 built on what block 1 commits
    for i, ref in enumerate(refs):
        cut = i % 3
        b1 = [*ref[:cut], (ref[cut] + 1) % 1000, 42][: 2 + i % 2]
        blocks.append([b1, ref[cut + 1 : cut + 4]])
    batched = BatchedVerifier(target, max_batch=8, max_wait_ms=200)
    single = BatchedVerifier(target, max_batch=1)
    got_batched = await _run_blocks(batched, sessions, blocks)
    got_single = await _run_blocks(single, sessions, blocks)
    assert batched.stats["batches"] < batched.stats["blocks"]  # blocks really shared forwards
    assert got_batched == got_single
    for i, p in enumerate(sessions):
        (a1, t1), (a2, t2) = got_batched[i]
        assert (a1, t1) == _reference_verify(target, p, blocks[i][0])
        prefix = p + blocks[i][0][:a1] + [t1]
        assert (a2, t2) == _reference_verify(target, prefix, blocks[i][1])
        assert a1 == i % 3 and t1 == refs[i][i % 3]  # exactly where block 1 was made wrong


async def test_a_pass_past_16_rows_runs_fused_and_keeps_the_targets_tokens(
    target, prompts, monkeypatch
) -> None:
    """Four sessions' blocks of 5 drafts (24 rows: every linear the prefill's panel GEMM over
    all of them, each row attending to its own session's cache) in one C pass: every result
    equals one session at a time and a full recompute."""
    passes: list[int] = []
    extend_many = _fastpath.extend_many

    def spy(model, slabs, inputs, **kw):
        passes.append(sum(len(x) for x in inputs))
        return extend_many(model, slabs, inputs, **kw)

    monkeypatch.setattr(_fastpath, "extend_many", spy)
    sessions = [prompts[0], prompts[1], prompts[2], prompts[1][:-3]]
    refs = [target_generate(target, p, 11) for p in sessions]
    blocks = []  # block 1 wrong at i (the last one all right), block 2 after what it commits
    for i, ref in enumerate(refs):
        b1 = [*ref[:i], (ref[i] + 1) % 1000, *ref[i + 1 : 5]] if i < 3 else ref[:5]
        nxt = i + 1 if i < 3 else 6
        blocks.append([b1, ref[nxt : nxt + 5]])
    batched = BatchedVerifier(target, max_batch=8, max_wait_ms=500)
    single = BatchedVerifier(target, max_batch=1)
    got_batched = await _run_blocks(batched, sessions, blocks)
    assert max(passes) == 24  # the four first blocks shared one fused pass
    got_single = await _run_blocks(single, sessions, blocks)
    assert got_batched == got_single
    for i, p in enumerate(sessions):
        (a1, t1), (a2, t2) = got_batched[i]
        assert (a1, t1) == _reference_verify(target, p, blocks[i][0])
        assert (a1, t1) == ((i, refs[i][i]) if i < 3 else (5, refs[i][5]))
        prefix = p + blocks[i][0][:a1] + [t1]
        assert (a2, t2) == _reference_verify(target, prefix, blocks[i][1])


def test_fused_pass_logits_match_each_sessions_own_forward(target, prompts) -> None:
    """The fused pass on the real target, 4 and 10 sessions of 6 rows (the panel GEMM): every
    row's logits float rounding away from its session's own forward, the same argmax."""
    model = target.model
    for n in (4, 10):
        sessions = [[i + 5, *prompts[i % 3]] for i in range(n)]
        blocks = [[(7 * i + j) % 1000 + 100 for j in range(6)] for i in range(n)]
        with torch.inference_mode():
            caches, alone = [], []
            for p, b in zip(sessions, blocks, strict=True):
                cache = DynamicCache()
                model(input_ids=torch.tensor([p]), past_key_values=cache, use_cache=True)
                out = model(input_ids=torch.tensor([b]), past_key_values=cache, use_cache=True)
                alone.append(out.logits[0])
                cache.crop(-len(b))
                caches.append(cache)
            slabs = [_fastpath.slab_of(c, model) for c in caches]
            together = _fastpath.extend_many(model, slabs, blocks)
        for a, t in zip(alone, together, strict=True):
            assert (t - a).abs().max() <= 1e-4 * a.abs().max()
            assert torch.equal(t.argmax(-1), a.argmax(-1))


async def test_verifier_refusals(target, prompts) -> None:
    v = BatchedVerifier(target, max_sessions=1, max_tokens_per_session=40, idle_timeout_s=0.2)
    opts = SamplingOptions()
    async with trio.open_nursery() as nursery:
        await nursery.start(v.run)
        with pytest.raises(WrongModel):
            await v.open_session(prompts[2], opts, model_id="other@0")
        with pytest.raises(BadRequest):
            await v.open_session([], opts)
        with pytest.raises(SessionLimit):
            await v.open_session(list(range(40)), opts)
        sid = await v.open_session(prompts[2], opts)
        with pytest.raises(VerifierFull):
            await v.open_session(prompts[2], opts)
        n, last = len(prompts[2]), prompts[2][-1]
        with pytest.raises(BadBlock):
            await v.verify(sid, Block(0, n, last, (target.vocab_size,)))
        with pytest.raises(BadBlock):
            await v.verify(sid, Block(0, n, last, (1,) * 17))
        with pytest.raises(SessionLimit):
            await v.verify(sid, Block(0, n, last, (1,) * (40 - n)))
        stale = await v.verify(sid, Block(0, n + 3, last, (1, 2)))
        assert stale.stale and stale.committed_len == n
        await trio.sleep(0.5)  # > idle timeout: the loop reaps the session
        with pytest.raises(UnknownSession):
            await v.verify(sid, Block(1, n, last, (1,)))
        with pytest.raises(BadRequest):
            SamplingOptions(temperature=-1)
        nursery.cancel_scope.cancel()


async def test_lead_budget_after_a_break_covers_the_edges_measured_reaction(
    target, prompts
) -> None:
    # An edge whose block comes >= 4 lead steps after a break (a long round trip): the verifier
    # measures that and refills the budget to the lead steps that fit in it, beyond the lead
    # asked for, so it does not sit idle until the block comes. Its leads stay the target's own.
    p = prompts[1]
    ref = target_generate(target, p, 40)
    leads: list[Lead] = []
    v = BatchedVerifier(target, max_wait_ms=1)

    async def wait_quiet(n: int) -> None:  # until the leads stop at n or more
        with trio.fail_after(60):
            for _ in range(6000):  # bounded; each lead is one target step
                seen = len(leads)
                await trio.sleep(0.3)
                if len(leads) >= n and len(leads) == seen:
                    return

    async with trio.open_nursery() as nursery:
        await nursery.start(v.run)
        sid = await v.open_session(p, SamplingOptions(), lead=2, on_lead=leads.append)
        await wait_quiet(2)
        assert len(leads) == 2  # nothing measured yet: the budget asked for
        await trio.sleep(4 * v.timing["batch_s"])  # a reaction of >= 4 lead steps, at any load
        s = v.sessions[sid]
        n = s.committed_len
        wrong = (ref[n - len(p)] + 1) % target.vocab_size
        res = await v.verify(sid, Block(0, n, s.last_token, (wrong,)))
        assert (res.accepted, res.next_token) == (0, ref[n - len(p)])
        assert s.reaction_s > 0.3 and s.refill >= 5
        await wait_quiet(2 + s.refill)
        nursery.cancel_scope.cancel()
    assert len(leads) == 2 + s.refill
    assert [x.token for x in leads] == ref[:2] + ref[3 : 3 + s.refill]


def test_lead_budget_counts_the_tokens_lookup_adds_to_a_step(target) -> None:
    # A reaction of 10 lead steps: 11 tokens of budget at one token a step; where lead steps
    # have committed 1.5 tokens each on average (prompt-lookup guesses), 16, the same time.
    v = BatchedVerifier(target)
    v.timing["batch_s"] = 0.03
    s = Session("s", SamplingOptions(), [1, 2], DynamicCache(), torch.Generator(), 0.0, lead=2)
    s.reaction_s = 0.3
    assert v._refill(s) == 11
    v.stats.update(lead=30, lookup_accepted=10)
    assert v._refill(s) == 16


async def test_verifier_lead_commits_target_tokens_and_blocks_merge_with_them(
    target, prompts
) -> None:
    # The verifier leads 3 tokens on its own; they must be the target's greedy tokens. A block
    # whose drafts agree with the leads is verified only beyond them; one that disagrees inside
    # the leads is answered from them (no forward); a block of zero tokens is one plain step.
    p = prompts[2]
    ref = target_generate(target, p, 7)
    leads: list[Lead] = []
    v = BatchedVerifier(target, max_wait_ms=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(v.run)
        sid = await v.open_session(p, SamplingOptions(), lead=3, on_lead=leads.append)
        with trio.fail_after(30):
            for _ in range(3000):  # bounded; each lead is one target step (~70 ms)
                if len(leads) >= 3:
                    break
                await trio.sleep(0.01)
        await trio.sleep(0.3)  # the budget is spent: no fourth lead
        assert leads == [Lead(len(p) + i, ref[i]) for i in range(3)]
        n = len(p)
        agree = await v.verify(sid, Block(0, n, p[-1], tuple(ref[:5])))
        # 3 drafts matched the leads, 2 were verified (both right), then the target's token
        assert (agree.accepted, agree.next_token, agree.committed_len) == (5, ref[5], n + 6)
        forwards = v.stats["batches"]
        wrong = (ref[0], (ref[1] + 1) % target.vocab_size)
        superseded = await v.verify(sid, Block(1, n, p[-1], wrong))
        assert (superseded.accepted, superseded.next_token) == (1, ref[1])
        assert superseded.committed_len == n + 6 and v.stats["batches"] == forwards
        with pytest.raises(UnknownSession):
            await v.verify("nope", Block(2, n, p[-1], ()))
        step = await v.verify(sid, Block(2, n + 6, ref[5], ()))
        assert (step.accepted, step.next_token, step.committed_len) == (0, ref[6], n + 7)
        with pytest.raises(BadRequest, match="on_lead"):
            await v.open_session(p, SamplingOptions(), lead=2)
        # At the context limit leading stops with a SessionLimit, not silence.
        short = BatchedVerifier(target, max_tokens_per_session=len(p) + 3, max_wait_ms=1)
        await nursery.start(short.run)
        news: list = []
        await short.open_session(p, SamplingOptions(), lead=8, on_lead=news.append)
        with trio.fail_after(30):
            for _ in range(3000):
                if news and isinstance(news[-1], SessionLimit):
                    break
                await trio.sleep(0.01)
        assert news[:-1] == [Lead(len(p), ref[0]), Lead(len(p) + 1, ref[1])]
        nursery.cancel_scope.cancel()


async def test_the_verifier_leads_after_a_fully_accepted_block_too(target, prompts) -> None:
    # After a block whose drafts were all right the session's budget refills, as after a
    # break: the edge's next block is a round trip away, and a lead step rides in passes that
    # run for other sessions anyway. The leads go on from the block's bonus token, the
    # target's own tokens.
    p = prompts[1]
    n, ref = len(p), target_generate(target, p, 8)
    leads: list[Lead] = []

    async def leads_reach(count: int) -> None:
        with trio.fail_after(30):
            for _ in range(3000):  # bounded; each lead is one target step
                if len(leads) >= count:
                    return
                await trio.sleep(0.01)

    v = BatchedVerifier(target, max_wait_ms=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(v.run)
        sid = await v.open_session(p, SamplingOptions(), lead=2, on_lead=leads.append)
        await leads_reach(2)
        result = await v.verify(sid, Block(0, n + 2, ref[1], tuple(ref[2:4])))
        assert (result.accepted, result.next_token, result.committed_len) == (2, ref[4], n + 5)
        await leads_reach(4)
        assert leads[:4] == [
            Lead(n, ref[0]),
            Lead(n + 1, ref[1]),
            Lead(n + 5, ref[5]),
            Lead(n + 6, ref[6]),
        ]
        nursery.cancel_scope.cancel()


async def test_lead_steps_check_prompt_lookup_guesses_and_keep_the_targets_tokens(target) -> None:
    # A prompt whose answer copies it: lead steps that check guesses taken from the session's own
    # tokens commit several tokens in some steps (fewer forward passes than tokens), and the
    # tokens are the target's, as with lookup off.
    tok, eos = target.tokenizer, target.eos_token_ids
    text = "Repeat this line three times: the quick brown fox jumps over the lazy dog."
    msgs = [{"role": "user", "content": text}]
    p = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    ref = target_generate(target, p, 10, eos_token_ids=eos)
    stats = {}
    for lookup in (4, 0):
        verifier = BatchedVerifier(target, lookup=lookup)
        async with trio.open_nursery() as nursery:
            await nursery.start(verifier.run)
            with trio.fail_after(60):
                async with inprocess_transport(verifier) as transport:
                    r = await remote_generate(transport, p, 10, eos_token_ids=eos)
            nursery.cancel_scope.cancel()
        assert r.tokens == ref, lookup
        stats[lookup] = dict(verifier.stats)
    on, off = stats[4], stats[0]
    assert on["lookup_accepted"] >= 1 and on["batches"] < off["batches"]
    assert off["lookup_guessed"] == 0 and off["batches"] == len(ref) - 1  # the first: prefill
    with pytest.raises(ValueError, match="lookup"):
        BatchedVerifier(target, lookup=-1)


async def test_verifier_prefix_cache_prefills_only_the_new_suffix(target, draft, prompts) -> None:
    # A chat's second turn: the history (prompt + first answer) is in the verifier's prefix
    # cache once the first session closed, so the new session prefills only the new message.
    eos = target.eos_token_ids
    verifier = BatchedVerifier(target, max_wait_ms=5)
    first = prompts[0]
    stats = verifier.stats

    async def run(prompt: list[int], lead: int = 0) -> list[int]:
        async with inprocess_transport(verifier) as transport:
            r = await speculative_generate(
                draft, transport, prompt, 8, gamma=3, lead=lead, eos_token_ids=eos
            )
        return r.tokens

    async with trio.open_nursery() as nursery:
        await nursery.start(verifier.run)
        with trio.fail_after(120):
            answer = await run(first)
            assert stats["prefix_hit_tokens"] == 0 and stats["prefill_tokens"] == len(first) - 1
            # The same prompt again: nothing to prefill but the token the first block runs.
            before = stats["prefill_tokens"]
            assert await run(first) == answer
            assert stats["prefill_tokens"] == before
            assert stats["prefix_hit_tokens"] == len(first) - 1
            # The next turn: history + a new user message; with a lead the prefill runs the
            # prompt's last token too, for its logits.
            second = first + answer + prompts[1][1:]
            before, hits = stats["prefill_tokens"], stats["prefix_hit_tokens"]
            got = await run(second, lead=2)
            hit = stats["prefix_hit_tokens"] - hits
            assert hit >= len(first) + len(answer) - 1
            assert stats["prefill_tokens"] - before == len(second) - hit
        nursery.cancel_scope.cancel()
    assert answer == target_generate(target, first, 8, eos_token_ids=eos)
    assert got == target_generate(target, second, 8, eos_token_ids=eos)
    # The same counters reach a node's /metrics.
    registry = CollectorRegistry()
    metrics = NodeMetrics(registry)
    metrics.live.verifier = verifier
    sample = registry.get_sample_value
    assert sample("p2pnode_verifier_sessions_total") == 3
    assert sample("p2pnode_verifier_prefix_hit_tokens_total") == stats["prefix_hit_tokens"] > 0
    assert sample("p2pnode_verifier_committed_tokens_total") >= 24
    assert sample("p2pnode_verifier_active_sessions") == 0
