"""Speculative decoding: W4A16 draft, verification math, batched verifier, edge client, protocol.

Real parts only: the default SmolLM2 target (fp32) and its W4A16 draft, real loopback libp2p nodes.
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from contextlib import asynccontextmanager
from functools import partial

import pytest
import torch
import trio
from prometheus_client import CollectorRegistry
from transformers import DynamicCache

from p2pnode.bootstrap.metrics import NodeMetrics
from p2pnode.identity import NodeKey
from p2pnode.inference._cpu import kernels as _kernels
from p2pnode.inference.blockhash import block_hashes, model_salt
from p2pnode.inference.sampling import probs_from_logits
from p2pnode.overlay.cache.antientropy import AntiEntropy, AntiEntropyConfig
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
from p2pnode.overlay.routing.router import rtt_from_peer_table
from p2pnode.speculation import (
    BadBlock,
    BadRequest,
    BatchedVerifier,
    Block,
    DraftHistory,
    DraftRunner,
    EdgeClient,
    Int4Linear,
    Lead,
    NoVerifier,
    P2PVerifierTransport,
    SamplingOptions,
    SessionLimit,
    UnknownSession,
    VerifierAdvert,
    VerifierFull,
    WrongModel,
    client,
    load_draft,
    open_edge,
    rank_verifiers,
    remote_generate,
    serve_verifier,
    speculative_generate,
    target_generate,
    truncate_probs,
    verify_digest_model,
    verify_greedy,
    verify_sampling,
)
from p2pnode.speculation._batching import Session
from p2pnode.speculation.draft import from_gptq, quantize_sym_int4, to_gptq
from p2pnode.speculation.protocol import VerifyBlock, decode_q, encode_q
from p2pnode.speculation.testing import inprocess_transport

PROMPTS = ["Explain why the sky is blue.", "Write a haiku about autumn.", "Hi"]


@pytest.fixture(scope="module")
def target(loaded):
    """The shared real model, here in its role: the target the drafts are checked against."""
    return loaded


@pytest.fixture(scope="module")
def draft():
    return load_draft()


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    tok = target.tokenizer
    out = []
    for p in PROMPTS:
        msgs = [{"role": "user", "content": p}]
        out.append(
            list(
                tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)[
                    "input_ids"
                ]
            )
        )
    return out


# ---------------------------------------------------------------- draft


def test_private_int4_cpu_kernel_matches_dequantized_matmul() -> None:
    # torch.ops.aten._weight_int4pack_mm_for_cpu is private: this pins its layout and formula.
    torch.manual_seed(0)
    w = torch.randn(192, 576)
    q, scales = quantize_sym_int4(w, 64)
    deq = ((q.float() - 8).reshape(192, 9, 64) * scales.float().t().unsqueeze(-1)).reshape(192, 576)
    x = torch.randn(5, 576)
    ref = x @ deq.t()
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):  # bf16: 8-bit mantissa
        lin = Int4Linear(q, scales, 64, dtype)
        old = _kernels.set_enabled(False)  # the private op (prefill's path), not the kernel
        try:
            y = lin(x.to(dtype)).float()
        finally:
            _kernels.set_enabled(old)
        assert (y - ref).abs().max() <= tol * ref.abs().max()
        if lin.stream:  # decode's path: the streaming int4 kernel, fp32 math
            y = lin(x).float()
            assert (y - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_gptq_layout_round_trip_and_config(draft) -> None:
    q = torch.randint(0, 16, (192, 576), dtype=torch.int32)
    scales = torch.rand(9, 192).half()
    t = to_gptq(q, scales, 64)
    assert t["qweight"].shape == (72, 192) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (9, 24) and int(t["qzeros"][0, 0]) == 0x77777777
    q2, s2, gs = from_gptq(t)
    assert torch.equal(q2, q) and torch.equal(s2, scales) and gs == 64
    cfg = json.loads((draft.path / "quantize_config.json").read_text())
    assert cfg["bits"] == 4 and cfg["sym"] is True and cfg["desc_act"] is False
    assert json.loads((draft.path / "config.json").read_text())["quantization_config"] == cfg


def test_gptq_act_order_beats_rounding_on_the_hessian_loss() -> None:
    # GPTQ minimizes tr((W - Q) H (W - Q)^T); with inputs whose columns differ in scale (as real
    # activations do) act-order (static groups) must do better than plain rounding and keep the
    # contiguous-group layout: q in 0..15, one scale per 64 inputs.
    from p2pnode.speculation._gptq import gptq_linear

    torch.manual_seed(0)
    w = torch.randn(48, 128)
    x = torch.randn(512, 128) * torch.linspace(0.1, 3.0, 128)
    h = x.t() @ x

    def loss(q: torch.Tensor, s: torch.Tensor) -> float:
        deq = ((q.float() - 8).reshape(48, 2, 64) * s.float().t().unsqueeze(-1)).reshape(48, 128)
        e = w - deq
        return float(torch.trace(e @ h @ e.t()))

    rtn = loss(*quantize_sym_int4(w, 64))
    q, s = gptq_linear(w, h, 64, act_order=True)
    assert q.shape == (48, 128) and int(q.min()) >= 0 and int(q.max()) <= 15
    assert s.shape == (2, 48) and s.dtype == torch.float16
    assert loss(q, s) < 0.8 * rtn
    assert loss(*gptq_linear(w, h, 64)) < 0.8 * rtn


def test_draft_logits_close_to_target_but_not_identical(target, draft, prompts) -> None:
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        a = target.model(input_ids=ids).logits[0]
        b = draft.model(input_ids=ids).logits[0].float()
    assert draft.target_model_id == target.model_id
    assert (a - b).abs().max() > 0.5  # a real int4 model, not a copy of the Q4_1 target
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    kl = (a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1))).sum(-1).mean()
    # Measured on the three prompts: top-1 agreement 0.65, mean KL 1.07-1.18 nats (RTN int4 on a
    # 135M model is lossy); bounds leave room for thread-count float noise, not for a broken draft
    # (a random or mis-packed model gives agreement ~0 and KL > 5).
    assert agree > 0.5 and kl < 2.0, (agree, kl)


# ---------------------------------------------------------------- verification math


def test_verify_greedy_accepts_longest_matching_prefix() -> None:
    logits = torch.full((4, 10), -1.0)
    for i, best in enumerate([3, 5, 7, 9]):
        logits[i, best] = 1.0
    assert verify_greedy(logits, [3, 5, 7]) == (3, 9)
    assert verify_greedy(logits, [3, 6, 7]) == (1, 5)
    assert verify_greedy(logits, [0, 5, 7]) == (0, 3)
    assert verify_greedy(logits[:1], []) == (0, 3)


# Synthetic target distributions over 5 tokens at 3 positions (2 drafts + the bonus).
_P = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1], [0.05, 0.05, 0.3, 0.3, 0.3], [0.2] * 5])


def _emitted_frequencies(q, draw, n: int, gen) -> tuple[list[float], list[float], int]:
    """Frequencies of the first and (where the first draft was accepted) the second emitted
    token over ``n`` verifications of ``draw()``'s drafts against ``_P``; and that count."""
    first, second = Counter(), Counter()
    for _ in range(n):
        draft = draw()
        acc, nxt = verify_sampling(_P, q, draft, gen)
        emitted = [*draft[:acc], nxt]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    m = sum(second.values())
    return [first[t] / n for t in range(5)], [second[t] / m for t in range(5)], m


def test_rejection_sampling_reproduces_target_distribution() -> None:
    # 2 draft tokens per block, drawn from q. The emitted pair must follow p0 x p1 exactly.
    # n = 6000: each cell's frequency has std <= 0.0065, so a max deviation of 0.025 (~4 sigma)
    # is a safe bound that a wrong rule (e.g. taking draft tokens as is) breaks by far (q
    # differs from p by >= 0.15 in some cells).
    q = torch.tensor([[0.1, 0.1, 0.6, 0.1, 0.1], [0.25, 0.25, 0.1, 0.2, 0.2]])
    gen = torch.Generator().manual_seed(1)

    def draw() -> list[int]:
        return [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]

    first, second, m = _emitted_frequencies(q, draw, 6000, gen)
    assert max(abs(first[t] - float(_P[0, t])) for t in range(5)) < 0.025
    assert m >= 2000  # the second token exists when the first was accepted
    assert max(abs(second[t] - float(_P[1, t])) for t in range(5)) < 0.04


def test_rejection_sampling_of_fixed_guesses_reproduces_target_distribution() -> None:
    # Prompt-lookup guesses are not drawn from any q: the same two guesses every time, checked
    # against a one-hot proposal (q None). The emitted tokens must still follow p exactly (bounds
    # as above; taking the guesses as they are would put all the first token's mass on 1).
    gen = torch.Generator().manual_seed(2)
    first, second, m = _emitted_frequencies(None, lambda: [1, 3], 6000, gen)
    assert max(abs(first[t] - float(_P[0, t])) for t in range(5)) < 0.025
    assert m >= 1000  # the first guess is taken with p0[1] = 0.2: m ~ 1200
    assert max(abs(second[t] - float(_P[1, t])) for t in range(5)) < 0.06


# ---------------------------------------------------------------- batched verifier


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


# ---------------------------------------------------------------- edge client


async def test_greedy_speculation_equals_target_several_tenants_at_once(
    target, draft, prompts
) -> None:
    # Four edges at once on one batched verifier: sync, async (2 blocks in flight) over a
    # 20 ms link, async with 3 blocks in flight (verdicts land while later blocks are drafted),
    # async with the verifier's lead over a 30 ms link; plus target-only remote generation.
    eos = target.eos_token_ids
    cases = [(0, 1, 0.0, 0), (1, 2, 0.02, 0), (2, 3, 0.0, 0), (0, 2, 0.03, 4)]
    refs = [target_generate(target, p, 8, eos_token_ids=eos) for p in prompts]
    verifier = BatchedVerifier(target, max_wait_ms=20)
    got: dict[int, list[int]] = {}
    led: list[int] = []

    async def edge(k: int, i: int, depth: int, delay: float, lead: int) -> None:
        async with inprocess_transport(verifier, one_way_delay_s=delay) as transport:
            r = await speculative_generate(
                draft,
                transport,
                prompts[i],
                8,
                gamma=3,
                depth=depth,
                lead=lead,
                eos_token_ids=eos,
            )
        got[k] = r.tokens
        if lead:
            led.append(r.stats.lead_tokens)
        s = r.stats
        # every verified block is either fully accepted or has exactly one rejected position
        assert s.rejections <= s.blocks_verified <= s.blocks_sent
        assert s.tokens_per_block == (s.accepted + s.blocks_verified) / s.blocks_verified

    async def remote() -> None:
        async with inprocess_transport(verifier, one_way_delay_s=0.01) as transport:
            got[4] = (await remote_generate(transport, prompts[1], 8, eos_token_ids=eos)).tokens

    async with trio.open_nursery() as nursery:
        await nursery.start(verifier.run)
        with trio.fail_after(120):
            async with trio.open_nursery() as edges:
                for k, case in enumerate(cases):
                    edges.start_soon(edge, k, *case)
                edges.start_soon(remote)
        nursery.cancel_scope.cancel()
    assert [got[k] for k in range(5)] == [refs[0], refs[1], refs[2], refs[0], refs[1]]
    # the lead edge opened with lead: the verifier decoded at least while the first block was
    # drafted and crossed the 30 ms link (~0.1 s), one target step being ~70 ms
    assert led and led[0] >= 1
    assert verifier.stats["batches"] < verifier.stats["blocks"] + verifier.stats["lead"]
    assert not verifier.sessions  # every transport closed its session


async def _speculate(target, draft, prompt: list[int], n: int, *, delay: float, **kw):
    """One edge session against a fresh batched verifier, over the in-process transport with a
    one-way ``delay`` (s); ``kw`` goes to ``speculative_generate``."""
    verifier = BatchedVerifier(target)
    async with trio.open_nursery() as nursery:
        await nursery.start(verifier.run)
        with trio.fail_after(120):
            async with inprocess_transport(verifier, one_way_delay_s=delay) as transport:
                r = await speculative_generate(
                    draft, transport, prompt, n, eos_token_ids=target.eos_token_ids, **kw
                )
        nursery.cancel_scope.cancel()
    return r


async def test_an_edge_that_lets_the_verifier_decode_alone_then_drafts_again(
    target, draft, prompts
) -> None:
    # The history says letting the verifier decode alone was faster (a long round trip): the
    # edge stops drafting at its first break, keeps the verifier's lead budget full with empty
    # blocks over a 30 ms link (a lead budget of 2 would run dry within one round trip
    # without them), and its 8th stretch explores drafting again. The output is the target's.
    eos, n = target.eos_token_ids, client.SEGMENT * 2 + 24
    ref = target_generate(target, prompts[0], n, eos_token_ids=eos)
    history = DraftHistory(rates={"draft": 1.0, "lead": 100.0}, chosen=5)
    r = await _speculate(
        target, draft, prompts[0], n, delay=0.03, gamma=3, depth=2, lead=2, history=history
    )
    assert r.tokens == ref
    s = r.stats
    assert s.lead_only >= 2 and s.keepalives >= 2  # stretches 6 and 7 (and any after 8)
    assert history.chosen >= 8 and s.blocks_sent >= 1  # the 8th explored drafting
    assert 0.0 < history.rates["lead"] < 100.0  # its measured rates were smoothed in
    assert s.lead_tokens >= 2 * client.SEGMENT


async def test_the_first_tokens_come_while_the_draft_still_prefills(
    target, draft, prompts, monkeypatch
) -> None:
    # The verifier's prefill gives the first token as a lead. Here the draft's prefill cannot
    # finish before two tokens have been committed: an edge that held the verifier's tokens
    # back until its draft was ready would never finish; this one commits them, then drafts,
    # and the output is the target's.
    eos = target.eos_token_ids
    ref = target_generate(target, prompts[0], 8, eos_token_ids=eos)
    committed: list[int] = []
    two = threading.Event()
    prefill = DraftRunner.prefill

    def gated(self) -> None:
        if not two.wait(timeout=30):
            raise AssertionError("no token was committed while the draft prefilled")
        prefill(self)

    def on_commit(new: list[int]) -> None:
        committed.extend(new)
        if len(committed) >= 2:
            two.set()

    monkeypatch.setattr(DraftRunner, "prefill", gated)
    r = await _speculate(
        target, draft, prompts[0], 8, delay=0.01, gamma=3, depth=2, lead=4, on_commit=on_commit
    )
    assert r.tokens == ref == committed
    assert r.stats.lead_tokens >= 2


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


def test_draft_rollback_after_rejection_equals_clean_run(draft, prompts) -> None:
    # A drafts 3 tokens, then the verifier rejects the 2nd: A rolls back to prompt + t1 + X.
    # B reaches the same tokens without ever drafting past them. Same forwards in the same
    # grouping on both sides, so caches and next drafts must be bitwise equal.
    x = 0
    a = DraftRunner(draft, SamplingOptions(), top_k=64, seed=None)
    a.tokens = list(prompts[2])
    t = a.extend(3)[0]
    x = (t[1] + 1) % 1000
    a.reset_to([*prompts[2], t[0], x])
    assert a.cache_len == a.cache.get_seq_length() == len(prompts[2]) + 1
    b = DraftRunner(draft, SamplingOptions(), top_k=64, seed=None)
    b.tokens = list(prompts[2])
    assert b.extend(2)[0] == t[:2]
    b.reset_to([*prompts[2], t[0], x])
    assert a.extend(2)[0] == b.extend(2)[0]
    for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


async def test_sampled_speculation_first_token_follows_target(target, draft) -> None:
    # 48 seeded runs of 2 tokens at temperature 1 on a raw prompt. The target's first-token
    # distribution is computed exactly; we bucket it into its top-3 tokens + "other" and require a
    # chi-square statistic below 16.3 (p = 0.001, 3 dof). Small n keeps this under ~10 s; the
    # exactness of the rule itself is tested above with 6000 draws.
    prompt = target.tokenizer("The capital of France is")["input_ids"]
    opts = [SamplingOptions(temperature=1.0, seed=s) for s in range(48)]
    with torch.inference_mode():
        p = probs_from_logits(
            target.model(input_ids=torch.tensor([prompt])).logits[0, -1], 1.0, 1.0
        )
    top = p.topk(3).indices.tolist()
    verifier = BatchedVerifier(target, max_sessions=64, max_batch=16, max_wait_ms=5)
    firsts: list[int] = []
    edges = trio.Semaphore(8)  # 8 edges at a time: the verifier batches them

    async def one(o: SamplingOptions) -> None:
        async with edges, inprocess_transport(verifier) as transport:
            lead = 2 * (o.seed % 2)  # half the runs let the verifier sample on its own too
            got = await speculative_generate(
                draft, transport, prompt, 2, gamma=2, depth=2, lead=lead, options=o
            )
        firsts.append(got.tokens[0])

    async with trio.open_nursery() as nursery:
        await nursery.start(verifier.run)
        async with trio.open_nursery() as runs:
            for o in opts:
                runs.start_soon(one, o)
        nursery.cancel_scope.cancel()
    n = len(firsts)
    expected = [float(p[t]) for t in top] + [1 - float(p[top].sum())]
    counts = [firsts.count(t) for t in top] + [sum(t not in top for t in firsts)]
    chi2 = sum((c - n * e) ** 2 / (n * e) for c, e in zip(counts, expected, strict=True) if e > 0)
    assert n == 48 and chi2 < 16.3, (counts, expected)
    assert not math.isnan(chi2)


# Chi-square critical values at p = 0.001 by degrees of freedom (no scipy here): a correct
# sampler fails the test one time in a thousand.
CHI2_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}
CHI2_P001.update({9: 27.88, 10: 29.59, 11: 31.26, 12: 32.91})


class _WireTransport:
    """The in-process transport with every block's draft distribution passed through the
    protocol's frame codec (``encode_q`` -> a ``VerifyBlock`` frame -> ``decode_q``), so the
    verifier sees exactly what an edge puts on the wire: the truncated, sparse q."""

    def __init__(self, inner, vocab: int) -> None:
        self.inner, self.vocab = inner, vocab
        self.max_block = inner.max_block
        self.sent_q = 0

    async def open(self, prompt, options, *, lead: int = 0) -> int:
        return await self.inner.open(prompt, options, lead=lead)

    async def send_block(self, block: Block) -> None:
        from p2pnode.overlay import wire
        from p2pnode.speculation.protocol import LIMIT

        width, ids, vals = encode_q(block.draft_probs)
        msg = VerifyBlock(
            block.number, block.base_len, block.base_token, list(block.tokens), width, ids, vals
        )
        frame = wire.encode_frame(wire.to_wire(msg), limit=LIMIT)
        got = wire.from_wire(wire.decode_frame(frame, limit=LIMIT), VerifyBlock)
        q = decode_q(got, self.vocab)
        self.sent_q += q is not None and 0 < got.q_width < self.vocab
        await self.inner.send_block(
            Block(got.number, got.base_len, got.base_token, tuple(got.tokens), q)
        )

    async def receive_result(self):
        return await self.inner.receive_result()

    async def close(self) -> None:
        await self.inner.close()


def _target_joint(target, prompt: list[int], temperature: float, top_p: float, depth: int):
    """Exact probability of every continuation of ``depth`` tokens under target-only sampling
    (enumerated over the support of each step's distribution)."""
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == depth:
            out[prefix] = mass
            return
        with torch.inference_mode():
            logits = target.model(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1]
        p = probs_from_logits(logits, temperature, top_p)
        for t in torch.nonzero(p).flatten().tolist():
            walk((*prefix, t), mass * float(p[t]))

    walk((), 1.0)
    return out


@pytest.mark.slow
async def test_sampled_speculation_joint_of_three_tokens_follows_target(target, draft) -> None:
    # The whole sampled pipeline: async blocks (depth 3, gamma 2, so blocks are drafted on
    # guessed bonus tokens and die), the verifier's lead on half the runs, the draft's
    # top-64-truncated q through the wire codec, rejection sampling in batches of edges. Over
    # N seeded runs the joint of the first 3 tokens must match target-only sampling: chi-square
    # over the outcomes expected >= 5 times (rarer ones pooled into one bin) below the p = 0.001
    # critical value. top_p 0.5 on a prompt with a confident answer keeps the joint support to
    # a handful of sequences (3 here: 0.69, 0.17, 0.14), so N = 120 gives every bin its counts and
    # the test stays cheap.
    temperature, top_p, n_runs = 1.0, 0.5, 120
    prompt = target.tokenizer("The capital of France is")["input_ids"]
    joint = _target_joint(target, prompt, temperature, top_p, 3)
    assert 2 <= len(joint) <= 40, f"support of {len(joint)} sequences: pick another prompt"
    verifier = BatchedVerifier(target, max_sessions=64, max_batch=16, max_wait_ms=5)
    got: list[tuple[int, ...]] = []
    wire_blocks = [0]
    edges = trio.Semaphore(16)

    async def one(seed: int) -> None:
        o = SamplingOptions(temperature=temperature, top_p=top_p, seed=seed)
        async with edges, inprocess_transport(verifier) as inner:
            transport = _WireTransport(inner, target.vocab_size)
            lead = 2 * (seed % 2)
            res = await speculative_generate(
                draft, transport, prompt, 3, gamma=2, depth=3, lead=lead, options=o
            )
            wire_blocks[0] += transport.sent_q
        got.append(tuple(res.tokens[:3]))

    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await nursery.start(verifier.run)
            async with trio.open_nursery() as runs:
                for seed in range(n_runs):
                    runs.start_soon(one, seed)
            nursery.cancel_scope.cancel()
    assert len(got) == n_runs and all(len(t) == 3 for t in got)
    assert set(got) <= set(joint), f"sequences the target never samples: {set(got) - set(joint)}"
    assert wire_blocks[0] > 0  # blocks carried a draft distribution through the codec
    counts = Counter(got)
    common = [s for s, p in joint.items() if p * n_runs >= 5]
    rare_p = 1 - sum(joint[s] for s in common)
    bins = [(counts[s], joint[s]) for s in common]
    if rare_p * n_runs >= 1:
        bins.append((n_runs - sum(counts[s] for s in common), rare_p))
    chi2 = sum((c - n_runs * p) ** 2 / (n_runs * p) for c, p in bins)
    assert len(bins) >= 3, "too few bins to test a joint distribution"
    assert chi2 < CHI2_P001[len(bins) - 1], (chi2, sorted(counts.items()), joint)


# ---------------------------------------------------------------- over libp2p


def test_sparse_q_round_trip_is_exact() -> None:
    q = truncate_probs(torch.softmax(torch.randn(3, 1000), -1), 64)
    width, ids, vals = encode_q(q)
    msg = VerifyBlock(0, 5, 1, [int(t) for t in q.argmax(-1)], width, ids, vals)
    assert torch.equal(decode_q(msg, 1000), q)
    with pytest.raises(BadBlock):
        decode_q(VerifyBlock(0, 5, 1, [1, 2, 3], width, ids[:-4], vals), 1000)
    with pytest.raises(BadBlock):
        decode_q(VerifyBlock(0, 5, 1, [1, 2, 3], width, ids, vals), 10)  # ids beyond vocab


@asynccontextmanager
async def _verifier_and_edge_nodes(target, overlay_network):
    """A batched verifier served on one loopback overlay node, and a second node to be the edge."""
    verifier = BatchedVerifier(target)
    async with overlay_network(2) as (server, edge), trio.open_nursery() as nursery:
        await nursery.start(verifier.run)
        serve_verifier(server, verifier)
        yield verifier, server, edge
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def _edge_client(target, draft, overlay_network):
    """An ``EdgeClient`` pinned to one served verifier (see ``_verifier_and_edge_nodes``)."""
    async with _verifier_and_edge_nodes(target, overlay_network) as (_, server, node):
        client = EdgeClient(node, draft, verifiers=[server.peer_id])
        try:
            yield client
        finally:
            await client.aclose()


async def test_edge_picks_the_verifier_holding_the_prefix_over_a_nearer_one(
    target, draft, prompts, overlay_network
) -> None:
    # Two verifiers gossip their digests; V1 has served this prompt twice (so its blocks are
    # advertised), V2 nothing. The edge, following the digests, ranks V1 first even when V2 is
    # a little nearer: V2 would prefill the whole prompt, V1 only the last token.
    eos = target.eos_token_ids
    prompt = prompts[0] * 4  # ~100 tokens: several blocks
    key = verify_digest_model(target.model_id)
    ae_config = AntiEntropyConfig(interval_s=0.2, pull_min_interval_s=0.3)
    async with overlay_network(3) as (n1, n2, edge), trio.open_nursery() as nursery:
        verifiers, edge_views = [], PeerViews()
        for node in (n1, n2):
            v = BatchedVerifier(target, max_wait_ms=5)
            advert = VerifierAdvert(node.peer_id, v, min_uses=2)
            await nursery.start(v.run)
            serve_verifier(node, v)
            ae = AntiEntropy(
                node, node.config.key, PeerViews(), builders={key: advert.builder}, config=ae_config
            )
            await nursery.start(ae.run)
            verifiers.append(v)
        await nursery.start(AntiEntropy(edge, None, edge_views, models=[key], config=ae_config).run)
        for _ in range(2):
            async with inprocess_transport(verifiers[0]) as transport:
                await speculative_generate(draft, transport, prompt, 2, eos_token_ids=eos)
        hashes = block_hashes(prompt, model_salt(target.model_id))
        # The client ranks by the RTTs its liveness probes measured, and an unmeasured one sorts
        # last; with gossip flowing a link is never idle, so its first sample can take up to
        # RTT_REFRESH_INTERVALS ping intervals (10 s).
        measured = rtt_from_peer_table(edge.peers)
        for _ in range(300):  # at most 30 s for both digests and both RTT samples
            held = edge_views.cached_prefix_tokens(n1.peer_id, hashes, key)
            pinged = measured(n1.peer_id) is not None and measured(n2.peer_id) is not None
            if held >= len(prompt) - 16 and edge_views.get(n2.peer_id, key) is not None and pinged:
                break
            await trio.sleep(0.1)
        else:
            raise AssertionError(
                f"the edge never saw both verifiers' digests and RTTs (V1 holds {held}, "
                f"RTTs {measured(n1.peer_id)}, {measured(n2.peer_id)})"
            )
        rtt = {n1.peer_id: 0.015, n2.peer_id: 0.010}.get
        assert rank_verifiers(
            [n2.peer_id, n1.peer_id], prompt, target.model_id, edge_views, rtt
        ) == [
            n1.peer_id,
            n2.peer_id,
        ]
        # Nothing of it cached anywhere (chat prompts would share the template's system
        # prompt): the nearer one.
        other = list(range(1000, 1100))
        assert (
            rank_verifiers([n1.peer_id, n2.peer_id], other, target.model_id, edge_views, rtt)[0]
            == n2.peer_id
        )
        client = EdgeClient(edge, draft, verifiers=[n2.peer_id, n1.peer_id], views=edge_views)
        try:
            result = await client.generate(prompt, 6)
        finally:
            await client.aclose()
        assert result.verifiers == [n1.peer_id]
        assert result.tokens == target_generate(target, prompt, 6, eos_token_ids=eos)
        nursery.cancel_scope.cancel()


async def test_greedy_over_libp2p_equals_target_and_sessions_are_released(
    target, draft, prompts, overlay_network
) -> None:
    eos = target.eos_token_ids
    ref = target_generate(target, prompts[0], 10, eos_token_ids=eos)
    async with _verifier_and_edge_nodes(target, overlay_network) as (verifier, server, edge):
        for depth, lead in ((1, 0), (2, 0), (2, 6)):  # sync, async, async + verifier lead
            transport = P2PVerifierTransport(edge, server.peer_id, draft.target_model_id)
            got = await speculative_generate(
                draft,
                transport,
                prompts[0],
                10,
                gamma=4,
                depth=depth,
                lead=lead,
                eos_token_ids=eos,
            )
            assert got.tokens == ref, (depth, lead)
        # target-only over the wire: leads of 3, refilled by empty blocks (verify-lead frames)
        verifier.max_lead = 3
        transport = P2PVerifierTransport(edge, server.peer_id, draft.target_model_id)
        got = await remote_generate(transport, prompts[0], 10, eos_token_ids=eos)
        assert got.tokens == ref and 3 <= got.stats.lead_tokens < 10
        verifier.max_lead = 64
        wrong = P2PVerifierTransport(edge, server.peer_id, "other-model@0")
        with pytest.raises(WrongModel):
            await wrong.open(prompts[0], SamplingOptions())
        wrong = P2PVerifierTransport(edge, server.peer_id, "other-model@0")
        with pytest.raises(WrongModel):  # the refusal itself, not wrapped in an ExceptionGroup
            await speculative_generate(draft, wrong, prompts[0], 4, depth=2, lead=4)
        # An edge that leaves while the verifier leads: the verifier's loop must live on.
        quitter = P2PVerifierTransport(edge, server.peer_id, draft.target_model_id)
        await quitter.open(prompts[2], SamplingOptions(), lead=8)
        assert isinstance(await quitter.receive_result(), Lead)
        await quitter.close()
        await trio.sleep(0.3)  # leads of the closing session land on a closed channel
        again = P2PVerifierTransport(edge, server.peer_id, draft.target_model_id)
        assert (await remote_generate(again, prompts[0], 3, eos_token_ids=eos)).tokens == ref[:3]
        # A sampled session over the wire (sparse q rows), then an edge that vanishes mid-session.
        sampled = P2PVerifierTransport(edge, server.peer_id, draft.target_model_id)
        got = await speculative_generate(
            draft, sampled, prompts[2], 6, gamma=3, options=SamplingOptions(1.0, 0.9, 7)
        )
        assert 1 <= len(got.tokens) <= 6 and got.stats.blocks_verified >= 1
        dropped = P2PVerifierTransport(edge, server.peer_id, draft.target_model_id)
        await dropped.open(prompts[2], SamplingOptions())
        assert len(verifier.sessions) == 1
        await dropped.stream.reset()
        with trio.fail_after(10):  # the handler sees the reset and releases the session
            for _ in range(200):
                if not verifier.sessions:
                    break
                await trio.sleep(0.05)
        assert not verifier.sessions


async def _hold_verifier_node(model_id, verifier, stop: trio.Event, *, bootstrap, task_status):
    cfg = OverlayConfig(
        key=NodeKey.generate(), bootstrap=bootstrap, models=[model_id], roles={"verifier"}
    )
    async with open_overlay_node(cfg) as node, trio.open_nursery() as nursery:
        await nursery.start(verifier.run)
        serve_verifier(node, verifier)
        task_status.started(node)
        await stop.wait()
        nursery.cancel_scope.cancel()


async def test_edge_discovers_verifiers_fails_over_then_raises_no_verifier(
    target, draft, prompts
) -> None:
    eos = target.eos_token_ids
    ref = target_generate(target, prompts[0], 12, eos_token_ids=eos)
    v1, v2 = BatchedVerifier(target), BatchedVerifier(target)
    stop1, stop2 = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        n1 = await nursery.start(
            partial(_hold_verifier_node, target.model_id, v1, stop1, bootstrap=[])
        )
        n2 = await nursery.start(
            partial(_hold_verifier_node, target.model_id, v2, stop2, bootstrap=[n1.addrs[0]])
        )
        async with open_edge([n1.addrs[0]], draft=draft, result_timeout_s=10) as edge:
            with trio.fail_after(20):  # DHT provider + node record propagation on loopback
                for _ in range(100):
                    if set(await edge.find_verifiers()) == {n1.peer_id, n2.peer_id}:
                        break
                    await trio.sleep(0.2)
            pinned = EdgeClient(edge.node, draft, verifiers=[n1.peer_id, n2.peer_id])

            async def kill_v1_mid_session() -> None:
                for _ in range(9000):  # bounded: 90 s at most, like the generation below
                    if v1.stats["blocks"] + v1.stats["lead"] >= 2:  # mid-session
                        break
                    await trio.sleep(0.01)
                stop1.set()

            nursery.start_soon(kill_v1_mid_session)
            with trio.fail_after(90):
                r = await pinned.generate(prompts[0], 12, mode="async")
            assert r.tokens == ref  # resumed on v2 from prompt + committed: same greedy output
            assert r.verifiers == [n1.peer_id, n2.peer_id]
            assert v2.stats["blocks"] + v2.stats["lead"] >= 1  # v2 committed the rest
            stop2.set()
            with trio.fail_after(30), pytest.raises(NoVerifier):
                await pinned.generate(prompts[2], 4, mode="sync")
        nursery.cancel_scope.cancel()


async def test_edge_starts_the_next_request_on_a_spare_stream(
    target, draft, prompts, overlay_network, monkeypatch
) -> None:
    # The first request opens its stream (2 round trips of negotiation) and a spare for the next
    # one; the second starts on the spare. A spare the verifier already dropped (its open timeout
    # shortened here to 0.5 s) is replaced by a fresh stream, with the same output.
    from p2pnode.speculation import edge as edge_mod
    from p2pnode.speculation import protocol

    ref = target_generate(target, prompts[2], 6, eos_token_ids=target.eos_token_ids)
    async with _edge_client(target, draft, overlay_network) as client:
        with trio.fail_after(60):
            first = await client.generate(prompts[2], 6, mode="remote")
            second = await client.generate(prompts[2], 6, mode="async")
            assert first.tokens == second.tokens == ref
            assert (first.warm, second.warm) == (False, True)
            monkeypatch.setattr(protocol, "OPEN_TIMEOUT_S", 0.5)
            monkeypatch.setattr(edge_mod, "SPARE_MAX_AGE_S", 100.0)
            await client.generate(prompts[2], 2, mode="sync")  # leaves a spare behind
            await trio.sleep(1.0)  # > 0.5 s: the verifier closes the idle spare
            third = await client.generate(prompts[2], 6, mode="sync")
            assert third.tokens == ref and not third.warm


async def test_auto_mode_tries_both_then_keeps_the_faster(
    target, draft, prompts, overlay_network
) -> None:
    ref = target_generate(target, prompts[2], 5, eos_token_ids=target.eos_token_ids)
    async with _edge_client(target, draft, overlay_network) as client:
        with trio.fail_after(60):
            runs = [await client.generate(prompts[2], 5, mode="auto") for _ in range(3)]
    assert [r.tokens for r in runs] == [ref] * 3
    assert [r.mode for r in runs[:2]] == ["async", "remote"]
    assert runs[2].mode == max(client.mode_rates, key=client.mode_rates.get)
    with pytest.raises(BadRequest, match="auto"):
        await client.generate(prompts[2], 5, mode="fastest")
