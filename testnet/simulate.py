"""``python -m p2pnode.testnet.simulate``: runs ``p2pnode simulate`` without the ``p2pnode``
script. The command is ``testnet/commands.py``'s; the simulator lives in ``testnet/sim/``.
"""

from __future__ import annotations

from p2pnode.testnet.commands import simulate

if __name__ == "__main__":
    simulate(prog_name="python -m p2pnode.testnet.simulate")
