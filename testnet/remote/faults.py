"""Churn on an inventory's hosts: the spec's ``[[churn]]`` events applied to remote nodes.

``RemoteChurn(swarm, workers, spec, arm, invite)`` is the ``churn.ChurnTrial`` the local churn
code drives (``testnet/workload/churn.py``): node ``i`` is the i-th workload host of the
inventory. ``leave`` ends the node's session (the hold wrapper's SIGTERM, a clean stop),
``leave(kill=True)`` SIGKILLs its process group on its host; ``join`` of a departed node
starts a new session with the same home (same peer id, its membership reused) and a new API
tunnel. New nodes (a join past the initial count) need a host the inventory does not have:
``RemoteChurn`` refuses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from p2pnode.testnet.spec import TrialSpec

if TYPE_CHECKING:
    from p2pnode.testnet.remote.controller import RemoteNode, RemoteSwarm

__all__ = ["RemoteChurn"]


class RemoteChurn:
    def __init__(
        self,
        swarm: RemoteSwarm,
        workers: Sequence[RemoteNode],
        spec: TrialSpec,
        arm: str,
        invite: str,
    ) -> None:
        self.swarm, self.workers, self.spec, self.arm, self.invite = (
            swarm, list(workers), spec, arm, invite
        )  # fmt: skip

    @property
    def nodes(self) -> list[RemoteNode]:
        return self.workers

    @property
    def apis(self) -> list[str]:
        return [n.api for n in self.workers]

    @property
    def peer_ids(self) -> list[str]:
        return [n.peer_id for n in self.workers]

    def add_new_node(self, i: int) -> object:
        raise ValueError(f"node{i}: new nodes need a host of their own (not on inventories)")

    def start_node(self, i: int) -> bool:
        node = self.workers[i]
        if node.session is not None and node.session.poll() is None:
            return False
        self.swarm.launch(node, self.spec, self.invite)
        return True

    def wait_ready(self, i: int, timeout_s: float = 120.0) -> None:
        self.swarm.wait_healthy([self.workers[i]], timeout_s)

    def leave(self, i: int, *, kill: bool = False) -> None:
        self.swarm.stop_node(self.workers[i], kill=kill)
