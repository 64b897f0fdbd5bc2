"""The HTTP API's one table from engine and router failures to OpenAI-style errors."""

from __future__ import annotations

import json
import logging

import pytest

from p2pnode.bootstrap.api import ApiError
from p2pnode.bootstrap.api._errors import error_from_exception
from p2pnode.inference._errors import (
    EmptyPrompt,
    EngineClosed,
    InvalidParams,
    InvalidToken,
    PromptTooLong,
)
from p2pnode.overlay.serve.forward import NoRouteError


@pytest.mark.parametrize(
    "exc, status, code, param",
    [
        (PromptTooLong("9000 tokens do not fit"), 400, "context_length_exceeded", "messages"),
        (EmptyPrompt("no tokens"), 400, "invalid_prompt", "messages"),
        (InvalidToken("token 99999"), 400, "invalid_prompt", "messages"),
        (InvalidParams("top_p out of range"), 400, "invalid_parameter", None),
        (NoRouteError("no peer serves this model"), 503, "no_capacity", None),
        (EngineClosed("stopped"), 503, None, None),
    ],
)
def test_failures_map_to_their_answer(exc, status, code, param) -> None:
    error = error_from_exception(exc, "messages")
    assert (error.status, error.code, error.param) == (status, code, param)
    assert str(exc) in error.message
    assert error.type == ("server_error" if status == 503 else "invalid_request_error")
    response = error.response()
    assert response.status_code == status
    assert json.loads(response.body)["error"]["code"] == code
    assert (response.headers.get("retry-after") == "1") == (status == 503)


def test_an_api_error_passes_through_and_anything_else_is_a_logged_500(caplog) -> None:
    mine = ApiError(404, "no such model", code="model_not_found")
    assert error_from_exception(mine, "prompt") is mine
    with caplog.at_level(logging.ERROR, logger="p2pnode.api"):
        error = error_from_exception(KeyError("slot"), "prompt")
    assert (error.status, error.code, error.type) == (500, "internal", "server_error")
    assert "KeyError" in error.message and "log" in error.message
    assert any(r.exc_info for r in caplog.records)  # the traceback is in the node's log
