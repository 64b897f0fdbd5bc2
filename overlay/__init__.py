"""p2pnode.overlay: the libp2p overlay (host, DHT, peer table, node) and the wire format.

Public face (details in each module's docstring):
- `open_overlay_node(OverlayConfig(key=...))` -> `OverlayNode` (node.py: the assembly; its
  collaborators, one job each: admission.py, dialing.py, discovery.py, liveness.py (with
  starvation.py), trimming.py; the knobs: config.py)
- `PeerTable`, `PeerState`, `PeerEntry` (peers.py)
- `OverlayDHT`, `NodeRecordValidator`, `record_key`, `model_key` (dht.py)
- `make_host`, `parse_multiaddr`, `quiet_libp2p_logs` (host.py)
- what a node advertises and dials: `AddressBook`, `dial_order`, `classify` (addrs.py);
  network and version check on every connection: `Hello`, `NetworkMismatch` (hello.py);
  dial-backs and the public/private verdict: `ReachabilityService` (reachability.py);
  circuit relay v2, relays found in the overlay, members only: `open_relay` (relay.py)
- errors: `OverlayError`, `BadMultiaddr`, `BootstrapFailed`, `PeerUnreachable`,
  `InvalidNodeRecord`; framing errors live in `p2pnode.overlay.wire`.

Map of the routing half (import from the modules; they pull in more than a node needs):
- `RoutedService` (service.py): the one composition root of a served model: the router's
  choice, the forward, fallback, audit and trust. What it needs of the node: `OverlayHost`
  (seams.py); of an engine: `p2pnode.inference.serving.ServingEngine`.
- the cost function that picks a peer, and placement of misses: `Router.decide` (router.py,
  contract at the top); learned network cost: netcost.py; scoped views: scope.py.
- what a digest holds and how it travels: digest.py (format, `DigestBuilder`), antientropy.py
  (gossipsub deltas, full digests, pulls on a version gap), views.py (`PeerViews`).
- the forward protocol, its server and client call: forward.py; the one wire format: wire.py.
- checking peers: trust.py, audit.py, probation.py and challenge.py; per-peer budgets: limits.py.
"""

from p2pnode.overlay._errors import BadMultiaddr, BootstrapFailed, OverlayError, PeerUnreachable
from p2pnode.overlay.dht import (
    InvalidNodeRecord,
    NodeRecordValidator,
    OverlayDHT,
    model_key,
    record_key,
)
from p2pnode.overlay.host import make_host, parse_multiaddr, quiet_libp2p_logs
from p2pnode.overlay.node import (
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
