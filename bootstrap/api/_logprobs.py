"""Log-probabilities in OpenAI's response shapes (the engine computes them; this only renders).

- Chat (``choice.logprobs``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": None}``.
- Completions (``choice.logprobs``): ``{"tokens", "token_logprobs", "top_logprobs" (one
  ``{token: logprob}`` map per token, or None when none were asked), "text_offset"}``.
- A token's text is its own decoding (special tokens included); ``bytes`` are that text's UTF-8
  bytes, so a token holding part of a multi-byte character shows U+FFFD there.
- ``parse_request`` reads the request options: completions take ``logprobs: int``; chat takes
  ``logprobs: bool`` and ``top_logprobs: int`` (which needs ``logprobs: true``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from p2pnode.errors import P2PNodeError
from p2pnode.inference.sampling import MAX_TOP_LOGPROBS, TokenLogprob

TokenText = Callable[[int], str]


class LogprobsOptionError(P2PNodeError, ValueError):
    """A logprobs option has the wrong type or range; ``param`` names it."""

    reason = "bad_logprobs_option"

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _count(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise LogprobsOptionError(
            f"{param} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}", param
        )
    return value


def parse_request(body: dict[str, Any], *, chat: bool) -> int | None:
    """How many alternatives per token the request asks for; None: no logprobs at all."""
    logprobs = body.get("logprobs")
    top = body.get("top_logprobs")
    if not chat:
        if top is not None:
            raise LogprobsOptionError(
                "top_logprobs is a chat option; on /v1/completions send logprobs=N", "top_logprobs"
            )
        return None if logprobs is None else _count(logprobs, "logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise LogprobsOptionError(f"logprobs must be a boolean, got {logprobs!r}", "logprobs")
    if top is not None:
        if not logprobs:
            raise LogprobsOptionError("top_logprobs needs logprobs: true", "top_logprobs")
        return _count(top, "top_logprobs")
    return 0 if logprobs else None


def _entry(token: int, logprob: float, text: TokenText) -> dict[str, Any]:
    s = text(token)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(lps: Sequence[TokenLogprob], text: TokenText) -> dict[str, Any]:
    content = []
    for lp in lps:
        entry = _entry(lp.token, lp.logprob, text)
        entry["top_logprobs"] = [_entry(t, v, text) for t, v in lp.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    lps: Sequence[TokenLogprob], text: TokenText, *, top: bool, offset: int = 0
) -> dict[str, Any]:
    """``offset``: characters of the answer before these tokens (later stream chunks)."""
    tokens, offsets = [], []
    for lp in lps:
        s = text(lp.token)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{text(t): v for t, v in lp.top} for lp in lps] if top else None,
        "text_offset": offsets,
    }
