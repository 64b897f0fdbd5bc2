"""p2pnode: a peer-to-peer overlay that serves LLM inference across the WAN.

Subsystems (each its own package, dependencies point one way):
``p2pnode.identity`` <- ``p2pnode.overlay`` <- ``p2pnode.speculation`` / ``p2pnode.bootstrap``;
``p2pnode.inference`` stands alone (no networking).
"""

__version__ = "0.1.0"
