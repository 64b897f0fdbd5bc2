"""The trial runner's memory check: what does not fit is refused before any node starts."""

from __future__ import annotations

from p2pnode.testnet.capacity import EMULATED_NODE_MB, OVERHEAD_MB, check_memory
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
