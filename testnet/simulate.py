"""``python -m p2pnode.testnet.simulate``: runs ``p2pnode simulate`` without the ``p2pnode``
script. The simulator and its names live in ``testnet/sim/``; import them from there.
"""

from __future__ import annotations

import sys

from p2pnode.testnet.sim import main

if __name__ == "__main__":
    sys.exit(main())
