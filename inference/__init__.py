"""p2pnode.inference: the local inference engine (no networking).

Public face:
- ``open_engine(loaded, ...)`` / ``Engine`` / ``GenerationResult`` / ``TokenStream`` (engine.py)
- ``SamplingParams``, ``probs_from_logits``, ``sample_token`` (sampling.py); ``Logits``, one
  row as the sampler reads it (a model's tensor or the emulated closed form), and
  ``LogitRows``, an answer's rows as the audits read them (scoring.py)
- ``RadixCache`` (radix.py), ``CostModel`` (costmodel.py)
- errors: ``EngineError`` and ``EmptyPrompt``, ``PromptTooLong``, ``InvalidToken``,
  ``InvalidParams`` (all ``ValueError``), ``EngineClosed``
- ``load_model`` / ``LoadedModel`` (models.py); block hashing lives in ``blockhash``.
- ``ServingEngine`` (serving.py): what the routing layer needs of an engine, the seam that the
  torch engine, the vLLM engine (``vllm/``) and the emulated one
  (emulated.py) all fill; ``OutputLengths`` (lengths.py): how long an answer is expected to be.

Map of the rest: the compute backends behind ``Engine`` (_backend.py, _backend_protocol.py;
the CPU kernel stack in ``_cpu/``: C decode and prefill kernels, KV slabs, attention; what the
loader and the kernels share in ``_common.py``), sampling
and scoring (sampling.py, scoring.py), the tokenizer without transformers (tokenizer.py). The
data sets live in ``p2pnode.datasets``.

Import submodules directly (``from p2pnode.inference.engine import open_engine``) or use these
lazy re-exports; importing this package alone does not import torch.
"""

from __future__ import annotations

from p2pnode._lazy import lazy_exports

_EXPORTS = {
    "open_engine": "engine",
    "Engine": "engine",
    "GenerationResult": "engine",
    "TokenStream": "engine",
    "SamplingParams": "sampling",
    "probs_from_logits": "sampling",
    "sample_token": "sampling",
    "Logits": "sampling",
    "LogitRows": "scoring",
    "RadixCache": "radix",
    "CostModel": "costmodel",
    "EngineError": "_errors",
    "EmptyPrompt": "_errors",
    "PromptTooLong": "_errors",
    "InvalidToken": "_errors",
    "InvalidParams": "_errors",
    "EngineClosed": "_errors",
    "load_model": "models",
    "ServingEngine": "serving",
    "OutputLengths": "lengths",
    "LoadedModel": "models",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
