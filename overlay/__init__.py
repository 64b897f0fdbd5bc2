"""p2pnode.overlay: the libp2p overlay, cache digests, routing, trust and serving.

Rooms (imports run one way, checked by import-linter: serve -> routing -> trust | cache | net,
all on the base below):
- ``net/``: membership and transport. ``open_overlay_node(OverlayConfig(key=...))`` ->
  ``OverlayNode`` (net/node.py, the assembly; the knobs: net/config.py); the DHT (net/dht.py),
  the host (net/host.py), the hello on every connection (net/hello.py), reachability, relays;
  ``net/patches/``: what we change in py-libp2p.
- ``cache/``: what a digest holds and how it travels (digest.py, antientropy.py, views.py).
- ``trust/``: trust earned from observations (book.py), audits, challenges.
- ``routing/``: the cost function that picks a peer, and placement of misses:
  ``Router.decide`` (routing/router.py, contract at the top); learned network cost.
- ``serve/``: ``RoutedService`` (serve/service.py), the one composition root of a served model:
  the router's choice, the forward (serve/forward.py), fallback, audit, probation and trust.
- the base: the one wire format (wire.py), what the rooms need of a node (seams.py), per-peer
  budgets (limits.py), the peer table (peers.py), errors (_errors.py).

Public face: `open_overlay_node`, `OverlayConfig`, `OverlayNode`, `ClosedNetwork` (a closed
network's config: net/members.py), `PeerTable`, `PeerState`,
`PeerEntry`, `OverlayDHT`, `NodeRecordValidator`, `record_key`, `model_key`, `make_host`,
`parse_multiaddr`, `quiet_libp2p_logs`; errors: `OverlayError`, `BadMultiaddr`,
`BootstrapFailed`, `PeerUnreachable`, `InvalidNodeRecord`; framing errors live in wire.py.
"""

from p2pnode.overlay._errors import BadMultiaddr, BootstrapFailed, OverlayError, PeerUnreachable
from p2pnode.overlay.net.dht import (
    InvalidNodeRecord,
    NodeRecordValidator,
    OverlayDHT,
    model_key,
    record_key,
)
from p2pnode.overlay.net.host import make_host, parse_multiaddr, quiet_libp2p_logs
from p2pnode.overlay.net.members import ClosedNetwork
from p2pnode.overlay.net.node import (
    PING_PROTOCOL,
    VERSION,
    OverlayConfig,
    OverlayNode,
    open_overlay_node,
    parse_peer_addr,
)
from p2pnode.overlay.peers import PeerEntry, PeerState, PeerTable

__all__ = [
    "PING_PROTOCOL",
    "VERSION",
    "BadMultiaddr",
    "BootstrapFailed",
    "ClosedNetwork",
    "InvalidNodeRecord",
    "NodeRecordValidator",
    "OverlayConfig",
    "OverlayDHT",
    "OverlayError",
    "OverlayNode",
    "PeerEntry",
    "PeerState",
    "PeerTable",
    "PeerUnreachable",
    "make_host",
    "model_key",
    "open_overlay_node",
    "parse_multiaddr",
    "parse_peer_addr",
    "quiet_libp2p_logs",
    "record_key",
]
