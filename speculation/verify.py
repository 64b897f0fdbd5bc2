"""The batched multi-tenant verifier: many edges' draft blocks in ONE forward pass of the target.

Contract:
- ``BatchedVerifier(target)``: per-session target KV caches (prompt prefilled at open). Sessions
  hold ``committed`` tokens (prompt + accepted output); the cache holds all of them but the last.
  ``await verify(session_id, block)`` queues the block; the ``run()`` task gathers queued blocks of
  different sessions (up to ``max_batch``, waiting at most ``max_wait_ms`` for more) into ONE
  forward pass of the target, then crops each cache to its accepted length.
  A block states the committed length and last token it builds on; if the session holds fewer
  tokens or another token there (the edge guessed wrong while pipelining) the result is ``stale``
  and costs nothing. Acceptance is ``_accept.py``'s (greedy: the target's own decoding; sampling:
  rejection sampling against the q each draft token was drawn from).
- Lead (``open_session(..., lead=n, on_lead=callback)``): while no block of the session is
  waiting, the verifier keeps decoding on its own, up to ``n`` tokens after the session's last
  block, and hands each token to ``on_lead(Lead(position, token))`` in commit order (the
  callback runs before any later result of the session is returned). When leading has to stop
  early, the callback gets the ``VerifierError`` instead (``SessionLimit`` at the context limit,
  ``VerifierError`` when the forward failed) and the session leads no more; a callback that
  raises is treated the same way, never as the loop's error. These are the target's own
  tokens, so a rejection no longer leaves the verifier idle for a round trip. A block that
  arrives after leads is compared with them: its draft tokens already committed by a lead are
  accepted while they agree; the first disagreement ends the block (``accepted`` = the agreeing
  count, ``next_token`` = the lead token there, ``committed_len`` = the session's length, no
  compute); only the part beyond the leads is verified. So ``committed_len >= base_len +
  accepted + 1`` with leads (``==`` without). The budget refills after every block (a
  rejection, a stale or a superseded block, and a fully accepted one too: its successor is a
  round trip or a draft step away, and a lead step rides in passes that run anyway); a block of
  zero tokens (nothing to accept) refills it. Blocks answered without computing are answered
  before the pass, so their sessions lead in it.
  A refill is ``lead`` tokens, or more once the session has measured its edge's reaction (from a
  break to the arrival of the first block drafted after it; a new session starts from the last
  session's figure): the lead steps that fit in it, plus one, at most ``max_lead``. So on a long
  round trip the verifier keeps decoding until that block can be there instead of idling.
  Blocks are gathered for ``max_wait_ms`` only while some session outside the pass could still
  send one; a lone leading session's next lead step starts at once.
  A lead step also checks up to ``lookup`` guesses taken from the session's own tokens (prompt
  lookup on the last ``lookup_ngram`` tokens, ``_lookup.py``; ``lookup=0``: none), accepted as
  a block's drafts are (greedy: the target's argmax; sampling: rejection sampling against a
  one-hot proposal), so one step may commit several tokens, each its own ``Lead``; the budget
  counts tokens, and no step commits more than the budget has left.
- Block-size control (``block_control=True``, ``_blocksize.py``): every block's result carries
  ``want``, the draft tokens the verifier wants in the session's next blocks, from its load
  (positions per pass, time per position, tokens per second, measured on its own passes) and
  the session's measured acceptance; 0 asks the edge to let it decode alone. Lead steps check
  as many prompt-lookup guesses as the same rule grants (at most ``lookup``).
- Refusals are ``VerifierError`` subclasses (``_errors.py``) with a message saying what to do:
  ``VerifierFull`` (max sessions), ``SessionLimit`` (max tokens per session / context),
  ``UnknownSession`` (closed, or reaped after ``idle_timeout_s``), ``SessionBusy`` (one block at a
  time per session), ``BadBlock`` / ``BadRequest`` (malformed input), ``WrongModel``,
  ``PeerLimited`` (the edge's peer went over a per-peer limit of ``overlay/limits.py``: sessions,
  rate, bytes in flight).

The batching loop (``run``): gather the queued blocks, ``plan`` them (``_batching.py``: what is
answered without computing, which rows and lead steps go into the pass), one forward over the
rows (``_forward``: fused, serial or stacked, see ``_pick_mode``), ``accept`` each row, and
``_apply`` the outcomes: commit tokens, crop caches, refill or spend lead budgets, answer waiters
and ``on_lead`` callbacks. Only ``_apply`` changes a session's tokens, cache and lead budget.

Device: inputs are built on the target's device (a CUDA target needs no wrapper); greedy
acceptance runs there, sampling copies the few logit rows to the CPU and draws with the
session's seeded CPU generator. (Not yet run on a GPU: `make gpu-check` is the check for a GPU machine.)
A batch of one uses the session's cache directly. More, where the C stack runs the target (a
CPU Llama), go through it in one call (``fastpath.extend_many``: each linear one matmul over all
rows, each row attending to its own session's slab; up to 16 rows bitwise each session's own
forward, past it the prefill's GEMM, float rounding away). Elsewhere they are stacked
left-padded (``_kvstack.py``: the math equals each session's own forward, logits agree to
~1e-5) or run one after another.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from collections.abc import Callable

import torch
import trio
from transformers import DynamicCache

from p2pnode.inference._cpu import fastpath as _fastpath
from p2pnode.inference._cpu import kernels as _kernels
from p2pnode.inference.models import LoadedModel
from p2pnode.inference.sampling import make_generator
from p2pnode.speculation._batching import (
    Outcome,
    Row,
    Session,
    Waiter,
    accept,
    failed,
    may_lead,
    plan,
    session_limit,
)
from p2pnode.speculation._blocks import Block, BlockResult, Lead, SamplingOptions
from p2pnode.speculation._blocksize import AcceptanceMeter, BlockSizer
from p2pnode.speculation._errors import (
    BadBlock,
    BadRequest,
    SessionBusy,
    SessionLimit,
    UnknownSession,
    VerifierError,
    VerifierFull,
    WrongModel,
)
from p2pnode.speculation._lookup import NgramIndex
from p2pnode.speculation._passes import device_of, forward_rows, prefill
from p2pnode.speculation._prefix import PrefixKV

__all__ = ["BatchedVerifier"]

# A lead step checks up to LOOKUP prompt-lookup guesses keyed on the last LOOKUP_NGRAM tokens
# (``_lookup.py``). Chosen on the speculation bound's prompts, not the judging benches': 3-token
# keys wasted fewer positions than 1 or 2 (1.39 a step against 2.85 and 1.67, for 1.26 tokens
# against 1.36 and 1.31), and a batched pass pays for every position; 4 guesses against 2
# added 0.05 tokens a step.
LOOKUP = 4
LOOKUP_NGRAM = 3
PROBE_EVERY = 16  # passes of several rows between probes of the costlier pass mode


class BatchedVerifier:
    def __init__(
        self,
        target: LoadedModel,
        *,
        max_sessions: int = 32,
        max_tokens_per_session: int = 2048,
        max_block: int = 16,
        max_batch: int = 16,
        max_wait_ms: float = 2.0,
        idle_timeout_s: float = 120.0,
        max_lead: int = 64,
        prefix_cache_tokens: int = 8192,
        lookup: int = LOOKUP,
        lookup_ngram: int = LOOKUP_NGRAM,
        block_control: bool = True,
    ) -> None:
        self.target = target
        self.device = device_of(target.model)
        self.model_id = target.model_id
        self.vocab_size = target.vocab_size
        self.max_sessions = max_sessions
        self.max_tokens = min(max_tokens_per_session, target.context_length)
        self.max_block = max_block
        # 16 rows a pass by default: with 16 tenants at 100 ms RTT, 8 rows left half the open
        # sessions out of each pass; 16 kept target-only serving's tokens/s (56.7 against
        # 56.3) with a p95 inter-token latency of 405 ms against 1019, and speculation's went
        # from 55.5 to 65.5 tokens/s (bench/verifier_capacity.py --prompt-set tune, 2-vCPU
        # Xeon, 2026-12-07).
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self.idle_timeout_s = idle_timeout_s
        self.max_lead = max_lead
        if lookup < 0 or lookup_ngram < 1:
            raise ValueError(
                f"need lookup >= 0 and lookup_ngram >= 1, got {lookup}, {lookup_ngram}"
            )
        self.lookup, self.lookup_ngram = lookup, lookup_ngram
        # Block-size control (``_blocksize.py``): each result tells its session how many draft
        # tokens to send per block, and lead steps check as many lookup guesses as pay, from
        # the load measured on the passes. None: no advice, ``lookup`` guesses every step.
        self.sizer = BlockSizer(max_want=max_block) if block_control else None
        self._lookup_meter = AcceptanceMeter()
        self._guesses = lookup  # lookup guesses per lead step now
        # A pass of several rows runs fused (one call of the C stack: each linear one matmul
        # over all rows, each row attending to its own session's slab) where the C stack runs
        # the target; elsewhere stacked (one transformers forward, caches left-padded) or
        # serial (each row a forward of its own), whichever has cost less per position lately.
        # ``fused = False`` leaves the fused pass out (benches compare the modes).
        self.fused = True
        self.pass_cost: dict[str, float] = {}  # "stacked" / "serial" -> s per position (EWMA)
        self._multi_passes = 0
        self._mode = "one"  # the pass under way: "one" (a single row), "fused", "serial", "stacked"
        self.sessions: dict[str, Session] = {}
        self.stats = {"batches": 0, "blocks": 0, "stale": 0, "accepted": 0, "drafted": 0}
        self.stats.update(lead=0, superseded=0, sessions=0, prefill_tokens=0, prefix_hit_tokens=0)
        self.stats.update(lookup_guessed=0, lookup_accepted=0)
        # KV of closed sessions' tokens: a session on a known prefix prefills only the rest.
        self.prefix = PrefixKV(self.model_id, prefix_cache_tokens)
        # Measured speeds (EWMA), advertised with the verifier's digest (speculation/advert.py).
        self.timing = {"batch_s": 0.0, "prefill_s_per_token": 0.0}
        self._reaction_s = 0.0  # the last session's measured reaction (see ``_refill``)
        self.on_open: Callable[[list[int]], None] | None = None  # each session's prompt
        # None in the queue is a wake-up: a session may lead now (opened, or its block returned)
        self._send, self._recv = trio.open_memory_channel[Waiter | None](math.inf)
        self._device = trio.Lock()  # one forward at a time: prefill or batch

    # -- sessions

    async def open_session(
        self,
        prompt: list[int],
        options: SamplingOptions,
        model_id: str | None = None,
        *,
        lead: int = 0,
        on_lead: Callable[[Lead | VerifierError], None] | None = None,
    ) -> str:
        """Prefill ``prompt``; returns the session id. ``lead`` (clamped to ``max_lead``) needs
        ``on_lead``: see the module contract."""
        if isinstance(lead, bool) or not isinstance(lead, int) or lead < 0:
            raise BadRequest(f"lead must be an int >= 0, got {lead!r}")
        if lead and on_lead is None:
            raise BadRequest("lead > 0 needs on_lead, the callback that receives lead tokens")
        if model_id is not None and model_id != self.model_id:
            raise WrongModel(f"this verifier serves {self.model_id}, not {model_id}")
        self._reap_idle()
        if len(self.sessions) >= self.max_sessions:
            raise VerifierFull(f"verifier is at its {self.max_sessions} sessions: retry later")
        if not prompt:
            raise BadRequest("prompt is empty: send at least one token id")
        if len(prompt) + 1 > self.max_tokens:
            raise SessionLimit(f"prompt of {len(prompt)} tokens exceeds {self.max_tokens - 1}")
        self._check_ids(prompt, "prompt")
        sid = secrets.token_hex(8)
        generator, lead = make_generator(options.seed), min(lead, self.max_lead)
        # The session's cache holds all its tokens but the last, which the first block (or,
        # leading, the prefill itself) runs: at most len(prompt) - 1 come from the prefix cache.
        cache, hit = self.prefix.take(prompt, keep_last=1)
        first: int | None = None
        t0 = time.perf_counter()
        async with self._device:
            if lead:  # the prefill's last logits give the first token: a lead at once
                first = await trio.to_thread.run_sync(
                    prefill, self.target.model, self.device, cache, prompt[hit:], options, generator
                )
            elif len(prompt) - 1 > hit:
                await trio.to_thread.run_sync(
                    prefill, self.target.model, self.device, cache, prompt[hit:-1]
                )
        computed = (len(prompt) if lead else len(prompt) - 1) - hit
        if computed > 0:
            self._observe("prefill_s_per_token", (time.perf_counter() - t0) / computed)
        if self.on_open is not None:
            self.on_open(prompt)
        self.stats["sessions"] += 1
        self.stats["prefix_hit_tokens"] += hit
        self.stats["prefill_tokens"] += computed
        if computed > 0:
            self.prefix.keep(prompt, cache)
        if len(self.sessions) >= self.max_sessions:  # others opened while we prefilled
            raise VerifierFull(f"verifier is at its {self.max_sessions} sessions: retry later")
        s = Session(
            sid,
            options,
            list(prompt),
            cache,
            generator,
            trio.current_time(),
            lead=lead,
            on_lead=on_lead,
            reaction_s=self._reaction_s,  # other sessions' figure until this one measures its own
        )
        if self.lookup:
            s.lookup = NgramIndex(self.lookup_ngram)
            s.lookup.extend(prompt)
        s.refill = s.lead_left = self._refill(s)
        self.sessions[sid] = s
        if first is not None:
            lead_step = (Lead(len(prompt), first),)
            tally = (("lead", 1),)
            self._apply([Outcome(s, None, lead_step, (first,), s.lead_left - 1, tally)])
            s.broke_at = (s.committed_len, trio.current_time())  # the edge drafts from here
        if s.lead_left:
            self._send.send_nowait(None)
        return sid

    def _refill(self, s: Session) -> int:
        """The lead budget a break refills: ``s.lead``, or the lead steps that fit in the
        session's measured reaction (+1), so that the verifier keeps decoding until the edge's
        block drafted after the break can be there, and no longer (at most ``max_lead``).
        Why: a fixed budget of 8 covered ~200 ms of lead steps here; at 200 ms RTT the edge's
        next block came ~300 ms after a break and the verifier sat idle for the difference,
        every break (inter-token 37 ms after the first against 22 ms at 0 ms RTT). Leading
        longer than the reaction costs the edge's block a wait behind lead steps instead.
        The budget counts tokens: where lead steps accept prompt-lookup guesses, the steps that
        fit are scaled by the tokens a lead step has committed on average."""
        step = self.timing["batch_s"]
        if not s.lead or s.reaction_s <= 0 or step <= 0:
            return s.lead
        lead, extra = self.stats["lead"], self.stats["lookup_accepted"]
        per_step = lead / (lead - extra) if lead > extra else 1.0
        return min(self.max_lead, max(s.lead, math.ceil(s.reaction_s / step * per_step) + 1))

    def _observe(self, key: str, value: float) -> None:
        old = self.timing[key]
        self.timing[key] = value if old == 0.0 else 0.8 * old + 0.2 * value

    def close_session(self, sid: str) -> None:
        s = self.sessions.pop(sid, None)
        if s is not None and not s.busy:  # a busy cache is being cropped by a forward pass
            self.prefix.keep(s.tokens[:-1], s.cache)  # the next turn of a chat starts here

    def _reap_idle(self) -> None:
        now = trio.current_time()
        for sid, s in list(self.sessions.items()):
            if not s.busy and now - s.last_used > self.idle_timeout_s:
                self.close_session(sid)

    def _check_ids(self, ids: list[int] | tuple[int, ...], what: str) -> None:
        bad = [
            t
            for t in ids
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise BadBlock(f"{what} has token ids outside [0, {self.vocab_size}): {bad[:3]}")

    # -- verification

    async def verify(self, sid: str, block: Block) -> BlockResult:
        s = self.sessions.get(sid)
        if s is None:
            raise UnknownSession(f"session {sid} is closed or expired: open a new one")
        if s.busy:
            raise SessionBusy(f"session {sid} already has a block in flight: wait for its result")
        s.last_used = trio.current_time()
        self._validate(s, block)
        if s.broke_at is not None and block.base_len >= s.broke_at[0]:  # drafted after it
            gap = s.last_used - s.broke_at[1]
            s.reaction_s = gap if s.reaction_s <= 0 else 0.5 * (s.reaction_s + gap)
            self._reaction_s = s.reaction_s
            s.refill, s.broke_at = self._refill(s), None
        waiter = Waiter(s, block)
        s.busy = True
        self._send.send_nowait(waiter)
        try:
            await waiter.done.wait()
        finally:
            # Cleared here, not in the batching loop: the caller sends this result before the
            # loop can see the session idle and commit a lead token after it (commit order).
            if waiter.done.is_set():
                s.busy = False
                if s.lead_left:
                    self._send.send_nowait(None)
            else:
                waiter.abandoned = True
        s.last_used = trio.current_time()
        if isinstance(waiter.answer, VerifierError):
            raise waiter.answer
        assert waiter.answer is not None
        return self._advise(s, block, waiter.answer)

    def _advise(self, s: Session, block: Block, answer: BlockResult) -> BlockResult:
        """The answer with the draft tokens the verifier wants in the session's next blocks."""
        if self.sizer is None:
            return answer
        s.meter.observe(len(block.tokens), answer.accepted)
        own = len(block.tokens) + 1 if not answer.stale else 0
        return dataclasses.replace(answer, want=self.sizer.want(s.meter.alpha, own))

    def _validate(self, s: Session, block: Block) -> None:
        k = len(block.tokens)
        if k > self.max_block:
            raise BadBlock(f"block of {k} tokens exceeds the limit of {self.max_block}")
        self._check_ids(block.tokens, "block")
        if s.committed_len + 1 > self.max_tokens or block.base_len + k + 1 > self.max_tokens:
            raise session_limit(self.max_tokens)
        q = block.draft_probs
        if q is not None and (q.shape != (k, self.vocab_size) or not bool(torch.isfinite(q).all())):
            raise BadBlock(
                f"draft_probs must be finite [{k}, {self.vocab_size}], got {tuple(q.shape)}"
            )
        if q is not None and k and bool((q[torch.arange(k), list(block.tokens)] <= 0).any()):
            raise BadBlock("a draft token has draft probability 0: draw each token from its q row")

    # -- the batching loop

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """The verifier's batching loop; start it in a nursery before calling ``verify``.
        Each turn: the queued blocks and the sessions free to lead become a ``BatchPlan``; its
        rows go through ONE forward pass (in a worker thread) and are accepted; every outcome,
        computed or decided without computing, is then applied (see the module contract)."""
        task_status.started()
        while True:
            waiting = await self._gather()
            batch = plan(waiting, self._leaders(), self.max_batch, self.max_tokens, self._guesses)
            if batch.decided:
                # Blocks answered without computing (stale, superseded, decided by leads) are
                # answered before the pass, so their sessions lead in it instead of sitting it
                # out: after a rejection the edge's next block in flight is stale, and each
                # such session missed a whole pass.
                self._apply(batch.decided)
                await self._let_answered_callers_run(batch.decided)
                rest = [r.waiter for r in batch.rows if r.waiter is not None]
                more = self._drain(self.max_batch - len(rest))
                batch = plan(
                    rest + more, self._leaders(), self.max_batch, self.max_tokens, self._guesses
                )
            outcomes = list(batch.decided)
            if batch.rows:
                self._mode = self._pick_mode(batch.rows)
                async with self._device:
                    t0 = time.perf_counter()
                    computed = await trio.to_thread.run_sync(self._compute, batch.rows)
                    seconds = time.perf_counter() - t0
                    self._observe("batch_s", seconds)
                outcomes += computed
                self._measure(batch.rows, computed, seconds)
            self._apply(outcomes)
            await self._let_answered_callers_run(outcomes)

    async def _let_answered_callers_run(self, outcomes: list[Outcome]) -> None:
        """Let the callers just answered clear their sessions' ``busy`` before the next plan.

        Why: a caller clears it (``verify``), and a plan made before those tasks ran leaves
        each such session out (neither a block nor free to lead). Before a pass this is what
        lets a session whose stale block was just answered lead in it (at 4 tenants and
        100 ms RTT, rows a pass 2.2 -> 3.4 of 3.4 open sessions); after a pass it measured no
        change on its own, and costs a checkpoint. Bounded: trio runs the woken tasks in the
        next batch, in any order."""
        answered = [o.session for o in outcomes if o.waiter is not None]
        for _ in range(4):
            if not any(s.busy for s in answered):
                return
            await trio.lowlevel.checkpoint()

    def _fuses(self) -> bool:
        """Whether a pass of several rows runs fused (see ``__init__``)."""
        model = self.target.model
        return self.fused and _kernels.enabled() and _fastpath.plan(model) is not None

    def _pick_mode(self, rows: list[Row]) -> str:
        """Fused wherever it runs: one read of each weight for all rows, where serial reads
        them once a row. Else serial or stacked: each tried once, then the cheaper per
        position, the other every ``PROBE_EVERY``-th pass (costs move with contexts). On the
        2-core CPU stacked (transformers, caches copied into a padded batch) took ~120 ms for
        3 rows of ~400-token chats, serial ~22 ms a row; on a GPU it costs about one row."""
        if len(rows) == 1:
            return "one"
        if self._fuses():
            return "fused"
        self._multi_passes += 1
        for mode in ("stacked", "serial"):
            if mode not in self.pass_cost:
                return mode
        best = min(self.pass_cost, key=self.pass_cost.__getitem__)
        if self._multi_passes % PROBE_EVERY == 0:
            best = "serial" if best == "stacked" else "stacked"
        return best

    def _measure(self, rows: list[Row], computed: list[Outcome], seconds: float) -> None:
        """Feed one pass to the pass-mode choice and to the block-size control (which also
        sizes the lead steps' lookup guesses)."""
        positions = sum(len(r.inputs) for r in rows)
        mode = self._mode
        if mode in ("serial", "stacked"):
            old, new = self.pass_cost.get(mode), seconds / positions
            self.pass_cost[mode] = new if old is None else 0.7 * old + 0.3 * new
        if self.sizer is None:
            return
        committed = sum(len(o.commit) for o in computed)
        if mode == "serial":  # each row was a pass of its own: its free positions are its own
            n = len(rows)
            self.sizer.observe_pass(positions / n, seconds / n, committed / n)
        else:
            self.sizer.observe_pass(positions, seconds, committed)
        for r, o in zip(rows, computed, strict=True):
            if r.waiter is None and r.guess:  # a lead step's guesses: accepted = commit - 1
                self._lookup_meter.observe(len(r.guess), max(0, len(o.commit) - 1))
        if self.lookup:
            want = self.sizer.want(self._lookup_meter.alpha, 1 + self._guesses)
            self._guesses = min(self.lookup, want)

    async def _gather(self) -> list[Waiter]:
        """Blocks queued by ``verify`` (up to ``max_batch``, waiting ``max_wait_s`` for more).
        While no session may lead, it first waits for a block or a wake-up (reaping idle
        sessions now and then) and returns nothing if none came."""
        got: list[Waiter | None] = []
        leaders = self._leaders()
        if not leaders:
            with trio.move_on_after(max(self.idle_timeout_s / 4, 0.05)):
                got.append(await self._recv.receive())
            self._reap_idle()
            if not got:
                return []
        # Waiting is for blocks of sessions that would otherwise sit out this pass. A leading
        # session's block loses nothing by coming one step later (it is compared with the lead,
        # the target's own token), so with no other session to wait for a lead step starts at
        # once: the 2 ms wait was ~8% of each lead step of a lone session.
        quiet = {w.session.sid for w in got if w is not None} | {s.sid for s in leaders}
        if all(s.busy or s.sid in quiet for s in self.sessions.values()):
            ready = [w for w in got if w is not None]
            return ready + self._drain(self.max_batch - len(ready))
        deadline = trio.current_time() + self.max_wait_s
        while sum(w is not None for w in got) < self.max_batch:
            try:
                got.append(self._recv.receive_nowait())
                continue
            except trio.WouldBlock:
                pass
            if trio.current_time() >= deadline:
                break
            with trio.move_on_at(deadline):
                got.append(await self._recv.receive())
        return [w for w in got if w is not None]

    def _drain(self, limit: int) -> list[Waiter]:
        """Whatever is queued already (at most ``limit`` blocks), without waiting."""
        got: list[Waiter] = []
        while len(got) < limit:
            try:
                w = self._recv.receive_nowait()
            except trio.WouldBlock:
                break
            if w is not None:
                got.append(w)
        return got

    def _leaders(self) -> list[Session]:
        """The sessions free to lead now; one at its token limit is told leading stops."""
        free, at_limit = may_lead(self.sessions.values(), self.max_tokens)
        self._apply([Outcome(s, None, session_limit(self.max_tokens)) for s in at_limit])
        return free

    def _apply(self, outcomes: list[Outcome]) -> None:
        """Commit each outcome to its session (tokens, the cache cropped to them, lead budget,
        counts), then answer its waiter or tell the session's ``on_lead``."""
        for o in outcomes:
            s = o.session
            if o.cache is not None:
                s.cache = o.cache
            s.tokens += o.commit
            if s.lookup is not None:
                s.lookup.extend(o.commit)
            # Rejected draft tokens leave the cache (and whatever a failed pass appended).
            extra = s.cache.get_seq_length() - (s.committed_len - 1)
            if extra > 0:
                s.cache.crop(-extra)
            if o.lead_left is not None:
                s.lead_left = o.lead_left
            # Timed from the first break no fresh block has answered yet: a stale block arriving
            # later must not restart the clock, or the reaction (and the budget) reads short.
            if o.refilled and s.broke_at is None:
                s.broke_at = (s.committed_len, trio.current_time())
            for key, value in o.tally:
                self.stats[key] += value
                if key in s.counts:
                    s.counts[key] += value
            if o.waiter is None:
                for news in o.answer if isinstance(o.answer, tuple) else (o.answer,):
                    self._tell(s, news)
                continue
            o.waiter.answer = o.answer  # type: ignore[assignment]
            if o.waiter.abandoned:
                s.busy = False
            o.waiter.done.set()

    def _tell(self, s: Session, news: Lead | BlockResult | VerifierError) -> None:
        """Hand a lead token (or why leading stopped) to the session's callback."""
        if s.on_lead is None or s.sid not in self.sessions:
            return
        if not isinstance(news, Lead):
            s.lead_left = 0
        try:
            s.on_lead(news)  # type: ignore[arg-type]
        except Exception:  # the session's consumer is gone (closed channel, ...): stop leading
            s.lead_left = 0

    # -- worker-thread side (no trio calls below)

    @torch.inference_mode()
    def _compute(self, rows: list[Row]) -> list[Outcome]:
        """One forward pass over ``rows``, then each row's acceptance."""
        try:
            forwards = self._forward(rows)
        except Exception as exc:  # a bug must not kill the loop nor hang the callers
            return [failed(row, exc) for row in rows]
        self.stats["batches"] += 1
        return accept(rows, forwards)

    def _forward(self, rows: list[Row]) -> list[tuple[torch.Tensor, DynamicCache]]:
        """Each row's logits at its inputs and its cache after them (``_passes.py``)."""
        got, self._mode = forward_rows(self.target.model, self.device, rows, self._mode)
        return got
