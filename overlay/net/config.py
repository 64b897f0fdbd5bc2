"""What an overlay node is told at start: `OverlayConfig`, one plain dataclass of knobs.

Contract: `OverlayConfig(key=...)` with every other field defaulted; each knob's comment says
what it bounds and why its default is what it is. `open_overlay_node` (``node.py``) validates
the addresses; the collaborators it builds (``dialing.py``, ``discovery.py``, ``liveness.py``,
``trimming.py``) read only the fields they need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pnode.identity import NodeKey
from p2pnode.overlay.net.hello import DEFAULT_NETWORK
from p2pnode.overlay.net.members import ClosedNetwork

__all__ = ["BACKGROUND_TIMEOUT_FACTOR", "BOOTSTRAP_TIMEOUT_FACTOR", "VERSION", "OverlayConfig"]

VERSION = "p2pnode/0.1"
# Background work is not urgent: a slow answer is still progress, a cancelled one is waste.
# So its limits are this many `connect_timeout`s, far above a healthy loopback (~10-60 ms).
BACKGROUND_TIMEOUT_FACTOR = 5.0
# A bootstrap dial that keeps timing out reached a listener (libp2p's own TCP connect limit is
# `dial_timeout`) whose handshake is slower than that: its limit grows to this many, up to the
# handshake's own limit (`host.UPGRADE_TIMEOUT_S`): 128 processes on 2 cores took ~20 s.
BOOTSTRAP_TIMEOUT_FACTOR = 15.0


@dataclass
class OverlayConfig:
    key: NodeKey
    listen_addrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    bootstrap: list[str] = field(default_factory=list)
    # Extra addresses to advertise (a public or port-forwarded address of this node).
    announce: list[str] = field(default_factory=list)
    network: str = DEFAULT_NETWORK  # nodes of another network id are refused (overlay/net/hello.py)
    models: list[str] = field(default_factory=list)
    roles: set[str] = field(default_factory=lambda: {"router"})
    capacity: dict[str, float] = field(default_factory=dict)
    ping_interval: float = 1.0  # probe a peer after this long without any frame from it
    gossip_heartbeat: float = 1.0
    # Gossipsub mesh degree D (low D - 2, high 2 D): every node forwards each message to its D
    # mesh peers and receives about D copies, so a node's gossip CPU is proportional to it. 6 is
    # the libp2p default; 3 still reaches everyone on a connected mesh, in more hops.
    gossip_degree: int = 6
    # Node records a second on the records topic, whole swarm (every node forwards each one
    # to its mesh peers, like digests); the node's --gossip-budget lowers it too.
    records_budget: float = 2.0
    ping_timeout: float = 1.0  # floor of the adaptive probe timeout (RTO); scale with the RTT
    connect_timeout: float = 3.0
    dial_timeout: float = 5.0  # libp2p's own dial limit; keep it above connect_timeout
    health_ping_timeout: float = 2.0  # libp2p health probe timeout (when that monitor is on)
    health_check_interval: float = 0.0  # libp2p health monitor period; 0 = off (see docstring)
    bootstrap_attempts: int = 4
    bootstrap_backoff: float = 0.2  # first retry delay; doubles per attempt
    require_bootstrap: bool = False
    discovery_interval: float = 0.5  # while the view grows
    # Once the view is stable. Each round is a DHT walk (new negotiated streams to several
    # peers, and work for them): at 10 s, lookups were the largest idle cost of 16 nodes on 2
    # cores. New peers do not wait for it: an inbound connection or a gossiped record of an
    # unknown peer wakes discovery at once. (libp2p's own table refresh runs every 10 min.)
    discovery_max_interval: float = 60.0
    peer_grace_period: float = 60.0
    record_refresh: float = 600.0
    max_peers: int = 128  # stop dialing discovered peers beyond this many connections
    # Bounded connections (overlay/net/connmgr.py): above `conn_high` connected peers the node
    # closes all but `conn_low` (bootstrap, relays, busy and new ones kept; then a few random
    # long links and the nearest by RTT); discovery dials new peers only below `conn_low`,
    # and explores one untried peer now and then below `conn_high`. 0 = unbounded.
    conn_low: int = 16
    conn_high: int = 24
    conn_grace: float = 30.0  # a new connection is never closed this young
    version: str = VERSION
    # A closed network (overlay/net/members.py): only members with a valid membership get
    # past the hello. None: open, anyone with an address may join.
    closed: ClosedNetwork | None = None
