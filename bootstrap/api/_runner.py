"""Running one checked request: through the routed service (or the engine alone), tokens in,
text deltas out, counted in the node's metrics.

Contract:
- ``JobRunner.run(job, deliver)`` generates ``job`` and awaits ``deliver(text, logprobs)``
  with each text delta as it forms (and the log-probabilities of the tokens consumed since the
  last one), then returns the ``Outcome``. A stop string found in the text cancels the
  generation (``finish_reason`` "stop"; tokens and logprobs past it are dropped).
- Requests go through ``service`` (the router may have a peer serve them); without a service
  they run on ``engine``. Failures are the engine's/router's exceptions, raised once the
  tokens already received are consumed (``_errors.py`` maps them to answers).
- ``admit()`` refuses a request (503 ``no_capacity``) while ``max_pending`` are in flight.
- Time to first token, inter-token latency, duration and token counts go to ``metrics``;
  ``on_outcome`` (the console's feed) hears every finished request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

import trio

from p2pnode.bootstrap.api._bodies import Outcome, routing_summary
from p2pnode.bootstrap.api._errors import ApiError
from p2pnode.bootstrap.api._params import Job
from p2pnode.bootstrap.api._seams import ApiEngine, ApiService
from p2pnode.bootstrap.api._text import TextAssembler
from p2pnode.bootstrap.metrics import NodeMetrics
from p2pnode.inference.sampling import TokenLogprob

Deliver = Callable[[str, list[TokenLogprob]], Awaitable[None]]


class JobRunner:
    """Runs the API's requests (see the module contract); ``pending`` are in flight."""

    def __init__(
        self,
        *,
        service: ApiService | None,
        engine: ApiEngine | None,
        metrics: NodeMetrics,
        max_pending: int,
    ) -> None:
        self.on_outcome: Callable[[Job, Outcome], None] | None = None
        self.service = service
        self.engine = engine
        self.metrics = metrics
        self.max_pending = max_pending
        self.pending = 0

    def admit(self) -> None:
        if self.pending >= self.max_pending:
            raise ApiError(
                503,
                f"{self.pending} requests are already in flight on this node; retry shortly",
                type="server_error",
                code="no_capacity",
            )

    def token_text(self, token: int) -> str:
        """A token's own text, special tokens included (logprobs show every token)."""
        return self.engine.tokenizer.decode([token])

    def text_of(self, job: Job) -> Callable[[int], str]:
        """``token_text`` with the tokenizer of the job's model."""
        engine = job.engine or self.engine
        return lambda token: engine.tokenizer.decode([token])

    async def run(self, job: Job, deliver: Deliver) -> Outcome:
        started = time.perf_counter()
        text = TextAssembler((job.engine or self.engine).decode, job.stops)
        send, recv = trio.open_memory_channel[int](math.inf)
        out = Outcome(prompt_tokens=len(job.prompt))
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

                def fresh_logprobs() -> list[TokenLogprob]:
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
        job: Job,
        on_token: Callable[[int], None],
        out: Outcome,
        on_logprob: Callable[[TokenLogprob], None],
    ) -> None:
        service = job.service if job.engine is not None else self.service
        if service is not None:
            result = await service.generate(
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
            out.routing = routing_summary(result)
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
