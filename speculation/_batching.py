"""One step of the verifier's batching loop as data and pure functions (``verify.py`` runs it).

Contract (the rules are the ones ``verify.py``'s contract states; this is where they live):
- ``Session``: a tenant's committed tokens (prompt + output; its cache holds all but the last),
  sampling options, seeded generator and lead budget. ``Waiter``: a block ``verify`` queued and
  the caller waiting for its answer.
- ``plan(waiting, leaders, max_batch, max_tokens, lookup=0) -> BatchPlan``: which blocks are
  answered without computing (stale; superseded or fully decided by lead tokens; over the
  session's limit) and which rows go into the forward pass: each block's draft past the tokens
  leads already committed (``Row.skip``), then one lead step per session free to lead, up to
  ``max_batch`` rows in all. A lead step checks up to ``lookup`` guesses from the session's
  ``NgramIndex`` (``_lookup.py``), within its lead budget and token limit, so it commits
  1 + the accepted guesses, each told as its own ``Lead``.
- ``accept(rows, forwards) -> list[Outcome]``: each row's acceptance on its logits. It changes
  no session; the only state it touches is a sampling session's generator, whose draws are the
  acceptance itself. A row that fails yields a ``VerifierError`` outcome, not an exception.
- ``Outcome``: what a row decided (tokens to commit, its answer, the new lead budget, what to
  count, the session's cache after the forward); ``BatchedVerifier._apply`` commits it.
- ``may_lead(sessions, max_tokens)``: the sessions free to lead and those that must stop at
  their token limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import trio
from transformers import DynamicCache

from p2pnode.speculation._accept import accept_draft
from p2pnode.speculation._blocks import Block, BlockResult, Lead, SamplingOptions
from p2pnode.speculation._blocksize import AcceptanceMeter
from p2pnode.speculation._errors import SessionLimit, VerifierError
from p2pnode.speculation._lookup import NgramIndex

__all__ = [
    "BatchPlan",
    "Outcome",
    "Row",
    "Session",
    "Waiter",
    "accept",
    "failed",
    "may_lead",
    "plan",
    "session_limit",
]


@dataclass
class Session:
    sid: str
    options: SamplingOptions
    tokens: list[int]  # committed: prompt + output; the cache holds all but the last
    cache: DynamicCache
    generator: torch.Generator
    last_used: float
    lead: int = 0  # tokens it may commit on its own after each block
    lead_left: int = 0
    # The budget a break refills: ``lead``, or more where the edge's measured reaction (a break
    # to its first block drafted after it) spans more lead steps (set by the verifier).
    refill: int = 0
    broke_at: tuple[int, float] | None = None  # (committed length, time) of the last break
    reaction_s: float = 0.0  # smoothed time from a break to the edge's next fresh block
    on_lead: Callable[[Lead | VerifierError], None] | None = None
    lookup: NgramIndex | None = None  # follows ``tokens``: guesses for its lead steps
    busy: bool = False  # a block submitted and not yet returned to its caller
    meter: AcceptanceMeter = field(default_factory=AcceptanceMeter)  # its drafts' acceptance
    # What this session's blocks and leads did (the console shows them per session).
    counts: dict[str, int] = field(
        default_factory=lambda: {"blocks": 0, "accepted": 0, "drafted": 0, "lead": 0}
    )

    def __post_init__(self) -> None:
        self.refill = self.refill or self.lead

    @property
    def committed_len(self) -> int:
        return len(self.tokens)

    @property
    def last_token(self) -> int:
        return self.tokens[-1]


@dataclass(eq=False)
class Waiter:
    """A block queued by ``verify``; ``done`` is set once ``answer`` is there."""

    session: Session
    block: Block
    done: trio.Event = field(default_factory=trio.Event)
    answer: BlockResult | VerifierError | None = None
    abandoned: bool = False  # its caller was cancelled before the answer


@dataclass(frozen=True)
class Row:
    """One row of the forward pass: a block's draft past ``skip`` tokens already committed by
    leads, or (``waiter`` None) a lead step: the session's next token, checking ``guess`` (its
    prompt-lookup guesses, one-hot proposals) on the way."""

    session: Session
    waiter: Waiter | None
    skip: int = 0
    guess: tuple[int, ...] = ()

    @property
    def draft(self) -> tuple[int, ...]:
        return self.guess if self.waiter is None else self.waiter.block.tokens[self.skip :]

    @property
    def q(self) -> torch.Tensor | None:
        q = None if self.waiter is None else self.waiter.block.draft_probs
        return None if q is None else q[self.skip :]

    @property
    def inputs(self) -> list[int]:
        return [self.session.last_token, *self.draft]


@dataclass(frozen=True)
class Outcome:
    session: Session
    waiter: Waiter | None  # None: a lead step, each of its tokens told to ``on_lead``
    answer: BlockResult | tuple[Lead, ...] | VerifierError
    commit: tuple[int, ...] = ()  # tokens the session commits
    lead_left: int | None = None  # the session's lead budget after it (None: unchanged)
    tally: tuple[tuple[str, int], ...] = ()  # added to the verifier's and the session's counts
    cache: DynamicCache | None = None  # the session's cache after the forward (None: its own)
    refilled: bool = False  # the edge's pipeline broke here: the budget was refilled


@dataclass(frozen=True)
class BatchPlan:
    rows: list[Row]  # one forward pass over these
    decided: list[Outcome]  # answered without computing


def session_limit(max_tokens: int) -> SessionLimit:
    return SessionLimit(f"session reached its {max_tokens} tokens: open a new one")


def may_lead(sessions: Iterable[Session], max_tokens: int) -> tuple[list[Session], list[Session]]:
    """(free to lead now, at the token limit with lead budget left: leading stops there)."""
    idle = [s for s in sessions if s.lead_left > 0 and not s.busy]
    return (
        [s for s in idle if s.committed_len + 1 < max_tokens],
        [s for s in idle if s.committed_len + 1 >= max_tokens],
    )


def plan(
    waiting: list[Waiter],
    leaders: list[Session],
    max_batch: int,
    max_tokens: int,
    lookup: int = 0,
) -> BatchPlan:
    rows: list[Row] = []
    decided: list[Outcome] = []
    for w in waiting:
        step = _decide(w, max_tokens)
        if isinstance(step, Row):
            rows.append(step)
        else:
            decided.append(step)
    with_block = {w.session.sid for w in waiting}
    free = [s for s in leaders if s.sid not in with_block][: max_batch - len(waiting)]
    return BatchPlan(
        rows + [Row(s, None, guess=_guess(s, lookup, max_tokens)) for s in free], decided
    )


def _guess(s: Session, lookup: int, max_tokens: int) -> tuple[int, ...]:
    """A lead step's guesses: at most ``lookup``, within its lead budget and its token limit
    (the step commits the accepted guesses and one token more)."""
    if s.lookup is None:
        return ()
    return s.lookup.guess(min(lookup, s.lead_left - 1, max_tokens - s.committed_len - 2))


def _decide(w: Waiter, max_tokens: int) -> Row | Outcome:
    """The block's answer when it needs no forward pass, else its row."""
    s, b = w.session, w.block
    n, base, d = s.committed_len, b.base_len, b.tokens
    if not 1 <= base <= n or s.tokens[base - 1] != b.base_token:
        stale = BlockResult(b.number, -1, -1, n)
        return Outcome(s, w, stale, lead_left=s.refill, refilled=True, tally=(("stale", 1),))
    skip = min(n - base, len(d))
    for i in range(skip):
        if d[i] != s.tokens[base + i]:
            superseded = BlockResult(b.number, i, s.tokens[base + i], n)
            tally = (("superseded", 1),)
            return Outcome(s, w, superseded, lead_left=s.refill, refilled=True, tally=tally)
    if base + len(d) < n:  # every draft token agreed with a lead; the next one is known
        result = BlockResult(b.number, len(d), s.tokens[base + len(d)], n)
        if not d:  # an empty block asks the verifier to keep decoding: refill its budget
            return Outcome(s, w, result, lead_left=s.refill)
        return Outcome(s, w, result)
    if n + len(d) - skip + 1 > max_tokens:
        return Outcome(s, w, session_limit(max_tokens))
    return Row(s, w, skip)


def accept(rows: list[Row], forwards: list[tuple[torch.Tensor, DynamicCache]]) -> list[Outcome]:
    """Each row's outcome given its logits and its cache after the forward pass."""
    out = []
    for row, (logits, cache) in zip(rows, forwards, strict=True):
        try:
            out.append(_accept_row(row, logits, cache))
        except Exception as exc:  # a bug must not kill the loop nor hang the callers
            out.append(failed(row, exc, cache))
    return out


def failed(row: Row, exc: Exception, cache: DynamicCache | None = None) -> Outcome:
    error = VerifierError(f"verification failed: {exc!r}")
    return Outcome(row.session, row.waiter, error, cache=cache)


def _accept_row(row: Row, logits: torch.Tensor, cache: DynamicCache) -> Outcome:
    s, w, draft = row.session, row.waiter, row.draft
    n, nxt = accept_draft(s.options, logits, draft, row.q, s.generator)
    commit = (*draft[:n], nxt)
    committed_len = s.committed_len + len(commit)
    if w is None:
        leads = tuple(Lead(s.committed_len + i, t) for i, t in enumerate(commit))
        tally = (("lead", len(commit)), ("lookup_guessed", len(draft)), ("lookup_accepted", n))
        return Outcome(s, None, leads, commit, s.lead_left - len(commit), tally, cache)
    # The budget refills after every block, not only where the edge's pipeline broke: after
    # a full acceptance the next block is on its way, but a round trip or a draft step away,
    # and meanwhile a lead step is one more row in passes that run for other sessions anyway
    # (a position costs ~5 ms beside a ~55 ms pass); the block then arrives to leads it is
    # compared with, not computed against.
    broke = n < len(draft) or not draft
    result = BlockResult(w.block.number, row.skip + n, nxt, committed_len)
    tally = (("blocks", 1), ("accepted", n), ("drafted", len(draft)))
    return Outcome(s, w, result, commit, s.refill, tally, cache, broke)
