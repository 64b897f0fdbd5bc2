"""The W4A16 draft (speculation/draft.py): the int4 kernel and op, the GPTQ layout and act-order, the
draft's logits against the target's.

Real parts only: the default SmolLM2 target (fp32) and its W4A16 draft, real loopback libp2p nodes.
"""

from __future__ import annotations

import json

import torch

from p2pnode.inference._cpu import kernels as _kernels
from p2pnode.speculation import (
    Int4Linear,
)
from p2pnode.speculation.draft import from_gptq, quantize_sym_int4, to_gptq


def test_private_int4_cpu_kernel_matches_dequantized_matmul() -> None:
    # torch.ops.aten._weight_int4pack_mm_for_cpu is private: this pins its layout and formula.
    torch.manual_seed(0)
    w = torch.randn(192, 576)
    q, scales = quantize_sym_int4(w, 64)
    deq = ((q.float() - 8).reshape(192, 9, 64) * scales.float().t().unsqueeze(-1)).reshape(192, 576)
    x = torch.randn(5, 576)
    ref = x @ deq.t()
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):  # bf16: 8-bit mantissa
        lin = Int4Linear(q, scales, 64, dtype)
        old = _kernels.set_enabled(False)  # the private op (prefill's path), not the kernel
        try:
            y = lin(x.to(dtype)).float()
        finally:
            _kernels.set_enabled(old)
        assert (y - ref).abs().max() <= tol * ref.abs().max()
        if lin.stream:  # decode's path: the streaming int4 kernel, fp32 math
            y = lin(x).float()
            assert (y - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_gptq_layout_round_trip_and_config(draft) -> None:
    q = torch.randint(0, 16, (192, 576), dtype=torch.int32)
    scales = torch.rand(9, 192).half()
    t = to_gptq(q, scales, 64)
    assert t["qweight"].shape == (72, 192) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (9, 24) and int(t["qzeros"][0, 0]) == 0x77777777
    q2, s2, gs = from_gptq(t)
    assert torch.equal(q2, q) and torch.equal(s2, scales) and gs == 64
    cfg = json.loads((draft.path / "quantize_config.json").read_text())
    assert cfg["bits"] == 4 and cfg["sym"] is True and cfg["desc_act"] is False
    assert json.loads((draft.path / "config.json").read_text())["quantization_config"] == cfg


def test_gptq_act_order_beats_rounding_on_the_hessian_loss() -> None:
    # GPTQ minimizes tr((W - Q) H (W - Q)^T); with inputs whose columns differ in scale (as real
    # activations do) act-order (static groups) must do better than plain rounding and keep the
    # contiguous-group layout: q in 0..15, one scale per 64 inputs.
    from p2pnode.speculation._gptq import gptq_linear

    torch.manual_seed(0)
    w = torch.randn(48, 128)
    x = torch.randn(512, 128) * torch.linspace(0.1, 3.0, 128)
    h = x.t() @ x

    def loss(q: torch.Tensor, s: torch.Tensor) -> float:
        deq = ((q.float() - 8).reshape(48, 2, 64) * s.float().t().unsqueeze(-1)).reshape(48, 128)
        e = w - deq
        return float(torch.trace(e @ h @ e.t()))

    rtn = loss(*quantize_sym_int4(w, 64))
    q, s = gptq_linear(w, h, 64, act_order=True)
    assert q.shape == (48, 128) and int(q.min()) >= 0 and int(q.max()) <= 15
    assert s.shape == (2, 48) and s.dtype == torch.float16
    assert loss(q, s) < 0.8 * rtn
    assert loss(*gptq_linear(w, h, 64)) < 0.8 * rtn


def test_draft_logits_close_to_target_but_not_identical(target, draft, prompts) -> None:
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        a = target.model(input_ids=ids).logits[0]
        b = draft.model(input_ids=ids).logits[0].float()
    assert draft.target_model_id == target.model_id
    assert (a - b).abs().max() > 0.5  # a real int4 model, not a copy of the Q4_1 target
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    kl = (a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1))).sum(-1).mean()
    # Measured on the three prompts: top-1 agreement 0.65, mean KL 1.07-1.18 nats (RTN int4 on a
    # 135M model is lossy); bounds leave room for thread-count float noise, not for a broken draft
    # (a random or mis-packed model gives agreement ~0 and KL > 5).
    assert agree > 0.5 and kl < 2.0, (agree, kl)
