"""inference/_cpu/hugepages.py: a model's tensors moved into one region advised for 2 MB pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from p2pnode.inference._cpu import hugepages as _hugepages

needs_thp = pytest.mark.skipif(
    not _hugepages.available(), reason="no transparent huge pages on this kernel"
)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(600, 256)  # 600 KB: page-aligned
        self.head = nn.Linear(256, 600, bias=False)
        self.head.weight = self.embed.weight  # tied, as an lm_head to its embedding
        self.norm = nn.LayerNorm(256)  # small tensors, packed
        table = torch.randn(300, 256)
        self.a, self.b = nn.Module(), nn.Module()
        self.a.register_buffer("table", table)
        self.b.register_buffer("table", table)  # one buffer, two holders


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``addr``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@needs_thp
def test_tensors_move_with_their_values_ties_and_holders() -> None:
    model = _Tied()
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    weight = model.embed.weight
    moved = _hugepages.move_to_huge_pages(model)
    expected = sum(t.numel() * t.element_size() for t in (weight, *model.norm.parameters()))
    assert moved == expected + model.a.table.numel() * 4
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(t, before[n]), n
    assert model.embed.weight is weight and model.head.weight is weight  # still one parameter
    assert model.a.table.data_ptr() == model.b.table.data_ptr()  # both holders moved
    assert weight.data_ptr() % 4096 == 0 and model.a.table.data_ptr() % 4096 == 0
    assert "hg" in _vm_flags(weight.data_ptr())  # advised MADV_HUGEPAGE
    with torch.no_grad():  # still an ordinary, writable tensor
        model.head.weight[0, 0] = 5.0
    assert model.embed(torch.tensor([0]))[0, 0].item() == 5.0


def test_switched_off_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PNODE_HUGEPAGES", "0")
    model = _Tied()
    ptr = model.embed.weight.data_ptr()
    assert not _hugepages.available()
    assert _hugepages.move_to_huge_pages(model) == 0
    assert model.embed.weight.data_ptr() == ptr
