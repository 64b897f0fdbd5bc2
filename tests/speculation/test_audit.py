"""The likelihood test of sampled speculative results (speculation/_audit.py ``audit_sampled``).

Real parts: the default SmolLM2 target (fp32) scores. Honest results: seeded samples of the
target at the claimed temperature and top-p (speculative sampling's output has exactly this
distribution), plus a few from the real speculative path (the W4A16 draft against a
``BatchedVerifier`` on the target), so the false-alarm rate is measured on both.
"""

from __future__ import annotations

import math

import pytest
import torch
import trio

from p2pnode.inference.sampling import probs_from_logits
from p2pnode.inference.scoring import ModelScorer
from p2pnode.overlay.trust.book import TrustBook
from p2pnode.speculation import (
    BadRequest,
    BatchedVerifier,
    EdgeResult,
    SamplingOptions,
    load_draft,
    speculative_generate,
)
from p2pnode.speculation._audit import SAMPLED_Z_MAX, audit_sampled
from p2pnode.speculation.testing import inprocess_transport

QUESTIONS = ["Name a fruit.", "Why is the sky blue?", "Write a short poem.", "Count to five."]
TEMPERATURE, TOP_P, TOKENS = 0.8, 0.95, 16
DIRECT, SPECULATIVE = 32, 4  # seeded honest runs of each kind
BOUND = 1 / (1 + SAMPLED_Z_MAX**2)  # Cantelli: the false-alarm rate is at most this (5.9 %)


@pytest.fixture(scope="module")
def target(loaded):
    """The shared real model, here in its role: the target the drafts are checked against."""
    return loaded


def _prompt(target, i: int) -> list[int]:
    tok = target.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return list(tok.encode(text, add_special_tokens=False))


def _result(prompt, tokens, temperature=TEMPERATURE, verifiers=("v1",), starts=(0,)):
    return EdgeResult(
        "",
        list(tokens),
        prompt_ids=list(prompt),
        greedy=False,
        temperature=temperature,
        top_p=TOP_P,
        verifiers=list(verifiers),
        starts=list(starts),
    )


def _sample_target(target, prompt: list[int], n: int, temperature: float, top_p: float, seed):
    """n tokens sampled from the target (KV-cached decode, the verifier's sampling rule)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    ids, past = torch.tensor([prompt]), None
    with torch.inference_mode():
        for _ in range(n):
            res = target.model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            p = probs_from_logits(res.logits[0, -1], temperature, top_p)
            out.append(int(torch.multinomial(p, 1, generator=gen)))
            ids = torch.tensor([[out[-1]]])
    return out


@pytest.mark.slow
async def test_honest_sampled_results_pass_and_foreign_tokens_are_flagged(target) -> None:
    scorer = ModelScorer(target.model)
    honest = [
        (
            _prompt(target, k),
            _sample_target(target, _prompt(target, k), TOKENS, TEMPERATURE, TOP_P, k),
        )
        for k in range(DIRECT)
    ]
    draft = load_draft()
    verifier = BatchedVerifier(target, max_sessions=8, max_batch=4, max_wait_ms=5)

    async def one(seed: int) -> None:
        prompt = _prompt(target, seed)
        options = SamplingOptions(temperature=TEMPERATURE, top_p=TOP_P, seed=seed)
        async with inprocess_transport(verifier) as transport:
            got = await speculative_generate(
                draft, transport, prompt, TOKENS, gamma=4, depth=2, lead=4, options=options
            )
        honest.append((prompt, got.tokens[:TOKENS]))

    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await nursery.start(verifier.run)
            async with trio.open_nursery() as runs:
                for seed in range(SPECULATIVE):
                    runs.start_soon(one, 100 + seed)
            nursery.cancel_scope.cancel()
    runs_total = DIRECT + SPECULATIVE
    assert len(honest) == runs_total

    book = TrustBook()
    audits = [audit_sampled(book, _result(p, t), scorer) for p, t in honest]
    alarms = [a for a in audits if a.verdict != "plausible"]
    zs = [a.segments["v1"].statistic for a in audits]
    # Stated: at most 5.9 % false alarms whatever the distribution (Cantelli); seeded runs,
    # so this is deterministic up to the verifier's batching order.
    assert len(alarms) <= math.floor(BOUND * runs_total), (len(alarms), zs)
    print(f"false alarms {len(alarms)}/{runs_total}, honest z max {max(zs):.2f}")
    assert all(math.isfinite(z) for z in zs)

    gen = torch.Generator().manual_seed(7)
    vocab = target.vocab_size
    for k, (prompt, _) in enumerate(honest[:8]):
        noise = torch.randint(0, vocab, (TOKENS,), generator=gen).tolist()
        random_text = audit_sampled(TrustBook(), _result(prompt, noise), scorer)
        assert random_text.verdict == "implausible" and random_text.blamed == ["v1"]
        # The target's own tokens, but sampled at temperature 2.0 while 0.8 is claimed.
        hot = _sample_target(target, prompt, TOKENS, 2.0, 1.0, seed=k)
        assert audit_sampled(TrustBook(), _result(prompt, hot), scorer).verdict == "implausible"

    # A failed-over result: the first verifier's share is honest, the second's random; only
    # the second is blamed, and three such audits demote it.
    prompt, good = honest[0]
    mixed = good[:8] + torch.randint(0, vocab, (8,), generator=gen).tolist()
    book = TrustBook()
    for _ in range(3):
        audit = audit_sampled(
            book, _result(prompt, mixed, verifiers=("v1", "v2"), starts=(0, 8)), scorer
        )
        assert audit.blamed == ["v2"] and audit.segments["v1"].passed
    assert book.usable("v1") and not book.usable("v2")


def test_a_greedy_result_is_not_audited_by_likelihood() -> None:
    greedy = EdgeResult("", [1, 2], prompt_ids=[3], greedy=True, verifiers=["v"], starts=[0])
    with pytest.raises(BadRequest, match="audit_result"):
        audit_sampled(TrustBook(), greedy, scorer=None)  # type: ignore[arg-type]
