"""Speculative verification: the acceptance math and a batched multi-tenant verifier.

Contract:
- ``verify_greedy(logits, draft)``: ``logits`` [k+1, V] are the target's at the positions of
  (last committed token, d_1..d_k). Accepts the longest prefix with argmax == d_i, then returns the
  target's own next token: ``(accepted, next_token)``. Output == the target's greedy decoding.
- ``verify_sampling(p, q, draft, generator)``: standard speculative rejection sampling. ``p`` [k+1, V]
  target probabilities, ``q`` [k, V] the distribution each d_i was drawn from (``None``: one-hot, for
  an argmax draft). Accept d_i with probability min(1, p/q); on rejection draw from
  norm(max(0, p - q)); if all k are accepted draw a bonus token from p[k]. The emitted tokens are
  distributed exactly as the target's samples, whatever q is.
- ``BatchedVerifier(target)``: per-session target KV caches (prompt prefilled at open). Sessions
  hold ``committed`` tokens (prompt + accepted output); the cache holds all of them but the last.
  ``await verify(session_id, block)`` queues the block; the ``run()`` task gathers queued blocks of
  different sessions (up to ``max_batch``, waiting at most ``max_wait_ms`` for more) into ONE
  forward pass of the target, then crops each cache to its accepted length.
  A block states the committed length and last token it builds on; if the session holds fewer
  tokens or another token there (the edge guessed wrong while pipelining) the result is ``stale``
  and costs nothing.
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
  accepted + 1`` with leads (``==`` without). The budget refills when the edge's pipeline breaks
  (a rejection, a stale or a superseded block) and empties on a fully accepted block, whose
  successor is usually in flight already; a block of zero tokens (nothing to accept) refills it.
- Refusals are ``VerifierError`` subclasses with a message saying what to do: ``VerifierFull``
  (max sessions), ``SessionLimit`` (max tokens per session / context), ``UnknownSession`` (closed,
  or reaped after ``idle_timeout_s``), ``SessionBusy`` (one block at a time per session),
  ``BadBlock`` / ``BadRequest`` (malformed input), ``WrongModel``, ``PeerLimited`` (the edge's
  peer went over a per-peer limit of ``overlay/limits.py``: sessions, rate, bytes in flight).

Device: inputs are built on the target's device (a CUDA target needs no wrapper); greedy
acceptance runs there, sampling copies the few logit rows to the CPU and draws with the
session's seeded CPU generator. (Not yet run on a GPU: `make gpu-check` is the check for a GPU machine.)

Batching choice: each session keeps its own ``DynamicCache``; a batch stacks them LEFT-padded to
the longest cache and RIGHT-pads the new tokens, with a 2-D attention mask hiding both pads and
explicit per-row position ids (true positions). Cached keys already carry their RoPE rotation, so
moving them in storage changes nothing: the math equals each session's own forward; only float
summation order may differ (logits agree to ~1e-5). After the pass each session's rows are sliced
back out (pads dropped) up to its accepted length. A batch of one uses the session cache directly.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import trio
from transformers import DynamicCache

from p2pnode.inference.models import LoadedModel
from p2pnode.inference.sampling import make_generator, probs_from_logits
from p2pnode.speculation._prefix import PrefixKV


class VerifierError(Exception):
    """A verification request refused; the message says what to change."""


class VerifierFull(VerifierError):
    pass


class SessionLimit(VerifierError):
    pass


class UnknownSession(VerifierError):
    pass


class SessionBusy(VerifierError):
    pass


class BadBlock(VerifierError):
    pass


class BadRequest(VerifierError):
    pass


class WrongModel(VerifierError):
    pass


class PeerLimited(VerifierError):
    """Over a per-peer limit (open sessions, opens or blocks per second, bytes in flight)."""


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, int | float) or not (0 <= t < math.inf):
            raise BadRequest(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0 < p <= 1):
            raise BadRequest(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise BadRequest(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Block:
    number: int
    base_len: int  # committed tokens (prompt + output) the block builds on
    base_token: int  # the last of them, as the edge believes it to be
    tokens: tuple[int, ...]
    draft_probs: torch.Tensor | None = None  # [len(tokens), V] fp32, sampling only


@dataclass(frozen=True)
class Lead:
    """A token the verifier committed on its own while no block of the session was waiting."""

    position: int  # its index in the session's tokens (prompt + output)
    token: int


@dataclass(frozen=True)
class BlockResult:
    number: int
    accepted: int  # -1: stale block, nothing verified
    next_token: int  # the target's token after the accepted prefix; -1 when stale
    committed_len: int  # the session's committed length after this block

    @property
    def stale(self) -> bool:
        return self.accepted < 0


# ---------------------------------------------------------------- the math


def verify_greedy(logits: torch.Tensor, draft: list[int] | tuple[int, ...]) -> tuple[int, int]:
    best = logits.argmax(-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return n, best[n]


def verify_sampling(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft: list[int] | tuple[int, ...],
    generator: torch.Generator,
) -> tuple[int, int]:
    for i, d in enumerate(draft):
        qd = 1.0 if q is None else float(q[i, d])
        if qd <= 0:
            raise BadBlock(
                f"draft token {i} ({d}) has draft probability 0: it was not drawn from q"
            )
        if float(torch.rand((), generator=generator)) * qd < float(p[i, d]):
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0
        else:
            residual = (p[i] - q[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q on the support: any draw from p is exact
            residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))


def truncate_probs(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Keep each row's ``k`` most likely tokens, renormalized (a valid, wire-cheap proposal q)."""
    if k >= probs.shape[-1]:
        return probs
    vals, idx = probs.topk(k, dim=-1)
    out = torch.zeros_like(probs).scatter_(-1, idx, vals)
    return out / out.sum(-1, keepdim=True)


# ---------------------------------------------------------------- the batched verifier


@dataclass
class _Session:
    sid: str
    options: SamplingOptions
    tokens: list[int]  # committed: prompt + output; the cache holds all but the last
    cache: DynamicCache
    generator: torch.Generator
    last_used: float
    lead: int = 0  # tokens it may commit on its own after each block
    lead_left: int = 0
    on_lead: Callable[[Lead | VerifierError], None] | None = None
    busy: bool = False  # a block submitted and not yet returned to its caller
    # What this session's blocks and leads did (the console shows them per session).
    counts: dict[str, int] = field(
        default_factory=lambda: {"blocks": 0, "accepted": 0, "drafted": 0, "lead": 0}
    )

    @property
    def committed_len(self) -> int:
        return len(self.tokens)

    @property
    def last_token(self) -> int:
        return self.tokens[-1]


@dataclass
class _Pending:
    """One session's row of a batch: a block to verify, or (``block`` None) a lead step."""

    session: _Session
    block: Block | None
    done: trio.Event = field(default_factory=trio.Event)
    result: BlockResult | None = None
    error: Exception | None = None
    lead: Lead | None = None
    skip: int = 0  # draft tokens already committed by leads (compared, not recomputed)
    abandoned: bool = False  # its caller was cancelled before the result

    @property
    def draft(self) -> tuple[int, ...]:
        return () if self.block is None else self.block.tokens[self.skip :]


class BatchedVerifier:
    def __init__(
        self,
        target: LoadedModel,
        *,
        max_sessions: int = 32,
        max_tokens_per_session: int = 2048,
        max_block: int = 16,
        max_batch: int = 8,
        max_wait_ms: float = 2.0,
        idle_timeout_s: float = 120.0,
        max_lead: int = 64,
        prefix_cache_tokens: int = 8192,
    ) -> None:
        self.target = target
        self.device = _device_of(target.model)
        self.model_id = target.model_id
        self.vocab_size = target.vocab_size
        self.max_sessions = max_sessions
        self.max_tokens = min(max_tokens_per_session, target.context_length)
        self.max_block = max_block
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self.idle_timeout_s = idle_timeout_s
        self.max_lead = max_lead
        self.sessions: dict[str, _Session] = {}
        self.stats = {"batches": 0, "blocks": 0, "stale": 0, "accepted": 0, "drafted": 0}
        self.stats.update(lead=0, superseded=0, sessions=0, prefill_tokens=0, prefix_hit_tokens=0)
        # KV of closed sessions' tokens: a session on a known prefix prefills only the rest.
        self.prefix = PrefixKV(self.model_id, prefix_cache_tokens)
        # Measured speeds (EWMA), advertised with the verifier's digest (speculation/advert.py).
        self.timing = {"batch_s": 0.0, "prefill_s_per_token": 0.0}
        self.on_open: Callable[[list[int]], None] | None = None  # each session's prompt
        # None in the queue is a wake-up: a session may lead now (opened, or its block returned)
        self._send, self._recv = trio.open_memory_channel[_Pending | None](math.inf)
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
                    self._prefill_and_pick, cache, prompt[hit:], options, generator
                )
            elif len(prompt) - 1 > hit:
                await trio.to_thread.run_sync(self._prefill, cache, prompt[hit:-1])
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
        s = _Session(
            sid,
            options,
            list(prompt),
            cache,
            generator,
            trio.current_time(),
            lead=lead,
            lead_left=lead,
            on_lead=on_lead,
        )
        self.sessions[sid] = s
        if first is not None:
            s.tokens.append(first)
            s.lead_left -= 1
            self.stats["lead"] += 1
            s.counts["lead"] += 1
            self._tell(s, Lead(len(prompt), first))
        if s.lead_left:
            self._send.send_nowait(None)
        return sid

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
        item = _Pending(s, block)
        s.busy = True
        self._send.send_nowait(item)
        try:
            await item.done.wait()
        finally:
            # Cleared here, not in the batching loop: the caller sends this result before the
            # loop can see the session idle and commit a lead token after it (commit order).
            if item.done.is_set():
                s.busy = False
                if s.lead_left:
                    self._send.send_nowait(None)
            else:
                item.abandoned = True
        s.last_used = trio.current_time()
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    def _validate(self, s: _Session, block: Block) -> None:
        k = len(block.tokens)
        if k > self.max_block:
            raise BadBlock(f"block of {k} tokens exceeds the limit of {self.max_block}")
        self._check_ids(block.tokens, "block")
        if s.committed_len + 1 > self.max_tokens or block.base_len + k + 1 > self.max_tokens:
            raise SessionLimit(f"session reached its {self.max_tokens} tokens: open a new one")
        q = block.draft_probs
        if q is not None and (q.shape != (k, self.vocab_size) or not bool(torch.isfinite(q).all())):
            raise BadBlock(
                f"draft_probs must be finite [{k}, {self.vocab_size}], got {tuple(q.shape)}"
            )
        if q is not None and k and bool((q[torch.arange(k), list(block.tokens)] <= 0).any()):
            raise BadBlock("a draft token has draft probability 0: draw each token from its q row")

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """The batching loop; start it in a nursery before calling ``verify``."""
        task_status.started()
        while True:
            batch = await self._gather()
            compute = [item for item in batch if self._plan(item)]
            if compute:
                async with self._device:
                    t0 = time.perf_counter()
                    await trio.to_thread.run_sync(self._run_batch, compute)
                    self._observe("batch_s", time.perf_counter() - t0)
            for item in batch:
                self._finish(item)

    def _leaders(self, exclude: set[str]) -> list[_Session]:
        self._stop_leads_at_limit()
        return [
            s
            for s in self.sessions.values()
            if s.lead_left > 0
            and not s.busy
            and s.sid not in exclude
            and s.committed_len + 1 < self.max_tokens
        ]

    async def _gather(self) -> list[_Pending]:
        """Queued blocks of different sessions (waiting up to ``max_wait_s`` for more), then a
        lead step for each session with lead budget and no block waiting, up to ``max_batch``."""
        got: list[_Pending | None] = []
        if not self._leaders(set()):
            with trio.move_on_after(max(self.idle_timeout_s / 4, 0.05)):
                got.append(await self._recv.receive())
            self._reap_idle()
            if not got:
                return []
        deadline = trio.current_time() + self.max_wait_s
        while sum(item is not None for item in got) < self.max_batch:
            try:
                got.append(self._recv.receive_nowait())
                continue
            except trio.WouldBlock:
                pass
            if trio.current_time() >= deadline:
                break
            with trio.move_on_at(deadline):
                got.append(await self._recv.receive())
        batch = [item for item in got if item is not None]
        with_block = {item.session.sid for item in batch}
        for s in self._leaders(with_block)[: self.max_batch - len(batch)]:
            batch.append(_Pending(s, None))
        return batch

    def _plan(self, item: _Pending) -> bool:
        """Answer what needs no forward pass (stale, or decided by leads); True: compute."""
        s, block = item.session, item.block
        if block is None:
            return True
        n, base, d = s.committed_len, block.base_len, block.tokens
        if not 1 <= base <= n or s.tokens[base - 1] != block.base_token:
            s.lead_left = s.lead
            self.stats["stale"] += 1
            item.result = BlockResult(block.number, -1, -1, n)
            return False
        item.skip = min(n - base, len(d))
        for i in range(item.skip):
            if d[i] != s.tokens[base + i]:
                s.lead_left = s.lead
                self.stats["superseded"] += 1
                item.result = BlockResult(block.number, i, s.tokens[base + i], n)
                return False
        if base + len(d) < n:  # every draft token agreed with a lead; the next one is known
            item.result = BlockResult(block.number, len(d), s.tokens[base + len(d)], n)
            return False
        if n + len(item.draft) + 1 > self.max_tokens:
            item.error = SessionLimit(
                f"session reached its {self.max_tokens} tokens: open a new one"
            )
            return False
        return True

    def _finish(self, item: _Pending) -> None:
        s = item.session
        if item.block is not None:
            if item.abandoned:
                s.busy = False
            item.done.set()
        elif item.lead is not None:
            self._tell(s, item.lead)
        elif item.error is not None:  # the lead step failed: say so instead of going silent
            self._tell(s, item.error)

    def _tell(self, s: _Session, news: Lead | VerifierError) -> None:
        """Hand a lead token (or why leading stopped) to the session's callback."""
        if s.on_lead is None or s.sid not in self.sessions:
            return
        if not isinstance(news, Lead):
            s.lead_left = 0
        try:
            s.on_lead(news)
        except Exception:  # the session's consumer is gone (closed channel, ...): stop leading
            s.lead_left = 0

    def _stop_leads_at_limit(self) -> None:
        for s in self.sessions.values():
            if s.lead_left > 0 and not s.busy and s.committed_len + 1 >= self.max_tokens:
                msg = f"session reached its {self.max_tokens} tokens: open a new one"
                self._tell(s, SessionLimit(msg))

    # -- worker-thread side (no trio calls below)

    def _ids(self, rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, device=self.device)

    @torch.inference_mode()
    def _prefill(self, cache: DynamicCache, ids: list[int]) -> None:
        self.target.model(input_ids=self._ids([ids]), past_key_values=cache, use_cache=True)

    @torch.inference_mode()
    def _prefill_and_pick(
        self,
        cache: DynamicCache,
        ids: list[int],
        options: SamplingOptions,
        generator: torch.Generator,
    ) -> int:
        logits = self.target.model(
            input_ids=self._ids([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1
        ).logits[0]
        if options.greedy:
            return verify_greedy(logits, ())[1]
        p = probs_from_logits(logits.float().cpu(), options.temperature, options.top_p)
        return verify_sampling(p, None, (), generator)[1]

    def _run_batch(self, batch: list[_Pending]) -> None:
        try:
            with torch.inference_mode():
                logits = self._forward(batch)
            self.stats["batches"] += 1
            for item, lg in zip(batch, logits, strict=True):
                self._accept(item, lg)
        except Exception as exc:  # a bug must not kill the loop nor hang the callers
            for item in batch:
                if item.result is None and item.lead is None:  # leads: reported by _finish
                    item.error = VerifierError(f"verification failed: {exc!r}")

    def _forward(self, batch: list[_Pending]) -> list[torch.Tensor]:
        inputs = [[it.session.last_token, *it.draft] for it in batch]
        model = self.target.model
        if len(batch) == 1:
            cache = batch[0].session.cache
            out = model(input_ids=self._ids(inputs), past_key_values=cache, use_cache=True)
            return [out.logits[0]]
        lens = [it.session.cache.get_seq_length() for it in batch]
        lmax, nmax = max(lens), max(len(x) for x in inputs)
        cache = DynamicCache()
        if lmax:
            cache = DynamicCache(
                ddp_cache_data=[
                    _stack_left_padded(batch, lens, li, lmax)
                    for li in range(model.config.num_hidden_layers)
                ]
            )
        ids = torch.zeros(len(batch), nmax, dtype=torch.long)
        mask = torch.zeros(len(batch), lmax + nmax, dtype=torch.long)
        pos = torch.zeros(len(batch), nmax, dtype=torch.long)
        for i, (x, n) in enumerate(zip(inputs, lens, strict=True)):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, lmax - n : lmax + len(x)] = 1
            pos[i] = torch.arange(n, n + nmax)
        out = model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=pos.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        for i, (it, n) in enumerate(zip(batch, lens, strict=True)):
            rows = slice(lmax - n, lmax + len(inputs[i]))
            it.session.cache = DynamicCache(
                ddp_cache_data=[
                    (lay.keys[i : i + 1, :, rows].clone(), lay.values[i : i + 1, :, rows].clone())
                    for lay in cache.layers
                ]
            )
        return [out.logits[i, : len(x)] for i, x in enumerate(inputs)]

    def _accept(self, item: _Pending, logits: torch.Tensor) -> None:
        s, block, draft = item.session, item.block, item.draft
        if s.options.greedy:
            n, nxt = verify_greedy(logits, draft)
        else:  # on the CPU: the session's generator is a CPU one (seeded, device-independent)
            p = probs_from_logits(logits.float().cpu(), s.options.temperature, s.options.top_p)
            q = None if block is None or block.draft_probs is None else block.draft_probs
            n, nxt = verify_sampling(p, None if q is None else q[item.skip :], draft, s.generator)
        unused = len(draft) - n
        if unused:
            s.cache.crop(-unused)
        s.tokens += [*draft[:n], nxt]
        if block is None:
            s.lead_left -= 1
            self.stats["lead"] += 1
            s.counts["lead"] += 1
            item.lead = Lead(s.committed_len - 1, nxt)
            return
        # Lead only where the edge's pipeline broke (a rejection): its blocks in flight are dead
        # and the next useful one is a round trip away. After a full acceptance the next block
        # is usually on its way already, and a lead step would only delay it.
        s.lead_left = s.lead if n < len(draft) or not draft else 0
        self.stats["blocks"] += 1
        self.stats["accepted"] += n
        self.stats["drafted"] += len(draft)
        for key, value in (("blocks", 1), ("accepted", n), ("drafted", len(draft))):
            s.counts[key] += value
        item.result = BlockResult(block.number, item.skip + n, nxt, s.committed_len)


def _device_of(model) -> torch.device:
    """Where the target's weights live: inputs go there, sampling stays on the CPU."""
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):  # a wrapper without parameters (bench/gpu_check.py)
        return torch.device("cpu")


def _stack_left_padded(
    batch: list[_Pending], lens: list[int], li: int, lmax: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``li`` of every session's cache, left-padded with zeros to ``lmax`` and stacked."""
    ks, vs = [], []
    for it, n in zip(batch, lens, strict=True):
        if n:
            layer = it.session.cache.layers[li]
            ks.append(F.pad(layer.keys, (0, 0, lmax - n, 0)))
            vs.append(F.pad(layer.values, (0, 0, lmax - n, 0)))
        else:
            ks.append(None)
            vs.append(None)
    like = next(k for k in ks if k is not None)
    zero = torch.zeros(1, like.shape[1], lmax, like.shape[3], dtype=like.dtype, device=like.device)
    return (
        torch.cat([zero if k is None else k for k in ks]),
        torch.cat([zero if v is None else v for v in vs]),
    )
