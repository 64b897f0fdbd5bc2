"""The trial runner's memory check: what does not fit is refused before any node starts."""

from __future__ import annotations

from p2pnode.testnet.run.capacity import EMULATED_NODE_MB, OVERHEAD_MB, check_cpu, check_memory
from p2pnode.testnet.spec import builtin_spec_path, load_spec


def test_scale_128_fits_in_plenty_and_is_refused_in_little() -> None:
    spec = load_spec(builtin_spec_path("scale-128"))
    assert spec.node_count == 128 and spec.compute == "emulated"
    need = 129 * EMULATED_NODE_MB + OVERHEAD_MB
    assert check_memory(spec, available=2 * need).ok
    small = check_memory(spec, available=4000.0)
    assert not small.ok and small.need_mb == need
    fits = int((4000.0 * 0.9 - OVERHEAD_MB) // EMULATED_NODE_MB) - 1
    assert f"at most {fits} such nodes fit" in small.message and "scale-128" in small.message


def test_cpu_check_warns_for_a_mesh_too_big_for_the_cores() -> None:
    small = load_spec(builtin_spec_path("smoke"))
    big = load_spec(builtin_spec_path("scale-128"))
    assert check_cpu(small, cores=2).ok
    fit = check_cpu(big, cores=2)
    assert not fit.ok and fit.need_mb > 2
    # 128 nodes, 12 connections each
    assert "scale-128" in fit.message and "1536 directed links" in fit.message
    assert check_cpu(big, cores=64).ok
