"""OpenAI response shapes: what one request produced (``Outcome``), as a body or a chunk.

Contract:
- ``completion_body`` is a non-streamed answer (``text_completion`` or ``chat.completion``);
  ``chunk`` is one server-sent event of a stream (``chat.completion.chunk``; completions
  reuse ``text_completion``): a delta, the finish chunk, or the usage chunk of
  ``stream_options.include_usage``.
- ``usage.prompt_tokens_details.cached_tokens``: the prompt tokens served from a prefix cache.
- Both carry a ``p2pnode`` field (served_by, served_locally, cached_tokens, routing summary,
  total_s); a stream carries it in the chunk with the finish reason, as the serving node is
  only known at the end. ``served_by`` is null when a stop string cancelled the generation.
- ``render_logprobs`` gives ``logprobs`` in OpenAI's shape for the endpoint (``_logprobs.py``),
  or None when the request asked for none; ``offset`` is the completion text already sent
  (``text_offset``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from p2pnode.bootstrap.api import _logprobs
from p2pnode.bootstrap.api._params import Job
from p2pnode.inference.sampling import TokenLogprob

if TYPE_CHECKING:
    from p2pnode.overlay.serve.service import RoutedResult


@dataclass
class Outcome:
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
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked
    routed: RoutedResult | None = None  # when the router handled the request

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


def routing_summary(result: RoutedResult) -> dict[str, Any]:
    d = result.decision
    return {
        "request_id": d.request_id,
        "chosen": d.chosen,
        "reason": d.reason,
        "fell_back": len(result.attempts) > 1,
        "attempts": [a.as_dict() for a in result.attempts],
    }


def render_logprobs(
    job: Job, lps: list[TokenLogprob], token_text: Callable[[int], str], offset: int = 0
) -> dict[str, Any] | None:
    if job.params.logprobs is None:
        return None
    if job.chat:
        return _logprobs.chat_logprobs(lps, token_text)
    top = job.params.logprobs > 0
    return _logprobs.completion_logprobs(lps, token_text, top=top, offset=offset)


def completion_body(
    job: Job, rid: str, out: Outcome, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    if job.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
        }
    else:
        choice = {
            "index": 0,
            "text": out.text,
            "logprobs": logprobs,
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
    job: Job,
    rid: str,
    created: int,
    *,
    text: str | None = None,
    role: bool = False,
    finish: Outcome | None = None,
    usage: bool = False,
    logprobs: dict[str, Any] | None = None,
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
