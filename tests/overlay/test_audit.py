"""Audited forwards (overlay/trust/audit.py): the verdict math, the probation policy, trust that survives
a restart (overlay/trust/store.py), an honest peer on another numeric path that is never flagged,
and liars of three kinds on a real 5-node loopback cluster with the real model.

The cluster's engines share one loaded model (the engine never writes weights); their cost
models are pinned and frozen so the routers' choices follow the advertised speeds, not the CPU
noise of a shared machine (as in tests/system/test_routing_cluster.py). The "other model" liar serves a copy
of the model with noisy weights: a stand-in for a different fine-tune under the same id (the
machine has one model).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
import trio
from prometheus_client import CollectorRegistry, generate_latest

from p2pnode.inference.engine import open_engine
from p2pnode.inference.sampling import SamplingParams
from p2pnode.inference.scoring import ModelScorer
from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
from p2pnode.overlay.serve.forward import ForwardConfig
from p2pnode.overlay.serve.service import RoutedService
from p2pnode.overlay.trust.audit import (
    AuditConfig,
    Auditor,
    AuditVerdict,
    check_greedy,
    check_sampled,
)
from p2pnode.overlay.trust.book import TrustBook
from p2pnode.overlay.trust.challenge import ChallengeConfig
from p2pnode.overlay.trust.store import load_trust, save_trust
from p2pnode.testnet.adversary.trial import make_adversary

from testkit import wait_until

logging.getLogger("libp2p").setLevel(logging.ERROR)


# --------------------------------------------------------------------------- verdict math


def test_greedy_check_accepts_ties_within_the_margin_and_finds_the_first_wrong_token() -> None:
    logits = torch.tensor([[5.0, 4.8, 0.0], [0.0, 1.0, 9.0], [2.0, 2.0, 2.0]])
    assert check_greedy(logits, [0, 2, 1], margin=0.5).passed
    assert check_greedy(logits, [1, 2, 0], margin=0.5).passed  # 0.2 below the argmax
    bad = check_greedy(logits, [0, 1, 0], margin=0.5)
    assert not bad.passed and bad.first_bad == 1 and bad.statistic == pytest.approx(8.0)
    assert not check_greedy(logits, [0, 2, 7], margin=0.5).passed  # not a token at all


def test_sampled_check_false_alarm_rate_is_below_its_bound_and_random_text_fails() -> None:
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    trials, alarms, caught = 400, 0, 0
    for _ in range(trials):
        n = rng.randrange(4, 33)
        logits = torch.randn(n, 512, generator=gen) * 3
        probs = torch.softmax(logits / 0.8, dim=-1)
        honest = torch.multinomial(probs, 1, generator=gen).squeeze(1).tolist()
        kw = {"temperature": 0.8, "top_p": 1.0, "z_max": 4.0}
        alarms += not check_sampled(logits, honest, **kw).passed
        noise = torch.randint(0, 512, (n,), generator=gen).tolist()
        caught += not check_sampled(logits, noise, **kw).passed
    # Cantelli bounds the false-alarm rate by 1 / (1 + 4^2) = 5.9 %; measured it is far lower.
    assert alarms / trials <= 0.01, alarms
    assert caught / trials >= 0.95, caught
    # A token outside the nucleus is impossible for an honest sampler.
    logits = torch.tensor([[10.0, 0.0, -10.0]])
    assert not check_sampled(logits, [2], temperature=1.0, top_p=0.9, z_max=4.0).passed


# --------------------------------------------------------------------------- probation policy


class _Scorer:
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def logits(self, prompt: Any, answer: Any) -> torch.Tensor:
        return self.rows[: len(answer)]

    def cost_s(self, tokens: int) -> float:
        return 0.0


async def test_new_identities_are_held_until_they_pass_probation_and_a_lie_demotes() -> None:
    rows = torch.zeros(4, 8)
    rows[:, 3] = 5.0  # the target's answer is always token 3
    book = TrustBook()
    cfg = AuditConfig(probation_answers=3, trusted_rate=0.0)
    auditor = Auditor(_Scorer(rows), book, cfg, registry=CollectorRegistry())
    greedy = SamplingParams(max_tokens=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(auditor.run)
        for _ in range(3):
            assert auditor.plan("peer", greedy).hold
            assert (await auditor.check("peer", [1], [3, 3], greedy)).passed
        assert not auditor.plan("peer", greedy).hold and not auditor.plan("peer", greedy).audit
        assert auditor.plan("newcomer", greedy).hold  # another key: on probation
        verdict = await auditor.check("newcomer", [1], [3, 5], greedy)
        assert not verdict.passed and verdict.first_bad == 1
        assert not book.usable("newcomer") and book.demotions("newcomer") == 1
        assert book.audited_ok("newcomer") == 0
        nursery.cancel_scope.cancel()
    assert auditor.counts == {"passed": 3, "failed": 1, "skipped": 0}


class _SlowScorer(_Scorer):
    """Scores as _Scorer, taking ``seconds`` per pass (a thread sleep: the pass is CPU work in a
    worker thread) and saying each pass costs ``cost``."""

    def __init__(self, rows: torch.Tensor, seconds: float, cost: float) -> None:
        super().__init__(rows)
        self.seconds, self.cost = seconds, cost

    def logits(self, prompt: Any, answer: Any) -> torch.Tensor:
        import time

        time.sleep(self.seconds)
        return super().logits(prompt, answer)

    def cost_s(self, tokens: int) -> float:
        return self.cost


async def test_a_probation_answer_is_never_released_unchecked_whatever_the_budget() -> None:
    rows = torch.zeros(4, 8)
    rows[:, 3] = 5.0
    book = TrustBook()
    clock = [0.0]
    cfg = AuditConfig(probation_answers=3, budget_share=0.1, budget_window_s=10.0, max_hold_s=2)
    scorer = _SlowScorer(rows, seconds=0.0, cost=0.6)
    auditor = Auditor(scorer, book, cfg, clock=lambda: clock[0])
    greedy = SamplingParams(max_tokens=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(auditor.run)
        assert auditor.hold_s("new", 10) == pytest.approx(0.6)  # the budget has room
        auditor._budget.spend(1.0)  # the whole budget (10 % of 10 s) is spent
        # The router may not pick the peer now: its answer could not be checked in time...
        assert auditor.hold_s("new", 10) == float("inf")
        # ...and an answer already on its way is still audited, never skipped.
        verdict = await auditor.check("new", [1], [3, 5], greedy)
        assert verdict is not None and not verdict.passed
        assert not book.usable("new")
        # A pass that outlasts the hold: the caller drops the answer (None); the verdict
        # still lands when the pass ends.
        scorer.seconds = 0.5
        assert await auditor.check("late", [1], [3, 3], greedy, wait_s=0.05) is None
        await wait_until(lambda: book.audited_ok("late") == 1, 10, "the late audit's verdict")
        # A pass longer than max_hold_s cannot be waited for at all: not a candidate.
        scorer.cost = 5.0
        clock[0] = 100.0  # the spent budget has left the window
        assert auditor.hold_s("late", 10) == float("inf")
        nursery.cancel_scope.cancel()
    assert auditor.counts["skipped"] == 0
    assert auditor.by_peer["new"] == {"passed": 0, "failed": 1, "skipped": 0, "by_self": 1}


async def test_members_are_trusted_from_their_first_answer_until_demoted() -> None:
    rows = torch.zeros(4, 8)
    rows[:, 3] = 5.0
    book = TrustBook()
    members = {"member"}
    auditor = Auditor(
        _Scorer(rows), book, AuditConfig(probation_answers=8), is_member=members.__contains__
    )
    greedy = SamplingParams(max_tokens=4)
    assert not auditor.plan("member", greedy).hold and auditor.state("member") == "member"
    assert auditor.hold_s("member", 100) == 0.0
    assert auditor.plan("stranger", greedy).hold and auditor.state("stranger") == "probation"
    async with trio.open_nursery() as nursery:
        await nursery.start(auditor.run)
        assert not (await auditor.check("member", [1], [3, 5], greedy)).passed
        nursery.cancel_scope.cancel()
    assert auditor.state("member") == "demoted"
    # Readmitted after its debt decays, a member caught once goes through probation.
    book._peers["member"].banned = False
    assert auditor.on_probation("member") and auditor.state("member") == "probation"


class _Others:
    """A ``SecondAuditor`` double: fixed verdicts per auditor, in the order asked."""

    def __init__(self, first: tuple[bool, str] | None, second: tuple[bool, str] | None) -> None:
        self.first, self.second_answer = first, second
        self.asked: list[set[str]] = []  # who each call excluded

    async def audit(self, prompt, answer, params, *, not_by):
        got = self.first if not self.asked else self.second_answer
        self.asked.append(set(not_by))
        if got is None:
            return None
        return AuditVerdict(got[0], len(answer)), got[1]


async def test_a_third_peers_failed_verdict_is_checked_before_anyone_is_demoted() -> None:
    rows = torch.zeros(4, 8)
    rows[:, 3] = 5.0  # the target's answer is always token 3
    greedy = SamplingParams(max_tokens=4)
    cases = [
        # (first, second, answer) -> (server usable, first auditor usable, by)
        ((True, "a"), None, [3, 3], True, True, "peer"),
        ((False, "a"), (False, "b"), [3, 5], False, True, "peer"),
        ((False, "a"), (True, "b"), [3, 3], True, False, "peer"),  # "a" lied about it
        ((False, "a"), None, [3, 3], True, False, "self"),  # our own pass settles it
        (None, None, [3, 5], False, True, "self"),  # nobody cheaper: our own pass
    ]
    for first, second, answer, server_ok, auditor_ok, by in cases:
        book = TrustBook()
        others = _Others(first, second)
        auditor = Auditor(_Scorer(rows), book, AuditConfig(probation_answers=0), others=others)
        async with trio.open_nursery() as nursery:
            await nursery.start(auditor.run)
            await auditor.check("server", [1], answer, greedy)
            nursery.cancel_scope.cancel()
        assert book.usable("server") == server_ok, (first, second)
        assert (book.score("a") == 1.0) == auditor_ok, (first, second)
        assert auditor.by_auditor[by] == 1, (first, second, auditor.by_auditor)
        assert others.asked[0] == {"server"}  # never the serving peer
        if len(others.asked) > 1:  # the tie-breaker is neither the server nor the first auditor
            assert others.asked[1] == {"server", "a"}


def test_every_trusted_peer_is_audited_at_least_every_max_gap_answers() -> None:
    auditor = Auditor(
        _Scorer(torch.zeros(1, 1)),
        TrustBook(),
        AuditConfig(probation_answers=0, trusted_rate=0.0, max_gap=5),
        rng=random.Random(0),
    )
    greedy = SamplingParams(max_tokens=4)
    plans = [auditor.plan("peer", greedy) for _ in range(20)]
    assert [i for i, p in enumerate(plans) if p.audit] == [4, 9, 14, 19]
    assert all(p.forced for p in plans if p.audit) and not any(p.hold for p in plans)


def test_the_sampled_rate_delivers_about_1_minus_p_over_p_lies_before_the_first_audit() -> None:
    """A liar that turns after earning trust lies on every answer; the first audited one
    demotes it. With rate p the count of lies delivered before it is geometric with mean
    (1 - p) / p (4 at the default 0.2), capped by max_gap - 1."""
    cfg = AuditConfig(probation_answers=0)  # it has earned trust
    counts = []
    for seed in range(400):  # bounded, seeded
        auditor = Auditor(_Scorer(torch.zeros(1, 1)), TrustBook(), cfg, rng=random.Random(seed))
        n = 0
        while not auditor.plan(f"liar{seed}", SamplingParams(max_tokens=4)).audit:
            n += 1
        counts.append(n)
    p = cfg.trusted_rate
    expected = (
        sum(min(k, cfg.max_gap - 1) * (1 - p) ** k * p for k in range(cfg.max_gap))
        + (cfg.max_gap - 1) * (1 - p) ** cfg.max_gap
    )
    assert max(counts) <= cfg.max_gap - 1
    assert abs(sum(counts) / len(counts) - expected) < 0.5, (sum(counts) / len(counts), expected)


def test_trust_survives_a_restart_and_a_bad_file_is_set_aside(tmp_path) -> None:
    book = TrustBook()
    for _ in range(5):
        book.observe_audit("honest", True)
    book.observe_audit("liar", False)
    path = tmp_path / "trust.json"
    save_trust(book, path)
    assert path.stat().st_mode & 0o777 == 0o600
    again = TrustBook()
    assert load_trust(again, path) == 2
    assert again.audited_ok("honest") == 5 and again.usable("honest")
    assert not again.usable("liar") and again.demotions("liar") == 1
    assert again.audited_ok("stranger") == 0  # a new key starts from nothing
    path.write_text(json.dumps({"format": 1, "peers": {"x": {"debt": "lots"}}}))
    assert load_trust(TrustBook(), path) == 0
    assert not path.exists() and (tmp_path / "trust.json.bad").exists()


# --------------------------------------------------------------------------- real model


QUESTIONS = [
    "Name a fruit.",
    "What colour is the sky?",
    "Say hello in French.",
    "Count to three.",
    "Name a large animal.",
    "What is two plus two?",
    "Name a planet.",
    "Give me a synonym for happy.",
    "What do bees make?",
    "Name a musical instrument.",
    "What is frozen water called?",
    "Name a day of the week.",
]


def chat(engine: Any, question: str) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": question}])


async def test_an_honest_bf16_peer_batching_four_is_never_flagged_in_200_answers(loaded) -> None:
    from p2pnode.inference.models import load_model

    bf16 = load_model(None, dtype="bfloat16")
    scorer = ModelScorer(loaded.model)
    prompts = []
    for i in range(200):  # 50 questions, 4 ways each: short, distinct, cheap
        q = f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"
        prompts.append(chat(_Tok(loaded.tokenizer), q))
    worst, flagged = 0.0, 0
    async with open_engine(bf16, calibrate_cost=False, torch_threads=2, max_batch=4) as engine:
        with trio.fail_after(900):
            for start in range(0, len(prompts), 4):
                results: list[Any] = [None] * 4

                async def one(j: int, p: list[int], out: list[Any] = results) -> None:
                    out[j] = await engine.generate(p, {"max_tokens": 6})

                async with trio.open_nursery() as nursery:  # four at once: the batched path
                    for j, p in enumerate(prompts[start : start + 4]):
                        nursery.start_soon(one, j, p)
                for p, r in zip(prompts[start : start + 4], results, strict=True):
                    logits = await trio.to_thread.run_sync(scorer.logits, p, r.tokens)
                    v = check_greedy(logits, r.tokens, AuditConfig().greedy_margin)
                    flagged += not v.passed
                    worst = max(worst, v.statistic)
    logging.getLogger(__name__).info("bf16 batched vs fp32: worst gap %.3f logits", worst)
    assert flagged == 0, worst


class _Tok:
    """encode_chat without an engine (the same template the engine applies)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode_chat(self, messages: Any) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))


# --------------------------------------------------------------------------- liars, real model

AE_CONFIG = AntiEntropyConfig(interval_s=0.2, pull_min_interval_s=0.3)
FORWARD_CONFIG = ForwardConfig(accept_slack_s=20, first_token_slack_s=30, idle_min_s=20)
MAX_TOKENS = 12
# Advertised decode speeds (s/token): the origin is slow so it forwards, the liars are the
# fastest so the router picks them first (random text, then wrong output, then other model).
SPEEDS = {"origin": 2.0, "random": 1 / 40, "wrong": 1 / 30, "other": 1 / 20, "honest": 1 / 10}
ROLES = ("origin", "random", "wrong", "other", "honest")


def noisy_copy(loaded: Any, scale: float) -> Any:
    from p2pnode.inference.models import LoadedModel

    model = copy.deepcopy(loaded.model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * float(p.std()))
    return LoadedModel(loaded.name, model, loaded.tokenizer, loaded.model_id, loaded.path)


@contextlib.asynccontextmanager
async def liar_cluster(
    loaded: Any, overlay_network: Any, audit_config: AuditConfig | None = None
) -> AsyncIterator[dict[str, Any]]:
    async with (
        overlay_network(len(ROLES), ping_timeout=5.0, health_ping_timeout=10.0) as nodes,
        contextlib.AsyncExitStack() as stack,
    ):
        n = len(nodes) - 1
        await wait_until(
            lambda: all(len(x.peers.up_peers()) == n for x in nodes), 30, "a full mesh"
        )

        async def engine_for(model: Any, decode_s: float) -> Any:
            e = await stack.enter_async_context(
                open_engine(model, calibrate_cost=False, torch_threads=1, cache_budget_tokens=2048)
            )
            e.cost.prefill_s_per_token, e.cost.decode_s_per_token = 1 / 200, decode_s
            e.cost.overhead_s, e.cost.alpha = 0.02, 0.0
            return e

        engines = [await engine_for(loaded, SPEEDS[r]) for r in ROLES]
        other = await engine_for(noisy_copy(loaded, 0.2), SPEEDS["other"])
        async with trio.open_nursery() as nursery:
            services: dict[str, Any] = {}
            for role, node, engine in zip(ROLES, nodes, engines, strict=True):
                registry = CollectorRegistry()
                svc = RoutedService(
                    node,
                    node.config.key,
                    engine,
                    antientropy_config=AE_CONFIG,
                    forward_config=FORWARD_CONFIG,
                    # The held path alone: known-answer challenges would catch some liars
                    # before a client request reaches them (tests/overlay/test_challenge.py).
                    challenge_config=ChallengeConfig(enabled=False),
                    registry=registry,
                    audit_config=audit_config,
                )
                if role == "origin":
                    services["registry"] = registry
                svc.router.rtt_s = lambda _peer: 0.002
                await nursery.start(svc.run)
                services[role] = svc
            make_adversary(services["random"], "random-text")
            make_adversary(services["wrong"], "wrong-output", rate=1 / 20)
            make_adversary(services["other"], "other-model", other=other)
            yield services
            nursery.cancel_scope.cancel()
        await trio.sleep(1.0)  # digests in flight land before the nodes stop


async def test_three_kinds_of_liar_are_caught_on_probation_and_no_wrong_answer_is_kept(
    loaded, overlay_network
) -> None:
    async with liar_cluster(loaded, overlay_network) as s:
        a = s["origin"]
        ids = {r: s[r].node.peer_id for r in ROLES}
        await wait_until(
            lambda: all(a.views.get(ids[r], a.model_id) is not None for r in ROLES[1:]),
            30,
            "the origin's views of every peer",
        )
        kept, served_by = [], []
        with trio.fail_after(600):
            for q in QUESTIONS:  # bounded: 12 requests
                prompt = chat(a.engine, q)
                res = await a.generate(prompt, {"max_tokens": MAX_TOKENS})
                reference = await a.engine.generate(prompt, {"max_tokens": MAX_TOKENS})
                kept.append(res.tokens == reference.tokens)
                served_by.append([(x.target, x.outcome) for x in res.attempts])
                liars_out = all(not a.trust.usable(ids[r]) for r in ("random", "wrong", "other"))
                if liars_out and res.served_by == ids["honest"]:
                    break
        log = logging.getLogger(__name__)
        log.info("attempts per request: %s", served_by)
        assert all(kept), served_by  # every answer the client got equals the target's
        tries = {r: sum(t == ids[r] for att in served_by for t, _ in att) for r in ROLES[1:4]}
        # On probation every answer is audited and held: random text fails its first answer;
        # one token in 20 is wrong by the second 12-token answer; the other model by its
        # first answer that leaves the margin, within its probation (8 answers).
        assert tries["random"] == 1 and 1 <= tries["wrong"] <= 2 and 1 <= tries["other"] <= 8
        for r in ("random", "wrong", "other"):
            assert not a.trust.usable(ids[r]) and a.trust.demotions(ids[r]) == 1, r
        assert a.trust.usable(ids["honest"])
        assert a.auditor.counts["failed"] == 3 and a.auditor.reserved == 3
        text = generate_latest(s["registry"]).decode()  # what GET /metrics serves
        assert 'p2pnode_audits_total{mode="held",verdict="failed"} 3.0' in text
        assert "p2pnode_audit_reserved_total 3.0" in text


async def test_liars_on_probation_get_no_wrong_answer_through_when_audits_cannot_keep_up(
    loaded, overlay_network
) -> None:
    """Twelve requests at once against an audit budget of one pass: the first forwards to
    peers on probation are held and audited (never skipped), and once the budget is spent
    those peers are no candidates (``no_audit``) until it recovers. Every answer a client gets
    equals the target's."""
    budget = AuditConfig(budget_share=0.005, budget_window_s=600.0)  # 3 s over 10 min
    async with liar_cluster(loaded, overlay_network, budget) as s:
        a = s["origin"]
        ids = {r: s[r].node.peer_id for r in ROLES}
        await wait_until(
            lambda: all(a.views.get(ids[r], a.model_id) is not None for r in ROLES[1:]),
            30,
            "the origin's views of every peer",
        )
        prompts = [chat(a.engine, f"{QUESTIONS[i % len(QUESTIONS)]} ({i})") for i in range(12)]
        results: dict[int, Any] = {}

        async def ask(i: int) -> None:
            results[i] = await a.generate(prompts[i], {"max_tokens": MAX_TOKENS})

        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(ask, i)
        outcomes = [[(x.target, x.outcome) for x in results[i].attempts] for i in range(12)]
        forwarded = [o for att in outcomes for o in att if o[0] != "local"]
        assert forwarded, outcomes  # the liars' forged speeds drew forwards at first
        for i in range(len(prompts)):  # bounded: 12 references
            reference = await a.engine.generate(prompts[i], {"max_tokens": MAX_TOKENS})
            assert results[i].tokens == reference.tokens, outcomes[i]
        assert a.auditor.counts["skipped"] == 0
        assert a.auditor.hold_s(ids["wrong"], 200) == float("inf")  # the budget is spent


async def test_a_node_keeps_its_trust_across_a_restart(tmp_path) -> None:
    # The node assembly restores trust.json at start and writes it back when it stops: a
    # liar demoted before the restart is still demoted after it, the honest peer keeps its
    # passed audits (no second probation).
    from p2pnode.bootstrap.config import settings_from
    from p2pnode.bootstrap.node import run_node

    book = TrustBook()
    book.observe_audit("liar", False)
    for _ in range(8):
        book.observe_audit("honest", True)
    save_trust(book, tmp_path / "trust.json")
    settings = settings_from(
        {
            "home": str(tmp_path),
            "listen": ["/ip4/127.0.0.1/tcp/0"],
            "api_port": 0,
            "backend": "emulated",
        }
    )
    for _ in range(2):  # two lives of the same node
        written = json.loads((tmp_path / "trust.json").read_text())["peers"]["liar"]["at_wall"]
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                await nursery.start(run_node, settings)
                nursery.cancel_scope.cancel()
        saved = json.loads((tmp_path / "trust.json").read_text())["peers"]["liar"]["at_wall"]
        assert saved > written  # the node itself wrote it back at shutdown
        again = TrustBook()
        assert load_trust(again, tmp_path / "trust.json") == 2
        assert not again.usable("liar") and again.demotions("liar") == 1
        assert again.audited_ok("honest") == 8


# --------------------------------------------------------------------------- emulated reference


async def test_the_emulated_model_answers_as_a_function_of_the_input_alone() -> None:
    """Cache hits, batching and order change nothing: a trial can recompute every honest
    answer (inference.scoring.emulated_answer) to count wrong ones."""
    from p2pnode.inference.models import ShapeOnlyModel
    from p2pnode.inference.scoring import emulated_answer

    shape = ShapeOnlyModel(model_id="emu", eos_token_ids=(2, 7))
    rng = random.Random(3)
    base = [rng.randrange(shape.vocab_size) for _ in range(40)]
    prompts = [base + [rng.randrange(shape.vocab_size) for _ in range(k)] for k in (1, 5, 9)]
    prompts.append(list(prompts[0]))  # the same prompt again, in the same batch
    async with open_engine(
        shape, backend="emulated", calibrate_cost=False, torch_threads=None, max_batch=4
    ) as engine:
        engine.cost.prefill_s_per_token = engine.cost.decode_s_per_token = 0.0
        engine.cost.overhead_s = 0.0
        params = SamplingParams(max_tokens=12)
        alone = (await engine.generate(prompts[0], params)).tokens  # cold cache
        batched: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            batched[i] = (await engine.generate(prompts[i], params)).tokens

        async with trio.open_nursery() as nursery:  # warm cache, one batch
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    assert alone == batched[0] == batched[3]
    for i, p in enumerate(prompts):
        assert batched[i] == emulated_answer(p, 12, shape.vocab_size, shape.eos_token_ids)
    assert len({tuple(t) for t in batched.values()}) >= 3  # not one constant answer


async def test_the_origins_own_audit_runs_on_its_cached_prefix_and_still_catches_a_lie(
    loaded,
) -> None:
    # An origin that holds a chat's system prompt pays only for the rest of the prompt and the
    # answer when it audits an answer itself (the engine's scoring pass reuses its cache).
    system = [{"role": "system", "content": "You are a terse assistant. " * 40}]
    async with open_engine(loaded, calibrate_cost=False, torch_threads=2) as engine:
        first = engine.encode_chat([*system, {"role": "user", "content": "Name a colour."}])
        await engine.generate(first, {"max_tokens": 2})  # the system prompt is now cached
        prompt = engine.encode_chat([*system, {"role": "user", "content": "Name a fruit."}])
        answer = (await engine.generate(prompt, {"max_tokens": 6})).tokens
        cached = engine.cached_prefix_len(prompt)
        assert cached >= len(prompt) // 2
        book = TrustBook()
        auditor = Auditor(
            ModelScorer(loaded.model), book, AuditConfig(probation_answers=0), score=engine.score
        )
        params = SamplingParams(max_tokens=6)
        before = dict(engine.totals)
        assert (await auditor._own(prompt, answer, params)).passed
        used = engine.totals["cached_tokens"] - before["cached_tokens"]
        assert used >= cached - 16, (used, cached)  # the pass started from the cached prefix
        lie = [*answer[:-1], (answer[-1] + 1) % engine.vocab_size]
        assert not (await auditor._own(prompt, lie, params)).passed
