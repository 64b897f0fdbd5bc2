"""``p2pnode simulate``'s entry point (``python -m p2pnode.testnet.simulate``).

The simulator lives in ``testnet/sim/`` (its package doc says what is real and what is
simulated); this module keeps the names other code imports from here.
"""

from __future__ import annotations

import sys

from p2pnode.testnet.sim import (
    COLUMNS,
    EARTH_KM,
    FIBER_KM_PER_S,
    MODEL_ID,
    REGION_SHARE,
    REGIONS,
    Network,
    SimConfig,
    SimNode,
    SimResult,
    Simulation,
    as_row,
    main,
    markdown_table,
    mmlu_prompts,
    plot,
    run_grid,
    simulate,
)

__all__ = [
    "COLUMNS",
    "EARTH_KM",
    "FIBER_KM_PER_S",
    "MODEL_ID",
    "REGIONS",
    "REGION_SHARE",
    "Network",
    "SimConfig",
    "SimNode",
    "SimResult",
    "Simulation",
    "as_row",
    "main",
    "markdown_table",
    "mmlu_prompts",
    "plot",
    "run_grid",
    "simulate",
]

if __name__ == "__main__":
    sys.exit(main())
