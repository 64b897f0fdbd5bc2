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
  A block states the committed length and last token it builds on; if they differ from the
  session's (the edge guessed wrong while pipelining) the result is ``stale`` and costs nothing.
- Refusals are ``VerifierError`` subclasses with a message saying what to do: ``VerifierFull``
  (max sessions), ``SessionLimit`` (max tokens per session / context), ``UnknownSession`` (closed,
  or reaped after ``idle_timeout_s``), ``SessionBusy`` (one block at a time per session),
  ``BadBlock`` / ``BadRequest`` (malformed input), ``WrongModel``, ``PeerLimited`` (the edge's
  peer went over a per-peer limit of ``overlay/limits.py``: sessions, rate, bytes in flight).

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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import trio
from transformers import DynamicCache

from p2pnode.inference.models import LoadedModel
from p2pnode.inference.sampling import make_generator, probs_from_logits


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
    committed_len: int
    last_token: int
    cache: DynamicCache
    generator: torch.Generator
    last_used: float
    busy: bool = False


@dataclass
class _Pending:
    session: _Session
    block: Block
    done: trio.Event = field(default_factory=trio.Event)
    result: BlockResult | None = None
    error: Exception | None = None


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
    ) -> None:
        self.target = target
        self.model_id = target.model_id
        self.vocab_size = target.vocab_size
        self.max_sessions = max_sessions
        self.max_tokens = min(max_tokens_per_session, target.context_length)
        self.max_block = max_block
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self.idle_timeout_s = idle_timeout_s
        self.sessions: dict[str, _Session] = {}
        self.stats = {"batches": 0, "blocks": 0, "stale": 0, "accepted": 0, "drafted": 0}
        self._send, self._recv = trio.open_memory_channel[_Pending](math.inf)
        self._device = trio.Lock()  # one forward at a time: prefill or batch

    # -- sessions

    async def open_session(
        self, prompt: list[int], options: SamplingOptions, model_id: str | None = None
    ) -> str:
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
        cache = DynamicCache()
        async with self._device:
            if len(prompt) > 1:
                await trio.to_thread.run_sync(self._prefill, cache, prompt[:-1])
        if len(self.sessions) >= self.max_sessions:  # others opened while we prefilled
            raise VerifierFull(f"verifier is at its {self.max_sessions} sessions: retry later")
        self.sessions[sid] = _Session(
            sid,
            options,
            len(prompt),
            prompt[-1],
            cache,
            make_generator(options.seed),
            trio.current_time(),
        )
        return sid

    def close_session(self, sid: str) -> None:
        self.sessions.pop(sid, None)

    def _reap_idle(self) -> None:
        now = trio.current_time()
        for sid, s in list(self.sessions.items()):
            if not s.busy and now - s.last_used > self.idle_timeout_s:
                del self.sessions[sid]

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
        if block.base_len != s.committed_len or block.base_token != s.last_token:
            self.stats["stale"] += 1
            return BlockResult(block.number, -1, -1, s.committed_len)
        self._validate(s, block)
        item = _Pending(s, block)
        s.busy = True
        self._send.send_nowait(item)
        await item.done.wait()
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
        if s.committed_len + k + 1 > self.max_tokens:
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
            with trio.move_on_after(max(self.idle_timeout_s / 4, 0.05)) as waiting:
                first = await self._recv.receive()
            self._reap_idle()
            if waiting.cancelled_caught:
                continue
            batch = [first]
            deadline = trio.current_time() + self.max_wait_s
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._recv.receive_nowait())
                    continue
                except trio.WouldBlock:
                    pass
                if trio.current_time() >= deadline:
                    break
                with trio.move_on_at(deadline):
                    batch.append(await self._recv.receive())
            async with self._device:
                await trio.to_thread.run_sync(self._run_batch, batch)
            for item in batch:
                item.session.busy = False
                item.done.set()

    # -- worker-thread side (no trio calls below)

    @torch.inference_mode()
    def _prefill(self, cache: DynamicCache, ids: list[int]) -> None:
        self.target.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)

    def _run_batch(self, batch: list[_Pending]) -> None:
        try:
            with torch.inference_mode():
                logits = self._forward(batch)
            self.stats["batches"] += 1
            for item, lg in zip(batch, logits, strict=True):
                item.result = self._accept(item, lg)
        except Exception as exc:  # a bug must not kill the loop nor hang the callers
            for item in batch:
                if item.result is None:
                    item.error = VerifierError(f"verification failed: {exc!r}")

    def _forward(self, batch: list[_Pending]) -> list[torch.Tensor]:
        inputs = [[it.session.last_token, *it.block.tokens] for it in batch]
        model = self.target.model
        if len(batch) == 1:
            cache = batch[0].session.cache
            out = model(input_ids=torch.tensor(inputs), past_key_values=cache, use_cache=True)
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
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
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

    def _accept(self, item: _Pending, logits: torch.Tensor) -> BlockResult:
        s, block = item.session, item.block
        if s.options.greedy:
            n, nxt = verify_greedy(logits, block.tokens)
        else:
            p = probs_from_logits(logits, s.options.temperature, s.options.top_p)
            n, nxt = verify_sampling(p, block.draft_probs, block.tokens, s.generator)
        unused = len(block.tokens) - n
        if unused:
            s.cache.crop(-unused)
        s.committed_len += n + 1
        s.last_token = nxt
        self.stats["blocks"] += 1
        self.stats["accepted"] += n
        self.stats["drafted"] += len(block.tokens)
        return BlockResult(block.number, n, nxt, s.committed_len)


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
    zero = torch.zeros(1, like.shape[1], lmax, like.shape[3], dtype=like.dtype)
    return (
        torch.cat([zero if k is None else k for k in ks]),
        torch.cat([zero if v is None else v for v in vs]),
    )
