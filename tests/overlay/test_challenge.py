"""Probation by known answers (overlay/trust/challenge.py) and the probation hold in the router.

Unit tests drive ``KnownAnswers`` and ``Challenger`` with an in-memory ``send`` (the forward
itself is tested in tests/system/test_routing_cluster.py); the cluster test runs real libp2p hosts on
127.0.0.1 with emulated engines (deterministic answers, no torch): an honest peer leaves
probation without one client request forwarded to it, and a liar is demoted the same way.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest

from p2pnode.inference.blockhash import block_hashes, model_salt
from p2pnode.inference.engine import open_engine
from p2pnode.inference.models import ShapeOnlyModel
from p2pnode.inference.scoring import emulated_answer
from p2pnode.inference.vllm.events import BlockStored
from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
from p2pnode.overlay.cache.digest import DigestBuilder, LoadInfo
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.routing.router import LOCAL, LocalState, Router, RouterConfig
from p2pnode.overlay.serve.forward import ForwardConfig
from p2pnode.overlay.serve.probation import ProbationChallenges
from p2pnode.overlay.serve.service import RoutedService
from p2pnode.overlay.trust.audit import AuditConfig, Auditor
from p2pnode.overlay.trust.book import TrustBook
from p2pnode.overlay.trust.challenge import (
    ChallengeConfig,
    Challenger,
    ChallengeUnanswered,
    KnownAnswers,
)
from p2pnode.testnet.adversary.trial import make_adversary

from testkit import wait_until

logging.getLogger("libp2p").setLevel(logging.ERROR)


# --------------------------------------------------------------------------- known answers


def test_known_answers_are_bounded_and_picked_cheap_then_unused_then_by_held_prefix() -> None:
    known = KnownAnswers(4)
    for i in range(6):  # the two oldest fall out
        known.add([i] * 40, [i + 100], blocks=[i, i + 1])
    assert len(known) == 4
    held = {2: 0, 3: 32, 4: 16, 5: 24}  # tokens the peer's view holds, by the first block
    first = known.pick(lambda blocks: held[blocks[0]], used=set())
    assert first is not None and first.prompt[0] == 3  # cheap (32 of 40 held), longest
    second = known.pick(lambda blocks: held[blocks[0]], used={first.serial})
    assert second is not None and second.prompt[0] == 5  # cheap and unused
    third = known.pick(lambda blocks: held[blocks[0]], used={first.serial, second.serial})
    assert third is not None and third.prompt[0] == 3  # a cheap one again, before dear ones
    assert KnownAnswers(2).pick(lambda _b: 0, set()) is None
    known.add([], [1], blocks=[])  # nothing to challenge with: not kept
    assert len(known) == 4


class _Send:
    """In-memory ``send``: answers from a table, or raises ChallengeUnanswered."""

    def __init__(self, answer: Callable[[list[int], int], list[int] | None]) -> None:
        self.answer = answer
        self.sent: list[tuple[str, int]] = []

    async def __call__(self, peer: str, prompt: list[int], max_tokens: int) -> list[int]:
        self.sent.append((peer, max_tokens))
        out = self.answer(prompt, max_tokens)
        if out is None:
            raise ChallengeUnanswered("stream reset")
        return out


async def test_a_right_answer_counts_as_a_passed_audit_and_a_wrong_one_goes_to_the_auditor():
    trust = TrustBook()
    audited: list[tuple[str, list[int]]] = []
    answers = {1: [7, 8], 2: [7, 9], 3: None}
    send = _Send(lambda prompt, n: None if answers[prompt[0]] is None else answers[prompt[0]][:n])
    ch = Challenger(
        send=send,
        peers=lambda: ["p"],
        held=lambda _peer, _blocks: 0,
        trust=trust,
        mismatch=lambda peer, _prompt, answer: audited.append((peer, answer)),
        config=ChallengeConfig(max_tokens=2, dear_interval_s=0.0),  # all dear: held is 0
        registry=(registry := CollectorRegistry()),
    )
    assert await ch.challenge("p") is None  # nothing known yet
    ch.known.add([1] * 20, [7, 8, 5], blocks=[1])  # only the first max_tokens are compared
    assert await ch.challenge("p") == "passed" and trust.audited_ok("p") == 1
    ch.known.add([2] * 20, [7, 8], blocks=[2])  # the peer answers 7, 9
    assert await ch.challenge("p") == "mismatch"
    assert audited == [("p", [7, 9])] and trust.audited_ok("p") == 1  # the audit decides
    ch.known.add([3] * 20, [4], blocks=[3])
    assert await ch.challenge("p") == "failed" and trust.usable("p")  # proves nothing
    assert send.sent == [("p", 2), ("p", 2), ("p", 1)]
    text = generate_latest(registry).decode()
    assert 'p2pnode_challenges_total{verdict="passed"} 1.0' in text
    assert 'p2pnode_challenges_total{verdict="mismatch"} 1.0' in text


async def test_dear_challenges_are_spaced_and_cheap_ones_are_not(autojump_clock) -> None:
    held_tokens = {"p": 0}
    send = _Send(lambda _prompt, n: [5] * n)
    ch = Challenger(
        send=send,
        peers=lambda: ["p"],
        held=lambda peer, _blocks: held_tokens[peer],
        trust=TrustBook(),
        mismatch=lambda *_: None,
        config=ChallengeConfig(dear_interval_s=10.0),
    )
    ch.known.add([1] * 40, [5], blocks=[1])
    assert await ch.challenge("p") == "passed"  # dear: the peer holds nothing of it
    assert await ch.challenge("p") is None  # a second dear one waits
    await trio.sleep(10.0)
    assert await ch.challenge("p") == "passed"
    held_tokens["p"] = 32  # now it holds 32 of the 40 tokens: cheap, no spacing
    assert [await ch.challenge("p") for _ in range(3)] == ["passed"] * 3


async def test_a_prefix_challenge_cuts_the_known_prompt_just_past_what_the_peer_holds() -> None:
    prompt = list(range(100, 300))  # 200 tokens; the peer's view holds the first 160
    asked: list[list[int]] = []
    sent: list[list[int]] = []
    busy = {"now": False}

    async def answer(p: list[int], n: int) -> list[int] | None:
        asked.append(p)
        return None if busy["now"] else [p[-1] % 7] * n  # our own greedy answer

    async def send(_peer: str, p: list[int], n: int) -> list[int]:
        sent.append(p)
        return [p[-1] % 7] * n  # an honest peer: the same model, the same answer

    trust = TrustBook()
    ch = Challenger(
        send=send, peers=lambda: ["p"], held=lambda _peer, _blocks: 160, trust=trust,
        mismatch=lambda *_: None, answer=answer, idle=lambda: not busy["now"],
        config=ChallengeConfig(max_tokens=2, max_overhang=15), rng=random.Random(3),
    )  # fmt: skip
    ch.known.add(prompt, [9, 9], blocks=[1])
    for _ in range(5):
        assert await ch.challenge("p") == "passed"
    assert trust.audited_ok("p") == 5
    for cut in sent:  # never more than 15 tokens the peer must prefill and cache
        assert cut == prompt[: len(cut)] and 161 <= len(cut) <= 175
    assert asked == sent  # each cut prompt answered here too
    busy["now"] = True  # our engine has client work: no challenge, nothing sent
    assert await ch.challenge("p") is None and len(sent) == 5


# --------------------------------------------------------------------------- router hold


class _Scorer:
    def logits(self, prompt: Sequence[int], answer: Sequence[int]) -> Any:
        raise AssertionError("not scored in this test")

    def cost_s(self, tokens: int) -> float:
        return 0.01 + tokens * 0.005


def _held_prefix_setup(
    model: str, peer: str, probation_answers: int
) -> tuple[list[int], list[int], PeerViews, TrustBook, Auditor, Router]:
    """A 512-token prompt of which ``peer`` advertises 480 tokens, a router that counts the
    probation hold, and its trust book and auditor."""
    tokens = [(7 * i) % 40000 + 1 for i in range(512)]
    hashes = block_hashes(tokens, model_salt(model))
    views = PeerViews()
    speeds = LoadInfo(
        queue_depth=0, est_wait_s=0.0, push_back=False,
        prefill_s_per_token=0.005, decode_s_per_token=0.05,
    )  # fmt: skip
    holder = DigestBuilder(peer, model, load_fn=lambda: speeds)
    holder.on_event(BlockStored(tuple(hashes[:30]), None))  # 480 of the 512 tokens
    views.apply(holder.full())
    trust = TrustBook()
    auditor = Auditor(_Scorer(), trust, AuditConfig(probation_answers=probation_answers))
    router = Router(views, rtt_s=lambda _p: 0.002, trust=trust, hold_s=auditor.hold_s)
    return tokens, hashes, views, trust, auditor, router


def test_the_router_counts_the_probation_hold_and_forwards_once_the_peer_passed() -> None:
    model, peer = "hold-model", "peer-b"
    _tokens, hashes, _views, trust, _auditor, router = _held_prefix_setup(model, peer, 2)
    local = LocalState(
        cached_tokens=0, wait_s=0.0, prefill_s_per_token=0.005, decode_s_per_token=0.05
    )

    def decide() -> Any:
        return router.decide(
            model_id=model, prompt_block_hashes=hashes, prompt_tokens=512, max_tokens=1,
            local=local,
        )  # fmt: skip

    # The peer saves 480 tokens of prefill, but on probation its answer waits for the origin's
    # scoring pass over all 513 tokens: a loss.
    held = decide()
    est = held.estimate_for(peer)
    assert held.chosen == LOCAL and est is not None
    assert est.hold_s == pytest.approx(0.01 + 513 * 0.005)
    for _ in range(2):
        trust.observe_audit(peer, True)
    free = decide()
    assert free.chosen == peer and free.estimate_for(peer).hold_s == 0.0


class _UnreachableNode:
    """A node whose every stream fails: a challenge sent through it is unanswered."""

    peer_id = "origin"

    async def open_stream(self, peer_id: str, protocol: str, **_kw: Any) -> Any:
        raise ConnectionError(f"{peer_id} unreachable")


async def test_challenges_are_earned_by_requests_that_would_have_gone_to_the_peer() -> None:
    model, peer = "earn-model", "peer-b"
    tokens, hashes, views, trust, auditor, router = _held_prefix_setup(model, peer, 3)
    probation = ProbationChallenges(
        node=_UnreachableNode(), model_id=model, salt=model_salt(model), views=views,
        router=router, auditor=auditor, trust=trust, forward_config=ForwardConfig(),
    )  # fmt: skip
    slow = LocalState(
        cached_tokens=0, wait_s=0.0, prefill_s_per_token=0.005, decode_s_per_token=0.05
    )
    fast = LocalState(
        cached_tokens=512, wait_s=0.0, prefill_s_per_token=0.005, decode_s_per_token=0.05
    )

    def decide(local: LocalState) -> Any:
        return router.decide(
            model_id=model, prompt_block_hashes=hashes, prompt_tokens=512, max_tokens=1,
            local=local,
        )  # fmt: skip

    probation.note_wanted(decide(fast))  # served better here anyway: earns the peer nothing
    assert probation.peers() == [] and not probation.earned
    wanted = decide(slow)  # held, but it would have won: it earns the time it would have saved
    probation.note_wanted(wanted)
    est = wanted.estimate_for(peer)
    assert est is not None and wanted.local_total_s is not None
    saved = wanted.local_total_s - (est.total_s - est.hold_s)
    assert probation.earned[peer].seconds == pytest.approx(saved)
    assert probation.peers() == [peer]
    cheap = probation.cost_s(peer, 512, 480, 1)  # 32 tokens to prefill and 1 to decode
    dear = probation.cost_s(peer, 512, 0, 1)
    assert cheap == pytest.approx(32 * 0.005 + 0.05) and dear == pytest.approx(512 * 0.005 + 0.05)
    assert probation.affords(peer, 512, 480, 1) and not probation.affords(peer, 512, 0, 1)
    probation.challenger.known.add(tokens, [5], hashes)
    # Cheap (the peer holds most of it): free once wanted. Unanswered: no verdict.
    assert await probation.challenger.challenge(peer) == "failed"
    assert probation.earned[peer].seconds == pytest.approx(saved)
    for _ in range(40):  # bounded: each want banks at most max_banked_s
        probation.note_wanted(wanted)
    assert probation.earned[peer].seconds == probation.config.max_banked_s
    other = [(13 * i) % 40000 + 3 for i in range(512)]  # a prompt the peer holds nothing of
    probation.challenger.known = KnownAnswers(1)
    probation.challenger.known.add(other, [5], block_hashes(other, model_salt(model)))
    probation.earned[peer].seconds = dear / 2  # earned less than a dear challenge costs
    assert await probation.challenger.challenge(peer) is None
    probation.earned[peer].seconds = dear * 1.5
    assert await probation.challenger.challenge(peer) == "failed"  # unanswered: spent anyway
    assert probation.earned[peer].seconds == pytest.approx(dear / 2)


# --------------------------------------------------------------------------- real nodes

SHAPE = ShapeOnlyModel(model_id="emu-challenge", eos_token_ids=(2,))
PROBATION = 3
CALM = {"ping_interval": 0.5}


@contextlib.asynccontextmanager
async def _emulated(prefill_s: float = 0.001) -> AsyncIterator[Any]:
    async with open_engine(
        SHAPE, backend="emulated", calibrate_cost=False, torch_threads=None
    ) as engine:
        cost = engine.cost  # pinned: 100 prompt tokens take 0.1 s by default
        cost.prefill_s_per_token, cost.decode_s_per_token = prefill_s, 0.01
        cost.overhead_s, cost.alpha = 0.005, 0.0
        yield engine


async def test_peers_pass_or_fail_probation_on_known_answers_without_client_forwards(
    overlay_network: Any,
) -> None:
    async with (
        overlay_network(3, **CALM) as nodes,
        # The origin prefills 10x slower than its peers: they would win its requests but for
        # the wait for their audit (a scoring pass at the origin's speed), so it wants them.
        _emulated(prefill_s=0.01) as e0,
        _emulated() as e1,
        _emulated() as e2,
        trio.open_nursery() as nursery,
    ):
        services = []
        for node, engine in zip(nodes, (e0, e1, e2), strict=True):
            svc = RoutedService(
                node,
                node.config.key,
                engine,
                antientropy_config=AntiEntropyConfig(interval_s=0.2, pull_min_interval_s=0.3),
                forward_config=ForwardConfig(accept_slack_s=20, first_token_slack_s=30),
                audit_config=AuditConfig(probation_answers=PROBATION),
                # The peers hold none of the known prompts: every challenge is dear.
                challenge_config=ChallengeConfig(interval_s=0.05, dear_interval_s=0.3),
                # Misses stay where they arrive (no rendezvous home): every request the origin
                # serves is one it knows the answer to.
                router_config=RouterConfig(placement=False),
                registry=CollectorRegistry(),
            )
            await nursery.start(svc.run)
            services.append(svc)
        origin, honest, liar = services
        make_adversary(liar, "wrong-output", rate=1.0)
        ids = [s.node.peer_id for s in services]
        await wait_until(
            lambda: all(
                origin.views.get(p, origin.model_id) and origin.router.rtt_s(p) for p in ids[1:]
            ),
            30,
            "views of both peers and their RTTs",
        )
        rng_prompts = [[(17 * i + 31 * j) % 4000 + 10 for j in range(200)] for i in range(4)]
        probation = origin.probation
        assert probation is not None
        assert probation.peers() == []  # no request wanted them yet: none challenged

        async def ask(prompt: list[int]) -> Any:
            res = await origin.generate(prompt, {"max_tokens": 3})
            assert res.tokens == emulated_answer(prompt, 3, SHAPE.vocab_size, SHAPE.eos_token_ids)
            return res

        first = await ask(rng_prompts[0])  # both peers on probation: served here
        assert first.served_locally and all(
            c.hold_s > 0 for c in first.decision.candidates if not c.is_local
        )
        # Both would have won but for the hold: each earned the time it would have saved.
        assert set(probation.earned) == set(ids[1:])
        assert all(e.seconds > 0 for e in probation.earned.values())
        # Known answers to challenge with. A request that arrives while this (slow) engine
        # computes a challenge's own answer may go to a peer on probation after all: its
        # answer is held for its audit, and that audit counts towards probation too.
        answers = [first]
        for prompt in rng_prompts[1:]:
            answers.append(await ask(prompt))
        to_honest = sum(r.served_by == ids[1] for r in answers)
        await wait_until(
            lambda: (
                origin.trust.audited_ok(ids[1]) >= PROBATION and not origin.trust.usable(ids[2])
            ),
            60,
            "the honest peer out of probation and the liar demoted",
        )
        counts = probation.counts
        # Every pass that no client's answer earned came from a known-answer challenge.
        assert counts["passed"] >= PROBATION - to_honest
        assert counts["mismatch"] >= 1  # the liar, audited and failed
        assert origin.auditor is not None and origin.auditor.counts["failed"] >= 1
        after = await ask([(13 * j) % 3000 + 7 for j in range(60)])  # a new prompt
        assert after.served_by == ids[1]  # the honest peer, out of probation, is faster
        nursery.cancel_scope.cancel()
