"""The verifier protocol over a libp2p stream: ``/p2pnode/verify/1``.

Contract (one stream = one session; frames and schemas from ``p2pnode.overlay.wire``):
- edge -> verifier ``verify-open`` {model_id, prompt, temperature, top_p, seed, lead}; the
  verifier answers ``verify-opened`` {committed_len, max_tokens, max_block, lead (granted)} or
  ``verify-refused`` {code, message} and closes. ``code`` is the ``reason`` of the
  ``VerifierError`` subclass (``VerifierFull``, ``SessionLimit``, ``WrongModel``, ``PeerLimited``,
  ...; ``_errors.py``) or ``BadMessage``; the edge raises the class with that ``reason``, or a
  plain ``VerifierError`` for a code it does not know.
- then any number of ``verify-block`` {number, base_len, base_token, tokens, q_width, q_ids,
  q_vals}, each answered in order by ``verify-result`` {number, accepted, next_token,
  committed_len, want} (accepted = -1: stale; want: the draft tokens the verifier wants per
  block from now on, its block-size control, ``_blocksize.py``; -1: no advice). The edge may send the next block before the previous
  result arrives (pipelining). For sampling, each draft token's q row travels sparse: ``q_width``
  entries per row, ids as little-endian int32 and probabilities as little-endian float32 bytes,
  so the verifier rebuilds the very q the edge drew from (exact; rows must sum to 1).
- With lead granted, the verifier also sends ``verify-lead`` {position, token}: a token it
  committed on its own (``verify.BatchedVerifier``'s lead). Results and leads share one writer,
  so the edge reads them in the verifier's commit order.
- ``verify-close`` {} (or the edge closing its side) ends the session. On an error the verifier
  sends ``verify-error`` {code, message} and ends it. A reset stream, a block slower than
  ``verifier.idle_timeout_s`` or a malformed frame also end it: the session is always released.
- Per-peer limits (``overlay/limits.py``, ``serve_verifier(..., limiter=)``): a ``verify`` stream
  slot and rate token per stream, at most ``max_sessions_per_peer`` open sessions, a
  ``verify_block`` token per block, a ``verify_lead`` token per lead token the verifier decodes
  for the peer, and the bytes of the request being served; excess is refused
  with code ``PeerLimited`` (``verify-refused`` before the session opened, else ``verify-error``).
- ``serve_verifier(node, verifier)`` registers the handler; the caller runs ``verifier.run`` in
  a nursery. ``P2PVerifierTransport(node, peer_id, model_id)`` is the edge side, a
  ``VerifierTransport`` for ``speculative_generate``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Self

import numpy as np
import torch
import trio

from p2pnode.overlay import wire
from p2pnode.overlay.limits import LimitExceeded, MeteredStream, PeerLimiter, remote_peer
from p2pnode.speculation._blocks import Block, BlockResult, Lead, SamplingOptions
from p2pnode.speculation._errors import BadBlock, PeerLimited, UnknownSession, VerifierError
from p2pnode.speculation.verify import BatchedVerifier

VERIFY_PROTOCOL = "/p2pnode/verify/1"
LIMIT = wire.PROTOCOL_LIMITS[VERIFY_PROTOCOL]
MAX_PROMPT = 8192
MAX_BLOCK = 64
MAX_Q_WIDTH = 256  # 2 KiB per draft token on the wire
MAX_LEAD = 4096
OPEN_TIMEOUT_S = 30.0
REFUSE_TIMEOUT_S = 5.0  # a refusal is one small frame; generous for a starved event loop
_I32 = {"ge": 0, "le": 2**31 - 1}


@wire.message("verify-open")
class VerifyOpen:
    model_id: str = field(metadata=wire.bounded(min_len=1, max_len=200))
    prompt: list[int] = field(
        metadata=wire.bounded(min_len=1, max_len=MAX_PROMPT, item_ge=0, item_le=2**31 - 1)
    )
    temperature: float = field(default=0.0, metadata=wire.bounded(ge=0, le=100))
    top_p: float = field(default=1.0, metadata=wire.bounded(ge=0, le=1))
    seed: int | None = field(default=None, metadata=wire.bounded(ge=-(2**63), le=2**63 - 1))
    lead: int = field(default=0, metadata=wire.bounded(ge=0, le=MAX_LEAD))


@wire.message("verify-opened")
class VerifyOpened:
    committed_len: int = field(metadata=wire.bounded(**_I32))
    max_tokens: int = field(metadata=wire.bounded(**_I32))
    max_block: int = field(metadata=wire.bounded(**_I32))
    lead: int = field(default=0, metadata=wire.bounded(ge=0, le=MAX_LEAD))


@wire.message("verify-lead")
class VerifyLead:
    position: int = field(metadata=wire.bounded(**_I32))
    token: int = field(metadata=wire.bounded(**_I32))


@dataclass(frozen=True)
class _Coded:
    """A refusal or an error: ``code`` is the error class's ``reason`` (see ``_errors.py``)."""

    code: str = field(metadata=wire.bounded(max_len=32))
    message: str = field(metadata=wire.bounded(max_len=1024))

    @classmethod
    def of(cls, exc: Exception) -> Self:
        return cls(_code(exc), str(exc)[:1024])


@wire.message("verify-refused")
class VerifyRefused(_Coded):
    """The open was refused; the verifier closes the stream."""


@wire.message("verify-block")
class VerifyBlock:
    number: int = field(metadata=wire.bounded(**_I32))
    base_len: int = field(metadata=wire.bounded(**_I32))
    base_token: int = field(metadata=wire.bounded(**_I32))
    tokens: list[int] = field(
        metadata=wire.bounded(max_len=MAX_BLOCK, item_ge=0, item_le=2**31 - 1)
    )
    q_width: int = field(default=0, metadata=wire.bounded(ge=0, le=MAX_Q_WIDTH))
    q_ids: bytes = field(default=b"", metadata=wire.bounded(max_len=MAX_BLOCK * MAX_Q_WIDTH * 4))
    q_vals: bytes = field(default=b"", metadata=wire.bounded(max_len=MAX_BLOCK * MAX_Q_WIDTH * 4))


@wire.message("verify-result")
class VerifyResult:
    number: int = field(metadata=wire.bounded(**_I32))
    accepted: int = field(metadata=wire.bounded(ge=-1, le=MAX_BLOCK))
    next_token: int = field(metadata=wire.bounded(ge=-1, le=2**31 - 1))
    committed_len: int = field(metadata=wire.bounded(**_I32))
    want: int = field(default=-1, metadata=wire.bounded(ge=-1, le=MAX_BLOCK))


@wire.message("verify-error")
class VerifyError(_Coded):
    """The session ended on an error (or leading stopped early, see ``verify.py``)."""


@wire.message("verify-close")
class VerifyClose:
    pass


# ---------------------------------------------------------------- sparse q rows


def encode_q(q: torch.Tensor | None) -> tuple[int, bytes, bytes]:
    """(width, ids, vals) of rows with at most ``MAX_Q_WIDTH`` non-zeros; exact, or BadBlock."""
    if q is None:
        return 0, b"", b""
    width = min(MAX_Q_WIDTH, q.shape[-1])
    vals, ids = q.topk(width, dim=-1)
    if bool((q > 0).sum(-1).gt(width).any()):
        raise BadBlock(f"a q row has more than {MAX_Q_WIDTH} non-zeros: truncate the draft's q")
    return (
        width,
        ids.to(torch.int32).numpy().astype("<i4").tobytes(),
        vals.float().numpy().astype("<f4").tobytes(),
    )


def decode_q(msg: VerifyBlock, vocab: int) -> torch.Tensor | None:
    k, w = len(msg.tokens), msg.q_width
    if w == 0:
        if msg.q_ids or msg.q_vals:
            raise BadBlock("q_ids/q_vals given with q_width 0")
        return None
    if len(msg.q_ids) != 4 * k * w or len(msg.q_vals) != 4 * k * w:
        raise BadBlock(f"q_ids and q_vals must hold {k} x {w} 4-byte entries each")
    ids = torch.from_numpy(np.frombuffer(msg.q_ids, dtype="<i4").astype(np.int64)).view(k, w)
    vals = torch.from_numpy(np.frombuffer(msg.q_vals, dtype="<f4").astype(np.float32)).view(k, w)
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise BadBlock(f"q ids must lie in [0, {vocab})")
    if not bool(torch.isfinite(vals).all()) or bool((vals < 0).any()):
        raise BadBlock("q probabilities must be finite and >= 0")
    q = torch.zeros(k, vocab).scatter_add_(1, ids, vals)
    if bool(((q.sum(-1) - 1).abs() > 1e-3).any()):
        raise BadBlock("each q row must sum to 1")
    return q


# ---------------------------------------------------------------- verifier side


def serve_verifier(node, verifier: BatchedVerifier, *, limiter: PeerLimiter | None = None) -> None:
    """Serve ``/p2pnode/verify/1`` on ``node`` (an overlay node with ``set_stream_handler``)."""
    limiter = limiter if limiter is not None else PeerLimiter()

    async def handle(stream) -> None:
        await serve_limited(stream, verifier, limiter)

    node.set_stream_handler(VERIFY_PROTOCOL, handle)


async def _send(stream, msg: object) -> None:
    await wire.write_frame(stream, wire.to_wire(msg), limit=LIMIT)


async def serve_limited(stream, verifier: BatchedVerifier, limiter: PeerLimiter) -> None:
    """One verify stream under ``limiter``'s per-peer limits (see the module contract)."""
    peer = remote_peer(stream)
    try:
        with limiter.admit(peer, "verify"), limiter.metered(peer, stream) as metered:
            await _serve_stream(metered, verifier, limiter, peer)
    except LimitExceeded as exc:  # raised by admit(): nothing was read or sent yet
        with trio.move_on_after(REFUSE_TIMEOUT_S):
            await _send(stream, VerifyRefused.of(exc))


async def _serve_stream(
    stream, verifier: BatchedVerifier, limiter: PeerLimiter | None = None, peer: str = ""
) -> None:
    obj = None  # stays None when the open frame does not arrive within OPEN_TIMEOUT_S
    with contextlib.ExitStack() as held:
        try:
            with trio.move_on_after(OPEN_TIMEOUT_S):
                obj = await wire.read_frame(stream, limit=LIMIT)
            if obj is None:  # an idle spare (or a silent peer): the edge must see it closed
                with trio.move_on_after(REFUSE_TIMEOUT_S), contextlib.suppress(Exception):
                    await stream.close()
                return
            req = wire.from_wire(obj, VerifyOpen)
            opts = SamplingOptions(req.temperature, req.top_p, req.seed)
            if limiter is not None:
                held.enter_context(limiter.session(peer))
            out_send, out_recv = trio.open_memory_channel[object](math.inf)

            def on_lead(news: Lead | VerifierError) -> None:  # raises once out_send is closed
                if isinstance(news, Lead):
                    try:
                        if limiter is not None:
                            limiter.charge(peer, "verify_lead")
                    except LimitExceeded as exc:  # told to the edge; raising stops the leading
                        out_send.send_nowait(VerifyError.of(exc))
                        raise
                    out_send.send_nowait(VerifyLead(news.position, news.token))
                else:  # leading stopped early: the edge must not wait for more
                    out_send.send_nowait(VerifyError.of(news))

            sid = await verifier.open_session(
                list(req.prompt), opts, req.model_id, lead=req.lead, on_lead=on_lead
            )
        except (wire.WireError, VerifierError, LimitExceeded) as exc:
            with trio.move_on_after(REFUSE_TIMEOUT_S):
                await _send(stream, VerifyRefused.of(exc))
            return
        try:
            s = verifier.sessions[sid]
            opened = VerifyOpened(s.committed_len, verifier.max_tokens, verifier.max_block, s.lead)
            await _send(stream, opened)  # before the writer starts: leads wait in out_recv
            _release(stream)
            failure: Exception | None = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_write_out, stream, out_recv, nursery.cancel_scope)
                try:
                    await _serve_blocks(stream, verifier, sid, limiter, peer, out_send)
                except (wire.WireError, VerifierError, LimitExceeded) as exc:
                    failure = exc  # answered below, after what is queued (no ExceptionGroup)
                out_send.close()  # the writer drains what is queued, then ends
            if failure is not None:
                raise failure
        except (wire.WireError, VerifierError, LimitExceeded) as exc:
            with trio.move_on_after(REFUSE_TIMEOUT_S):
                await _send(stream, VerifyError.of(exc))
        finally:
            verifier.close_session(sid)


async def _write_out(stream, out: trio.MemoryReceiveChannel, scope: trio.CancelScope) -> None:
    """The session's only writer: results and leads leave in the verifier's commit order."""
    try:
        async for msg in out:
            await _send(stream, msg)
            if isinstance(msg, VerifyResult):
                _release(stream)
    except Exception:  # the stream is gone: end the session (the reader would wait for blocks)
        scope.cancel()


async def _serve_blocks(
    stream,
    verifier: BatchedVerifier,
    sid: str,
    limiter: PeerLimiter | None,
    peer: str,
    out: trio.MemorySendChannel,
) -> None:
    while True:
        # Only the wait for the next block is timed: a verification queued behind a busy
        # verifier used to count too, and was cancelled as "no block" (found by fuzzing).
        obj, waited_out = None, True
        with trio.move_on_after(verifier.idle_timeout_s):
            obj = await wire.read_frame(stream, limit=LIMIT)
            waited_out = False
        if waited_out:
            raise UnknownSession(f"no block for {verifier.idle_timeout_s:.0f} s: session closed")
        if obj is None:
            return
        msg = wire.from_wire(obj, VerifyBlock, VerifyClose)
        if isinstance(msg, VerifyClose):
            return
        if limiter is not None:
            limiter.charge(peer, "verify_block")
        q = decode_q(msg, verifier.vocab_size)
        block = Block(msg.number, msg.base_len, msg.base_token, tuple(msg.tokens), q)
        r = await verifier.verify(sid, block)
        want = -1 if r.want is None else min(r.want, MAX_BLOCK)
        out.send_nowait(VerifyResult(r.number, r.accepted, r.next_token, r.committed_len, want))


def _release(stream) -> None:
    """The request just answered no longer counts toward the peer's bytes in flight."""
    if isinstance(stream, MeteredStream):
        stream.release()


def _family(cls: type[VerifierError]) -> list[type[VerifierError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _family(sub))]


# code on the wire -> the class the edge raises; only what a verifier may send (_errors.py)
_BY_CODE = {c.reason: c for c in _family(VerifierError) if c.sent_by_verifier}


def _code(exc: Exception) -> str:
    if isinstance(exc, LimitExceeded):
        return PeerLimited.reason
    return exc.reason if isinstance(exc, VerifierError) else "BadMessage"


def _error(code: str, message: str) -> VerifierError:
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls(f"verifier: {message}")
    return VerifierError(f"verifier ({code}): {message}")


# ---------------------------------------------------------------- edge side


class P2PVerifierTransport:
    """``VerifierTransport`` over one ``/p2pnode/verify/1`` stream to ``peer_id``.

    ``spare``: a stream already opened to that peer (``open_spare``), which saves the stream
    negotiation (2 round trips in py-libp2p) on the session's first token. A spare the verifier
    already dropped (it waits ``OPEN_TIMEOUT_S`` for the open) is replaced by a fresh stream."""

    def __init__(
        self,
        node,
        peer_id: str,
        model_id: str,
        *,
        result_timeout_s: float = 120.0,
        spare=None,
    ):
        self.node, self.peer_id, self.model_id = node, peer_id, model_id
        self.result_timeout_s = result_timeout_s
        self.stream = None
        self.spare = spare
        self.used_spare = False
        self.opened: VerifyOpened | None = None

    async def open(self, prompt: list[int], options: SamplingOptions, *, lead: int = 0) -> int:
        req = VerifyOpen(
            self.model_id,
            list(prompt),
            options.temperature,
            options.top_p,
            options.seed,
            min(lead, MAX_LEAD),
        )
        reply = None
        if self.spare is not None:
            self.stream, self.spare = self.spare, None
            with contextlib.suppress(Exception):  # dropped by the verifier, reset, ...
                reply = await self._request_open(req)
                self.used_spare = reply is not None
            if reply is None:
                await drop_stream(self.stream)
        if reply is None:
            self.stream = await self.node.open_stream(self.peer_id, VERIFY_PROTOCOL)
            reply = await self._request_open(req)
        if reply is None:
            raise VerifierError("verifier closed the stream before answering the open")
        if isinstance(reply, VerifyRefused):
            raise _error(reply.code, reply.message)
        if reply.lead > lead:
            raise VerifierError(f"verifier granted lead {reply.lead}, more than the {lead} asked")
        self.opened = reply
        return reply.lead

    @property
    def max_block(self) -> int | None:
        return self.opened.max_block if self.opened is not None else None

    async def _request_open(self, req: VerifyOpen) -> VerifyOpened | VerifyRefused | None:
        await _send(self.stream, req)
        with trio.fail_after(OPEN_TIMEOUT_S):
            obj = await wire.read_frame(self.stream, limit=LIMIT)
        return None if obj is None else wire.from_wire(obj, VerifyOpened, VerifyRefused)

    async def send_block(self, block: Block) -> None:
        width, ids, vals = encode_q(block.draft_probs)
        msg = VerifyBlock(
            block.number, block.base_len, block.base_token, list(block.tokens), width, ids, vals
        )
        await _send(self.stream, msg)

    async def receive_result(self) -> BlockResult | Lead:
        with trio.move_on_after(self.result_timeout_s):
            obj = await wire.read_frame(self.stream, limit=LIMIT)
            if obj is None:
                raise VerifierError("verifier closed the stream: open a new session")
            msg = wire.from_wire(obj, VerifyResult, VerifyLead, VerifyError)
            if isinstance(msg, VerifyError):
                raise _error(msg.code, msg.message)
            if isinstance(msg, VerifyLead):
                return Lead(msg.position, msg.token)
            want = None if msg.want < 0 else msg.want
            return BlockResult(msg.number, msg.accepted, msg.next_token, msg.committed_len, want)
        raise VerifierError(f"no verification result within {self.result_timeout_s:.0f} s")

    async def close(self) -> None:
        if self.spare is not None:
            await drop_stream(self.spare)
            self.spare = None
        if self.stream is None:
            return
        stream, self.stream = self.stream, None
        with trio.move_on_after(2):
            try:
                await _send(stream, VerifyClose())
                await stream.close()
            except Exception:  # the peer may already be gone; reset to release our side
                await drop_stream(stream)


async def open_spare(node, peer_id: str):
    """A ``/p2pnode/verify/1`` stream to ``peer_id`` for a later session's ``spare=``."""
    return await node.open_stream(peer_id, VERIFY_PROTOCOL)


async def drop_stream(stream) -> None:
    """Reset ``stream``, quietly and within 2 s (a peer may already be gone)."""
    with trio.move_on_after(2), contextlib.suppress(Exception):
        await stream.reset()


__all__ = [
    "VERIFY_PROTOCOL",
    "P2PVerifierTransport",
    "drop_stream",
    "open_spare",
    "serve_verifier",
    "encode_q",
    "decode_q",
]
