"""OpenAI-style error answers, and the one table that maps our failures to them.

Contract:
- ``ApiError(status, message, *, type, param, code)`` is the answer ``{"error": {"message",
  "type", "param", "code"}}``; ``response()`` renders it (a 503 adds ``retry-after: 1``).
- ``bad(message, param, code)`` is the 400 of a request the client must change.
- ``error_from_exception(exc, prompt_param)`` answers a failure raised while a request ran:
  ``_ANSWERS`` is keyed by ``reason`` (``p2pnode.errors``), looked up along the exception's
  class and then its bases, so an error with no row of its own takes its parent's (bad prompt
  or parameters 400, no node able to serve 503, engine closing 503); anything else is a 500,
  logged with its traceback. ``prompt_param`` ("prompt" or "messages") is named as the
  ``param`` of errors about the prompt.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from p2pnode.errors import P2PNodeError

log = logging.getLogger("p2pnode.api")


class ApiError(P2PNodeError):
    """An OpenAI-style error answer; ``message`` says what the client should change."""

    reason = "api_error"

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


def bad(message: str, param: str | None = None, code: str = "invalid_parameter") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class _Answer:
    status: int
    code: str | None
    type: str = "invalid_request_error"
    about_prompt: bool = False  # ``param`` is the request's prompt field
    message: str = "{}"  # formatted with the exception's text


# Keyed by ``reason``: the engine's (``p2pnode.inference``) and the router's
# (``p2pnode.overlay.serve.forward``) refusals; ``engine_error`` answers every other ``EngineError``.
_ANSWERS: dict[str, _Answer] = {
    "prompt_too_long": _Answer(400, "context_length_exceeded", about_prompt=True),
    "empty_prompt": _Answer(400, "invalid_prompt", about_prompt=True),
    "invalid_token": _Answer(400, "invalid_prompt", about_prompt=True),
    "engine_error": _Answer(400, "invalid_parameter"),
    "no_route": _Answer(503, "no_capacity", type="server_error"),
    "engine_closed": _Answer(
        503,
        None,
        type="server_error",
        message="the engine is shutting down: {}; retry on another node",
    ),
}


def _answer_for(exc: BaseException) -> _Answer | None:
    """The row of the nearest class of ``exc`` (itself, then its bases) that has one."""
    for cls in type(exc).__mro__:
        if issubclass(cls, P2PNodeError) and (answer := _ANSWERS.get(cls.reason)) is not None:
            return answer
    return None


def error_from_exception(exc: BaseException, prompt_param: str) -> ApiError:
    """The answer to ``exc``, raised while a request ran (see the module contract)."""
    if isinstance(exc, ApiError):
        return exc
    answer = _answer_for(exc)
    if answer is not None:
        return ApiError(
            answer.status,
            answer.message.format(exc),
            type=answer.type,
            param=prompt_param if answer.about_prompt else None,
            code=answer.code,
        )
    log.exception("request failed", exc_info=exc)
    return ApiError(
        500,
        f"internal error: {type(exc).__name__}: {exc}; the node's log has the traceback",
        type="server_error",
        code="internal",
    )
