"""Errors raised by the inference engine for bad requests (all are ``ValueError``s)."""

from __future__ import annotations


class EngineError(ValueError):
    """A request the engine refuses; the message says what to change."""


class EmptyPrompt(EngineError):
    pass


class PromptTooLong(EngineError):
    pass


class InvalidToken(EngineError):
    pass


class InvalidParams(EngineError):
    pass


class EngineClosed(RuntimeError):
    """The engine was shut down before (or while) the request ran."""
