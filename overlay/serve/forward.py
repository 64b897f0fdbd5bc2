"""The forward protocol: its messages, the server that answers them, and the client call.

Protocol ``/p2pnode/forward/1`` (wire frames, one request per stream, the remote is the Noise-
authenticated peer): the origin sends ``fwd-request`` {model id, prompt ids, sampling params,
remaining deadline}; the server answers ``fwd-accepted`` {its cached prefix now, queue depth},
then ``fwd-tokens`` {start index, ids} as the engine produces them, then ``fwd-done`` {finish
reason, the REAL cached prompt tokens it served from, timings}, or ``fwd-error`` {code, message}
at any point (codes: ``busy``, ``no_model``, ``bad_request``, ``deadline``, ``internal``,
``limited``: over a per-peer limit of ``overlay/limits.py``, ``LimitExceeded.reason``).

Every gap in the token stream (``start`` not equal to the tokens received) fails the attempt.
A request with ``logprobs`` set (top alternatives per token) gets one ``fwd-logprob`` per token
inside each ``fwd-tokens`` frame, computed by the serving engine; a frame without them, or for
other tokens, fails the attempt like a gap. Choosing the peer and falling back is
``RoutedService``'s job (``overlay/serve/service.py``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from p2pnode.errors import P2PNodeError
from p2pnode.inference.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob
from p2pnode.inference.serving import ServingEngine
from p2pnode.overlay import wire
from p2pnode.overlay.cache.digest import MAX_MODEL_ID_LEN
from p2pnode.overlay.limits import LimitExceeded, PeerLimiter, remote_peer

if TYPE_CHECKING:
    from libp2p.abc import INetStream

    from p2pnode.inference._front import TokenStreamBase
    from p2pnode.overlay.seams import OverlayHost, Stream

log = logging.getLogger("p2pnode.overlay.serve.forward")

FORWARD_PROTOCOL = "/p2pnode/forward/1"
MAX_PROMPT_TOKENS = 1 << 17
MAX_GEN_TOKENS = 1 << 15


@wire.message("fwd-request")
@dataclass(frozen=True)
class ForwardRequest:
    model_id: str = field(metadata=wire.bounded(min_len=1, max_len=MAX_MODEL_ID_LEN))
    prompt: list[int] = field(
        metadata=wire.bounded(min_len=1, max_len=MAX_PROMPT_TOKENS, item_ge=0, item_le=2**31)
    )
    max_tokens: int = field(metadata=wire.bounded(ge=1, le=MAX_GEN_TOKENS))
    temperature: float = field(default=0.0, metadata=wire.bounded(ge=0, le=100))
    top_p: float = field(default=1.0, metadata=wire.bounded(ge=0, le=1))
    seed: int | None = field(default=None, metadata=wire.bounded(ge=-(2**63), le=2**64 - 1))
    stop_token_ids: list[int] = field(
        default_factory=list, metadata=wire.bounded(max_len=64, item_ge=0, item_le=2**31)
    )
    deadline_s: float = field(default=60.0, metadata=wire.bounded(ge=0, le=3600))
    request_id: str = field(default="", metadata=wire.bounded(max_len=64))
    logprobs: int | None = field(default=None, metadata=wire.bounded(ge=0, le=MAX_TOP_LOGPROBS))

    # The request carries every field of SamplingParams: the origin writes them with ``of`` and
    # the serving peer reads them back with ``sampling``, so both sides map them here, once.
    @classmethod
    def of(
        cls,
        model_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        deadline_s: float,
        request_id: str,
    ) -> ForwardRequest:
        """The request that asks a peer to run ``params`` over ``prompt``."""
        return cls(
            model_id=model_id,
            prompt=prompt,
            max_tokens=params.max_tokens,
            temperature=float(params.temperature),
            top_p=float(params.top_p),
            seed=params.seed,
            stop_token_ids=list(params.stop_token_ids),
            deadline_s=deadline_s,
            request_id=request_id,
            logprobs=params.logprobs,
        )

    def sampling(self) -> SamplingParams:
        """The request's sampling parameters; raises ``InvalidParams`` when they are invalid."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            logprobs=self.logprobs,
        )


@wire.message("fwd-accepted")
@dataclass(frozen=True)
class ForwardAccepted:
    cached_tokens: int = field(metadata=wire.bounded(ge=0))
    queue_depth: int = field(metadata=wire.bounded(ge=0))


@wire.message("fwd-logprob")
@dataclass(frozen=True)
class WireLogprob:
    """A ``TokenLogprob`` on the wire (inside ``fwd-tokens``)."""

    logprob: float = field(metadata=wire.bounded(ge=-1e4, le=0))
    top_ids: list[int] = field(
        default_factory=list,
        metadata=wire.bounded(max_len=MAX_TOP_LOGPROBS, item_ge=0, item_le=2**31),
    )
    top_logprobs: list[float] = field(
        default_factory=list, metadata=wire.bounded(max_len=MAX_TOP_LOGPROBS)
    )

    @classmethod
    def of(cls, lp: TokenLogprob) -> WireLogprob:
        return cls(lp.logprob, [t for t, _ in lp.top], [v for _, v in lp.top])

    def to_logprob(self, token: int) -> TokenLogprob:
        if len(self.top_ids) != len(self.top_logprobs):
            raise wire.SchemaError("fwd-logprob: top_ids and top_logprobs differ in length")
        return TokenLogprob(
            token, self.logprob, tuple(zip(self.top_ids, self.top_logprobs, strict=True))
        )


@wire.message("fwd-tokens")
@dataclass(frozen=True)
class ForwardTokens:
    start: int = field(metadata=wire.bounded(ge=0, le=MAX_GEN_TOKENS))
    ids: list[int] = field(metadata=wire.bounded(min_len=1, max_len=4096, item_ge=0, item_le=2**31))
    logprobs: list[WireLogprob] | None = field(default=None, metadata=wire.bounded(max_len=4096))


@wire.message("fwd-done")
@dataclass(frozen=True)
class ForwardDone:
    n_tokens: int = field(metadata=wire.bounded(ge=0, le=MAX_GEN_TOKENS))
    finish_reason: str = field(metadata=wire.bounded(max_len=16))
    cached_tokens: int = field(metadata=wire.bounded(ge=0))
    prompt_tokens: int = field(metadata=wire.bounded(ge=0))
    ttft_s: float = field(metadata=wire.bounded(ge=0))
    total_s: float = field(metadata=wire.bounded(ge=0))


@wire.message("fwd-error")
@dataclass(frozen=True)
class ForwardError:
    code: str = field(metadata=wire.bounded(max_len=32))
    message: str = field(metadata=wire.bounded(max_len=1024))


class ForwardFailed(P2PNodeError):
    """A forwarding attempt failed; ``tokens`` is what arrived first.

    ``reason`` is set per attempt, not per class: the ``fwd-error`` code the peer sent (any
    string, so no class could stand for each) or ours for a failure on the way (``eof``,
    ``timeout``, ``protocol``, ``unreachable``). The routed service counts attempts by it."""

    reason = "forward_failed"

    def __init__(self, reason: str, message: str, tokens: Sequence[int] = ()) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason  # type: ignore[misc]  # per attempt: see the docstring
        self.tokens = list(tokens)


class NoRouteError(P2PNodeError):
    """No node could serve the request (no local engine and every peer failed)."""

    reason = "no_route"


@dataclass
class ForwardConfig:
    """Timeouts of one attempt, scaled from the router's estimate for that peer."""

    accept_slack_s: float = 2.0  # for the accepted frame, on top of 2 RTT
    first_token_factor: float = (
        3.0  # first token within factor * estimated (wait + prefill) + slack
    )
    first_token_slack_s: float = 3.0
    idle_factor: float = 10.0  # later tokens within factor * decode s/token, at least idle_min_s
    idle_min_s: float = 2.0
    default_deadline_s: float = 120.0


# --------------------------------------------------------------------------- server side


class ForwardServer:
    """Serves ``/p2pnode/forward/1`` on one engine."""

    def __init__(
        self,
        engine: ServingEngine,
        *,
        admit: Callable[[], bool] = lambda: True,
        on_served: Callable[[str, int], None] | None = None,
        limiter: PeerLimiter | None = None,
        on_request: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_request = on_request  # a valid request arrived (counts block uses)
        self.admit = admit
        self.limiter = limiter if limiter is not None else PeerLimiter()
        self.on_served = on_served
        self.received = 0  # request streams opened to us, whatever became of them
        self.served = 0
        self.refused: dict[str, int] = {}

    async def handle(self, stream: INetStream) -> None:
        # Per-peer limits (overlay/limits.py): a stream slot and a rate token per request, its
        # bytes held until it ends; excess gets a ``limited`` error and never reaches the engine.
        self.received += 1
        peer = remote_peer(stream)
        try:
            with self.limiter.admit(peer, "forward"), self.limiter.metered(peer, stream) as s:
                await self._serve(s)
        except LimitExceeded as exc:
            await self._refuse(stream, exc.reason, str(exc))
        except trio.TooSlowError:  # only the request read is timed here; _run has its own
            await self._refuse(stream, "deadline", "no complete fwd-request within 10 s")

    async def _serve(self, stream: Stream) -> None:
        limit = wire.limit_for(FORWARD_PROTOCOL)
        with trio.fail_after(10):
            obj = await wire.read_frame(stream, limit=limit)
        try:
            req = wire.from_wire(obj, ForwardRequest)
        except wire.WireError as exc:
            await self._refuse(stream, "bad_request", str(exc))
            return
        if req.model_id != self.engine.model_id:
            await self._refuse(stream, "no_model", f"this node serves {self.engine.model_id}")
            return
        if not self.admit():
            await self._refuse(stream, "busy", "queue over the push-back threshold")
            return
        try:
            token_stream = self.engine.stream(req.prompt, req.sampling())
        except (ValueError, TypeError) as exc:  # EngineError subclasses are ValueErrors
            await self._refuse(stream, "bad_request", str(exc))
            return
        if self.on_request is not None:
            self.on_request(req.prompt)
        await self._run(stream, req, token_stream, limit)

    async def _run(
        self, stream: Stream, req: ForwardRequest, token_stream: TokenStreamBase, limit: int
    ) -> None:
        cached_now = self.engine.cached_prefix_len(req.prompt)
        sent = 0
        try:
            await wire.write_frame(
                stream,
                wire.to_wire(ForwardAccepted(cached_now, self.engine.queue_depth)),
                limit=limit,
            )
            with trio.fail_after(req.deadline_s):
                async for token in token_stream:
                    lps = None
                    if req.logprobs is not None:
                        lps = [WireLogprob.of(token_stream.logprobs[sent])]
                    await wire.write_frame(
                        stream, wire.to_wire(ForwardTokens(sent, [token], lps)), limit=limit
                    )
                    sent += 1
            result = token_stream.result
            done = ForwardDone(
                n_tokens=sent,
                finish_reason=result.finish_reason,
                cached_tokens=result.cached_tokens,
                prompt_tokens=result.prompt_tokens,
                ttft_s=result.ttft_s,
                total_s=result.total_s,
            )
            await wire.write_frame(stream, wire.to_wire(done), limit=limit)
            self.served += 1
            if self.on_served is not None:
                self.on_served(req.request_id, result.cached_tokens)
        except trio.TooSlowError:
            await token_stream.aclose()
            await self._refuse(stream, "deadline", f"deadline of {req.deadline_s:.1f} s passed")
        except BaseException:
            await token_stream.aclose()  # the origin went away: free the engine slot
            raise

    async def _refuse(self, stream: Stream, code: str, message: str) -> None:
        self.refused[code] = self.refused.get(code, 0) + 1
        with trio.move_on_after(2):
            await wire.write_frame(
                stream,
                wire.to_wire(ForwardError(code, message[:1024])),
                limit=wire.limit_for(FORWARD_PROTOCOL),
            )


# --------------------------------------------------------------------------- client side


@dataclass
class ForwardOutcome:
    tokens: list[int]
    done: ForwardDone
    accepted_cached: int
    # Measured here, from just before the stream opens (trust checks of advertised speeds).
    first_token_s: float | None = None
    last_token_s: float | None = None


async def forward_request(
    node: OverlayHost,
    peer_id: str,
    request: ForwardRequest,
    *,
    accept_timeout_s: float,
    first_token_timeout_s: float,
    idle_timeout_s: float,
    on_token: Callable[[int], None] | None = None,
    on_logprob: Callable[[TokenLogprob], None] | None = None,
) -> ForwardOutcome:
    """Run ``request`` on ``peer_id``; raises ``ForwardFailed`` (with the tokens received).

    With ``request.logprobs`` set, ``on_logprob`` gets each token's log-probability just before
    ``on_token`` gets the token."""
    limit = wire.limit_for(FORWARD_PROTOCOL)
    tokens: list[int] = []
    stream = None
    finished = False
    t0 = time.perf_counter()
    first_s: float | None = None
    last_s: float | None = None
    try:
        with trio.fail_after(accept_timeout_s):
            stream = await node.open_stream(peer_id, FORWARD_PROTOCOL, timeout=accept_timeout_s)
            await wire.write_frame(stream, wire.to_wire(request), limit=limit)
            first = wire.from_wire(
                await wire.read_frame(stream, limit=limit), ForwardAccepted, ForwardError
            )
        if isinstance(first, ForwardError):
            raise ForwardFailed(first.code, first.message)
        timeout = first_token_timeout_s
        while True:
            with trio.fail_after(timeout):
                obj = await wire.read_frame(stream, limit=limit)
            if obj is None:
                raise ForwardFailed("eof", "the peer closed the stream before finishing", tokens)
            msg = wire.from_wire(obj, ForwardTokens, ForwardDone, ForwardError)
            if isinstance(msg, ForwardError):
                raise ForwardFailed(msg.code, msg.message, tokens)
            if isinstance(msg, ForwardDone):
                if msg.n_tokens != len(tokens):
                    raise ForwardFailed(
                        "protocol", f"done after {len(tokens)} tokens, says {msg.n_tokens}", tokens
                    )
                finished = True
                return ForwardOutcome(tokens, msg, first.cached_tokens, first_s, last_s)
            if msg.start != len(tokens):
                raise ForwardFailed(
                    "protocol", f"tokens from {msg.start}, expected {len(tokens)}", tokens
                )
            if len(tokens) + len(msg.ids) > request.max_tokens:
                raise ForwardFailed("protocol", "more tokens than max_tokens", tokens)
            lps = _logprobs_of(msg, request, tokens)
            last_s = time.perf_counter() - t0
            first_s = last_s if first_s is None else first_s
            for i, t in enumerate(msg.ids):
                tokens.append(t)
                if on_logprob is not None and lps is not None:
                    on_logprob(lps[i])
                if on_token is not None:
                    on_token(t)
            timeout = idle_timeout_s
    except ForwardFailed:
        raise
    except trio.TooSlowError:
        raise ForwardFailed("timeout", f"{peer_id} went silent", tokens) from None
    except wire.WireError as exc:
        raise ForwardFailed("protocol", str(exc), tokens) from None
    except Exception as exc:  # unreachable, stream reset: the peer died or the link broke
        raise ForwardFailed("unreachable", f"{type(exc).__name__}: {exc}", tokens) from None
    finally:
        if stream is not None:
            # Shielded: when the origin is cancelled (client gone, stop string matched) the
            # enclosing scope is already cancelled, and an unshielded close never runs, so the
            # peer would keep generating. A reset tells it to stop; a finished stream closes.
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(1),
                contextlib.suppress(Exception),
            ):
                await (stream.close() if finished else stream.reset())


def _logprobs_of(
    msg: ForwardTokens, request: ForwardRequest, tokens: list[int]
) -> list[TokenLogprob] | None:
    if request.logprobs is None:
        return None
    if msg.logprobs is None or len(msg.logprobs) != len(msg.ids):
        raise ForwardFailed("protocol", "tokens without their requested logprobs", tokens)
    return [lp.to_logprob(t) for lp, t in zip(msg.logprobs, msg.ids, strict=True)]
