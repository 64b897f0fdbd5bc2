"""Will a trial fit in this machine's memory? Checked before any node starts.

``check_memory(spec)`` -> ``Fit``: the memory the trial's processes need (per node process,
by compute mode, plus the bootstrap, the fork server and the driver) against ``MemAvailable``
of ``/proc/meminfo``. ``fit.ok`` False means the trial would run the machine out of memory
(nodes killed or swapping, and figures that measure that instead of the overlay); ``fit.message``
says what does not fit and what would.

Per-process figures (unique memory, PSS, measured on the 2-core development machine):
- emulated node forked from the trial's fork server: ~55 MB (RSS ~105-130 MB, half of it
  pages shared with the fork server and the other nodes); ``EMULATED_NODE_MB`` keeps a margin
  for the caches, connections and views a node grows during a trial;
- real-compute node: ~1.3 GB peak (SmolLM2-135M fp32 plus KV cache);
- driver (requests, results) and fork server: ``OVERHEAD_MB``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from p2pnode.testnet.spec import TrialSpec

EMULATED_NODE_MB = 90.0
REAL_NODE_MB = 1300.0
OVERHEAD_MB = 700.0
# What the rest of the machine (other work, page cache) keeps; a trial never plans on it.
RESERVE_FRACTION = 0.10


@dataclass(frozen=True)
class Fit:
    ok: bool
    need_mb: float
    available_mb: float
    message: str


def available_mb(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def per_node_mb(spec: TrialSpec) -> float:
    return EMULATED_NODE_MB if spec.compute == "emulated" else REAL_NODE_MB


def check_memory(spec: TrialSpec, available: float | None = None) -> Fit:
    """One arm at a time runs, so the need is one arm's processes (see the module doc)."""
    available = available_mb() if available is None else available
    nodes = spec.node_count + 1  # and the bootstrap
    each = per_node_mb(spec)
    need = nodes * each + OVERHEAD_MB
    if available is None:
        return Fit(True, need, float("nan"), "free memory unknown (no /proc/meminfo): not checked")
    usable = available * (1 - RESERVE_FRACTION)
    if need <= usable:
        return Fit(True, need, available, f"needs ~{need:.0f} MB of {available:.0f} MB available")
    fits = max(0, int((usable - OVERHEAD_MB) // each) - 1)
    return Fit(
        False,
        need,
        available,
        f"{spec.name}: {spec.node_count} {spec.compute} nodes + bootstrap need ~{need:.0f} MB "
        f"(~{each:.0f} MB each + {OVERHEAD_MB:.0f} MB driver), but only {available:.0f} MB is "
        f"available ({100 * RESERVE_FRACTION:.0f} % kept free): at most {fits} such nodes fit "
        "now; free memory or use a spec with fewer nodes",
    )
