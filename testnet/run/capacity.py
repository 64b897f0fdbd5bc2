"""Will a trial fit in this machine's memory and CPU? Checked before any node starts.

``check_cpu(spec)`` -> ``Fit`` (in cores): what the trial's overlay costs while idle, every node
connected to every other or to ``max_connections`` peers when that is less (each link gets
liveness probes, gossip and DHT traffic), against
``os.cpu_count()``. It warns (the runner still starts) when the idle mesh alone would take more
than ``MAX_IDLE_SHARE`` of the cores: then nodes are too starved to form the mesh in the
trial's time, let alone serve. The per-link figure is one measurement on this machine
(``IDLE_CORE_PER_LINK``), so the check is an estimate, said as such.

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

import os
from dataclasses import dataclass
from pathlib import Path

from p2pnode.testnet.spec import TrialSpec

EMULATED_NODE_MB = 90.0
REAL_NODE_MB = 1300.0
OVERHEAD_MB = 700.0
# What the rest of the machine (other work, page cache) keeps; a trial never plans on it.
RESERVE_FRACTION = 0.10
# Idle CPU per directed link of a full mesh, in cores: 16 emulated node processes (240 links)
# used 2.39 % of a core each while idle after reaching full views
# (`bench/overlay_join_processes.py --nodes 16 --idle 60`, 2-vCPU Xeon, 2026-12-07 20:12 UTC;
# 4.65 % before unchanged nodes went quiet between heartbeats, 7.3 % before record gossip
# was budgeted and yamux stopped crediting every small read).
IDLE_CORE_PER_LINK = 0.0016
# 16 nodes formed full views within 18-26 s at 59 % of 2 cores idle (the figure of 2026-12-02).
MAX_IDLE_SHARE = 0.75


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


def check_cpu(spec: TrialSpec, cores: int | None = None) -> Fit:
    """The idle full mesh's CPU against this machine's cores (see the module doc)."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    n = spec.node_count
    # Bounded connections (overlay/net/connmgr.py): each node holds at most max_connections.
    bound = spec.node.max_connections or n - 1
    links = n * min(n - 1, bound)
    need = links * IDLE_CORE_PER_LINK
    share = need / cores
    if share <= MAX_IDLE_SHARE:
        return Fit(True, need, float(cores), f"idle mesh ~{need:.1f} of {cores} cores (estimate)")
    most = 1
    while (most + 1) * min(most, bound) * IDLE_CORE_PER_LINK <= MAX_IDLE_SHARE * cores:
        most += 1
    return Fit(
        False,
        need,
        float(cores),
        f"{spec.name}: {n} nodes at up to {min(n - 1, bound)} connections each are {links} directed links, ~{need:.1f} cores "
        f"while idle at {100 * IDLE_CORE_PER_LINK:.2f} % of a core per link (measured with 16 "
        f"nodes), {100 * share:.0f} % of this machine's {cores} cores: the overlay is unlikely "
        f"to form within the trial, and figures would measure starvation, not routing; about "
        f"{most} nodes fit in {100 * MAX_IDLE_SHARE:.0f} % of these cores (estimate)",
    )
