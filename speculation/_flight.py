"""The edge's state during speculation: its copy of the committed tokens, the blocks in flight,
and what they counted. ``edge.py``'s loop and verdict receiver share it.

Contract:
- ``Committed``: the session's committed tokens as the verifier gave them, in its commit order.
  Every verdict must agree with what was committed before it and leave no gap; a verifier that
  rewrites a token it already gave, skips one or names one outside the vocabulary raises
  ``BadVerdict`` (never a silent fix). ``on_commit`` hears each new run of tokens, up to what
  the session may output (``limit`` tokens after the prompt, cut after the first EOS): a block
  accepted whole can commit more, which the result drops, and a stream must drop them too.
- ``Flight``: the blocks sent and not answered yet, in order. ``take(result)`` checks a verdict
  on the oldest one (``overlay.trust.verdict_problem``, a base that was committed, the committed
  length it states) and commits its tokens; ``take_lead(lead)`` commits a lead token at the end;
  ``resync(draft)`` marks the draft stale (``dirty``) and the blocks built on a wrong token dead
  (``live_from``). Anything impossible is a ``BadVerdict``: the edge fails over (``client.py``).
- ``SpecStats``: blocks and tokens counted per session (``client.py`` sums them over failovers).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from p2pnode.overlay.trust.book import verdict_problem
from p2pnode.speculation._blocks import Block, BlockResult, Lead
from p2pnode.speculation._errors import BadVerdict

__all__ = ["Committed", "DraftHistory", "Flight", "Part", "SpecStats", "finished", "trim"]

# An honest verifier never calls a live block stale (it builds on tokens that verifier commits);
# a liar could loop us, and the draft cannot resume from one (nothing new to feed it). 2 in a row
# rather than 1 leaves room for a corner case we did not foresee at the price of one wasted
# block from a liar.
MAX_LIVE_STALE = 2


@dataclass
class SpecStats:
    blocks_sent: int = 0
    blocks_verified: int = 0
    blocks_stale: int = 0
    drafted: int = 0  # draft tokens in verified blocks
    accepted: int = 0
    rejections: int = 0  # verified blocks not fully accepted
    lead_tokens: int = 0  # committed by the verifier on its own (lead)
    lead_only: int = 0  # times the edge stopped drafting for the verifier to decode alone
    keepalives: int = 0  # empty blocks sent meanwhile (to refill its lead budget)
    seconds: float = 0.0

    @property
    def acceptance(self) -> float:
        """Accepted / drafted tokens (what a block's budget yields)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability: every verified position ends accepted or rejected,
        so accepted / (accepted + rejections) estimates P(draft token == target's) at a position."""
        tried = self.accepted + self.rejections
        return self.accepted / tried if tried else 0.0

    @property
    def tokens_per_block(self) -> float:
        """Committed tokens per verified block (accepted + the verifier's own token)."""
        return (
            (self.accepted + self.blocks_verified) / self.blocks_verified
            if self.blocks_verified
            else 0.0
        )


@dataclass
class DraftHistory:
    """What an edge measured against one verifier over its sessions: committed tokens a second
    while it drafts and while it lets the verifier decode alone (``rates``, smoothed over
    stretches of ``edge.SEGMENT`` tokens or more), and how many stretches it has chosen."""

    rates: dict[str, float] = field(default_factory=dict)  # "draft" / "lead" -> tokens/s
    chosen: int = 0

    def observe(self, behaviour: str, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate, old = tokens / seconds, self.rates.get(behaviour)
        self.rates[behaviour] = rate if old is None else old + 0.5 * (rate - old)

    def choose(self, explore_every: int) -> str:
        """ "draft" or "lead": each measured once first, then the faster, the slower again
        every ``explore_every``-th stretch (the round trip and the load change)."""
        self.chosen += 1
        for behaviour in ("draft", "lead"):
            if behaviour not in self.rates:
                return behaviour
        best, other = sorted(self.rates, key=lambda b: -self.rates[b])
        return other if self.chosen % explore_every == 0 else best


def finished(out: list[int], max_new: int, eos: Collection[int]) -> bool:
    """``max_new`` tokens out, or an end-of-sequence token among them."""
    return len(out) >= max_new or any(t in eos for t in out)


def trim(out: list[int], max_new: int, eos: Collection[int]) -> list[int]:
    """``out`` cut to ``max_new`` tokens and after its first end-of-sequence token."""
    out = out[:max_new]
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1]
    return out


class Committed:
    """The edge's copy of the session's committed tokens, fed in the verifier's commit order.

    Every verdict must agree with what was committed before it and leave no gap; the verifier
    cannot rewrite a token it already gave (that is a ``BadVerdict``, never a silent fix)."""

    def __init__(
        self,
        prompt: list[int],
        vocab: int | None,
        on_commit,
        limit: int | None = None,
        eos: Collection[int] = (),
    ) -> None:
        self.tokens = list(prompt)
        self.vocab = vocab
        self.on_commit = on_commit
        self.limit, self.eos = limit, eos
        self.told, self.ended = 0, False  # output tokens handed to on_commit; all it may get

    def place(self, position: int, tokens: list[int]) -> None:
        if position > len(self.tokens):
            raise BadVerdict(f"verifier skipped tokens {len(self.tokens)}..{position - 1}")
        new = []
        for p, t in enumerate(tokens, start=position):
            if p < len(self.tokens):
                if self.tokens[p] != t:
                    raise BadVerdict(f"verifier changed committed token {p}: {self.tokens[p]}->{t}")
                continue
            if t < 0 or (self.vocab is not None and t >= self.vocab):
                raise BadVerdict(f"token {t} outside the vocabulary of {self.vocab}")
            self.tokens.append(t)
            if not self.ended:
                new.append(t)
                self.told += 1
                self.ended = t in self.eos or self.told == self.limit
        if new and self.on_commit is not None:
            self.on_commit(new)


@dataclass
class Part:
    """The block being drafted, ONE token per worker call so that a verdict that kills it is
    seen within one draft step, not one block."""

    base: int
    size: int
    tokens: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)  # the draft's q rows, when sampling


@dataclass
class Flight:
    """The blocks in flight, shared by the drafting loop and the verdict receiver.

    Blocks numbered below ``live_from`` build on tokens the verifier did not commit (dead);
    ``dirty``: the draft no longer extends the committed tokens, the drafter resyncs it first.
    With lead, the first block after a reset is lengthened by ``overlap``: about as many tokens
    as the verifier commits on its own before that block arrives (measured on earlier first
    blocks, ``firsts``), so that ``gamma`` of its drafts still reach past the leads."""

    committed: Committed
    stats: SpecStats
    vocab: int | None
    lead: bool
    sent: deque[Block] = field(default_factory=deque)  # sent, not answered yet, in order
    number: int = 0
    live_from: int = 0
    live_stale: int = 0
    dirty: bool = False
    firsts: set[int] = field(default_factory=set)
    overlap: float = 0.0

    def live(self) -> int:
        return sum(b.number >= self.live_from for b in self.sent)

    def ends_at(self, draft_len: int) -> bool:
        """A live block in flight ends where the draft does: its bonus token comes next. (After
        the verifier's own tokens ran past the blocks in flight, nothing is left to guess.)"""
        last = next((b for b in reversed(self.sent) if b.number >= self.live_from), None)
        return last is not None and last.base_len + len(last.tokens) == draft_len

    def resync(self, draft: list[int]) -> None:
        """Mark the flight dirty where the draft's tokens no longer extend the committed ones."""
        c = self.committed.tokens
        if draft[: len(c)] == c:
            return
        if c[: len(draft)] != draft:  # a wrong token in the draft: all dead
            self.live_from = self.number
        self.dirty = True  # (else the verifier's own tokens ran ahead of the draft: catch up)

    def launch(self, draft: list[int], part: Part, first: bool) -> Block:
        """The block drafted on ``part.base`` of ``draft``, numbered and counted as in flight."""
        rows = part.rows
        block = Block(
            self.number,
            part.base,
            draft[part.base - 1],
            tuple(part.tokens),
            torch.cat(rows) if rows else None,
        )
        self.sent.append(block)  # before the send: a verdict may arrive during it
        if first and self.lead:
            self.firsts.add(block.number)
        self.number += 1
        if block.tokens:
            self.stats.blocks_sent += 1
        else:
            self.stats.keepalives += 1
        return block

    def take(self, res: BlockResult) -> None:
        """A verdict on the oldest block in flight (an impossible one is a ``BadVerdict``: the
        edge then fails over, see client.py)."""
        if not self.sent or res.number != self.sent[0].number:
            raise BadVerdict(f"verifier answered block {res.number}, which is not in flight")
        block, alive = self.sent.popleft(), res.number >= self.live_from
        stats, c = self.stats, self.committed
        if res.stale:
            stats.blocks_stale += 1
            self.live_stale += alive
            if self.live_stale >= MAX_LIVE_STALE:
                raise BadVerdict(f"{self.live_stale} live blocks in a row called stale")
            return
        self.live_stale = 0 if alive else self.live_stale
        problem = verdict_problem(
            block_len=len(block.tokens),
            base_len=block.base_len,
            accepted=res.accepted,
            next_token=res.next_token,
            committed_len=res.committed_len,
            vocab_size=self.vocab,
            lead=self.lead,
        )
        base = block.base_len
        if problem is None and (base > len(c.tokens) or c.tokens[base - 1] != block.base_token):
            problem = "a verdict on a block whose base was never committed"
        if problem is not None:
            raise BadVerdict(f"verifier answered block {res.number} impossibly: {problem}")
        if block.number in self.firsts:
            self.firsts.discard(block.number)
            led = min(len(c.tokens) - base, len(block.tokens))
            self.overlap += 0.5 * (led - self.overlap)
        c.place(base, [*block.tokens[: res.accepted], res.next_token])
        if res.committed_len != len(c.tokens):
            raise BadVerdict(f"verifier says {res.committed_len} committed, sent {len(c.tokens)}")
        if not alive:
            stats.blocks_stale += 1
            return
        if not block.tokens:  # a keep-alive of the verifier's lead: no drafts to count
            return
        stats.blocks_verified += 1
        stats.drafted += len(block.tokens)
        stats.accepted += res.accepted
        stats.rejections += res.accepted < len(block.tokens)

    def take_lead(self, ev: Lead) -> None:
        c = self.committed
        if not self.lead or ev.position != len(c.tokens):
            raise BadVerdict(f"unexpected lead token at {ev.position} ({len(c.tokens)} committed)")
        c.place(ev.position, [ev.token])
        self.stats.lead_tokens += 1
