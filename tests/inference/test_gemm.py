"""Prefill-sized matmuls on packed weights (``inference/_cpu/gemm.py``): the C panel GEMM and
oneDNN's, the per-process choice between them, and ``StreamLinear`` on them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from p2pnode.inference._cpu import gemm as _gemm
from p2pnode.inference._cpu import kernels as _kernels

from testkit.kernels import check_panels

lib = _kernels.library()
needs_lib = pytest.mark.skipif(
    lib is None,
    reason="kernels unavailable (no C compiler, or P2PNODE_KERNELS=0): the torch path is used",
)


@needs_lib
def test_panel_gemm_matches_f_linear_for_every_tile_height() -> None:
    check_panels(lib)


def test_pack_panels_lays_out_each_inputs_outputs_side_by_side() -> None:
    w = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)  # 4 outputs, 3 inputs
    p = _gemm.pack_panels(w, 2)
    assert p.shape == (2, 3, 2)
    assert p[1, 2].tolist() == [w[2, 2].item(), w[3, 2].item()]  # panel 1, input 2
    with pytest.raises(ValueError, match="panels of 8"):
        _gemm.pack_panels(torch.zeros(12, 4), 8)


@needs_lib
def test_prefill_weight_falls_back_where_panels_do_not_divide() -> None:
    width = _gemm.panel_width()
    odd = torch.randn(width + 1, 64)
    form = _gemm.prefill_weight(odd)
    if form is not None:  # oneDNN took it: no panel form exists for these outputs
        assert form.kind == "onednn"
        x = torch.randn(20, 64)
        assert (form(x) - F.linear(x, odd)).abs().max() <= 1e-5 * F.linear(x, odd).abs().max()
    assert _gemm.prefill_weight(odd.bfloat16()) is None  # fp32 weights only


@needs_lib
def test_choice_is_one_of_the_forms_and_the_pin_holds(monkeypatch) -> None:
    assert _gemm.choice() in ("panels", "onednn")
    for pin in ("panels", "onednn"):
        monkeypatch.setenv("P2PNODE_PREFILL_GEMM", pin)
        _gemm.choice.cache_clear()
        try:
            got = _gemm.choice()
            assert got == pin or (pin == "onednn" and not torch.backends.mkldnn.is_available())
        finally:
            _gemm.choice.cache_clear()
    monkeypatch.setenv("P2PNODE_PACKED_PREFILL", "0")
    try:
        assert _gemm.choice() == "plain" and _gemm.prefill_weight(torch.randn(64, 64)) is None
    finally:
        _gemm.choice.cache_clear()


@needs_lib
def test_prefill_shaped_inputs_run_on_a_packed_copy_of_the_weight() -> None:
    torch.manual_seed(2)
    w = torch.randn(8 * _gemm.panel_width(), 96)
    lin = _kernels.StreamLinear(w, lib)
    x = torch.randn(2, 40, 96)  # 80 rows: past MAX_ROWS
    with torch.no_grad():
        y = lin(x)
    packed = lin._packed()
    assert packed is not None and packed.kind == _gemm.choice()  # made on that call
    ref = F.linear(x, w)
    assert y.shape == ref.shape and (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    with torch.no_grad():
        lin(x)
    assert lin._packed() is packed  # made once
    # An input that needs gradients keeps autograd (the packed GEMMs have none): F.linear.
    xg = x.clone().requires_grad_()
    lin(xg).sum().backward()
    assert torch.allclose(xg.grad, w.sum(0).expand_as(x), atol=1e-4)
    assert copy.deepcopy(lin)._prefill == []  # a copy makes its own from its own weight
