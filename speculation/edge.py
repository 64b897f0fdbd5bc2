"""The edge loop of speculative decoding: a local W4A16 draft, a remote target verifier.

Contract:
- ``speculative_generate(draft, transport, prompt, max_new_tokens, ...)`` returns the generated
  ids (at most ``max_new_tokens``, cut after the first EOS) and stats. For greedy options they
  equal the target's own greedy output token for token; for sampling they follow the target's
  distribution (the verifier does rejection sampling against the q each draft token came from).
- ``depth=1`` is the synchronous baseline: draft gamma tokens, send, wait for the verdict.
  ``depth>=2`` is the asynchronous (PicoSpec-style) pipeline: right after sending block k the edge
  guesses the target's bonus token (the draft's argmax), drafts block k+1 on top and sends it too,
  so drafting and the WAN trip overlap verification. When block k is not fully accepted, or the
  bonus differs from the guess, every block in flight is dead: the draft's cache is cropped back to
  the committed tokens and drafting resumes from the target's token. The verifier answers dead
  blocks "stale" without computing (each block names the committed length and token it builds on).
  ``depth`` is the number of blocks kept in flight. Verdicts are taken by a receiver task while
  the draft runs ONE token per worker call, so a verdict that kills the pipeline stops the
  drafting within one draft step (not one block) and the edge redrafts at once. A block built on
  a guess survives with probability ~alpha^(gamma+1): at alpha ~0.75 short blocks (gamma 2) with
  3 in flight beat gamma 4 (bench/speculation_processes.py models and measures it).
- ``lead=n`` (async): the verifier decodes on its own, up to n tokens, whenever no block of the
  session waits after a rejection (see ``verify.py``), so a rejection no longer idles it for a
  round trip. Its tokens arrive as ``Lead`` in commit order and are committed at once; a lead
  that contradicts the draft kills the blocks in flight like a rejection, one that runs past the
  draft just moves it forward. The first block after a reset is lengthened by the overlap
  measured on earlier ones, so its last ``gamma`` drafts reach past the verifier's own tokens.
  At a break the edge may instead stop drafting for ``SEGMENT`` tokens and let the verifier
  decode alone (empty blocks keep its lead budget full): per verifier (``history=``, a
  ``_flight.DraftHistory``) it keeps the committed tokens a second of both behaviours and
  takes the faster, the other every ``EXPLORE_EVERY``-th stretch.
- The verifier's block-size control (``BlockResult.want``, ``_blocksize.py``): the edge drafts
  at most ``want`` tokens per block (at least 1), and with lead, at ``want`` 0, lets the
  verifier decode alone (lead-only stretches) until a result asks for drafts again. Every verdict must agree with what is committed (``_flight.Committed``), else ``BadVerdict``.
- ``remote_generate(transport, prompt, n)``: target-only remote generation over the same
  protocol (the verifier streams leads; empty blocks refill the budget): the baseline, and the
  fastest mode where the draft is barely cheaper than the target.
- The verifier is reached through ``VerifierTransport`` (open / send_block / receive_result /
  close; results and leads come back in the verifier's commit order).
  ``p2pnode.speculation.protocol`` provides the libp2p one; ``speculation.testing`` an
  in-process one for tests and benches.
- Where: ``speculative_generate`` sets up an ``_Edge``; its ``draft`` is the edge loop and its
  ``receive`` the verdict receiver; both work on the ``Flight`` (``_flight.py``: the blocks in
  flight and the edge's copy of the committed tokens) and wake each other through a ``_Signal``.
- Draft and target forwards run in worker threads (``trio.to_thread``) so the event loop keeps
  moving frames and timers while torch computes.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import trio
from transformers import DynamicCache

from p2pnode.inference._cpu import fastpath as _fastpath
from p2pnode.inference.models import LoadedModel
from p2pnode.inference.sampling import make_generator, probs_from_logits
from p2pnode.speculation._accept import truncate_probs
from p2pnode.speculation._blocks import Block, BlockResult, Lead, SamplingOptions
from p2pnode.speculation._errors import BadVerdict
from p2pnode.speculation._flight import (
    Committed,
    DraftHistory,
    Flight,
    Part,
    SpecStats,
    finished,
    trim,
)
from p2pnode.speculation.draft import DraftModel

GREEDY = SamplingOptions()
DEFAULT_PROBS_TOP_K = 64  # draft distributions are cut to 64 tokens: exact, and cheap on the wire
MAX_OVERLAP = 8  # draft tokens a first block may add for the verifier's lead
# With lead, at a break the edge either drafts or lets the verifier decode alone, for a stretch
# of at least SEGMENT committed tokens, whichever was faster against this verifier so far
# (``DraftHistory``), the other again every EXPLORE_EVERY-th stretch (as "auto" does for
# modes). On a long round trip drafts land after the verifier's own tokens and only slow it
# where the two share a host (its lead steps took 24-29 ms while the edge drafted, 17-20 alone).
SEGMENT = 16
EXPLORE_EVERY = 8


class VerifierTransport(Protocol):
    async def open(self, prompt: list[int], options: SamplingOptions, *, lead: int = 0) -> int:
        """Open the session; returns the lead the verifier granted (<= ``lead``)."""

    async def send_block(self, block: Block) -> None: ...

    # Optional: ``max_block``, the verifier's block limit once open (caps lengthened blocks).

    async def receive_result(self) -> BlockResult | Lead:
        """The next result or lead token, in the verifier's commit order."""

    async def close(self) -> None: ...


# ---------------------------------------------------------------- the draft's own state


class DraftRunner:
    """The draft's token list (committed + speculative) and a KV cache covering a prefix of it."""

    def __init__(
        self, draft: DraftModel, options: SamplingOptions, *, top_k: int, seed: int | None
    ):
        self.model = draft.model
        self.options = options
        self.top_k = top_k
        self.generator = make_generator(seed)
        self.tokens: list[int] = []
        self.cache = DynamicCache()
        self.cache_len = 0

    def start_from(self, prefix: DraftPrefix, prompt: list[int]) -> None:
        """Start on ``prompt`` from the KV ``prefix`` holds of an earlier prompt (a copy)."""
        self.tokens = list(prompt)
        n = prefix.usable(prompt)
        if n and prefix.cache is not None:
            self.cache = copy.deepcopy(prefix.cache)
            _keep_first(self.cache, n)
            self.cache_len = n

    def reset_to(self, committed: list[int]) -> None:
        """Drop speculative tokens that disagree with ``committed``; crop the cache to match."""
        same = 0
        for a, b in zip(self.tokens, committed, strict=False):
            if a != b:
                break
            same += 1
        if self.cache_len > same:
            self.cache.crop(same - self.cache_len)
            self.cache_len = same
        self.tokens = list(committed)

    def _feed(self, end: int) -> torch.Tensor:
        """Cache ``tokens[cache_len:end]``; returns the last position's logits. In runs of at
        most ``_fastpath.MAX_ROWS``: the draft's C path took 156 ms for a 36-token prompt in
        runs of 16 where one call, on torch's bf16 int4 op, took 270 (100 tokens: 444 / 734)."""
        logits = None
        while self.cache_len < end:
            stop = min(end, self.cache_len + _fastpath.MAX_ROWS)
            x = torch.tensor([self.tokens[self.cache_len : stop]])
            logits = self.model(
                input_ids=x, past_key_values=self.cache, use_cache=True, logits_to_keep=1
            ).logits[0, -1]
            self.cache_len = stop
        assert logits is not None, "nothing to feed"
        return logits

    @torch.inference_mode()
    def prefill(self) -> None:
        """Cache all tokens but the last (``extend`` feeds it): runs while the session opens."""
        if len(self.tokens) - 1 > self.cache_len:
            self._feed(len(self.tokens) - 1)

    @torch.inference_mode()
    def extend(self, n: int, *, argmax: bool = False) -> tuple[list[int], torch.Tensor | None]:
        """Draft ``n`` tokens after ``self.tokens``; returns them and their q rows (sampling)."""
        out: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(n):
            logits = self._feed(len(self.tokens))
            if argmax or self.options.greedy:
                token = int(logits.argmax())
            else:
                q = probs_from_logits(logits.float(), self.options.temperature, self.options.top_p)
                q = truncate_probs(q, self.top_k)
                token = int(torch.multinomial(q, 1, generator=self.generator))
                rows.append(q)
            self.tokens.append(token)
            out.append(token)
        return out, (torch.stack(rows) if rows else None)


class DraftPrefix:
    """The draft's KV of the last session's prompt, which the next session on the same prefix
    (a deployment's system prompt) starts from. Why: the draft prefilled a 375-token chat
    prompt in ~1.2 s, longer than the verifier's lead took for a 32-token answer, so without
    it the edge drafted nothing on the chat workload (bench/verifier_capacity.py)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.cache: DynamicCache | None = None

    def usable(self, prompt: list[int]) -> int:
        """Cached tokens ``prompt`` can start from (its last token is always run)."""
        n = 0
        for a, b in zip(self.tokens, prompt[:-1], strict=False):
            if a != b:
                break
            n += 1
        return n

    def keep(self, runner: DraftRunner, prompt: list[int]) -> None:
        """Keep the runner's cache of ``prompt`` (the runner is done with it)."""
        n = min(runner.cache_len, len(prompt) - 1)
        if n > 0 and runner.tokens[:n] == prompt[:n]:
            _keep_first(runner.cache, n)
            self.tokens, self.cache = list(prompt[:n]), runner.cache


def _keep_first(cache: DynamicCache, n: int) -> None:
    """Crop ``cache`` to its first ``n`` positions. By the count to drop: transformers'
    ``DynamicLayer.crop`` refuses a length to keep (a draft off the C path holds one)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)


# ---------------------------------------------------------------- the speculative loop


@dataclass
class SpecResult:
    tokens: list[int]
    stats: SpecStats = field(default_factory=SpecStats)


class _Signal:
    """Wakes whoever waits for a change of the flight (a verdict, a lead token, a failure)."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass
class _Edge:
    """One speculative session at the edge: the drafting loop (``draft``) and the verdict
    receiver (``receive``) share the flight and wake each other through ``changed``."""

    transport: VerifierTransport
    runner: DraftRunner
    fl: Flight
    prompt_len: int
    max_new: int
    eos: frozenset[int]
    gamma: int
    depth: int
    lead: int
    max_block: int = 0
    history: DraftHistory = field(default_factory=DraftHistory)  # against this verifier
    stretch: tuple[int, float] | None = None  # the drafting stretch's start: committed, time
    want: int | None = None  # the verifier's block-size advice (``_blocksize.py``); None: none
    changed: _Signal = field(default_factory=_Signal)
    failure: list[Exception] = field(default_factory=list)  # the receiver's, raised by draft()

    def done(self) -> bool:
        return finished(self.fl.committed.tokens[self.prompt_len :], self.max_new, self.eos)

    async def receive(self) -> None:
        """Verdicts and lead tokens, in the verifier's commit order, into the flight."""
        try:
            while not self.done():
                msg = await self.transport.receive_result()
                if isinstance(msg, Lead):
                    self.fl.take_lead(msg)
                else:
                    self.fl.take(msg)
                    if msg.want is not None:
                        self.want = msg.want
                self.fl.resync(self.runner.tokens)
                self.changed.fire()
        except Exception as exc:  # handed to the drafting loop, which raises it
            self.failure.append(exc)
            self.changed.fire()

    async def draft(self) -> None:
        """The edge loop: draft one token at a time, send each block once full, keep ``depth``
        live blocks in flight, and start over from the committed tokens when a verdict or a
        lead kills the blocks in flight (``fl.dirty``)."""
        fl, d, part, first = self.fl, self.runner, None, True
        while not self.done() and not self.failure:
            if fl.dirty:
                d.reset_to(fl.committed.tokens)
                fl.dirty, part, first = False, None, True
            full = fl.live() >= self.depth or len(d.tokens) - self.prompt_len >= self.max_new
            if full and part is None:  # a block being drafted is always finished
                await self.changed.wait()
                continue
            if part is None and first and self.lead and self.lead_now():
                await self.lead_only()
                continue
            if part is None:
                if fl.ends_at(len(d.tokens)):  # guess the bonus of the block in flight
                    await self._draft_one(argmax=True)
                    if fl.dirty:
                        continue
                extra = min(round(fl.overlap), MAX_OVERLAP) if first and self.lead else 0
                gamma = self.gamma if self.want is None else max(1, min(self.gamma, self.want))
                part = Part(len(d.tokens), max(gamma, min(gamma + extra, self.max_block)))
            toks, q = await self._draft_one()
            if fl.dirty:
                continue
            part.tokens.extend(toks)
            if q is not None:
                part.rows.append(q)
            if len(part.tokens) >= part.size:
                block = fl.launch(d.tokens, part, first)
                part, first = None, False
                await self.transport.send_block(block)

    def lead_now(self) -> bool:
        """At a break: whether to let the verifier decode alone next: when it asks for no
        drafts (``want`` 0), else as ``lead_next`` measures."""
        if self.want == 0:
            self.end_stretch()
            return True
        return self.lead_next()

    def lead_next(self) -> bool:
        """At a break: whether the next stretch lets the verifier decode alone. A drafting
        stretch lasts until its first break after ``SEGMENT`` tokens; its rate is kept then."""
        n, now = len(self.fl.committed.tokens), time.perf_counter()
        if self.stretch is not None:
            if n - self.stretch[0] < SEGMENT:
                return False
            self.end_stretch()
        choice = self.history.choose(EXPLORE_EVERY)
        self.stretch = (n, now) if choice == "draft" else None
        return choice == "lead"

    def end_stretch(self) -> None:
        """Keep the rate of the drafting stretch under way, if it is long enough to judge by."""
        if self.stretch is None:
            return
        (start, t0), n = self.stretch, len(self.fl.committed.tokens)
        if n - start >= SEGMENT:
            self.history.observe("draft", n - start, time.perf_counter() - t0)
        self.stretch = None

    async def lead_only(self) -> None:
        """``SEGMENT`` tokens of the verifier decoding alone, its rate kept. Empty blocks refill
        its lead budget (answered at once, nothing to verify); two in flight, so that a refill
        lands about every half round trip, well inside a budget sized to a whole one. The draft
        catches up on the committed tokens afterwards (one forward)."""
        fl, t0 = self.fl, time.perf_counter()
        start = len(fl.committed.tokens)
        fl.stats.lead_only += 1
        while not self.done() and not self.failure and len(fl.committed.tokens) - start < SEGMENT:
            while len(fl.sent) < 2:
                c = fl.committed.tokens
                await self.transport.send_block(fl.launch(c, Part(len(c), 0), first=False))
            await self.changed.wait()
        self.history.observe("lead", len(fl.committed.tokens) - start, time.perf_counter() - t0)

    async def _draft_one(self, argmax: bool = False) -> tuple[list[int], torch.Tensor | None]:
        return await trio.to_thread.run_sync(lambda: self.runner.extend(1, argmax=argmax))

    async def run(self, prompt: list[int], options: SamplingOptions) -> None:
        """Open the session while the draft prefills the prompt, and take the verifier's first
        tokens as soon as they come: its prefill's token is a lead, and a draft prefill (~150 ms
        here for a chat prompt) held it back, ~200 ms of first-token latency that remote
        generation did not pay. Drafting starts once the prefill is done."""
        prefilled = trio.Event()

        async def prefill() -> None:
            try:
                await trio.to_thread.run_sync(self.runner.prefill)
                prefilled.set()
            except Exception as exc:  # raised by run(), as the receiver's are
                self.failure.append(exc)
            self.changed.fire()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(prefill)
            try:
                await self.transport.open(prompt, options, lead=self.lead)
                self.max_block = (
                    getattr(self.transport, "max_block", None) or self.gamma + MAX_OVERLAP
                )
                nursery.start_soon(self.receive)
                while not (prefilled.is_set() or self.done() or self.failure):
                    await self.changed.wait()
                await self.draft()
            except Exception as exc:  # raised below, outside the nursery: no ExceptionGroup
                self.failure.append(exc)
            nursery.cancel_scope.cancel()
        if self.failure:
            raise self.failure[0]


async def speculative_generate(
    draft: DraftModel,
    transport: VerifierTransport,
    prompt: list[int],
    max_new_tokens: int,
    *,
    gamma: int = 4,
    depth: int = 1,
    lead: int = 0,
    options: SamplingOptions | None = None,
    eos_token_ids: tuple[int, ...] | list[int] = (),
    probs_top_k: int = DEFAULT_PROBS_TOP_K,
    on_commit: Callable[[list[int]], None] | None = None,
    history: DraftHistory | None = None,
    prefix: DraftPrefix | None = None,
) -> SpecResult:
    """See the module contract. ``on_commit(new_ids)`` is called as tokens become final (for
    streaming, and so a caller can resume on another verifier from prompt + committed ids).
    ``history``: what the caller's earlier sessions against this verifier measured
    (``DraftHistory``: drafting or letting the verifier decode alone, which was faster); this
    session's stretches are added to it. ``prefix``: the draft's KV of an earlier prompt
    (``DraftPrefix``): the draft prefills only what differs, and keeps this prompt's there."""
    options = options or GREEDY
    if not prompt or max_new_tokens < 1 or gamma < 1 or depth < 1 or lead < 0:
        raise ValueError(
            "need a non-empty prompt, max_new_tokens >= 1, gamma >= 1, depth >= 1, lead >= 0"
        )
    eos, started = frozenset(eos_token_ids), time.perf_counter()
    vocab = getattr(getattr(draft.model, "config", None), "vocab_size", None)
    d = DraftRunner(draft, options, top_k=probs_top_k, seed=options.seed)
    d.tokens = list(prompt)
    if prefix is not None:
        d.start_from(prefix, prompt)
    c = Committed(prompt, vocab, on_commit, max_new_tokens, eos)
    fl = Flight(c, SpecStats(), vocab, lead > 0)
    edge = _Edge(transport, d, fl, len(prompt), max_new_tokens, eos, gamma, depth, lead)
    edge.history = history if history is not None else DraftHistory()
    try:
        await edge.run(prompt, options)
    finally:
        edge.end_stretch()
        with trio.CancelScope(shield=True):
            await transport.close()
    if prefix is not None:
        prefix.keep(d, prompt)
    fl.stats.seconds = time.perf_counter() - started
    return SpecResult(trim(fl.committed.tokens[len(prompt) :], max_new_tokens, eos), fl.stats)


async def remote_generate(
    transport: VerifierTransport,
    prompt: list[int],
    max_new_tokens: int,
    *,
    options: SamplingOptions | None = None,
    eos_token_ids: tuple[int, ...] | list[int] = (),
    on_commit: Callable[[list[int]], None] | None = None,
) -> SpecResult:
    """Target-only remote generation over the same protocol (no draft): the verifier streams
    lead tokens; when its lead budget runs out an empty block asks for the next token and
    refills it. The baseline speculation is measured against, and the output it must equal."""
    options = options or GREEDY
    eos, stats, started = frozenset(eos_token_ids), SpecStats(), time.perf_counter()
    c = Committed(prompt, None, on_commit, max_new_tokens, eos)
    try:
        granted = await transport.open(prompt, options, lead=max_new_tokens)
        budget, number = granted, 0
        while not finished(c.tokens[len(prompt) :], max_new_tokens, eos):
            if budget == 0:
                block = Block(number, len(c.tokens), c.tokens[-1], ())
                number += 1
                await transport.send_block(block)
            msg = await transport.receive_result()
            if isinstance(msg, Lead):
                if msg.position != len(c.tokens):
                    raise BadVerdict(f"lead token at {msg.position}, {len(c.tokens)} committed")
                c.place(msg.position, [msg.token])
                budget -= 1
                stats.lead_tokens += 1
            elif msg.stale or msg.accepted != 0:
                raise BadVerdict(f"an empty block answered with {msg}")
            else:
                c.place(len(c.tokens), [msg.next_token])
                if msg.committed_len != len(c.tokens):
                    raise BadVerdict(f"verifier says {msg.committed_len} committed")
                budget = granted
    finally:
        with trio.CancelScope(shield=True):
            await transport.close()
    stats.seconds = time.perf_counter() - started
    return SpecResult(trim(c.tokens[len(prompt) :], max_new_tokens, eos), stats)


# ---------------------------------------------------------------- baselines and transports


@torch.inference_mode()
def target_generate(
    target: LoadedModel,
    prompt: list[int],
    max_new_tokens: int,
    *,
    options: SamplingOptions | None = None,
    eos_token_ids: tuple[int, ...] | list[int] = (),
) -> list[int]:
    """The target alone: a plain KV-cached decoding loop (the reference speculation must match)."""
    options = options or GREEDY
    eos, gen, cache = frozenset(eos_token_ids), make_generator(options.seed), DynamicCache()
    device = next(target.model.parameters()).device
    x, out = torch.tensor([prompt], device=device), []
    while not finished(out, max_new_tokens, eos):
        logits = target.model(
            input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1
        ).logits[0, -1]
        if options.greedy:
            token = int(logits.argmax())
        else:
            p = probs_from_logits(logits.float().cpu(), options.temperature, options.top_p)
            token = int(torch.multinomial(p, 1, generator=gen))
        out.append(token)
        x = torch.tensor([[token]], device=device)
    return out
