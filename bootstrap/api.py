"""The node's local HTTP API (an ASGI app served by hypercorn inside the node's trio loop).

Contract:
- ``build_app(status, *, service=None, engine=None, registry=None, model_name=None,
  metrics=None, max_pending=64)`` -> Starlette app with
  ``GET /status``, ``GET /peers`` (from ``status()``), ``GET /metrics`` (Prometheus text of
  ``registry``), and the OpenAI-compatible ``GET /v1/models``, ``GET /v1/models/{id}``,
  ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` gives
  server-sent events in OpenAI's chunk format ending with ``data: [DONE]``).
- Requests go through ``service`` (a ``RoutedService``: the router may have a peer serve them);
  without a service they run on ``engine`` directly. ``engine`` is needed for text: it encodes
  prompts (``encode``, ``encode_chat``) and decodes answers. Without an engine the OpenAI
  endpoints answer 503.
- Text is detokenized incrementally and never splits a UTF-8 character; ``stop`` strings end
  the answer and are not part of it (stop strings that are one token also stop the engine
  itself). Streamed deltas concatenate to exactly the non-streamed text.
- Errors are OpenAI-style ``{"error": {"message", "type", "param", "code"}}``: unknown model
  404 (``model_not_found``), bad JSON or parameters 400, prompt + max_tokens over the context
  400 (``context_length_exceeded``), no node able to serve or too many requests in flight 503.
  A streamed request that fails before its first token still gets its status code; after it,
  the error arrives as a ``data: {"error": ...}`` event.
- ``GET /`` is the web console; its JSON and SSE endpoints live under ``/console/`` (see
  ``console/`` and docs/console.md).
- ``GET /health``: 200 ``{"status": "ok", ...}`` once ``ready()`` holds (model loaded, overlay
  joined), 503 with the same shape and ``"status": "starting"`` before (see ``health.py``).
- ``logprobs`` / ``top_logprobs`` (completions: ``logprobs=N``; chat: ``logprobs: true`` and
  ``top_logprobs=N``) come back in OpenAI's shapes (``_logprobs.py``), computed by the engine
  that served each token, forwarded or not; streamed chunks carry those of their tokens.
- ``usage.prompt_tokens_details.cached_tokens``: the prompt tokens served from a prefix cache.
- Non-streamed answers carry headers ``x-p2pnode-served-by`` (peer id; ``local`` without an
  overlay) and ``x-p2pnode-cached-tokens``, and a ``p2pnode`` field (served_by, cached_tokens,
  routing summary). Streams carry the ``p2pnode`` field in the chunk with the finish reason,
  as the serving node is only known at the end. When a stop string ends the answer early the
  generation is cancelled and ``served_by`` is null.
- Metrics (``NodeMetrics``, ``app.state.metrics``) are recorded in ``registry``; pass the
  registry given to ``RoutedService`` so its router/forward/digest counters are scraped too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from p2pnode.bootstrap import _logprobs
from p2pnode.bootstrap.health import health_response, health_state
from p2pnode.bootstrap.metrics import NodeMetrics

log = logging.getLogger("p2pnode.api")

MAX_BODY_BYTES = 8 << 20
SHUTDOWN_GRACE_S = 1.0  # open requests get this long when the node stops
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # the hold-back check is quadratic in a stop string's length
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 1024  # chat defaults to "until done": capped by this and the context
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


# --------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"retry-after": "1"} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _bad(message: str, param: str | None = None, code: str = "invalid_parameter") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _error_from_exception(exc: BaseException, prompt_param: str) -> ApiError:
    """Map engine/routing failures to API errors (anything unknown is a 500)."""
    from p2pnode.inference._errors import (
        EmptyPrompt,
        EngineClosed,
        EngineError,
        InvalidParams,
        InvalidToken,
        PromptTooLong,
    )
    from p2pnode.overlay.forward import NoRouteError

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PromptTooLong):
        return _bad(str(exc), prompt_param, "context_length_exceeded")
    if isinstance(exc, EmptyPrompt | InvalidToken):
        return _bad(str(exc), prompt_param, "invalid_prompt")
    if isinstance(exc, InvalidParams | EngineError):
        return _bad(str(exc))
    if isinstance(exc, NoRouteError):
        return ApiError(503, str(exc), type="server_error", code="no_capacity")
    if isinstance(exc, EngineClosed):
        return ApiError(503, f"the engine is shutting down: {exc}", type="server_error")
    log.exception("request failed", exc_info=exc)
    return ApiError(
        500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal"
    )


# --------------------------------------------------------------------------- text


class TextAssembler:
    """Token ids in, text deltas out.

    Never emits part of a UTF-8 character (a window whose decoding ends in U+FFFD waits for
    more tokens) and never emits any part of a stop string: text that could still begin one is
    held back until it cannot. ``text`` is the answer so far (held text included);
    ``stopped`` turns True when a stop string was found (``text`` is cut before it).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stops = tuple(s for s in stops if s)
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False
        self._prefix = 0  # tokens before this are fully turned into text
        self._read = 0  # tokens[_prefix:_read] decode to the last chunk of text added
        self._emitted = 0  # characters of ``text`` already handed out

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.tokens.append(token)
        # Decode a window that starts a few tokens back so context-dependent decoding (leading
        # spaces, merged bytes) matches a decode of the whole sequence.
        prefix_text = self._decode(self.tokens[self._prefix : self._read])
        new_text = self._decode(self.tokens[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character, or a special token that decodes to nothing
        self.text += new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once no token will come."""
        if not self.stopped:
            full = self._decode(self.tokens)
            if full.startswith(self.text):
                self.text = full
            else:  # decoding is not prefix-stable here: add what the window still holds
                prefix_text = self._decode(self.tokens[self._prefix : self._read])
                self.text += self._decode(self.tokens[self._prefix :])[len(prefix_text) :]
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        safe = len(self.text)
        if self._stops and not self.stopped:
            hits = [i for s in self._stops if (i := self.text.find(s, self._emitted)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                safe = len(self.text)
            elif not final:
                safe -= self._held_suffix()
        out = self.text[self._emitted : safe]
        self._emitted = max(self._emitted, safe)
        return out

    def _held_suffix(self) -> int:
        """Length of the longest end of ``text`` that is a proper prefix of a stop string."""
        tail = self.text[self._emitted :]
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return best


# --------------------------------------------------------------------------- requests


@dataclass
class _Job:
    endpoint: str  # "/v1/completions" or "/v1/chat/completions"
    chat: bool
    model: str
    prompt: list[int]
    params: Any  # SamplingParams
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    prompt_param: str  # "prompt" or "messages", for error answers
    private: bool = False  # "p2pnode": {"private": true}: never leaves this node
    turn: int | None = None  # chat: earlier assistant answers in the messages (the router's
    # look-ahead for sessions, overlay/sessions.py)


@dataclass
class _Outcome:
    """What one request produced, wherever it ran."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    served_by: str | None = None
    served_locally: bool | None = None
    routing: dict[str, Any] | None = None
    total_s: float = 0.0
    logprobs: list[Any] = field(default_factory=list)  # TokenLogprob per token, when asked
    routed: Any = None  # the RoutedResult, when the router handled the request

    def p2pnode(self) -> dict[str, Any]:
        return {
            "served_by": self.served_by,
            "served_locally": self.served_locally,
            "cached_tokens": self.cached_tokens,
            "routing": self.routing,
            "total_s": round(self.total_s, 4),
        }

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.tokens),
            "total_tokens": self.prompt_tokens + len(self.tokens),
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens or 0},
        }


def _routing_summary(result: Any) -> dict[str, Any]:
    d = result.decision
    return {
        "request_id": d.request_id,
        "chosen": d.chosen,
        "reason": d.reason,
        "fell_back": len(result.attempts) > 1,
        "attempts": [
            {
                "target": a.target,
                "outcome": a.outcome,
                "tokens": a.tokens,
                "seconds": round(a.seconds, 4),
            }
            for a in result.attempts
        ],
    }


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


class _Api:
    """Request handling shared by the endpoints (see the module contract)."""

    def __init__(
        self,
        *,
        service: Any,
        engine: Any,
        metrics: NodeMetrics,
        model_name: str | None,
        max_pending: int,
    ) -> None:
        self.on_outcome: Callable[[_Job, _Outcome], None] | None = None  # the console's feed
        self.service = service
        self.engine = engine
        self.metrics = metrics
        self.max_pending = max_pending
        self.pending = 0
        model_id = service.model_id if service is not None else getattr(engine, "model_id", None)
        self.model_id: str | None = model_id
        self.model_name = model_name or model_id
        names = {n for n in (self.model_name, model_id) if n}
        # Also accept the bare model name ("SmolLM2-135M-Instruct" for "...@<hash>").
        self.model_names = names | {n.split("@", 1)[0] for n in names}
        self.created = int(time.time())

    # -- parsing ------------------------------------------------------------------------------

    async def read_json(self, request: Request) -> dict[str, Any]:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", code="too_large")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _bad(f"the body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise _bad("the body must be a JSON object", code="invalid_json")
        return data

    def check_model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if self.model_id is None:
            raise ApiError(
                503,
                "this node serves no model; start it with --model",
                type="server_error",
                code="no_model",
            )
        if model is None:
            return self.model_name  # lenient: the one model this node serves
        if not isinstance(model, str) or model not in self.model_names:
            raise ApiError(
                404,
                f"The model {model!r} does not exist on this node; it serves "
                f"{self.model_name!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return model

    def parse(self, body: dict[str, Any], *, chat: bool) -> _Job:
        from p2pnode.inference.sampling import SamplingParams

        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        model = self.check_model(body)
        if self.engine is None:
            raise ApiError(
                503,
                "this node runs no engine, so it cannot turn text into tokens; send the "
                "request to a node started with --model",
                type="server_error",
                code="no_tokenizer",
            )
        _reject_unsupported(body, chat=chat)
        prompt_param = "messages" if chat else "prompt"
        prompt = self._chat_prompt(body) if chat else self._completion_prompt(body)
        if not prompt:
            raise _bad("the prompt is empty; send some text", prompt_param, "invalid_prompt")
        context = int(self.engine.context_length)
        max_tokens = body.get("max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is None:
            default = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
            max_tokens = max(1, min(default, context - len(prompt)))
        elif not _is_int(max_tokens) or max_tokens < 1:
            raise _bad(f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
        if len(prompt) + max_tokens > context:
            raise _bad(
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the "
                f"{prompt_param}, {max_tokens} for the completion). Please reduce the length "
                f"of the {prompt_param} or max_tokens.",
                prompt_param,
                "context_length_exceeded",
            )
        temperature = body.get("temperature", 1.0)
        if temperature is None:
            temperature = 1.0
        if not _is_number(temperature) or not 0 <= temperature <= 2:
            raise _bad(
                f"temperature must be a number in [0, 2], got {temperature!r}", "temperature"
            )
        top_p = body.get("top_p", 1.0)
        if top_p is None:
            top_p = 1.0
        if not _is_number(top_p) or not 0 <= top_p <= 1:
            raise _bad(f"top_p must be a number in [0, 1], got {top_p!r}", "top_p")
        # top_p 0 means "only the most likely token"; the engine keeps the argmax for any top_p.
        top_p = max(float(top_p), 1e-9)
        seed = body.get("seed")
        if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
            raise _bad(f"seed must be a 64-bit integer, got {seed!r}", "seed")
        stops = _parse_stop(body.get("stop"))
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise _bad(f"stream must be a boolean, got {stream!r}", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise _bad("stream_options must be an object", "stream_options")
        include_usage = bool(options.get("include_usage", False))
        try:
            logprobs = _logprobs.parse_request(body, chat=chat)
        except _logprobs.LogprobsOptionError as exc:
            raise _bad(str(exc), exc.param) from None
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=float(temperature),
                top_p=top_p,
                seed=seed,
                stop_token_ids=self._stop_token_ids(stops),
                logprobs=logprobs,
            )
        except ValueError as exc:
            raise _bad(str(exc)) from None
        return _Job(
            endpoint,
            chat,
            model,
            prompt,
            params,
            stops,
            stream,
            include_usage,
            prompt_param,
            _parse_private(body),
            _chat_turn(body) if chat else None,
        )

    def _stop_token_ids(self, stops: Sequence[str]) -> tuple[int, ...]:
        # A stop string that is exactly one token stops the engine itself (no wasted tokens);
        # longer ones are matched on the text and cancel the generation.
        ids = []
        for s in stops:
            enc = self.engine.encode(s)
            if len(enc) == 1 and self.engine.decode(enc) in ("", s):
                ids.append(enc[0])
        return tuple(ids)

    def _completion_prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.engine.encode(prompt)
        if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            vocab = int(self.engine.vocab_size)
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise _bad(
                    f"token id {bad} is outside the vocabulary [0, {vocab})",
                    "prompt",
                    "invalid_prompt",
                )
            return list(prompt)
        if isinstance(prompt, list):
            raise _bad(
                "only one prompt per request is supported: send a string or a list of token ids",
                "prompt",
                "invalid_prompt",
            )
        raise _bad("prompt must be a string or a list of token ids", "prompt", "invalid_prompt")

    def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages must be a non-empty list", "messages", "invalid_messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
                raise _bad(
                    f"messages[{i}] needs a role in {sorted(CHAT_ROLES)}",
                    f"messages[{i}].role",
                    "invalid_messages",
                )
            role = "system" if m["role"] == "developer" else m["role"]
            clean.append({"role": role, "content": _message_text(m.get("content"), i)})
        try:
            return self.engine.encode_chat(clean)
        except Exception as exc:  # the chat template refused these messages
            raise _bad(
                f"the model's chat template cannot render these messages: {exc}",
                "messages",
                "invalid_messages",
            ) from None

    # -- running ------------------------------------------------------------------------------

    def admit(self) -> None:
        if self.pending >= self.max_pending:
            raise ApiError(
                503,
                f"{self.pending} requests are already in flight on this node; retry shortly",
                type="server_error",
                code="no_capacity",
            )

    async def run(
        self, job: _Job, deliver: Callable[[str, list[Any]], Awaitable[None]]
    ) -> _Outcome:
        """Generate ``job``, handing text deltas (and the log-probabilities of the tokens
        consumed since the last delta) to ``deliver`` as they form.

        Raises the engine's/router's exception when generation fails.
        """
        started = time.perf_counter()
        text = TextAssembler(self.engine.decode, job.stops)
        send, recv = trio.open_memory_channel[int](math.inf)
        out = _Outcome(prompt_tokens=len(job.prompt))
        failure: list[BaseException] = []
        self.pending += 1

        async def produce() -> None:
            try:
                with send:
                    await self._generate(job, send.send_nowait, out, out.logprobs.append)
            except Exception as exc:  # reported to the caller once the consumer has drained
                failure.append(exc)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)
                last = None
                handed = 0  # tokens whose logprobs went out with a delta

                def fresh_logprobs() -> list[Any]:
                    nonlocal handed
                    lps = out.logprobs[handed : len(out.tokens)]
                    handed += len(lps)
                    return lps

                async for token in recv:
                    now = time.perf_counter()
                    if last is None:
                        self.metrics.ttft.observe(now - started)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                    out.tokens.append(token)
                    delta = text.push(token)
                    if delta:
                        await deliver(delta, fresh_logprobs())
                    if text.stopped:
                        nursery.cancel_scope.cancel()  # a stop string ended the answer
                        out.finish_reason = "stop"
                        break
            if failure:
                raise failure[0]
            tail = text.finish()
            del out.logprobs[len(out.tokens) :]  # produced past a stop string: not answered
            rest = fresh_logprobs()
            if tail or rest:
                await deliver(tail, rest)
            if text.stopped:
                out.finish_reason = "stop"
            out.text = text.text
            out.total_s = time.perf_counter() - started
            self.metrics.duration.observe(out.total_s)
            self.metrics.observe_generation(
                local=out.served_locally,
                prompt_tokens=out.prompt_tokens,
                generated=len(out.tokens),
                cached_tokens=out.cached_tokens or 0,
            )
            if self.on_outcome is not None:
                self.on_outcome(job, out)
            return out
        finally:
            self.pending -= 1

    async def _generate(
        self,
        job: _Job,
        on_token: Callable[[int], None],
        out: _Outcome,
        on_logprob: Callable[[Any], None],
    ) -> None:
        if self.service is not None:
            result = await self.service.generate(
                job.prompt,
                job.params,
                on_token=on_token,
                on_logprob=on_logprob,
                private=job.private,
                turn=job.turn,
            )
            out.routed = result
            out.finish_reason = result.finish_reason
            out.cached_tokens = result.cached_tokens
            out.served_by = result.served_by
            out.served_locally = result.served_locally
            out.routing = _routing_summary(result)
            return
        stream = self.engine.stream(job.prompt, job.params)
        try:
            async for token in stream:
                if job.params.logprobs is not None:
                    on_logprob(stream.logprobs[len(out.logprobs)])
                on_token(token)
        finally:
            if stream.result is None:
                await stream.aclose()
        out.finish_reason = stream.result.finish_reason
        out.cached_tokens = stream.result.cached_tokens
        out.served_by = "local"
        out.served_locally = True

    # -- response bodies ----------------------------------------------------------------------

    def token_text(self, token: int) -> str:
        return self.engine.tokenizer.decode([token])

    def render_logprobs(self, job: _Job, lps: list[Any], offset: int = 0) -> Any:
        if job.params.logprobs is None:
            return None
        if job.chat:
            return _logprobs.chat_logprobs(lps, self.token_text)
        top = job.params.logprobs > 0
        return _logprobs.completion_logprobs(lps, self.token_text, top=top, offset=offset)

    def completion_body(self, job: _Job, rid: str, out: _Outcome) -> dict[str, Any]:
        if job.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": self.render_logprobs(job, out.logprobs),
                "finish_reason": out.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": out.text,
                "logprobs": self.render_logprobs(job, out.logprobs),
                "finish_reason": out.finish_reason,
            }
        return {
            "id": rid,
            "object": "chat.completion" if job.chat else "text_completion",
            "created": int(time.time()),
            "model": job.model,
            "choices": [choice],
            "usage": out.usage(),
            "p2pnode": out.p2pnode(),
        }

    def chunk(
        self,
        job: _Job,
        rid: str,
        created: int,
        *,
        text: str | None = None,
        role: bool = False,
        finish: _Outcome | None = None,
        usage: bool = False,
        logprobs: Any = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": created,
            "model": job.model,
        }
        if usage:
            assert finish is not None
            body["choices"] = []
            body["usage"] = finish.usage()
            return body
        if job.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs}
        choice["finish_reason"] = finish.finish_reason if finish is not None else None
        body["choices"] = [choice]
        if job.include_usage:
            body["usage"] = None
        if finish is not None:
            body["p2pnode"] = finish.p2pnode()
        return body


def _message_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(
                    f"messages[{i}].content: only text parts are supported",
                    f"messages[{i}].content",
                    "invalid_messages",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"messages[{i}].content: a text part needs a string 'text'")
            parts.append(text)
        return "".join(parts)
    raise _bad(
        f"messages[{i}].content must be a string or a list of text parts",
        f"messages[{i}].content",
        "invalid_messages",
    )


def _chat_turn(body: dict[str, Any]) -> int:
    """Earlier assistant answers in a (validated) chat body: 0 for a session's first turn."""
    return sum(1 for m in body["messages"] if m.get("role") == "assistant")


def _parse_private(body: dict[str, Any]) -> bool:
    """``"p2pnode": {"private": true}`` (OpenAI clients: ``extra_body``)."""
    ext = body.get("p2pnode")
    if ext is None:
        return False
    if not isinstance(ext, dict) or set(ext) - {"private"}:
        raise _bad('p2pnode must be an object like {"private": true}', "p2pnode")
    private = ext.get("private", False)
    if not isinstance(private, bool):
        raise _bad(f"p2pnode.private must be a boolean, got {private!r}", "p2pnode.private")
    return private


def _parse_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)
    ):
        raise _bad(
            f"stop must be a string of 1 to {MAX_STOP_CHARS} characters or a list of up to "
            f"{MAX_STOP_STRINGS} of them",
            "stop",
        )
    return tuple(stop)


def _reject_unsupported(body: dict[str, Any], *, chat: bool) -> None:
    """Options we do not implement are refused rather than silently ignored."""
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad("only n=1 is supported", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise _bad("only best_of=1 is supported", "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0):
            raise _bad(f"{name} is not supported (send 0 or leave it out)", name)
    if body.get("logit_bias"):
        raise _bad("logit_bias is not supported", "logit_bias")
    if not chat and body.get("echo"):
        raise _bad("echo is not supported", "echo")
    if not chat and body.get("suffix"):
        raise _bad("suffix is not supported", "suffix")
    if chat and (body.get("tools") or body.get("functions")):
        raise _bad("tool and function calls are not supported", "tools")
    fmt = body.get("response_format")
    if chat and fmt not in (None, {"type": "text"}):
        raise _bad("only response_format {'type': 'text'} is supported", "response_format")


# --------------------------------------------------------------------------- streaming


class _EventStream(Response):
    """Server-sent events of one generation, started lazily.

    The status line waits for the first text (or the end): a request that fails before any
    token gets a proper JSON error with its status code instead of a 200 stream.
    """

    media_type = "text/event-stream"

    def __init__(self, api: _Api, job: _Job) -> None:
        self.api = api
        self.job = job
        self.status_code = 200
        self.background = None
        self.rid = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api, job = self.api, self.job
        started = False

        async def event(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
            await send(
                {
                    "type": "http.response.body",
                    "body": f"data: {data}\n\n".encode(),
                    "more_body": True,
                }
            )

        async def start() -> None:
            nonlocal started
            if started:
                return
            started = True
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            if job.chat:
                await event(api.chunk(job, self.rid, self.created, text="", role=True))

        offset = 0  # characters sent so far (text_offset of completions' logprobs)

        async def deliver(text: str, lps: list[Any]) -> None:
            nonlocal offset
            await start()
            logprobs = api.render_logprobs(job, lps, offset)
            offset += sum(len(api.token_text(lp.token)) for lp in lps)
            await event(api.chunk(job, self.rid, self.created, text=text, logprobs=logprobs))

        status = 200
        finished = False

        async def watch_disconnect(cancel: trio.CancelScope) -> None:
            nonlocal status
            while True:
                message = await receive()
                if message["type"] == "http.disconnect" and not finished:
                    status = 499  # nginx's "client closed request", for the metrics
                    cancel.cancel()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_disconnect, nursery.cancel_scope)
            try:
                out = await api.run(job, deliver)
            except Exception as exc:
                error = _error_from_exception(exc, job.prompt_param)
                status, finished = error.status, True
                if started:  # too late for a status code: an error event ends the stream
                    await event(error.body())
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                else:
                    await error.response()(scope, receive, send)
            else:
                finished = True
                await start()
                await event(api.chunk(job, self.rid, self.created, finish=out))
                if job.include_usage:
                    await event(api.chunk(job, self.rid, self.created, finish=out, usage=True))
                await event("[DONE]")
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            nursery.cancel_scope.cancel()
        api.metrics.count_request(job.endpoint, status)


# --------------------------------------------------------------------------- the app


def build_app(
    status: Callable[[], dict[str, Any]],
    *,
    service: Any = None,
    engine: Any = None,
    registry: CollectorRegistry | None = None,
    model_name: str | None = None,
    metrics: NodeMetrics | None = None,
    max_pending: int = 64,
    health: Callable[[], dict[str, Any]] | None = None,
    console: bool = True,
    api_key: str | None = None,
) -> Starlette:
    """The node's HTTP app (see the module contract).

    ``api_key``: every request must carry it as a bearer token (``bootstrap/auth.py``).

    ``service``: the node's ``RoutedService`` (its ``engine`` is used when ``engine`` is not
    given). ``registry``: the one passed to ``RoutedService``; a fresh one when None.
    ``metrics``: an existing ``NodeMetrics`` for that registry (built here otherwise).
    ``health``: the state ``/health`` reports (``health.health_state`` of the engine and the
    service's node when None). ``console``: serve the web console at ``/`` and its JSON/SSE
    endpoints under ``/console/`` (``console/``).
    """
    if engine is None and service is not None:
        engine = service.engine
    if metrics is None:
        metrics = NodeMetrics(
            registry if registry is not None else CollectorRegistry(),
            node=getattr(service, "node", None),
            engine=engine,
            service=service,
        )
    api = _Api(
        service=service,
        engine=engine,
        metrics=metrics,
        model_name=model_name,
        max_pending=max_pending,
    )
    metrics.live.inflight = lambda: api.pending

    def counted(endpoint: str, handler: Callable[[Request], Awaitable[Response]]):
        async def wrapped(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as exc:
                response = exc.response()
            if not isinstance(response, _EventStream):  # a stream counts itself when done
                metrics.count_request(endpoint, response.status_code)
            return response

        return wrapped

    async def get_status(request: Request) -> JSONResponse:
        return JSONResponse(status())

    node = getattr(service, "node", None)
    health_of = health or (lambda: health_state(engine=engine, node=node))

    async def get_health(request: Request) -> JSONResponse:
        return health_response(health_of())

    async def get_peers(request: Request) -> JSONResponse:
        return JSONResponse(status().get("peers", []))

    async def get_metrics(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {
            "id": api.model_name,
            "object": "model",
            "created": api.created,
            "owned_by": "p2pnode",
            "p2pnode": {"model_id": api.model_id},
        }

    async def list_models(request: Request) -> JSONResponse:
        data = [model_card()] if api.model_id is not None else []
        return JSONResponse({"object": "list", "data": data})

    async def get_model(request: Request) -> JSONResponse:
        api.check_model({"model": request.path_params["model"]})
        return JSONResponse(model_card())

    def completions(chat: bool) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            job = api.parse(await api.read_json(request), chat=chat)
            api.admit()
            if job.stream:
                return _EventStream(api, job)
            try:
                out = await api.run(job, _ignore_text)
            except Exception as exc:
                raise _error_from_exception(exc, job.prompt_param) from None
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            headers = {
                "x-p2pnode-served-by": out.served_by or "",
                "x-p2pnode-cached-tokens": str(out.cached_tokens or 0),
            }
            return JSONResponse(api.completion_body(job, rid, out), headers=headers)

        return handle

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        code = "not_found" if exc.status_code == 404 else "method_not_allowed"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, message, code=code).response()

    routes = [
        Route("/health", counted("/health", get_health)),
        Route("/status", counted("/status", get_status)),
        Route("/peers", counted("/peers", get_peers)),
        Route("/metrics", counted("/metrics", get_metrics)),
        Route("/v1/models", counted("/v1/models", list_models)),
        Route("/v1/models/{model:path}", counted("/v1/models/{model}", get_model)),
        Route(
            "/v1/completions",
            counted("/v1/completions", completions(chat=False)),
            methods=["POST"],
        ),
        Route(
            "/v1/chat/completions",
            counted("/v1/chat/completions", completions(chat=True)),
            methods=["POST"],
        ),
    ]
    feed = None
    if console:
        from p2pnode.bootstrap.console import ConsoleFeed, console_routes

        feed = ConsoleFeed(status, service=service, engine=engine, metrics=metrics)
        api.on_outcome = feed.record_outcome
        routes += console_routes(feed, health_of)
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    if api_key:
        from p2pnode.bootstrap.auth import BearerAuth

        app.add_middleware(BearerAuth, api_key=api_key)
    app.state.metrics = metrics
    app.state.api = api
    app.state.console = feed
    return app


async def _ignore_text(text: str, logprobs: list[Any]) -> None:
    return None


KEEP_ALIVE_S = 75.0  # idle seconds before the server closes a keep-alive connection


async def serve_api(
    app: Starlette, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``app`` until cancelled; ``task_status.started`` gets ``"http://host:port"``.

    The socket is bound here (port 0 picks a free one) and handed to hypercorn as a duplicate
    file descriptor (hypercorn closes its copy, we close ours), so the caller learns the real
    port before any request arrives. Cancellation becomes hypercorn's graceful shutdown (open
    requests get ``SHUTDOWN_GRACE_S``) instead of a cancel that the app's lifespan task would
    report as a failure.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot listen for the HTTP API on {host}:{port} ({exc.strerror}); "
            "choose another --api-port (0 picks a free one)"
        ) from None
    sock.listen(128)
    bound = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{os.dup(sock.fileno())}"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = SHUTDOWN_GRACE_S
    # Longer than any client's idle keep-alive (httpx, the OpenAI SDK's transport: 5 s, which
    # is also hypercorn's default): the client always drops an idle connection first, so a
    # request is never written into one the server is closing at that instant ("server
    # disconnected without sending a response", seen once in a trial).
    config.keep_alive_timeout = KEEP_ALIVE_S
    shutdown = trio.Event()
    # Shielded: hypercorn must see the shutdown trigger, not the caller's cancellation; the
    # deadline set at shutdown bounds the wait if a connection never finishes.
    server_scope = trio.CancelScope(shield=True)

    async def run_server() -> None:
        with server_scope:
            await serve(app, config, shutdown_trigger=shutdown.wait)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_server)
            task_status.started(f"http://{host}:{bound}")
            try:
                await trio.sleep_forever()
            finally:
                shutdown.set()
                server_scope.deadline = trio.current_time() + SHUTDOWN_GRACE_S + 2.0
    finally:
        sock.close()
