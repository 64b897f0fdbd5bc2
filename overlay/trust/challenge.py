"""Probation by known answers: a new peer earns trust on prompts this node already answered.

Why: a peer on probation has every answer it serves for us held until the origin re-scored it
(``overlay/trust/audit.py``), a teacher-forced pass over the whole prompt that costs the origin about
what serving the request itself would. Forwards to such a peer cannot save time, so without
another way out of probation a fresh swarm (every identity new) never profits from routing,
and counting the hold honestly in the router (``Auditor.hold_s``) would keep peers there for ever.

Contract:
- ``KnownAnswers`` keeps the newest ``known`` greedy answers this node computed itself
  (``RoutedService`` adds every non-private, temperature-0 request it served locally from the
  start; private requests never leave the node, so they never become challenges).
- ``Challenger.run`` (a background task of the service) sends, every ``interval_s`` and at most
  one at a time to each peer, a known prompt to every peer that still needs passed audits
  (``peers()``; ``RoutedService`` gives those a request of the last minute would have been
  sent to but for the wait for their audit, and that are up, serving the model, usable, on
  probation, with a free slot by their digest and nothing of ours in flight there), as an ordinary forward with ``max_tokens`` = up to ``max_tokens`` of the
  known answer. Known answers whose prefix the peer's view holds for half the prompt or more
  go first (cheap for the peer, and they add little to its cache), then those not yet sent to
  that peer before those already sent, then the longest held prefix. A *dear* challenge (the
  view holds under half the prompt: the peer must prefill most of it, a request's worth of
  compute) goes to one peer at most every ``dear_interval_s``, so challenges never crowd out
  real work on a cold swarm where nobody holds anything yet.
- Verdict: the peer's tokens equal the known ones -> a passed audit (``TrustBook.observe_audit``:
  counts towards leaving probation). They differ -> the answer goes to ``mismatch`` (the
  auditor's background audit): another numeric path may pick a different token at a near-tie,
  so only the scored check (``check_greedy``'s margin) may demote. A forward that fails
  (timeout, refused) proves nothing and counts nothing.
- Prefix challenges (``answer`` given, and the peer's view holds at least ``min_prefix`` tokens
  of the known prompt but not all of it): the prompt is cut 1 to ``max_overhang`` tokens past
  what the view holds, and this node answers the cut prompt itself while the peer does (a few
  decode steps on a prefix it holds; only while a new request would start here at once
  (``idle``), and when that stops holding the challenge is called off and the forward closed). A full known prompt would make the peer
  prefill and cache the whole uncached rest: on small caches that evicts prefixes its own
  clients need (measured on a 200 ms trial with 4,096-token caches: hit rate 63.3 % against
  66.3 % with no challenges).
- ``afford`` (optional): asked before each full-prompt challenge with its size; False sends
  nothing now (``overlay/serve/probation.py`` spends an earned budget there).
- Cost: on the peer, one forward of a few tokens on a prefix it holds (a prefix challenge) or a
  known prompt (the others), only while it advertises a free slot; on this node's engine, a
  few decode steps per prefix challenge, sharing the batch with client work, never queued
  ahead of it.
- Metrics (registry given): ``p2pnode_challenges_total{verdict}`` with verdict
  passed / mismatch / failed.

Limits: a challenge is a prompt some client already sent here, mostly on a prefix the peer
holds, so a peer cannot tell it from real traffic by its text; a peer that tells challenges apart some other way (it rarely sees a
prompt it does not hold) can pass probation honestly and lie afterwards, where only the
sampled audits of trusted peers (``trusted_rate``) catch it, as they would any peer that turns
after its probation.
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio
from prometheus_client import CollectorRegistry, Counter

from p2pnode.errors import P2PNodeError
from p2pnode.overlay.trust.book import TrustBook

log = logging.getLogger("p2pnode.overlay.trust.challenge")


class ChallengeUnanswered(P2PNodeError):
    """The challenge's forward failed (timeout, refused, stream closed): no verdict."""

    reason = "unanswered"


# send(peer, prompt, max_tokens) -> the peer's answer tokens; raises ChallengeUnanswered.
SendFn = Callable[[str, list[int], int], Awaitable[list[int]]]
# afford(peer, prompt tokens, tokens it holds, answer tokens) -> whether to send it now.
AffordFn = Callable[[str, int, int, int], bool]
# answer(prompt, max_tokens) -> this node's own greedy answer, or None when its engine is busy.
AnswerFn = Callable[[list[int], int], Awaitable[list[int] | None]]


@dataclass(frozen=True)
class ChallengeConfig:
    enabled: bool = True
    known: int = 32  # known answers kept, newest
    interval_s: float = 0.25  # at least this long between two challenges
    max_tokens: int = 4  # answer tokens a challenge asks for and compares
    # A challenge the peer must mostly prefill (its view holds under half the prompt) goes to
    # one peer at most this often: it costs the peer a request's worth of compute.
    dear_interval_s: float = 10.0
    # A prefix challenge cuts a known prompt this many tokens at most past what the peer's
    # view holds (less than a block: the peer's cache gains next to nothing), and needs a held
    # prefix of at least min_prefix tokens (a shorter one is no prompt a client would send).
    max_overhang: int = 15
    min_prefix: int = 64

    def __post_init__(self) -> None:
        if self.known < 1 or self.interval_s <= 0 or self.max_tokens < 1:
            raise ValueError("need known >= 1, interval_s > 0 and max_tokens >= 1")
        if self.dear_interval_s < 0 or self.max_overhang < 1 or self.min_prefix < 1:
            raise ValueError("need dear_interval_s >= 0, max_overhang >= 1 and min_prefix >= 1")


@dataclass(frozen=True, slots=True)
class KnownAnswer:
    serial: int
    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    blocks: tuple[int, ...]  # the prompt's block hashes: what a peer's view is matched on


class KnownAnswers:
    """The newest greedy answers this node computed itself (see the module contract)."""

    def __init__(self, capacity: int) -> None:
        self._items: deque[KnownAnswer] = deque(maxlen=capacity)
        self._serial = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, prompt: Sequence[int], answer: Sequence[int], blocks: Sequence[int]) -> None:
        if not prompt or not answer:
            return
        self._serial += 1
        self._items.append(KnownAnswer(self._serial, tuple(prompt), tuple(answer), tuple(blocks)))

    def pick(self, held: Callable[[Sequence[int]], int], used: set[int]) -> KnownAnswer | None:
        """Cheap for the peer first (``held(blocks)``, the prefix its view holds, covers half
        the prompt or more), then unused before used, then the longest held prefix, then the
        newest."""
        if not self._items:
            return None

        def rank(k: KnownAnswer) -> tuple[bool, bool, int, int]:
            h = held(k.blocks)
            return (2 * h >= len(k.prompt), k.serial not in used, h, k.serial)

        return max(self._items, key=rank)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.challenges = Counter(
            "p2pnode_challenges",
            "Known-answer challenges sent to peers on probation, by verdict",
            ["verdict"],
            registry=registry,
        )


class Challenger:
    """Sends known-answer challenges to peers on probation (see the module contract)."""

    def __init__(
        self,
        *,
        send: SendFn,
        peers: Callable[[], Sequence[str]],
        held: Callable[[str, Sequence[int]], int],  # (peer, block hashes) -> tokens it holds
        trust: TrustBook,
        mismatch: Callable[[str, list[int], list[int]], None],
        afford: AffordFn | None = None,
        answer: AnswerFn | None = None,
        idle: Callable[[], bool] | None = None,  # whether ``answer`` can run now
        config: ChallengeConfig | None = None,
        registry: CollectorRegistry | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or ChallengeConfig()
        self._afford = afford
        self._answer = answer
        self._idle = idle or (lambda: True)
        self._rng = rng or random.Random()
        self.known = KnownAnswers(self.config.known)
        self._send = send
        self._peers = peers
        self._held = held
        self._trust = trust
        self._mismatch = mismatch
        self._used: dict[str, set[int]] = {}
        self._busy: set[str] = set()  # peers with a challenge in flight (one each)
        self._last_dear: dict[str, float] = {}  # peer -> when it last got a dear challenge
        self._metrics = _Metrics(registry) if registry is not None else None
        self.counts: dict[str, int] = {"passed": 0, "mismatch": 0, "failed": 0}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:  # a service task: it ends when the node's nursery is cancelled
                await trio.sleep(self.config.interval_s)
                if not len(self.known):
                    continue
                for peer in self._peers():
                    if peer not in self._busy:
                        self._busy.add(peer)
                        nursery.start_soon(self._challenge_one, peer)

    async def _challenge_one(self, peer: str) -> None:
        try:
            await self.challenge(peer)
        finally:
            self._busy.discard(peer)

    async def challenge(self, peer: str) -> str | None:
        """One challenge to ``peer`` now; returns its verdict (None: no known answer yet)."""
        used = self._used.setdefault(peer, set())
        known = self.known.pick(lambda blocks: self._held(peer, blocks), used)
        if known is None:
            return None
        held = self._held(peer, known.blocks)
        cfg = self.config
        t0 = trio.current_time()
        if self._answer is not None and cfg.min_prefix <= held < len(known.prompt):
            # A prefix challenge: the known prompt cut just past what the peer holds, so it
            # costs the peer a few tokens and adds next to nothing to its cache; this node
            # answers the cut prompt itself (it holds the prefix: it served the whole prompt).
            if not self._idle():
                return None  # our engine has client work: later, nothing sent
            cut = min(len(known.prompt), held + self._rng.randint(1, cfg.max_overhang))
            prompt = list(known.prompt[:cut])
            used.add(known.serial)
            if cut == len(known.prompt):
                expected: list[int] | None = list(known.answer[: cfg.max_tokens])
                got = await self._ask(peer, prompt, len(expected))
            else:
                expected, got = await self._ask_and_answer(peer, prompt)
                if expected is None:
                    return None  # our engine is busy: later (the peer's answer is dropped)
            kind = "prefix"
        else:
            prompt = list(known.prompt)
            expected = list(known.answer[: cfg.max_tokens])
            if self._afford is not None and not self._afford(
                peer, len(prompt), held, len(expected)
            ):
                return None  # not earned yet
            if 2 * held < len(prompt):
                now = trio.current_time()
                if now - self._last_dear.get(peer, -math.inf) < cfg.dear_interval_s:
                    return None  # only dear ones known for this peer: later
                self._last_dear[peer] = now
            used.add(known.serial)
            got = await self._ask(peer, prompt, len(expected))
            kind = "known"
        took = trio.current_time() - t0
        if got is None:
            return self._count("failed")
        if got == expected:
            self._trust.observe_audit(peer, True)
            log.info(
                "challenge to %s passed (%s, %d tokens, %.2f s)", peer, kind, len(prompt), took
            )
            return self._count("passed")
        log.info("challenge to %s: answer differs from the known one; auditing it", peer)
        self._mismatch(peer, prompt, got)
        return self._count("mismatch")

    async def _ask(self, peer: str, prompt: list[int], max_tokens: int) -> list[int] | None:
        """The peer's answer, or None when the forward failed (that proves nothing)."""
        try:
            return await self._send(peer, prompt, max_tokens)
        except ChallengeUnanswered as exc:
            log.info("challenge to %s not answered: %s", peer, exc)
            return None

    async def _ask_and_answer(
        self, peer: str, prompt: list[int]
    ) -> tuple[list[int] | None, list[int] | None]:
        """This node's answer and the peer's, computed at once: the challenge then takes the
        longer of the two, not their sum (the answer needs this engine idle; the peer's needs
        the network and the peer)."""
        assert self._answer is not None
        answer = self._answer
        mine: list[list[int] | None] = [None]
        theirs: list[list[int] | None] = [None]

        async with trio.open_nursery() as nursery:

            async def own() -> None:
                mine[0] = await answer(prompt, self.config.max_tokens) or None
                if mine[0] is None:  # busy: closing the forward frees the peer's engine too
                    nursery.cancel_scope.cancel()

            async def peer_side() -> None:
                theirs[0] = await self._ask(peer, prompt, self.config.max_tokens)

            nursery.start_soon(own)
            nursery.start_soon(peer_side)
        return mine[0], theirs[0]

    def _count(self, verdict: str) -> str:
        self.counts[verdict] += 1
        if self._metrics is not None:
            self._metrics.challenges.labels(verdict).inc()
        return verdict
