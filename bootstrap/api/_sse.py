"""The server-sent events of one streamed request (``stream: true``).

Contract:
- OpenAI's chunk format (``_bodies.chunk``): for chat, a first chunk with the role; one chunk
  per text delta (with the logprobs of its tokens); the chunk with the finish reason (and the
  ``p2pnode`` field); the usage chunk when ``stream_options.include_usage``; ``data: [DONE]``.
- The status line waits for the first text (or the end): a request that fails before its
  first token still gets a JSON error with its status code; after it, the error arrives as a
  ``data: {"error": ...}`` event that ends the stream.
- A client that disconnects cancels the generation; the request is counted as status 499.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import trio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from p2pnode.bootstrap.api._bodies import chunk, render_logprobs
from p2pnode.bootstrap.api._errors import error_from_exception
from p2pnode.bootstrap.api._params import Job
from p2pnode.bootstrap.api._runner import JobRunner
from p2pnode.inference.sampling import TokenLogprob


class EventStream(Response):
    """Server-sent events of one generation, started lazily (see the module contract)."""

    media_type = "text/event-stream"

    def __init__(self, runner: JobRunner, job: Job) -> None:
        self.runner = runner
        self.job = job
        self.status_code = 200
        self.background = None
        self.rid = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        runner, job = self.runner, self.job
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
                await event(chunk(job, self.rid, self.created, text="", role=True))

        offset = 0  # characters sent so far (text_offset of completions' logprobs)

        async def deliver(text: str, lps: list[TokenLogprob]) -> None:
            nonlocal offset
            await start()
            token_text = runner.text_of(job)
            logprobs = render_logprobs(job, lps, token_text, offset)
            offset += sum(len(token_text(lp.token)) for lp in lps)
            await event(chunk(job, self.rid, self.created, text=text, logprobs=logprobs))

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
                out = await runner.run(job, deliver)
            except Exception as exc:
                error = error_from_exception(exc, job.prompt_param)
                status, finished = error.status, True
                if started:  # too late for a status code: an error event ends the stream
                    await event(error.body())
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                else:
                    await error.response()(scope, receive, send)
            else:
                finished = True
                await start()
                await event(chunk(job, self.rid, self.created, finish=out))
                if job.include_usage:
                    await event(chunk(job, self.rid, self.created, finish=out, usage=True))
                await event("[DONE]")
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            nursery.cancel_scope.cancel()
        runner.metrics.count_request(job.endpoint, status)
