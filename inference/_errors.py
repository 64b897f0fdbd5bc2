"""Errors raised by the inference engine.

``EngineError`` and its subclasses are requests the engine refuses (all ``ValueError``s: the
caller must change the request). ``EngineClosed`` is no such refusal (the same request may succeed
on another engine), so it stays a ``RuntimeError`` outside ``EngineError``: a handler that answers
``EngineError`` with "fix your request" must not catch it.
"""

from __future__ import annotations

from p2pnode.errors import P2PNodeError


class EngineError(P2PNodeError, ValueError):
    """A request the engine refuses; the message says what to change."""

    reason = "engine_error"


class EmptyPrompt(EngineError):
    reason = "empty_prompt"


class PromptTooLong(EngineError):
    reason = "prompt_too_long"


class InvalidToken(EngineError):
    reason = "invalid_token"


class InvalidParams(EngineError):
    reason = "invalid_params"


class EngineClosed(P2PNodeError, RuntimeError):
    """The engine was shut down before (or while) the request ran."""

    reason = "engine_closed"
