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
  endpoints answer 503. What the API needs of both: ``ApiService``, ``ApiEngine``.
- Text is detokenized incrementally and never splits a UTF-8 character; ``stop`` strings end
  the answer and are not part of it. Streamed deltas concatenate to exactly the non-streamed
  text.
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
  ``top_logprobs=N``) come back in OpenAI's shapes, computed by the engine that served each
  token, forwarded or not; streamed chunks carry those of their tokens.
- Non-streamed answers carry headers ``x-p2pnode-served-by`` (peer id; ``local`` without an
  overlay) and ``x-p2pnode-cached-tokens``, and a ``p2pnode`` field (served_by, cached_tokens,
  routing summary); streams carry it in their finish chunk.
- Metrics (``NodeMetrics``, ``app.state.metrics``) are recorded in ``registry``; pass the
  registry given to ``RoutedService`` so its router/forward/digest counters are scraped too.

The path of a request, one job per module:
- ``_app.py``: ``build_app``: routes, model cards, the wiring below.
- ``_params.py``: the JSON body and every OpenAI parameter checked, the prompt encoded: a ``Job``.
- ``_runner.py``: ``JobRunner``: runs a job on the service or the engine, tokens to text
  deltas, in-flight limit, metrics.
- ``_text.py``: ``TextAssembler``: incremental detokenization and stop strings.
- ``_bodies.py``: OpenAI's response bodies and stream chunks (``_logprobs.py``: their
  ``logprobs``).
- ``_sse.py``: ``EventStream``: a streamed answer as server-sent events.
- ``_errors.py``: ``ApiError`` and the one table from engine/router failures to answers.
- ``_seams.py``: ``ApiEngine``, ``ApiService``: what the API needs of what it is given.
- ``_server.py``: ``serve_api``: hypercorn on a socket bound here, graceful shutdown.
"""

from p2pnode.bootstrap.api._app import build_app as build_app
from p2pnode.bootstrap.api._errors import ApiError as ApiError
from p2pnode.bootstrap.api._params import (
    DEFAULT_CHAT_MAX_TOKENS as DEFAULT_CHAT_MAX_TOKENS,
)
from p2pnode.bootstrap.api._params import (
    DEFAULT_COMPLETION_MAX_TOKENS as DEFAULT_COMPLETION_MAX_TOKENS,
)
from p2pnode.bootstrap.api._params import MAX_BODY_BYTES as MAX_BODY_BYTES
from p2pnode.bootstrap.api._seams import ApiEngine as ApiEngine
from p2pnode.bootstrap.api._seams import ApiService as ApiService
from p2pnode.bootstrap.api._server import KEEP_ALIVE_S as KEEP_ALIVE_S
from p2pnode.bootstrap.api._server import SHUTDOWN_GRACE_S as SHUTDOWN_GRACE_S
from p2pnode.bootstrap.api._server import serve_api as serve_api
from p2pnode.bootstrap.api._text import TextAssembler as TextAssembler

__all__ = [
    "DEFAULT_CHAT_MAX_TOKENS",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "KEEP_ALIVE_S",
    "MAX_BODY_BYTES",
    "SHUTDOWN_GRACE_S",
    "ApiEngine",
    "ApiError",
    "ApiService",
    "TextAssembler",
    "build_app",
    "serve_api",
]
