"""What a caller adds to a node it starts: ``run_node(settings, extensions=[...])``.

The product passes none. Trials pass theirs (an adversary that lies to its peers,
``testnet/run/node.py``) so that what they change runs on the node's real path, through a
door the node assembly declares rather than a list it keeps for anyone to append to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import trio

    from p2pnode.overlay.serve.service import RoutedService


class NodeExtension(Protocol):
    """Called by ``run_node`` once the node's routed service runs (a node serving no model has
    none and calls no extension)."""

    def service_started(self, service: RoutedService, nursery: trio.Nursery) -> None:
        """``service`` is the running service itself, not a narrower interface: an extension
        may replace parts of it. ``nursery`` lives as long as the node; tasks started in it
        stop when the node does."""
        ...
