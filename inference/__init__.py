"""p2pnode.inference: the local inference engine (no networking).

Public face:
- ``open_engine(loaded, ...)`` / ``Engine`` / ``GenerationResult`` / ``TokenStream`` (engine.py)
- ``SamplingParams``, ``probs_from_logits``, ``sample_token`` (sampling.py)
- ``RadixCache`` (radix.py), ``CostModel`` (costmodel.py)
- errors: ``EngineError`` and ``EmptyPrompt``, ``PromptTooLong``, ``InvalidToken``,
  ``InvalidParams`` (all ``ValueError``), ``EngineClosed``
- ``load_model`` / ``LoadedModel`` (models.py); block hashing lives in ``blockhash``.

Import submodules directly (``from p2pnode.inference.engine import open_engine``) or use these
lazy re-exports; importing this package alone does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "open_engine": "engine",
    "Engine": "engine",
    "GenerationResult": "engine",
    "TokenStream": "engine",
    "SamplingParams": "sampling",
    "probs_from_logits": "sampling",
    "sample_token": "sampling",
    "RadixCache": "radix",
    "CostModel": "costmodel",
    "EngineError": "_errors",
    "EmptyPrompt": "_errors",
    "PromptTooLong": "_errors",
    "InvalidToken": "_errors",
    "InvalidParams": "_errors",
    "EngineClosed": "_errors",
    "load_model": "models",
    "LoadedModel": "models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'p2pnode.inference' has no attribute {name!r}")
    return getattr(importlib.import_module(f"p2pnode.inference.{module}"), name)
