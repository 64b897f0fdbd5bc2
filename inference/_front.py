"""The request front both engines share (the CPU scheduler in ``engine`` and vLLM's wrapper).

Contract: a subclass sets ``tokenizer``, ``vocab_size``, ``context_length`` and
``_listeners`` and implements ``stream(prompt_ids, params)`` returning an async iterator of
token ids with ``.result`` and ``aclose()``. It then gets the same text helpers, the same
request validation (same errors, same messages) and ``generate`` — so a router or the API
cannot tell which engine sits behind a node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import trio

from p2pnode.inference._errors import EmptyPrompt, InvalidParams, InvalidToken, PromptTooLong
from p2pnode.inference.blockhash import BlockEvent
from p2pnode.inference.sampling import SamplingParams


class _CachedBlocks(Protocol):
    """What an engine's ``tree`` answers about the prefix cache (the radix tree, or vLLM's)."""

    def prefix_len(self, tokens: Sequence[int]) -> int: ...
    def cached_block_hashes(self) -> set[int]: ...


class EngineFront:
    tokenizer: Any
    vocab_size: int
    context_length: int
    tree: _CachedBlocks
    _listeners: list[Callable[[BlockEvent], None]]

    # ---- cache views -----------------------------------------------------------------------
    def cached_prefix_len(self, prompt_ids: Sequence[int]) -> int:
        return self.tree.prefix_len(prompt_ids)

    def cached_block_hashes(self) -> set[int]:
        return self.tree.cached_block_hashes()

    # ---- text helpers ----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a chat (``[{"role": ..., "content": ...}]``) ready for the reply."""
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def add_block_listener(self, fn: Callable[[BlockEvent], None]) -> None:
        self._listeners.append(fn)

    # ---- requests --------------------------------------------------------------------------
    def validate(
        self, prompt_ids: Sequence[int], params: SamplingParams | Mapping | None = None
    ) -> tuple[list[int], SamplingParams]:
        """Check a request without queueing it: ``(prompt, params)`` or the ``EngineError``
        subclass ``stream`` would raise (used by routers before anything leaves the node)."""
        if params is None:
            params = SamplingParams()
        elif isinstance(params, Mapping):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise InvalidParams(f"params must be SamplingParams or a dict, got {type(params)}")
        if isinstance(prompt_ids, str | bytes):
            raise InvalidToken("prompt_ids must be token ids; use engine.encode(text) first")
        prompt = list(prompt_ids)
        if not prompt:
            raise EmptyPrompt("the prompt has no tokens; send at least one token id")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidToken(f"token id {t!r} is not an int in [0, {self.vocab_size})")
        if len(prompt) + params.max_tokens > self.context_length:
            raise PromptTooLong(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.context_length} tokens; shorten the prompt or max_tokens"
            )
        return prompt, params

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams | Mapping | None = None):
        raise NotImplementedError

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | Mapping | None = None
    ) -> Any:
        """Run a request to the end; returns the stream's ``GenerationResult``."""
        stream = self.stream(prompt_ids, params)
        try:
            async for _ in stream:
                pass
        finally:
            if stream.result is None:
                await stream.aclose()
        assert stream.result is not None
        return stream.result


class TokenStreamBase:
    """Async iterator of generated token ids; ``result`` is set after the last one.

    Subclasses say how to cancel their request (``_cancel``) and when it has ended
    (``_ended``); leaving the iteration early, or ``aclose()``, cancels it.
    """

    def __init__(self, engine: Any, req: Any, recv: trio.MemoryReceiveChannel) -> None:
        self._engine = engine
        self._req = req
        self._recv = recv

    @property
    def result(self) -> Any:
        return self._req.result

    def __aiter__(self) -> TokenStreamBase:
        return self

    async def __anext__(self) -> int:
        try:
            return await self._recv.receive()
        except trio.EndOfChannel:
            if self._req.error is not None:
                raise self._req.error from None
            raise StopAsyncIteration from None
        except BaseException:
            self._cancel()
            raise

    async def aclose(self) -> None:
        """Stop early: the request is cancelled and its resources freed."""
        if not self._ended():
            self._cancel()
        await self._recv.aclose()

    def _cancel(self) -> None:
        raise NotImplementedError

    def _ended(self) -> bool:
        raise NotImplementedError
