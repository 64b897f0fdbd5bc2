"""The inference engine: a trio scheduler over one model, with an exact radix prefix cache.

One file (~650 lines) on purpose: admission, chunked prefill, batched decode, scoring and the
cache's pins all act on the one scheduler loop's requests; the compute lives behind the
``Backend`` seam (``_backend.py``), the cache in ``radix.py``, costs in ``costmodel.py``.

Contract:
- ``async with open_engine(loaded, cache_budget_tokens=..., max_batch=...) as engine:`` starts
  the scheduler task (and, unless ``calibrate=False``, a ~1-2 s cost-model calibration). On exit
  the scheduler stops; unfinished requests fail with ``EngineClosed``.
- ``await engine.generate(prompt_ids, params)`` -> ``GenerationResult``; ``engine.stream(...)``
  -> ``TokenStream``, an async iterator of token ids whose ``.result`` is set once it ends.
  Both validate synchronously and raise ``EngineError`` subclasses (EmptyPrompt, PromptTooLong,
  InvalidToken, InvalidParams) without disturbing other requests. ``params`` may be a
  ``SamplingParams``, a mapping of its fields (unknown names rejected) or ``None``.
- Output ``tokens`` include the stop token (EOS or one of ``stop_token_ids``) when
  ``finish_reason == "stop"``; otherwise ``finish_reason == "length"``.
- Scheduling: up to ``max_batch`` requests run at once, the rest wait FIFO. Each iteration runs,
  in one worker thread (``trio.to_thread.run_sync``, so the caller's loop stays responsive):
  admission of waiting requests (radix match + lock + KV copy), ONE prefill chunk of one
  prefilling request (round robin; ``prefill_chunk`` tokens while others decode, up to
  ``solo_chunk`` when alone), and ONE batched decode step of every decoding request.
- Cache: the longest cached prefix is reused (always leaving >= 1 prompt token to compute);
  a prefilling prompt's whole blocks are inserted chunk by chunk, the prompt once prefilled,
  pinned until the request ends, when prompt + output (minus the last token, which has no KV
  yet) is inserted and unpinned. A waiting request that would compute a block or more that a
  running prefill is computing waits (keeping its place in the queue, not a slot) until those
  blocks are in the tree: a burst sharing a new prefix computes it once.
  ``cached_tokens`` in the result is the prompt tokens served from the cache.
- ``params.logprobs`` set: each sampled token's ``TokenLogprob`` (``sampling.token_logprob`` of
  the logits it was sampled from) is in ``stream.logprobs[i]`` by the time token ``i`` is
  received, and in ``result.logprobs``.
- ``engine.totals``: running counts (prompt tokens admitted, of which cached, tokens generated,
  requests finished) for dashboards; they never reset.
- Block events from the radix tree are delivered to ``add_block_listener`` callbacks on the
  trio thread, after the step that caused them.
- ``await engine.score(prompt_ids, answer_ids)`` -> rows ``[len(answer), V]``: row ``i`` is
  the logits for ``answer[i]`` given ``prompt + answer[:i]``, from ONE prefill of
  ``prompt + answer[:-1]`` on the longest cached prefix of the prompt (an audit of someone
  else's answer costs the uncached part of the prompt plus the answer); it is scheduled as a
  prefill among the other requests and leaves what it computed in the cache.
- ``backend="emulated"`` replaces forwards with cost-model delays (fake tokens, real tree).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from p2pnode.inference._backend_protocol import Backend, Logits, Rows
from p2pnode.inference._errors import EmptyPrompt, EngineClosed
from p2pnode.inference._front import EngineFront, TokenStreamBase
from p2pnode.inference.blockhash import BLOCK_SIZE, BlockEvent
from p2pnode.inference.costmodel import (
    CostModel,
    calibrate,
    load_calibration,
    recalibrate_when_idle,
    save_calibration,
)
from p2pnode.inference.emulated import EmulatedBackend
from p2pnode.inference.lengths import OutputLengths
from p2pnode.inference.radix import LockHandle, RadixCache
from p2pnode.inference.sampling import (
    SamplingParams,
    TokenLogprob,
    sample_token,
    token_logprob,
)

if TYPE_CHECKING:
    import random

    import torch

    from p2pnode.inference.models import LightModel, LoadedModel, ShapeOnlyModel

# Waiting requests compared with this many requests ahead of them for a shared prefix (bounds
# the cost of a decision; queues deeper than this are already far past any forward's cost).
_SHARED_PREFIX_LOOKBACK = 8
# Waiting requests the scheduler considers for a free slot each step: one held back for a
# prefix being prefilled lets the ones behind it in, up to this far back.
_ADMIT_LOOKAHEAD = 32


# The one source of these defaults: the node's settings (bootstrap/config.py) and the trial
# specs read them from here.
DEFAULT_CACHE_BUDGET_TOKENS = 32_768  # ~1.5 GB of fp32 KV for SmolLM2-135M at most
DEFAULT_MAX_BATCH = 4


def _shared_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slice equality (C speed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class GenerationResult:
    tokens: list[int]
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    total_s: float
    finish_reason: str  # "stop" | "length"
    request_id: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token when params.logprobs is set

    @classmethod
    def of(
        cls,
        req: _Finished,
        finish_reason: str,
        request_id: int,
        *,
        now: float,
        logprobs: list[TokenLogprob] | None = None,
    ) -> GenerationResult:
        """The result of a finished request of either engine (its timings measured at ``now``)."""
        return cls(
            tokens=list(req.tokens),
            prompt_tokens=len(req.prompt),
            cached_tokens=req.cached,
            ttft_s=(req.t_first or now) - req.t_submit,
            total_s=now - req.t_submit,
            finish_reason=finish_reason,
            request_id=request_id,
            logprobs=logprobs,
        )


class _Finished(Protocol):
    """What a result is made of: an engine's request as it ends."""

    tokens: list[int]
    prompt: list[int]
    cached: int
    t_first: float | None
    t_submit: float


@dataclass(eq=False)
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    gen: torch.Generator | random.Random
    send: trio.MemorySendChannel
    t_submit: float
    tokens: list[int] = field(default_factory=list)
    fresh: list[int] = field(default_factory=list)  # sampled this step, not yet streamed
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when params.logprobs is set
    state: object = None
    handle: LockHandle | None = None
    cached: int = 0
    pos: int = 0  # prompt tokens that have KV
    t_first: float | None = None
    finish_reason: str | None = None
    result: GenerationResult | None = None
    error: BaseException | None = None
    cancelled: bool = False
    done: trio.Event = field(default_factory=trio.Event)
    # A score request (``Engine.score``): the first position whose logits it returns, and
    # those logits as computed, chunk by chunk. None for a generation.
    score_from: int | None = None
    rows: list[Rows] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.prompt)


class TokenStream(TokenStreamBase):
    """Async iterator of generated token ids; ``result`` is set after the last one."""

    def _cancel(self) -> None:
        self._req.cancelled = True
        self._engine._wake()

    def _ended(self) -> bool:
        return self._req.done.is_set()

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """Log-probabilities of the tokens so far (empty unless ``params.logprobs`` is set)."""
        return self._req.logprobs


class Engine(EngineFront):
    """See the module contract. Build it with ``open_engine``."""

    def __init__(
        self,
        loaded: LoadedModel | LightModel | ShapeOnlyModel,
        *,
        cache_budget_tokens: int | None = None,
        cache_budget_bytes: int | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        prefill_chunk: int = 128,
        solo_chunk: int = 1024,
        backend: str | Backend = "hf",
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk < 1 or solo_chunk < prefill_chunk:
            raise ValueError("need 1 <= prefill_chunk <= solo_chunk")
        self.loaded = loaded
        self.model_id = loaded.model_id
        self.tokenizer = loaded.tokenizer
        self.context_length = loaded.context_length
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.solo_chunk = solo_chunk
        self.cost = CostModel()
        self.lengths = OutputLengths()
        if backend == "hf":
            from p2pnode.inference._backend import HFBackend

            self._backend: Backend = HFBackend(loaded.model)
        elif backend == "emulated":
            eos = min(self.eos_token_ids) if self.eos_token_ids else None
            # The emulated forward sleeps what this model says; folding those measured sleeps
            # (plus scheduling lag) back in would ratchet the cost up with every request
            # (seen: prefill 2.3 -> ~6 ms/token in one trial at load 14). Frozen after
            # calibration, the emulated hardware keeps one speed for the whole run.
            self.cost.alpha = 0.0
            self._backend = EmulatedBackend(self.vocab_size, self.cost, eos)
        elif isinstance(backend, str):
            raise ValueError(f"unknown backend {backend!r}: use 'hf' or 'emulated'")
        else:
            self._backend = backend
        self.tree = RadixCache(
            self.model_id, max_tokens=cache_budget_tokens, max_bytes=cache_budget_bytes
        )
        self._events: list[BlockEvent] = []
        self.tree.add_listener(self._events.append)
        self._listeners: list[Callable[[BlockEvent], None]] = []
        self._waiting: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._ids = itertools.count(1)
        self._rr = 0
        # The step in progress: the request it prefills and how many of its tokens, and when
        # it should end by the cost model (a new request's wait starts with the rest of it).
        self._step_prefill: tuple[_Request, int] | None = None
        self._step_end = 0.0
        self._idle_since = time.perf_counter()  # when the engine last ran out of work
        # Held while the backend computes: a step, or a measurement of it (recalibration).
        self.compute = trio.Lock()
        self._wakeup = trio.Event()
        self._closed = False
        self.steps = 0
        self.totals = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "requests": 0}

    # ---- cache views (cached_prefix_len, cached_block_hashes: EngineFront) ----------------
    @property
    def kv_bytes_per_token(self) -> int:
        return self._backend.kv_bytes_per_token

    @property
    def backend(self) -> Backend:
        """The compute backend (audits score answers with the same model, see scoring.py)."""
        return self._backend

    def _make_generator(self, seed: int | None) -> torch.Generator | random.Random:
        return self._backend.make_generator(seed)

    def _no_grad(self) -> contextlib.AbstractContextManager:
        return self._backend.no_grad()

    # ---- load views ------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Requests in the engine: waiting for a slot plus running."""
        return len(self._waiting) + len(self._active)

    def idle_for_s(self) -> float:
        """Seconds since the engine last had a request (0 while it has one)."""
        return 0.0 if self.queue_depth else time.perf_counter() - self._idle_since

    def estimated_wait_s(self, prefill_tokens: int | None = None) -> float:
        """Rough seconds a new request loses to the work already here.

        Without ``prefill_tokens``: the prefill work ahead of it (remaining prompt tokens of
        running and waiting requests) plus, when all ``max_batch`` slots are taken, the decode
        time until enough slots free up; a bound for any request (digests advertise it). A
        waiting request's prefix shared with one ahead of it counts as cached: that one inserts
        it before the waiting one is admitted (a burst of same-subject prompts is one prefill,
        not one per request; counting each as a miss overstated the local wait ~1.3 s in
        200 ms trials and sent requests on forwards that lost).

        With ``prefill_tokens`` (the uncached prompt tokens of the request in question) and a
        free slot: the scheduler admits it at the next step and runs the prefills round robin,
        ``prefill_chunk`` tokens each, so it waits for the rest of the step in progress and
        then for one chunk of each other prefill per chunk of its own, not for the whole
        backlog. Never more than the bound above. A cached request behind a long miss waited
        ~0.1 s where the bound said 2-3 s, and the router sent it away on forwards that lost.
        """
        backlog, remaining = self._prefill_backlog()
        fifo = self._fifo_wait_s(backlog)
        if prefill_tokens is None or self.queue_depth >= self.max_batch:
            return fifo
        c = self.cost
        chunk = self.prefill_chunk
        turns = max(1, math.ceil(prefill_tokens / chunk))
        interleaved = [min(r, turns * chunk) for r in remaining if r > 0]
        others_chunks = sum(math.ceil(t / chunk) for t in interleaved)
        steps = turns + others_chunks  # each also decodes one token of every decoding request
        decoding = [
            self.lengths.remaining(len(r.tokens), r.params.max_tokens)
            for r in self._active
            if not r.prefilling
        ]
        wait = (
            max(0.0, self._step_end - time.perf_counter())
            + sum(interleaved) * c.prefill_s_per_token
            + others_chunks * c.overhead_s
            + min(steps, max(decoding, default=0)) * c.decode_s_per_token
        )
        return min(fifo, wait)

    def _prefill_backlog(self) -> tuple[int, list[int]]:
        """Prompt tokens still to prefill ahead of a new request: the total and per request
        (a waiting request's prefix shared with one ahead of it counts as cached)."""
        remaining = [len(r.prompt) - r.pos - self._in_step(r) for r in self._active]
        ahead_prompts = [r.prompt for r in self._active]
        for r in self._waiting:
            reuse = self.tree.prefix_len(r.prompt)
            for p in ahead_prompts[-_SHARED_PREFIX_LOOKBACK:]:
                reuse = max(reuse, _shared_prefix_len(r.prompt, p))
            remaining.append(len(r.prompt) - reuse)
            ahead_prompts.append(r.prompt)
        return sum(len(r.prompt) - r.pos for r in self._active) + sum(
            remaining[len(self._active) :]
        ), remaining

    def _in_step(self, req: _Request) -> int:
        """Prompt tokens of ``req`` the step in progress is prefilling (0 when none)."""
        if self._step_prefill is None or self._step_prefill[0] is not req:
            return 0
        return self._step_prefill[1]

    def _fifo_wait_s(self, backlog: int) -> float:
        c = self.cost
        wait = backlog * c.prefill_s_per_token
        ahead = len(self._waiting) + len(self._active) - self.max_batch + 1
        if ahead > 0:
            left = sorted(
                self.lengths.remaining(len(r.tokens), r.params.max_tokens) for r in self._active
            )
            rounds, rest = divmod(ahead - 1, self.max_batch)
            per_round = max(left) if left else 0
            slot = left[min(rest, len(left) - 1)] if left else 0
            wait += (rounds * per_round + slot) * c.decode_s_per_token + ahead * c.overhead_s
        return wait

    # ---- requests --------------------------------------------------------------------------
    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams | Mapping | None = None
    ) -> TokenStream:
        if self._closed:
            raise EngineClosed("the engine is closed")
        prompt, params = self.validate(prompt_ids, params)
        send, recv = trio.open_memory_channel[int](float("inf"))
        req = _Request(
            id=next(self._ids),
            prompt=prompt,
            params=params,
            gen=self._make_generator(params.seed),
            send=send,
            t_submit=time.perf_counter(),
        )
        self._waiting.append(req)
        self._wake()
        return TokenStream(self, req, recv)

    async def score(self, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> Rows:
        """The target's logits for each answer token (see the module contract)."""
        answer = list(answer_ids)
        if not answer:
            raise EmptyPrompt("scoring needs at least one answer token")
        prompt, _ = self.validate(prompt_ids, SamplingParams(max_tokens=len(answer)))
        answer, _ = self.validate(answer, SamplingParams(max_tokens=1))
        if self._closed:
            raise EngineClosed("the engine is closed")
        send, _recv = trio.open_memory_channel[int](float("inf"))
        req = _Request(
            id=next(self._ids),
            prompt=prompt + answer[:-1],
            params=SamplingParams(max_tokens=1),
            gen=self._make_generator(None),
            send=send,
            t_submit=time.perf_counter(),
            score_from=len(prompt) - 1,
        )
        self._waiting.append(req)
        self._wake()
        try:
            await req.done.wait()
        except BaseException:
            req.cancelled = True
            self._wake()
            raise
        if req.error is not None:
            raise req.error
        return self._backend.concat_rows(req.rows)

    # ---- scheduler -------------------------------------------------------------------------
    def _wake(self) -> None:
        self._wakeup.set()

    def _finish(self, req: _Request, error: BaseException | None = None) -> None:
        if req.handle is not None:
            req.handle.release()
            req.handle = None
        if req.state is not None:
            self._backend.free(req.state)
            req.state = None
        req.error = error
        if error is None and req.finish_reason is not None:
            logprobs = list(req.logprobs) if req.params.logprobs is not None else None
            req.result = GenerationResult.of(
                req, req.finish_reason, req.id, now=time.perf_counter(), logprobs=logprobs
            )
            if req.score_from is None:  # a score is no answer: it says nothing of lengths
                self.totals["requests"] += 1
                self.lengths.observe(len(req.tokens), hit_limit=req.finish_reason == "length")
        req.send.close()
        req.done.set()

    def _drop_cancelled(self) -> None:
        for req in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(req)
            self._finish(req, EngineClosed("cancelled"))
        for req in [r for r in self._active if r.cancelled]:
            self._active.remove(req)
            self._finish(req, EngineClosed("cancelled"))

    def _admit_one(self, req: _Request) -> None:
        m = self.tree.match(req.prompt)
        req.handle = self.tree.lock(m)
        usable = min(m.length, len(req.prompt) - 1)
        if req.score_from is not None:  # the positions it scores are computed, not cached
            usable = min(usable, req.score_from)
        kv = self.tree.gather_parts(m, usable) if usable > 0 else None
        req.state = self._backend.new_state(kv, usable, expect=len(req.prompt))
        req.cached = req.pos = usable
        self.totals["prompt_tokens"] += len(req.prompt)
        self.totals["cached_tokens"] += usable

    def _prefill(self, req: _Request, chunk_size: int) -> None:
        chunk = req.prompt[req.pos : req.pos + chunk_size]
        t0 = time.perf_counter()
        keep = 0
        if req.score_from is not None:
            keep = req.pos + len(chunk) - max(req.pos, req.score_from)
        if keep > 0:
            req.rows.append(self._backend.extend_rows(req.state, chunk, keep))
        else:
            logits = self._backend.extend(req.state, chunk)
        self.cost.observe_prefill(len(chunk), time.perf_counter() - t0)
        req.pos += len(chunk)
        if req.prefilling:
            # The whole blocks computed so far go in the tree now: a request sharing them
            # (held back by ``_waits_on_prefill``) is admitted on them as soon as they are.
            self._insert_pinned(req, req.prompt[: req.pos // BLOCK_SIZE * BLOCK_SIZE])
            return
        self._insert_pinned(req, req.prompt)
        if req.score_from is not None:
            req.finish_reason = "scored"
            return
        self._accept(req, sample_token(logits, req.params, req.gen), logits)

    def _insert_pinned(self, req: _Request, tokens: list[int]) -> None:
        """Cache ``tokens`` (a prefix of what ``req`` has KV for) and pin them for ``req``."""
        if not tokens or (req.handle is not None and req.handle.length >= len(tokens)):
            return
        state = req.state
        self.tree.insert(tokens, lambda b, e: self._backend.export_kv(state, b, e))
        old, req.handle = req.handle, self.tree.lock(self.tree.match(tokens))
        if old is not None:
            old.release()

    def _accept(self, req: _Request, token: int, logits: Logits) -> None:
        if req.params.logprobs is not None:  # before the token: readers find it with the token
            req.logprobs.append(token_logprob(logits, token, req.params.logprobs))
        self.totals["generated_tokens"] += 1
        req.tokens.append(token)
        req.fresh.append(token)
        if token in self.eos_token_ids or token in req.params.stop_token_ids:
            req.finish_reason = "stop"
        elif len(req.tokens) >= req.params.max_tokens:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            seq = req.prompt + req.tokens[:-1]
            state = req.state
            self.tree.insert(seq, lambda b, e: self._backend.export_kv(state, b, e))

    def _take_admissible(self) -> list[_Request]:
        """Waiting requests that get the free slots now, in arrival order, moved to active.

        A request that would compute a block or more of prompt that a request being prefilled
        is computing right now stays queued (keeping its place) until that prefill puts those
        blocks in the tree: the prefix is computed once, not once per request of a burst. It
        waits no longer than computing the prefix itself would take (the other request is
        further along, and no longer shares its steps), and requests behind it that share
        nothing are admitted meanwhile."""
        admit: list[_Request] = []
        for req in list(itertools.islice(self._waiting, _ADMIT_LOOKAHEAD)):
            if len(self._active) >= self.max_batch:
                break
            if self._waits_on_prefill(req):
                continue
            self._waiting.remove(req)
            self._active.append(req)
            admit.append(req)
        return admit

    def _waits_on_prefill(self, req: _Request) -> bool:
        prefilling = [a.prompt for a in self._active if a.prefilling]
        if not prefilling:
            return False
        cached = self.tree.prefix_len(req.prompt)
        computed = len(req.prompt) - 1  # the last prompt token is always computed
        return any(
            min(_shared_prefix_len(req.prompt, p), computed) - cached >= BLOCK_SIZE
            for p in prefilling
        )

    def _step(
        self, admit: list[_Request], prefill: _Request | None, decode: list[_Request]
    ) -> None:
        """One scheduler iteration's compute (runs in a worker thread)."""
        with self._no_grad():
            for req in admit:
                self._admit_one(req)
            if prefill is not None:
                chunk = self.prefill_chunk if (decode or len(self._active) > 1) else self.solo_chunk
                self._prefill(prefill, chunk)
            if decode:
                t0 = time.perf_counter()
                logits = self._backend.decode(
                    [r.state for r in decode], [r.tokens[-1] for r in decode]
                )
                self.cost.observe_decode(time.perf_counter() - t0)
                for i, req in enumerate(decode):
                    self._accept(req, sample_token(logits[i], req.params, req.gen), logits[i])

    async def _run(self) -> None:
        while True:
            self._drop_cancelled()
            admit = self._take_admissible()
            if not self._active:
                self._idle_since = time.perf_counter()
                self._wakeup = trio.Event()
                await self._wakeup.wait()
                continue
            decode = [r for r in self._active if not r.prefilling and r not in admit]
            prefilling = [r for r in self._active if r.prefilling]
            prefill = None
            if prefilling:
                self._rr = (self._rr + 1) % len(prefilling)
                prefill = prefilling[self._rr]
            if prefill is not None:
                chunk = self.prefill_chunk if (decode or len(self._active) > 1) else self.solo_chunk
                n = min(chunk, len(prefill.prompt) - prefill.pos)
                self._step_prefill = (prefill, n)
            c = self.cost
            self._step_end = time.perf_counter() + (
                (c.overhead_s + self._step_prefill[1] * c.prefill_s_per_token if prefill else 0.0)
                + (c.decode_s_per_token if decode else 0.0)
            )
            try:
                async with self.compute:
                    await trio.to_thread.run_sync(self._step, admit, prefill, decode)
            except Exception as exc:  # a failed forward fails its batch, not the engine
                for req in set(admit + decode + ([prefill] if prefill else [])):
                    if req in self._active:
                        self._active.remove(req)
                    self._finish(req, exc)
            self._step_prefill, self._step_end = None, 0.0
            self.steps += 1
            self._deliver()
            await trio.lowlevel.checkpoint()

    def _deliver(self) -> None:
        now = time.perf_counter()
        for req in list(self._active):
            if req.fresh:
                if req.t_first is None:
                    req.t_first = now
                try:
                    for t in req.fresh:
                        req.send.send_nowait(t)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    req.cancelled = True  # the reader went away; dropped next iteration
                req.fresh.clear()
            if req.finish_reason is not None:
                self._active.remove(req)
                self._finish(req)
        events, self._events[:] = list(self._events), []
        for ev in events:
            for fn in list(self._listeners):
                fn(ev)

    def _close(self) -> None:
        self._closed = True
        for req in list(self._waiting) + self._active:
            self._finish(req, EngineClosed("the engine shut down before the request finished"))
        self._waiting.clear()
        self._active.clear()


@asynccontextmanager
async def open_engine(
    loaded: LoadedModel | LightModel | ShapeOnlyModel,
    *,
    cache_budget_tokens: int | None = DEFAULT_CACHE_BUDGET_TOKENS,
    cache_budget_bytes: int | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    prefill_chunk: int = 128,
    solo_chunk: int = 1024,
    backend: str | Backend = "hf",
    calibrate_cost: bool = True,
    torch_threads: int | None = 2,
) -> AsyncIterator[Engine]:
    """Run an ``Engine`` (scheduler task + optional calibration) for the ``async with`` body.

    The emulated backend is not measured (it would measure its own sleeps): with
    ``calibrate_cost`` it takes the calibration a real engine of the model wrote
    (``costmodel.load_calibration``); a real engine writes that file once it has measured."""
    if torch_threads and backend != "emulated":
        import torch

        torch.set_num_threads(torch_threads)
    engine = Engine(
        loaded,
        cache_budget_tokens=cache_budget_tokens,
        cache_budget_bytes=cache_budget_bytes,
        max_batch=max_batch,
        prefill_chunk=prefill_chunk,
        solo_chunk=solo_chunk,
        backend=backend,
    )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine._run)
            try:
                if calibrate_cost and backend == "emulated":  # fixed speeds: the shipped ones
                    load_calibration(engine.model_id).apply_to(engine.cost)
                elif calibrate_cost:
                    await calibrate(engine)
                    if backend == "hf":
                        save_calibration(engine.model_id, engine.cost)
                    nursery.start_soon(recalibrate_when_idle, engine)
                yield engine
            finally:
                engine._closed = True
                nursery.cancel_scope.cancel()
    finally:
        # Only after the nursery: the scheduler's worker thread has finished with the states.
        engine._close()
