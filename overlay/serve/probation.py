"""Which peers on probation a node challenges, how often, and how a challenge travels.

Why: ``overlay/trust/challenge.py`` knows how to challenge a peer; this module decides *whom* and
*how much*, from the node's own routing decisions. A challenge costs the peer a forward's
compute, so a swarm of fresh identities must not spend more on probation than probation can
earn back.

Contract:
- ``note_wanted(decision)``: every probation peer that would have won the request but for the
  wait for its audit earns the time it would have saved (this node's total minus the peer's
  total without the hold), up to ``max_banked_s``. A challenge on a prompt the peer holds half
  of or more (a prefix challenge, or a cheap one) is free once the peer is wanted: it costs
  the peer a few decode steps, as a real forward on a prefix it holds would. A dear one (the
  peer would prefill most of the prompt) is sent only when its cost on the peer (its
  advertised prefill speed times the prompt it does not hold, plus decoding the compared
  tokens) fits in what the peer earned, and spends that: where forwarding barely wins (long
  WAN delays) peers get few of them, where it wins by a prefill they get them at once.
  Earned time lapses ``wanted_for_s`` after the last want.
- ``peers()``: the peers a challenge may go to now: with time earned, serving the model, up,
  usable, on probation, with a free slot by their digest (``FREE_SLOT_WAIT_S``) and nothing
  of ours in flight there.
- ``know(prompt, params, tokens)``: a greedy answer this node computed itself becomes a known
  answer (the caller never passes private requests).
- A challenge is an ordinary forward (``forward_request``) with the timeouts real forwards
  get; its first-token time also feeds the router's learned network cost.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from p2pnode.inference.blockhash import block_hashes
from p2pnode.inference.sampling import SamplingParams
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.routing.router import Router, RoutingDecision
from p2pnode.overlay.serve.forward import (
    ForwardConfig,
    ForwardFailed,
    ForwardRequest,
    forward_request,
)
from p2pnode.overlay.trust.audit import Auditor
from p2pnode.overlay.trust.book import TrustBook
from p2pnode.overlay.trust.challenge import (
    AnswerFn,
    ChallengeConfig,
    Challenger,
    ChallengeUnanswered,
)

if TYPE_CHECKING:
    import trio

    from p2pnode.overlay.seams import OverlayHost

# A challenge goes to a peer, and this node answers one, only while a new request there would
# start at once (a free batch slot, no prefill queued ahead): it then shares decode steps with
# the client work running, and never makes a client's request wait for a slot. Waiting for an
# empty engine instead held trust back by tens of seconds on a busy LAN trial.
FREE_SLOT_WAIT_S = 0.05


@dataclass(frozen=True)
class ProbationConfig:
    # Earned time is banked up to this: a burst of wants cannot buy a burst of challenges.
    max_banked_s: float = 30.0
    wanted_for_s: float = 60.0  # earned time lapses this long after the last want

    def __post_init__(self) -> None:
        if self.max_banked_s <= 0 or self.wanted_for_s <= 0:
            raise ValueError("need max_banked_s > 0 and wanted_for_s > 0")


@dataclass(slots=True)
class Earned:
    seconds: float  # peer compute challenges may still take
    at: float  # monotonic time of the last want


class ProbationChallenges:
    """Known-answer challenges for the peers this node's own requests want (module contract)."""

    def __init__(
        self,
        *,
        node: OverlayHost,
        model_id: str,
        salt: bytes,
        views: PeerViews,
        router: Router,
        auditor: Auditor,
        trust: TrustBook,
        forward_config: ForwardConfig,
        answer: AnswerFn | None = None,
        idle: Callable[[], bool] | None = None,
        challenge_config: ChallengeConfig | None = None,
        config: ProbationConfig | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config or ProbationConfig()
        self._node = node
        self._model_id = model_id
        self._salt = salt
        self._views = views
        self._router = router
        self._auditor = auditor
        self._trust = trust
        self._forward_config = forward_config
        self.earned: dict[str, Earned] = {}
        self.challenger = Challenger(
            send=self._send,
            peers=self.peers,
            held=lambda peer, blocks: views.cached_prefix_tokens(peer, blocks, model_id),
            trust=trust,
            mismatch=lambda peer, prompt, answer: auditor.later(
                peer, prompt, answer, SamplingParams(max_tokens=len(answer))
            ),
            afford=self.affords,
            answer=answer,
            idle=idle,
            config=challenge_config,
            registry=registry,
        )

    @property
    def counts(self) -> dict[str, int]:
        return self.challenger.counts

    async def run(self, *, task_status: trio.TaskStatus[None]) -> None:
        await self.challenger.run(task_status=task_status)

    def know(self, prompt: list[int], params: SamplingParams, tokens: list[int]) -> None:
        if params.temperature == 0 and tokens:
            self.challenger.known.add(prompt, tokens, block_hashes(prompt, self._salt))

    def note_wanted(self, decision: RoutingDecision) -> None:
        if decision.local_total_s is None:
            return
        now, local = time.monotonic(), decision.local_total_s
        for c in decision.candidates:
            unheld = c.total_s - c.hold_s
            # A peer skipped because its answer could not be audited in time is held too: known
            # answers are its one way out of probation.
            held = c.hold_s > 0 and c.skipped is None or c.skipped == "no_audit"
            if held and unheld + decision.margin_s < local:
                e = self.earned.setdefault(c.peer_id, Earned(0.0, now))
                e.seconds = min(self.config.max_banked_s, e.seconds + local - unheld)
                e.at = now

    def cost_s(self, peer: str, prompt_tokens: int, held: int, answer_tokens: int) -> float:
        """A challenge's compute on ``peer``, by the speeds its digest advertises."""
        view = self._views.get(peer, self._model_id)
        if view is None:
            return math.inf
        load = view.load
        return (
            max(0, prompt_tokens - held) * load.prefill_s_per_token
            + answer_tokens * load.decode_s_per_token
        )

    def affords(self, peer: str, prompt_tokens: int, held: int, answer_tokens: int) -> bool:
        e = self.earned.get(peer)
        if e is None:
            return False
        if _cheap(prompt_tokens, held):
            return True
        return self.cost_s(peer, prompt_tokens, held, answer_tokens) <= e.seconds

    def peers(self) -> list[str]:
        horizon = time.monotonic() - self.config.wanted_for_s
        for p in [p for p, e in self.earned.items() if e.at < horizon]:
            del self.earned[p]
        out = []
        for view in self._views.live(self._model_id):
            p = view.peer_id
            e = self.earned.get(p)
            if (
                e is not None
                and e.seconds > 0
                and self._auditor.on_probation(p)
                and self._trust.usable(p)
                and not view.load.push_back
                and view.load.est_wait_s <= FREE_SLOT_WAIT_S
                and self._router.inflight(p) == 0
                and self._router.is_up(p)
            ):
                out.append(p)
        return out

    async def _send(self, peer: str, prompt: Sequence[int], max_tokens: int) -> list[int]:
        e = self.earned.get(peer)
        held = self._views.cached_prefix_tokens(
            peer, block_hashes(prompt, self._salt), self._model_id
        )
        if e is not None and not _cheap(len(prompt), held):
            # Spent whatever the verdict: a failing peer earns no retries.
            e.seconds -= self.cost_s(peer, len(prompt), held, max_tokens)
        cfg = self._forward_config
        rtt = self._router.rtt_s(peer)
        rtt = self._router.config.default_rtt_s if rtt is None else rtt
        request = ForwardRequest(
            model_id=self._model_id,
            prompt=list(prompt),
            max_tokens=max_tokens,
            deadline_s=cfg.default_deadline_s,
            request_id=uuid.uuid4().hex[:16],
        )
        sent = self._router.note_sent(peer, 0.0)  # the peer is busy with it: no second challenge
        try:
            outcome = await forward_request(
                self._node,
                peer,
                request,
                accept_timeout_s=2 * rtt + cfg.accept_slack_s,
                first_token_timeout_s=cfg.first_token_slack_s + 2 * rtt + 10.0,
                idle_timeout_s=cfg.idle_min_s,
            )
        except ForwardFailed as exc:
            raise ChallengeUnanswered(str(exc)) from exc
        finally:
            self._router.note_done(peer, 0.0, sent)
        if outcome.first_token_s is not None:  # a forward like any other: learn its cost
            self._router.observe_forward(
                peer,
                len(prompt),
                outcome.first_token_s,
                outcome.done.ttft_s,
                outcome.last_token_s,
                outcome.done.total_s,
            )
        return list(outcome.tokens)


def _cheap(prompt_tokens: int, held: int) -> bool:
    """The peer holds half the prompt or more: the challenge costs it what a real forward on a
    prefix it holds would (``overlay/trust/challenge.py`` sends those first)."""
    return 2 * held >= prompt_tokens
