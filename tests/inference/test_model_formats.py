"""Models beyond the default (inference/models.py): a GGUF file of another architecture and a
bf16 folder each load and serve, with answers equal to their fp32 reference within the
tolerance each test states.

References are plain transformers (no C kernels) in fp32, greedy: tests/inference's
``hf_greedy``. The Gemma GGUF comes from the registry packages ``make setup`` installs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2pnode.inference.engine import SamplingParams, open_engine
from p2pnode.inference.models import load_model

from testkit import models

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
NEW = 8


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    return models.gemma_gguf()


def teacher_forced_logits(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """The logits that pick each answer token (rows len(prompt)-1 .. end-1), in fp32."""
    with torch.inference_mode():
        ids = torch.tensor([prompt + answer])
        return model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()


async def _served(loaded, prompts: list[list[int]]) -> list[list[int]]:
    async with open_engine(loaded, calibrate_cost=False, torch_threads=2) as engine:
        params = SamplingParams(max_tokens=NEW, temperature=0)
        return [(await engine.generate(p, params)).tokens for p in prompts]


@pytest.mark.slow
async def test_a_gguf_file_of_another_architecture_serves_its_reference(gemma_gguf) -> None:
    """Tolerance: none on tokens. The GGUF is dequantized once to fp32 (exact: Q4_K values
    are small integers times fp16 scales), and the node runs it in fp32 with the C linear
    kernels, which differ from torch's matmul by float rounding only (logits within 1e-3 of
    their scale), far below the top-2 margins of these greedy answers."""
    node = load_model(gemma_gguf)  # what `--model FILE.gguf` runs
    assert node.model_id.startswith(gemma_gguf.stem + "@")
    assert "gemma3" in node.compute and "no C fast path" in node.compute
    ref = load_model(gemma_gguf, accelerate=False)
    assert ref.model_id == node.model_id
    eos = set(ref.eos_token_ids)
    prompts = [ref.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    want = [models.hf_greedy(ref.model, eos, p, NEW) for p in prompts]
    assert await _served(node, prompts) == want
    for p, a in zip(prompts, want, strict=True):
        got = teacher_forced_logits(node.model, p, a)
        exp = teacher_forced_logits(ref.model, p, a)
        assert (got - exp).abs().max() <= 1e-3 * exp.abs().max()


@pytest.mark.slow
async def test_a_bf16_folder_serves_in_bf16_within_its_rounding(tmp_path) -> None:
    """Tolerance: bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per value), and 30
    layers add those roundings up, so logits move against fp32 by a few percent of their
    scale: the bound is 10 % of the largest reference logit (a different model, not a
    rounding, would move them by their whole scale). Each served token must be the fp32
    reference's greedy choice, unless the bf16 rounding measured at that very position (the
    change of the two competing logits) exceeds the reference's margin between them: then
    either is a correct answer, and the answer is compared no further."""
    fp32 = load_model(None, accelerate=False)
    folder = tmp_path / "SmolLM2-135M-Instruct-bf16"
    fp32.model.to(torch.bfloat16).save_pretrained(folder)
    fp32.tokenizer.save_pretrained(folder)
    fp32.model.to(torch.float32)

    node = load_model(folder, dtype="auto")  # what --dtype auto (the default) runs
    assert node.model.dtype == torch.bfloat16 and "bfloat16" in node.compute
    assert node.model_id != fp32.model_id  # other weights, another id
    assert load_model(folder, dtype="float32", accelerate=False).model_id != node.model_id

    eos = set(fp32.eos_token_ids)
    prompts = [fp32.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    served = await _served(node, prompts)
    compared = 0
    for p, answer in zip(prompts, served, strict=True):
        assert answer, "no tokens served"
        ref = teacher_forced_logits(fp32.model, p, answer)
        bf = teacher_forced_logits(node.model, p, answer)
        assert (bf - ref).abs().max() <= 0.1 * ref.abs().max()
        for i, tok in enumerate(answer):
            best = int(ref[i].argmax())
            if tok != best:
                margin = float(ref[i, best] - ref[i, tok])
                moved = float((bf[i, best] - ref[i, best]).abs() + (bf[i, tok] - ref[i, tok]).abs())
                assert margin <= moved, (i, tok, best, margin, moved)
                break
            compared += 1
            if tok in eos:
                break
    assert compared >= NEW  # real tokens were compared, not only rounding ties
