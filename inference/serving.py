"""What a node's routing layer needs from an engine: the seam between inference and overlay.

Both engines (``inference/engine.py``, the CPU scheduler; ``inference/vllm/engine.py``) satisfy
``ServingEngine``; ``overlay/serve/service.py`` and ``overlay/serve/forward.py`` use nothing else of them.
A third engine is one class with these members.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from p2pnode.inference._front import TokenStreamBase
from p2pnode.inference.blockhash import BlockEvent
from p2pnode.inference.costmodel import CostModel
from p2pnode.inference.lengths import OutputLengths
from p2pnode.inference.sampling import SamplingParams


@runtime_checkable
class ServingEngine(Protocol):
    model_id: str
    cost: CostModel  # calibrated speeds: advertised in digests, used by the router
    lengths: OutputLengths  # recent completion lengths: the router's decode term

    @property
    def queue_depth(self) -> int: ...

    def estimated_wait_s(self, prefill_tokens: int | None = None) -> float:
        """Seconds a new request loses to the work already here: for one with that many
        uncached prompt tokens, or (None) a bound for any request."""
        ...

    def cached_prefix_len(self, prompt_ids: Sequence[int]) -> int:
        """Tokens of ``prompt_ids`` the engine's own cache holds (exact, not a digest)."""
        ...

    def cached_block_hashes(self) -> set[int]: ...

    def add_block_listener(self, fn: Callable[[BlockEvent], None]) -> None:
        """``fn`` hears every block stored in or evicted from the cache (digests follow it)."""
        ...

    def validate(
        self, prompt_ids: Sequence[int], params: SamplingParams | Mapping | None = None
    ) -> tuple[list[int], SamplingParams]:
        """The request's checks without queueing it; raises the ``EngineError`` ``stream``
        would."""
        ...

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams | Mapping | None = None
    ) -> TokenStreamBase: ...
