"""What the API needs from the engine and the routed service it is given.

Both engines (``inference/engine.py`` and ``inference/vllm/engine.py``, through
``inference/_front.py``) satisfy ``ApiEngine``, and ``overlay/serve/service.py``'s ``RoutedService``
satisfies ``ApiService``. The routing layer's own needs of an engine are a different seam,
``inference/serving.py``'s ``ServingEngine``: the API adds text (encoding prompts and chats,
decoding answers) and reads nothing of the routing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from p2pnode.inference.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from p2pnode.overlay.serve.service import RoutedResult


class Tokenizer(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class FinishedStream(Protocol):
    finish_reason: str
    cached_tokens: int


class TokenStream(Protocol):
    """``ApiEngine.stream``'s answer: token ids as they are sampled."""

    @property
    def result(self) -> FinishedStream | None:
        """Set once the last token was received."""
        ...

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """One per token received so far. Read only when the request asked for logprobs: an
        engine that cannot compute them refuses such a request in ``stream`` (vLLM's stream
        has no ``logprobs``)."""
        ...

    def __aiter__(self) -> AsyncIterator[int]: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class ApiEngine(Protocol):
    model_id: str
    context_length: int
    vocab_size: int
    tokenizer: Tokenizer  # a token's own text (special tokens included), for logprobs

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The model's chat template applied; raises when it refuses the messages."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> TokenStream: ...


class ApiModels(Protocol):
    """Every model the swarm serves (``overlay/serve/swarm.py``'s ``SwarmModels``)."""

    @property
    def local_model(self) -> str | None:
        """The model this node runs (None on a light node)."""
        ...

    def listing(self) -> dict[str, int]:
        """Model id -> how many nodes serve it (this one counted)."""
        ...

    async def service(self, model: str, wait_s: float = 10.0) -> ApiService | None:
        """The routed service of a model this node does not run (None: nobody serves it)."""
        ...

    async def text(self, model: str) -> ApiEngine:
        """Its tokenizer and chat template, fetched from a peer the first time."""
        ...


@runtime_checkable
class ApiService(Protocol):
    """The node's routed service: the router may have a peer serve a request."""

    model_id: str
    engine: ApiEngine | None  # None on a routing-only node

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        on_token: Callable[[int], None] | None = None,
        on_logprob: Callable[[TokenLogprob], None] | None = None,
        private: bool = False,
        turn: int | None = None,
    ) -> RoutedResult: ...
