"""The edge loop (speculation/edge.py): speculative_generate equals the target (greedy) or follows
it in distribution (sampled), draft or lead only, the first tokens during the draft's prefill,
DraftRunner's rollback.

Real parts only: the default SmolLM2 target (fp32) and its W4A16 draft, real loopback libp2p nodes.
"""

from __future__ import annotations

import math
import threading
from collections import Counter

import pytest
import torch
import trio

from p2pnode.inference.sampling import probs_from_logits
from p2pnode.speculation import (
    BatchedVerifier,
    Block,
    DraftHistory,
    DraftRunner,
    SamplingOptions,
    edge,
    remote_generate,
    speculative_generate,
    target_generate,
)
from p2pnode.speculation.protocol import VerifyBlock, decode_q, encode_q
from p2pnode.speculation.testing import inprocess_transport


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
    eos, n = target.eos_token_ids, edge.SEGMENT * 2 + 24
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
    assert s.lead_tokens >= 2 * edge.SEGMENT


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


def test_draft_prefix_keeps_and_restores_a_plain_dynamic_cache(draft) -> None:
    # A draft off the C path holds transformers' DynamicCache, whose crop takes only a count
    # to drop: keeping a prompt's KV and starting from it crop by that, never by a length.
    from transformers import DynamicCache

    from p2pnode.speculation.edge import DraftPrefix

    runner = DraftRunner(draft, SamplingOptions(), top_k=8, seed=None)
    cache = DynamicCache()
    kv = torch.randn(1, 2, 10, 4, generator=torch.Generator().manual_seed(1))
    cache.update(kv, kv + 1, 0)
    runner.cache, runner.cache_len, runner.tokens = cache, 10, list(range(12))
    prefix = DraftPrefix()
    prefix.keep(runner, list(range(8)))  # its last token is always run: 7 kept
    assert prefix.tokens == list(range(7)) and prefix.cache.get_seq_length() == 7
    assert torch.equal(prefix.cache.layers[0].keys, kv[..., :7, :])
    other = DraftRunner(draft, SamplingOptions(), top_k=8, seed=None)
    other.start_from(prefix, [0, 1, 2, 3, 4, 99, 100])
    assert other.cache_len == 5 and other.cache.get_seq_length() == 5
    assert prefix.cache.get_seq_length() == 7  # a copy was cropped, not the kept cache


async def test_second_session_starts_from_the_drafts_prefix_and_equals_target(
    target, draft, prompts
) -> None:
    # Two chat prompts share the chat template's system turn: the second session's draft
    # starts from the first one's KV of it (DraftPrefix) and prefills only the rest; both
    # outputs equal the target's greedy decoding.
    from p2pnode.speculation.edge import DraftPrefix

    eos = target.eos_token_ids
    prefix = DraftPrefix()
    verifier = BatchedVerifier(target)
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1], strict=False)) if a != b)
    assert shared > 8
    async with trio.open_nursery() as nursery:
        await nursery.start(verifier.run)
        for p in prompts[:2]:
            async with inprocess_transport(verifier) as transport:
                got = await speculative_generate(
                    draft, transport, p, 12, gamma=4, depth=2, eos_token_ids=eos, prefix=prefix
                )
            assert got.tokens == target_generate(target, p, 12, eos_token_ids=eos)
            assert prefix.tokens == p[: len(p) - 1]  # this prompt's KV, for the next session
            assert prefix.cache is not None and prefix.cache.get_seq_length() == len(p) - 1
        nursery.cancel_scope.cancel()
    assert prefix.usable(prompts[0]) == shared
