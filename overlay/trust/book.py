"""Trust in peers, earned from what this node observes them do (lying peers, wrong verifiers).

Contract:
- ``TrustBook`` keeps, per peer, a *debt*: evidence that its claims failed, in units of "one
  claim that failed completely". ``score(peer) = 0.5 ** debt`` (1.0 for a peer never seen).
  A peer becomes *untrusted* when its score falls below ``min_score`` (default 0.15: debt
  2.74, i.e. three complete failures within ~80 s with nothing to offset them) and stays so
  until the score recovers to ``readmit_score`` (0.4; hysteresis, so a demoted peer does not
  flap). ``usable(peer)`` says whether
  the router may use it; the router skips untrusted peers, so their digests stop driving
  decisions.
- Debt decays with a half-life (``half_life_s``, default 10 min): trust recovers slowly, and a
  demoted peer that stops being tried (it gets no traffic) is readmitted after ~1.2
  half-lives (debt 3 -> 1.3), on probation: two more complete failures demote it again. Every demotion multiplies the
  half-life by ``repeat_factor`` for that peer (repeat offenders recover ever more slowly).
- Evidence:
  ``observe_claim(peer, claimed_tokens, served_tokens, *, prompt_tokens=None, view_age_s=None)``
  after a forwarded request: the view's claimed cached prefix (before any confidence discount)
  against the cached length the peer reported serving. ``observe_timing(peer, expected_s,
  observed_s)``: what the peer's advertised wait and speeds predicted against what the origin
  measured. ``observe_fault(peer, weight)`` / ``observe_ok(peer)``: a wrong or a confirmed
  answer from a verifier (see ``verdict_problem`` and ``speculation/client.py``).
  ``observe_audit(peer, passed)``: an answer re-scored against the target model
  (``overlay/trust/audit.py``): a failure is proof, so it demotes at once; a pass counts in
  ``audited_ok(peer)``, the passed audits since the peer was first seen or last demoted (the
  audit policy keeps a peer on probation until it has enough), and repays no debt: a right
  answer proves nothing about cache or speed claims, so a fake-cache liar is demoted as fast.
  Each returns the ``Verdict`` it drew.
- Persistence: ``export()`` gives a JSON-ready dict (debts as of now, wall-clock stamped) and
  ``restore(data)`` folds one back in, decayed by the wall time that passed
  (``overlay/trust/store.py`` keeps it in the node's home): a restart forgets nothing.
- Honest staleness is tolerated, systematic lying is not. Views are approximate: a digest is up
  to one anti-entropy round old (plus gossip delay), so a block the peer evicted in that window
  is still claimed. Three allowances cover that:
  1. a shortfall of at most ``tolerance_tokens`` (one block) or ``tolerance_fraction`` of the
     claim counts as held (LRU evicts the tail of a path first, so staleness usually costs its
     last block or two, not the whole claim);
  2. a failed claim from a view older than ``stale_view_s`` weighs ``stale_view_s / age`` (a
     view we know is old, e.g. its gossip was lost, is excused in proportion; a liar keeps its
     forged view fresh, so it gets no discount);
  3. every claim that held repays ``honest_credit`` of debt. With a credit of 0.25 per held
     claim and 1.0 per failed one, debt only grows when more than 1 in 5 claims fail. For an
     honest peer a claim fails only when eviction hit the claimed prefix within the digest's
     age (<~1 s) while the block lives in the cache for far longer (minutes under LRU on a
     working set): a few percent at most; a liar that claims what it does not hold fails
     nearly every time and is demoted after 3 requests it served (bounded: from full trust,
     ``ceil(log2(1 / min_score))`` complete failures when they come within a fraction of a
     half-life).
- Timing is coarse on purpose: a serve counts as slow only when ``observed > slow_factor *
  expected + slow_slack_s`` (defaults 4x + 2 s), and weighs ``slow_penalty`` (0.5). It catches
  gross speed or queue lies (an advertised empty queue with seconds of backlog), not 20 %
  optimism, and it survives a loaded CPU or a jittery link.
- Limits: the served cached length is reported by the peer itself. A peer that also lies in
  its report (says it served from cache when it did not) passes the claim check; only the timing
  check can see it, and only when the uncached prefill it pretends to have skipped is long
  compared with ``slow_slack_s``. A peer can also be honest with us and lie to others: trust is
  local to each origin (nothing is gossiped, so nobody can slander a peer).
- Metrics (when a registry is given; never the global one): counter
  ``p2pnode_trust_observations_total{kind,verdict}`` and ``p2pnode_trust_demotions_total``.
- Not thread-safe; use from the node's trio thread. ``clock`` is injectable for tests.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from p2pnode.inference.blockhash import BLOCK_SIZE


class Verdict(enum.Enum):
    NO_CLAIM = "no_claim"  # nothing was claimed: no evidence either way
    HELD = "held"  # the claim held (within the staleness tolerance)
    FAILED = "failed"  # the claim did not hold
    OK = "ok"  # timing within bounds, or a verifier answer confirmed
    SLOW = "slow"  # far slower than advertised
    FAULT = "fault"  # a verifier answer found wrong


@dataclass
class TrustConfig:
    half_life_s: float = 600.0
    repeat_factor: float = 2.0
    min_score: float = 0.15
    readmit_score: float = 0.4
    tolerance_tokens: int = BLOCK_SIZE
    tolerance_fraction: float = 0.25
    stale_view_s: float = 5.0
    honest_credit: float = 0.25
    slow_factor: float = 4.0
    slow_slack_s: float = 2.0
    slow_penalty: float = 0.5
    fault_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.min_score < self.readmit_score <= 1:
            raise ValueError(
                f"need 0 < min_score < readmit_score <= 1, got {self.min_score}, "
                f"{self.readmit_score}"
            )
        if self.half_life_s <= 0 or self.repeat_factor < 1 or self.stale_view_s <= 0:
            raise ValueError("need half_life_s > 0, repeat_factor >= 1 and stale_view_s > 0")
        if not 0 <= self.tolerance_fraction < 1 or self.tolerance_tokens < 0:
            raise ValueError("need 0 <= tolerance_fraction < 1 and tolerance_tokens >= 0")
        if min(self.honest_credit, self.slow_penalty, self.fault_penalty) < 0:
            raise ValueError("credits and penalties must be >= 0")
        if self.slow_factor < 1 or self.slow_slack_s < 0:
            raise ValueError("need slow_factor >= 1 and slow_slack_s >= 0")


@dataclass
class _Peer:
    debt: float = 0.0
    at: float = 0.0  # clock time ``debt`` refers to
    banned: bool = False
    demotions: int = 0
    failures: int = 0
    held: int = 0
    audited_ok: int = 0
    digest_ignored: int = 0  # times the router stopped believing its digest


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.observations = Counter(
            "p2pnode_trust_observations",
            "Checks of peers' claims and answers, by kind and verdict",
            ["kind", "verdict"],
            registry=registry,
        )
        self.demotions = Counter(
            "p2pnode_trust_demotions", "Peers demoted to untrusted", registry=registry
        )


class TrustBook:
    """See the module contract."""

    def __init__(
        self,
        config: TrustConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config or TrustConfig()
        self._clock = clock
        self._peers: dict[str, _Peer] = {}
        self._metrics = _Metrics(registry) if registry is not None else None
        # Debt above which a peer is demoted / below which it is readmitted.
        self._ban_debt = math.log2(1 / self.config.min_score)
        self._readmit_debt = math.log2(1 / self.config.readmit_score)

    # -- queries ------------------------------------------------------------------------------

    def score(self, peer: str) -> float:
        """0.5 ** debt, in (0, 1]; 1.0 for a peer never observed."""
        p = self._peers.get(peer)
        return 1.0 if p is None else 0.5 ** self._decayed(p)

    def usable(self, peer: str) -> bool:
        """False while the peer is demoted (the router skips it)."""
        p = self._peers.get(peer)
        if p is None or not p.banned:  # the fast path: called per candidate per decision
            return True
        if self._decayed(p) <= self._readmit_debt:
            p.banned = False  # probation: usable again, with what debt remains
        return not p.banned

    def demotions(self, peer: str) -> int:
        p = self._peers.get(peer)
        return 0 if p is None else p.demotions

    def snapshot(self) -> dict[str, dict[str, float | int | bool]]:
        """Per peer: score, usable, demotions, failed and held claims (for logs, /status)."""
        return {
            peer: {
                "score": round(self.score(peer), 4),
                "usable": self.usable(peer),
                "demotions": p.demotions,
                "failures": p.failures,
                "held": p.held,
            }
            for peer, p in self._peers.items()
        }

    def audited_ok(self, peer: str) -> int:
        """Audits passed since the peer was first seen or last demoted (0 while demoted)."""
        p = self._peers.get(peer)
        return 0 if p is None or not self.usable(peer) else p.audited_ok

    def export(self) -> dict[str, dict[str, float | int | bool]]:
        """Every peer's state, debts decayed to now and stamped with the wall clock."""
        now = time.time()
        return {
            peer: {
                "debt": self._decayed(p),
                "at_wall": now,
                "banned": p.banned,
                "demotions": p.demotions,
                "failures": p.failures,
                "held": p.held,
                "audited_ok": p.audited_ok,
                "digest_ignored": p.digest_ignored,
            }
            for peer, p in self._peers.items()
        }

    def restore(self, data: dict[str, dict[str, float | int | bool]]) -> int:
        """Fold in what ``export`` wrote (decayed by the wall time since); returns the count.
        Entries of the wrong shape raise ``ValueError`` (nothing is half-applied)."""
        parsed: dict[str, _Peer] = {}
        now_wall, now = time.time(), self._clock()
        for peer, d in data.items():
            try:
                p = _Peer(
                    debt=max(0.0, float(d["debt"])),
                    at=now,
                    banned=bool(d["banned"]),
                    demotions=max(0, int(d["demotions"])),
                    failures=max(0, int(d["failures"])),
                    held=max(0, int(d["held"])),
                    audited_ok=max(0, int(d.get("audited_ok", 0))),
                    digest_ignored=max(0, int(d.get("digest_ignored", 0))),
                )
                elapsed = max(0.0, now_wall - float(d["at_wall"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"trust entry for {peer!r} is malformed: {exc!r}") from None
            p.debt *= 0.5 ** (elapsed / self._half_life(p))
            parsed[str(peer)] = p
        self._peers.update(parsed)
        return len(parsed)

    def forget(self, peer: str) -> None:
        """Drop what we know. Not for peers that left: a liar must not reset by reconnecting."""
        self._peers.pop(peer, None)

    # -- evidence -----------------------------------------------------------------------------

    def observe_claim(
        self,
        peer: str,
        claimed_tokens: int,
        served_tokens: int,
        *,
        prompt_tokens: int | None = None,
        view_age_s: float | None = None,
    ) -> Verdict:
        """A forwarded request came back: ``claimed_tokens`` is what the peer's digest promised
        for the prompt (the view's raw prefix, not discounted), ``served_tokens`` the cached
        length the peer reported serving from. ``prompt_tokens`` caps the claim (the last prompt
        token is always computed)."""
        cfg = self.config
        claimed = max(0, int(claimed_tokens))
        if prompt_tokens is not None:
            claimed = min(claimed, max(0, int(prompt_tokens) - 1))
        if claimed < BLOCK_SIZE:
            return self._count("claim", Verdict.NO_CLAIM)
        missing = max(0, claimed - max(0, int(served_tokens)))
        p = self._peer(peer)
        if missing <= cfg.tolerance_tokens or missing <= cfg.tolerance_fraction * claimed:
            p.held += 1
            self._add(peer, p, -cfg.honest_credit)
            return self._count("claim", Verdict.HELD)
        weight = missing / claimed
        if view_age_s is not None and view_age_s > cfg.stale_view_s:
            weight *= cfg.stale_view_s / view_age_s
        p.failures += 1
        self._add(peer, p, weight)
        return self._count("claim", Verdict.FAILED)

    def observe_timing(self, peer: str, expected_s: float, observed_s: float) -> Verdict:
        """The peer's advertised wait and speeds predicted ``expected_s``; we measured
        ``observed_s`` (both from sending the request to the same event)."""
        cfg = self.config
        if observed_s > cfg.slow_factor * max(0.0, expected_s) + cfg.slow_slack_s:
            self._add(peer, self._peer(peer), cfg.slow_penalty)
            return self._count("timing", Verdict.SLOW)
        return self._count("timing", Verdict.OK)

    def observe_fault(self, peer: str, weight: float = 1.0) -> Verdict:
        """An answer from ``peer`` was found wrong (e.g. an impossible verifier verdict)."""
        p = self._peer(peer)
        p.failures += 1
        self._add(peer, p, self.config.fault_penalty * max(0.0, weight))
        return self._count("answer", Verdict.FAULT)

    def observe_audit(self, peer: str, passed: bool) -> Verdict:
        """An answer of ``peer`` was re-scored against the target: a failure demotes now."""
        p = self._peer(peer)
        if passed:  # no credit against its claims' debt: a right answer says nothing of them
            p.held += 1
            p.audited_ok += 1
            return self._count("audit", Verdict.OK)
        p.failures += 1
        debt = self._decayed(p)
        self._add(peer, p, max(self.config.fault_penalty, self._ban_debt + 1 - debt))
        return self._count("audit", Verdict.FAULT)

    def note_digest_ignored(self, peer: str) -> None:
        """The router stopped believing ``peer``'s cache claims (its measured first tokens
        contradicted them): recorded for /status and the trial reports; it is no lie about an
        answer, so no debt."""
        self._peer(peer).digest_ignored += 1

    def digest_ignored(self, peer: str) -> int:
        p = self._peers.get(peer)
        return 0 if p is None else p.digest_ignored

    def observe_ok(self, peer: str) -> Verdict:
        """An answer from ``peer`` was checked and confirmed: repays ``honest_credit``."""
        p = self._peer(peer)
        p.held += 1
        self._add(peer, p, -self.config.honest_credit)
        return self._count("answer", Verdict.OK)

    # -- internals ----------------------------------------------------------------------------

    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            p = self._peers[peer] = _Peer(at=self._clock())
        return p

    def _half_life(self, p: _Peer) -> float:
        return self.config.half_life_s * self.config.repeat_factor ** max(0, p.demotions - 1)

    def _decayed(self, p: _Peer) -> float:
        now = self._clock()
        if p.debt > 0 and now > p.at:
            p.debt *= 0.5 ** ((now - p.at) / self._half_life(p))
        p.at = now
        return p.debt

    def _add(self, peer: str, p: _Peer, amount: float) -> None:
        p.debt = max(0.0, self._decayed(p) + amount)
        if not p.banned and p.debt > self._ban_debt:
            p.banned = True
            p.demotions += 1
            p.audited_ok = 0  # readmitted later, it starts its probation again
            if self._metrics is not None:
                self._metrics.demotions.inc()

    def _count(self, kind: str, verdict: Verdict) -> Verdict:
        if self._metrics is not None:
            self._metrics.observations.labels(kind, verdict.value).inc()
        return verdict


def verdict_problem(
    *,
    block_len: int,
    base_len: int,
    accepted: int,
    next_token: int,
    committed_len: int,
    vocab_size: int | None,
    lead: bool = False,
) -> str | None:
    """What is impossible about a verifier's answer to a block, or None when nothing is.

    The edge holds only the draft, so it cannot recompute the target's choice; it can check that
    the verdict is internally consistent: ``0 <= accepted <= block_len`` (a verifier cannot
    accept tokens that were not sent), ``0 <= next_token < vocab_size``, and ``committed_len ==
    base_len + accepted + 1`` (the session's length after the block; ``>=`` when the session
    has ``lead`` on, as the verifier may have committed tokens of its own past the block).
    Limits: this catches a broken or careless verifier, not a careful liar. One that answers plausibly but wrongly
    (rejects good draft tokens, or names a valid but wrong next token) passes these checks and
    its tokens are committed. Catching that needs a second opinion: the edge's audit
    re-verifies a window of a greedy result on another verifier and asks a third to arbitrate
    a disagreement (``EdgeClient.audit`` in the speculation package).
    """
    if not 0 <= accepted <= block_len:
        return f"accepted {accepted} of a {block_len}-token block"
    if next_token < 0 or (vocab_size is not None and next_token >= vocab_size):
        return f"next token {next_token} outside the vocabulary of {vocab_size}"
    if committed_len < base_len + accepted + 1 or (
        not lead and committed_len != base_len + accepted + 1
    ):
        return f"committed length {committed_len}, expected {base_len + accepted + 1}"
    return None
