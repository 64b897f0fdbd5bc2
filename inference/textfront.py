"""A model's text side without its weights: what an entry node needs of a model it does not run.

Contract: ``TextFront(light)`` wraps a ``LightModel`` (``models.tokenizer_model``: the real
tokenizer and chat template, no torch) with the engines' own text helpers and request checks
(``_front.EngineFront``): ``encode``, ``encode_chat``, ``decode``, ``validate`` answer exactly as
an engine of that model would. ``stream`` refuses: requests for it go to the peers that run it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from p2pnode.inference._errors import EngineError
from p2pnode.inference._front import EngineFront
from p2pnode.inference.models import LightModel
from p2pnode.inference.sampling import SamplingParams


class NoLocalEngine(EngineError):
    """This node runs no engine for the model; only its peers can serve it."""

    reason = "no_local_engine"


class TextFront(EngineFront):
    """See the module contract."""

    def __init__(self, light: LightModel) -> None:
        self.loaded = light
        self.model_id = light.model_id
        self.tokenizer = light.tokenizer
        self.vocab_size = light.vocab_size
        self.context_length = light.context_length
        self.eos_token_ids = frozenset(light.eos_token_ids)
        self._listeners = []

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams | Mapping | None = None):
        raise NoLocalEngine(f"this node runs no engine for {self.model_id}")
