"""OpenAI request parameters: the JSON body in, a checked ``Job`` out.

Contract:
- ``read_json(request)`` reads a body of at most ``MAX_BODY_BYTES`` that must be a JSON object
  (413 / 400 ``invalid_json`` otherwise).
- ``ModelNames.check(model)``: the model a request names must be the one this node serves (its
  display name, its model id, or either without the ``@<hash>`` part); none named means that
  one. Unknown: 404 ``model_not_found``; a node without a model: 503 ``no_model``.
- ``pick_model(model, listing, local)``: the same for a node that knows every model of the
  swarm (``ApiModels``): any model some node serves; unknown: 404 naming them all.
- ``parse_job(body, chat=..., model=..., engine=...)`` checks every OpenAI parameter and
  encodes the prompt with ``engine`` (chat: its chat template). Bad values are 400s that name
  the ``param`` and the accepted range; prompt + max_tokens over the context is 400
  ``context_length_exceeded``; options we do not implement (n > 1, penalties, logit_bias,
  echo, suffix, tools, response formats other than text) are refused rather than ignored.
  No engine: 503 ``no_tokenizer``.
- ``max_tokens`` defaults: completions 16 (OpenAI's), chat "until done", capped by
  ``DEFAULT_CHAT_MAX_TOKENS`` and the context.
- ``"p2pnode": {"private": true}`` (OpenAI clients: ``extra_body``) keeps the request on this
  node; a chat's earlier assistant answers are its ``turn`` (the router's look-ahead for
  sessions, ``overlay/routing/sessions.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from p2pnode.bootstrap.api import _logprobs
from p2pnode.bootstrap.api._errors import ApiError, bad
from p2pnode.bootstrap.api._seams import ApiEngine, ApiService
from p2pnode.inference.sampling import SamplingParams

MAX_BODY_BYTES = 8 << 20
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # the hold-back check is quadratic in a stop string's length
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 1024  # chat defaults to "until done": capped by this and the context
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


@dataclass
class Job:
    """One checked request, ready to run."""

    endpoint: str  # "/v1/completions" or "/v1/chat/completions"
    chat: bool
    model: str
    prompt: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    prompt_param: str  # "prompt" or "messages", for error answers
    private: bool = False  # never leaves this node
    turn: int | None = None  # chat: earlier assistant answers in the messages
    # Another model of the swarm than this node's own: its routed service and text side.
    service: ApiService | None = None
    engine: ApiEngine | None = None


async def read_json(request: Request) -> dict[str, Any]:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(
                413,
                f"request body over {MAX_BODY_BYTES} bytes; send a shorter prompt",
                code="too_large",
            )
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad("the body must be a JSON object", code="invalid_json")
    return data


@dataclass(frozen=True)
class ModelNames:
    """The names a request may give this node's one model."""

    model_id: str | None
    name: str | None  # what /v1/models lists
    accepted: frozenset[str]

    @classmethod
    def of(cls, model_id: str | None, model_name: str | None) -> ModelNames:
        name = model_name or model_id
        names = {n for n in (name, model_id) if n}
        # Also the bare model name ("SmolLM2-135M-Instruct" for "...@<hash>").
        return cls(model_id, name, frozenset(names | {n.split("@", 1)[0] for n in names}))

    def check(self, model: Any) -> str:
        if self.model_id is None:
            raise ApiError(
                503,
                "this node serves no model; start it with --model",
                type="server_error",
                code="no_model",
            )
        if model is None:
            return self.name  # lenient: the one model this node serves
        if not isinstance(model, str) or model not in self.accepted:
            raise ApiError(
                404,
                f"The model {model!r} does not exist on this node; it serves "
                f"{self.name!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return model


def pick_model(model: Any, listing: Mapping[str, int], local: str | None) -> str:
    """The swarm's model a request names: its model id, or its bare name (this node's own
    first); none named means this node's own, or the swarm's only one. Unknown: 404
    ``model_not_found`` naming what the swarm serves."""
    if not listing:
        raise ApiError(
            503,
            "no node in this swarm serves a model yet (none seen so far); retry shortly",
            type="server_error",
            code="no_model",
        )
    if model is None:
        if local is not None:
            return local
        if len(listing) == 1:
            return next(iter(listing))
        raise bad(f"name a model: this swarm serves {sorted(listing)}", "model", "model_required")
    if isinstance(model, str):
        if model in listing:
            return model
        bare = [m for m in listing if m.split("@", 1)[0] == model]
        if local in bare:
            return local
        if len(bare) == 1:
            return bare[0]
    raise ApiError(
        404,
        f"The model {model!r} is not served in this swarm; it serves {sorted(listing)} "
        "(see GET /v1/models)",
        param="model",
        code="model_not_found",
    )


def parse_job(body: dict[str, Any], *, chat: bool, model: str, engine: ApiEngine | None) -> Job:
    """The checked request (see the module contract); ``model`` is ``ModelNames.check``'s."""
    if engine is None:
        raise ApiError(
            503,
            "this node runs no engine, so it cannot turn text into tokens; send the "
            "request to a node started with --model",
            type="server_error",
            code="no_tokenizer",
        )
    _reject_unsupported(body, chat=chat)
    prompt_param = "messages" if chat else "prompt"
    prompt = _chat_prompt(body, engine) if chat else _completion_prompt(body, engine)
    if not prompt:
        raise bad("the prompt is empty; send some text", prompt_param, "invalid_prompt")
    max_tokens = _max_tokens(body, chat, len(prompt), int(engine.context_length), prompt_param)
    temperature = _number(body, "temperature", 2.0)
    # top_p 0 means "only the most likely token"; the engine keeps the argmax for any top_p.
    top_p = max(_number(body, "top_p", 1.0), 1e-9)
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
        raise bad(f"seed must be a 64-bit integer, got {seed!r}", "seed")
    stops = _parse_stop(body.get("stop"))
    stream, include_usage = _parse_stream(body)
    try:
        logprobs = _logprobs.parse_request(body, chat=chat)
    except _logprobs.LogprobsOptionError as exc:
        raise bad(str(exc), exc.param) from None
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop_token_ids=_stop_token_ids(stops, engine),
            logprobs=logprobs,
        )
    except ValueError as exc:
        raise bad(str(exc)) from None
    return Job(
        "/v1/chat/completions" if chat else "/v1/completions",
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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _max_tokens(body: dict[str, Any], chat: bool, prompt: int, context: int, param: str) -> int:
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        default = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
        max_tokens = max(1, min(default, context - prompt))
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise bad(f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    if prompt + max_tokens > context:
        raise bad(
            f"This model's maximum context length is {context} tokens. However, you "
            f"requested {prompt + max_tokens} tokens ({prompt} in the {param}, {max_tokens} "
            f"for the completion). Please reduce the length of the {param} or max_tokens.",
            param,
            "context_length_exceeded",
        )
    return max_tokens


def _number(body: dict[str, Any], name: str, high: float) -> float:
    """``body[name]`` in [0, high]; 1.0 when absent or null (OpenAI's default for both)."""
    value = body.get(name, 1.0)
    if value is None:
        value = 1.0
    if not _is_number(value) or not 0 <= value <= high:
        raise bad(f"{name} must be a number in [0, {high:g}], got {value!r}", name)
    return float(value)


def _parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad(f"stream must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    return stream, bool(options.get("include_usage", False))


def _stop_token_ids(stops: Sequence[str], engine: ApiEngine) -> tuple[int, ...]:
    # A stop string that is exactly one token stops the engine itself (no wasted tokens);
    # longer ones are matched on the text and cancel the generation.
    ids = []
    for s in stops:
        enc = engine.encode(s)
        if len(enc) == 1 and engine.decode(enc) in ("", s):
            ids.append(enc[0])
    return tuple(ids)


def _completion_prompt(body: dict[str, Any], engine: ApiEngine) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return engine.encode(prompt)
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        vocab = int(engine.vocab_size)
        wrong = next((t for t in prompt if not 0 <= t < vocab), None)
        if wrong is not None:
            raise bad(
                f"token id {wrong} is outside the vocabulary [0, {vocab})",
                "prompt",
                "invalid_prompt",
            )
        return list(prompt)
    if isinstance(prompt, list):
        raise bad(
            "only one prompt per request is supported: send a string or a list of token ids",
            "prompt",
            "invalid_prompt",
        )
    raise bad("prompt must be a string or a list of token ids", "prompt", "invalid_prompt")


def _chat_prompt(body: dict[str, Any], engine: ApiEngine) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages", "invalid_messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise bad(
                f"messages[{i}] needs a role in {sorted(CHAT_ROLES)}",
                f"messages[{i}].role",
                "invalid_messages",
            )
        role = "system" if m["role"] == "developer" else m["role"]
        clean.append({"role": role, "content": _message_text(m.get("content"), i)})
    try:
        return engine.encode_chat(clean)
    except Exception as exc:  # the chat template refused these messages
        raise bad(
            f"the model's chat template cannot render these messages: {exc}",
            "messages",
            "invalid_messages",
        ) from None


def _message_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(
                    f"messages[{i}].content: only text parts are supported",
                    f"messages[{i}].content",
                    "invalid_messages",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad(f"messages[{i}].content: a text part needs a string 'text'")
            parts.append(text)
        return "".join(parts)
    raise bad(
        f"messages[{i}].content must be a string or a list of text parts",
        f"messages[{i}].content",
        "invalid_messages",
    )


def _chat_turn(body: dict[str, Any]) -> int:
    """Earlier assistant answers in a (validated) chat body: 0 for a session's first turn."""
    return sum(1 for m in body["messages"] if m.get("role") == "assistant")


def _parse_private(body: dict[str, Any]) -> bool:
    ext = body.get("p2pnode")
    if ext is None:
        return False
    if not isinstance(ext, dict) or set(ext) - {"private"}:
        raise bad('p2pnode must be an object like {"private": true}', "p2pnode")
    private = ext.get("private", False)
    if not isinstance(private, bool):
        raise bad(f"p2pnode.private must be a boolean, got {private!r}", "p2pnode.private")
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
        raise bad(
            f"stop must be a string of 1 to {MAX_STOP_CHARS} characters or a list of up to "
            f"{MAX_STOP_STRINGS} of them",
            "stop",
        )
    return tuple(stop)


def _reject_unsupported(body: dict[str, Any], *, chat: bool) -> None:
    """Options we do not implement are refused rather than silently ignored."""
    n = body.get("n")
    if n is not None and n != 1:
        raise bad("only n=1 is supported; send one request per answer", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad("only best_of=1 is supported; leave it out", "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0):
            raise bad(f"{name} is not supported (send 0 or leave it out)", name)
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported; leave it out", "logit_bias")
    if not chat and body.get("echo"):
        raise bad("echo is not supported; leave it out", "echo")
    if not chat and body.get("suffix"):
        raise bad("suffix is not supported; leave it out", "suffix")
    if chat and (body.get("tools") or body.get("functions")):
        raise bad("tool and function calls are not supported; leave tools out", "tools")
    fmt = body.get("response_format")
    if chat and fmt not in (None, {"type": "text"}):
        raise bad("only response_format {'type': 'text'} is supported", "response_format")
