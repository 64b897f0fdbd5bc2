"""Light emulated nodes: no torch, no transformers, a small resident set.

The process test starts a real bootstrap and a real ``join --backend emulated`` node, serves a
chat and a sampled completion through its HTTP API (engine, audit and logprob paths), and reads
what the process holds from outside: its RSS from ``/proc/<pid>/status`` and its mapped shared
libraries from ``/proc/<pid>/maps`` (libtorch would show there), plus the module list the node
reports in ``/status``. The closed-form emulated logits are checked against the dense tensor
path they replace, and the light tokenizer against transformers on the converted model.
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path

import httpx
import pytest

from p2pnode.inference import costmodel
from p2pnode.inference.costmodel import (
    CalibrationError,
    CostModel,
    calibration_path,
    load_calibration,
    save_calibration,
)
from p2pnode.inference.emulated import EmulatedLogits, EmulatedRows
from p2pnode.inference.sampling import SamplingParams

RSS_LIMIT_BYTES = 150 * 1024 * 1024


def _serving(api: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(api + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{api}/health not 200 within {timeout} s")


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.mark.slow
def test_emulated_node_process_imports_no_torch_and_stays_small(
    tmp_path: Path, node_processes
) -> None:
    boot = node_processes.spawn(["bootstrap", "--open"], tmp_path / "boot")
    addr = node_processes.runtime(tmp_path / "boot", boot)["addrs"][0]
    home = tmp_path / "node"
    node = node_processes.spawn(
        ["join", "--model", "default", "--backend", "emulated", "--bootstrap", addr], home
    )
    api = node_processes.runtime(home, node)["api"]
    _serving(api)
    chat = httpx.post(
        api + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Name a prime."}], "max_tokens": 4},
        timeout=30.0,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 4
    sampled = httpx.post(
        api + "/v1/completions",
        json={"prompt": "The sky is", "max_tokens": 3, "temperature": 0.8, "logprobs": 2},
        timeout=30.0,
    )
    assert sampled.status_code == 200, sampled.text
    assert len(sampled.json()["choices"][0]["logprobs"]["tokens"]) == 3

    status = httpx.get(api + "/status", timeout=5.0).json()
    assert status["process"]["heavy_modules"] == []
    probation = status["routing"]["probation"]  # no peer serves the model: none to challenge
    assert probation["answers_needed"] == 8 and probation["on_probation"] == []
    assert probation["challenges"] == {"passed": 0, "mismatch": 0, "failed": 0}
    maps = Path(f"/proc/{node.pid}/maps").read_text()
    assert "libtorch" not in maps and "torch/lib" not in maps
    rss = _rss_bytes(node.pid)
    assert rss < RSS_LIMIT_BYTES, f"emulated node RSS {rss / 2**20:.0f} MB"


def test_light_model_tokenizes_as_transformers_and_has_the_same_id() -> None:
    from p2pnode.inference.models import load_light_model

    light = load_light_model()
    from transformers import AutoTokenizer

    from p2pnode.inference.models import load_model

    full = AutoTokenizer.from_pretrained(light.path)
    assert light.model_id == load_model(light.path, accelerate=False).model_id
    texts = ["Hello, world!", "  spaces  and\ttabs\n", "émigré naïve — ünïcödé 数学 🙂", ""]
    for text in texts:
        ids = full.encode(text, add_special_tokens=False)
        assert light.tokenizer.encode(text, add_special_tokens=False) == ids
        assert light.tokenizer.decode(ids, skip_special_tokens=True) == full.decode(
            ids, skip_special_tokens=True
        )
    for messages in (
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ):
        ours = light.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        theirs = full.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours == theirs
    assert light.eos_token_ids == (full.convert_tokens_to_ids("<|im_end|>"),)


def test_calibration_written_once_then_read_and_the_shipped_one_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("P2PNODE_CACHE", str(tmp_path))
    shipped = load_calibration("some-model@0123")
    assert "shipped" in shipped.source and shipped.prefill_s_per_token > 0
    measured = CostModel(prefill_s_per_token=0.004, decode_s_per_token=0.07, overhead_s=0.02)
    # A machine busier than its cores writes nothing: its figures would slow every later trial.
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 40.0, 20.0))
    assert save_calibration("some-model@0123", measured) is None
    assert not calibration_path("some-model@0123").exists()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    # A quiet load average, but the measuring thread was on a core half the time: not saved.
    starved = CostModel(prefill_s_per_token=0.02, decode_s_per_token=0.26, cpu_share=0.5)
    assert save_calibration("some-model@0123", starved) is None
    assert not calibration_path("some-model@0123").exists()
    # A quiet load average and a full share, but tasks queued for the cores: not saved.
    monkeypatch.setattr(costmodel, "cpu_pressure", lambda: 35.0)
    assert save_calibration("some-model@0123", measured) is None
    assert not calibration_path("some-model@0123").exists()
    monkeypatch.setattr(costmodel, "cpu_pressure", lambda: 0.5)
    assert save_calibration("some-model@0123", measured) == calibration_path("some-model@0123")
    again = CostModel(prefill_s_per_token=0.9)
    assert save_calibration("some-model@0123", again) is None  # written once
    mine = load_calibration("some-model@0123")
    assert (mine.prefill_s_per_token, mine.decode_s_per_token, mine.overhead_s) == (
        0.004,
        0.07,
        0.02,
    )
    cost = mine.apply_to(CostModel())
    assert cost.calibrated and cost.prefill_s_per_token == 0.004
    calibration_path("some-model@0123").write_text('{"prefill_s_per_token": "fast"}')
    with pytest.raises(CalibrationError, match="delete it"):
        load_calibration("some-model@0123")


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (2.0, 0.5), (5.0, 1.0)])
def test_closed_form_emulated_logits_match_the_dense_tensor_path(
    temperature: float, top_p: float
) -> None:
    import torch

    from p2pnode.inference.sampling import probs_from_logits, token_logprob
    from p2pnode.overlay.trust.audit import check_greedy, check_sampled

    vocab = 4096  # small enough that the nucleus boundary falls inside the vocabulary
    row = EmulatedLogits.after(37, 1234, vocab, eos_token_id=2)
    dense = row.tensor()
    assert int(dense.argmax()) == row.argmax()
    probs = probs_from_logits(dense, temperature, top_p)
    kept = int((probs > 0).sum())
    # the same mass on the pick and the same number of tokens kept (ties: see emulated.py)
    assert math.isclose(
        math.exp(row.log_prob(row.pick, temperature, top_p)), float(probs[row.pick]), rel_tol=1e-5
    )
    others = [t for t in range(vocab) if t != row.pick]
    kept_ours = 1 + sum(row.log_prob(t, temperature, top_p) > -math.inf for t in others[: kept + 2])
    assert kept_ours == kept
    lp = token_logprob(row, row.pick, 2)
    ref = token_logprob(dense, row.pick, 1)
    assert math.isclose(lp.logprob, ref.logprob, abs_tol=1e-4)  # torch in fp32

    # honest samples from the closed form pass the audit in both forms with one z
    rng = random.Random(5)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=16)
    rows = [EmulatedLogits.after(40 + i, i, vocab, 2) for i in range(16)]
    tokens = [r.sample(params, rng) for r in rows]
    args = {"temperature": temperature, "top_p": top_p, "z_max": 4.0, "nucleus_slack": 0.0}
    closed = check_sampled(EmulatedRows(rows, vocab), tokens, **args)
    assert closed.passed
    if top_p == 1.0:  # with a nucleus torch may keep other tied ids than the lowest
        tensor = check_sampled(torch.stack([r.tensor() for r in rows]), tokens, **args)
        assert math.isclose(closed.statistic, tensor.statistic, rel_tol=1e-3, abs_tol=1e-3)
    greedy = [r.pick for r in rows]
    assert check_greedy(EmulatedRows(rows, vocab), greedy, 0.5).passed
    swapped = check_greedy(EmulatedRows(rows, vocab), [greedy[0] + 1, *greedy[1:]], 0.5)
    assert not swapped.passed and swapped.first_bad == 0
