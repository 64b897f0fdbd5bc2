"""Checks shared by the kernel tests: run on the native build and on narrower ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from p2pnode.inference._cpu import gemm as _gemm


def check_panels(build) -> None:
    """``gemm_panels`` of ``build`` against F.linear: every tile height (1-6 rows, balanced
    tiles), more outputs than one panel, one and two threads; a row's bits independent of the
    number of rows."""
    width = int(build.panel_width())
    torch.manual_seed(5)
    for n, k in ((3 * width, 96), (width, 1024)):
        w = torch.randn(n, k)
        form = _gemm.PanelWeight(w, build, width)
        x_all = torch.randn(50, k)
        ref_all = F.linear(x_all, w)
        for threads in (1, 2):
            old = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                for rows in (1, 5, 17, 23, 50):
                    y = form(x_all[:rows].contiguous())
                    ref = ref_all[:rows]
                    assert y.shape == ref.shape
                    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max(), (n, k, rows)
                    assert torch.equal(y, form(x_all)[:rows])  # rows do not change a row's bits
            finally:
                torch.set_num_threads(old)
