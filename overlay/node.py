"""The assembled overlay of one p2pnode: host + gossipsub + DHT + discovery + liveness.

Contract:
- `async with open_overlay_node(OverlayConfig(key=...)) as node:` starts a Noise/yamux host,
  gossipsub (strict signing, ~1 s heartbeat; built before any connection so it sees them all)
  and a server-mode DHT; connects to `bootstrap` peers (exponential backoff, bounded by
  `bootstrap_attempts`; a malformed address raises `BadMultiaddr` at once, unreachable ones are
  logged in one line each and retried by the discovery loop; with `require_bootstrap=True`
  `BootstrapFailed` is raised instead); publishes the signed node record to the DHT and
  provides each model id in the background (`await node.wait_announced()` to wait for it).
  Leaving the block stops everything.
- Background loops: discovery (DHT self lookup, plus a random-key lookup once the network
  outgrows one Kademlia bucket, + routing table -> connect to unknown peers; rounds at least
  `discovery_interval` apart, woken early only by a peer never seen before, backing off to
  `discovery_max_interval` while nothing new turns up); node-record fetches (per-peer backoff);
  liveness (below); pruning of peers down longer than `peer_grace_period`; republishing our
  node record every `record_refresh` s and whenever our view of the network has doubled.
- Bounded connections (``overlay/connmgr.py``, ``conn_low``/``conn_high``): discovery dials
  new peers only below the low watermark (then one untried peer now and then below the high
  one), redials lost or trimmed peers only below the low one, and every ``TRIM_EVERY_S`` a
  node above the high watermark closes all but the low one (``trim_connections``; those peers
  are marked down, "pruned"). Two candidates that discover each other: the larger id waits
  ``TIE_BREAK_WAIT_S`` for the smaller one's dial, except across a NAT: a NAT'd node dials a
  public one at once, and a public node waits ``PRIVATE_PEER_WAIT_S`` for a NAT'd one (which
  can reach it directly; it could only open a circuit).
- Node records also travel over gossipsub (`RECORDS_TOPIC`): a node publishes its signed record
  every `RECORD_GOSSIP_INTERVAL` s while new peers keep appearing; receivers verify it (invalid
  ones are not forwarded) and keep the newest seq; the signed addresses of a peer not yet
  connected go to discovery, which dials it. The DHT fetch and lookups remain the fallback.
- Liveness: any frame received on a peer's connection counts as a sign of life (stamped on the
  secured connection's reads), so busy peers are never probed. A peer silent for
  `ping_interval` (or longer with many peers: at most `PROBE_BUDGET_PER_S` probes per second
  in all, so the interval is at least connected peers / that budget) gets one 32-byte echo
  probe on a persistent /p2pnode/ping/1 stream (opened once per connection; a late echo is
  still used, never a reason to reopen). A probe missed is one with no echo AND no frame at all from the peer within the RTO = srtt + 4 * rttvar of
  that peer (RFC 6298), clamped to [`ping_timeout`, `RTO_CEILING` * `ping_timeout`]; the next
  probe follows at once; a miss while our own loop lagged more than RTO/2 is excused (silence
  proves nothing when we did not run). 1 missed probe -> suspect, 2 -> down; after
  `CLOSE_AFTER_EXTRA_MISSES` more the connection is closed (frees a hung peer; discovery
  redials it later; a wrongly demoted peer is up again with its next frame, no redial). So a hung (SIGSTOP) peer on an idle link
  is down within ~ping_interval + 2 * RTO (~3.5 s with the defaults) and a closed or killed
  one at once (its connection drops). libp2p's own health monitor (a new negotiated stream
  per connection per check, connection aborted on ONE late answer) is off unless
  `health_check_interval` > 0; `health_ping_timeout` is its probe timeout then.
- Public face: `peer_id`, `addrs` (multiaddrs ending in /p2p/<id>), `host`, `pubsub`, `dht`,
  `peers` (PeerTable), `record` (our NodeRecord), `find_providers`, `get_node_record`,
  `set_stream_handler`, `open_stream`, `connect`, `status()`.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from p2pnode.identity import (
    IdentityError,
    NodeKey,
    NodeRecord,
    new_node_record,
    sign_node_record,
    verify_node_record,
)
from p2pnode.overlay._errors import BadMultiaddr, BootstrapFailed, PeerUnreachable
from p2pnode.overlay.addrs import AddressBook, classify, dial_order
from p2pnode.overlay.connmgr import TRIM_EVERY_S, ConnLimits, ConnManager
from p2pnode.overlay.dht import OverlayDHT
from p2pnode.overlay.hello import (
    DEFAULT_NETWORK,
    HELLO_PROTOCOL,
    Hello,
    NetworkMismatch,
    answer_hello,
    mismatch,
    say_hello,
)
from p2pnode.overlay.host import make_host, parse_multiaddr
from p2pnode.overlay.limits import PeerLimiter, remote_peer
from p2pnode.overlay.peers import PeerState, PeerTable
from p2pnode.overlay.seams import StreamHandler
from p2pnode.overlay.tuning import QuietGossipSub

__all__ = [
    "PING_PROTOCOL",
    "VERSION",
    "OverlayConfig",
    "OverlayNode",
    "open_overlay_node",
    "parse_peer_addr",
]

logger = logging.getLogger(__name__)

VERSION = "p2pnode/0.1"
# Our own echo protocol: libp2p's /ipfs/ping handler refuses a third concurrent stream per peer,
# which collides with its health monitor's probes and then aborts healthy connections.
PING_PROTOCOL = "/p2pnode/ping/1"
PING_LENGTH = 32
# The probe timeout never exceeds this many `ping_timeout`s, however bad the measured RTT.
RTO_CEILING = 4.0
# A peer declared down by probes keeps its connection for this many more missed probes (a
# false verdict then costs no redial: its next frame brings it back up), then it is closed.
CLOSE_AFTER_EXTRA_MISSES = 4
# Probe timeouts over a relayed connection start this many times higher (a third node's
# event loop and two more hops sit on the path).
RELAYED_TIMEOUT_FACTOR = 3.0
# Idle peers get an RTT sample at least this many ping intervals apart (the router uses it).
RTT_REFRESH_INTERVALS = 10
# Probes of idle links a node sends per second at most, all peers together: the silence that
# triggers a probe grows past `ping_interval` to (connected peers / this) seconds. At 63 peers
# and 1 s, probes were the largest single cost of 64 nodes on 2 cores (4,000 probes/s in all),
# and starved nodes then missed real frames. Detection of a hung peer slows in proportion
# (~4 s + 2 RTO at 64 peers); a closed or killed one is still seen at once.
PROBE_BUDGET_PER_S = 16.0
# A connection's kind (direct or relayed) is looked up again this often while probing it.
KIND_REFRESH_S = 30.0
# One Kademlia bucket: below this many peers a self lookup already returns the whole network.
KAD_BUCKET_SIZE = 20
# Background work (discovery dials, record fetches) runs this many at a time per node: each is
# several negotiated round trips, and when many nodes share busy cores an unbounded burst
# makes every one of them slower than its timeout (measured: 16 nodes, ~100 % failed).
BACKGROUND_PARALLEL = 4
# Signed node records also spread over this gossipsub topic, on streams that already exist: a
# DHT fetch is a new negotiated stream per peer, the slowest part of a join on busy cores.
RECORDS_TOPIC = "/p2pnode/records/1"
# A node republishes its record at most this often, and only after new peers appeared.
RECORD_GOSSIP_INTERVAL = 2.0
# Addresses learned from gossiped records stay in the peerstore this long (s).
GOSSIPED_ADDR_TTL = 600
# Records gossiped for peers we are not connected to yet wait here (bounded).
MAX_PENDING_RECORDS = 1024
# Record fetch retries back off up to this many discovery intervals.
RECORD_RETRY_CAP_INTERVALS = 4
# Two peers that discover each other at once: the larger id waits this long for the smaller
# one's dial (one connection per peer: libp2p closes one of two under its streams).
TIE_BREAK_WAIT_S = 3.0
# A public node waits this long for a NAT'd candidate to dial it directly (the NAT'd side can;
# the public side could only open a circuit through a relay, a slower path for good).
PRIVATE_PEER_WAIT_S = 8.0
# A node with no connection at all runs discovery (its bootstrap retries) at least this often.
ISOLATED_RETRY_S = 5.0
# Distinct peers remembered as seen (beyond it every peer counts as known).
MAX_EVER_SEEN = 65536
# Background work is not urgent: a slow answer is still progress, a cancelled one is waste.
# So its limits are this many `connect_timeout`s, far above a healthy loopback (~10-60 ms).
BACKGROUND_TIMEOUT_FACTOR = 5.0
# Streams every connection keeps open for good: they never make a peer busy for the trim.
IDLE_PROTOCOLS = frozenset(
    {PROTOCOL_ID_V11, PROTOCOL_ID_V12, TProtocol("/meshsub/1.0.0"), TProtocol(PING_PROTOCOL)}
)


@dataclass
class OverlayConfig:
    key: NodeKey
    listen_addrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    bootstrap: list[str] = field(default_factory=list)
    # Extra addresses to advertise (a public or port-forwarded address of this node).
    announce: list[str] = field(default_factory=list)
    network: str = DEFAULT_NETWORK  # nodes of another network id are refused (overlay/hello.py)
    models: list[str] = field(default_factory=list)
    roles: set[str] = field(default_factory=lambda: {"router"})
    capacity: dict[str, float] = field(default_factory=dict)
    ping_interval: float = 1.0  # probe a peer after this long without any frame from it
    gossip_heartbeat: float = 1.0
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
    # Bounded connections (overlay/connmgr.py): above `conn_high` connected peers the node
    # closes all but `conn_low` (bootstrap, relays, busy and new ones kept; then a few random
    # long links and the nearest by RTT); discovery dials new peers only below `conn_low`,
    # and explores one untried peer now and then below `conn_high`. 0 = unbounded.
    conn_low: int = 16
    conn_high: int = 24
    conn_grace: float = 30.0  # a new connection is never closed this young
    version: str = VERSION


def _peer_str(peer_id: ID | str) -> str:
    return peer_id if isinstance(peer_id, str) else peer_id.to_base58()


def parse_peer_addr(addr: str) -> PeerInfo:
    """`/ip4/.../tcp/.../p2p/<id>` -> PeerInfo; `BadMultiaddr` when malformed or without id."""
    maddr = parse_multiaddr(addr)
    try:
        return info_from_p2p_addr(maddr)
    except Exception as exc:
        raise BadMultiaddr(f"peer address {addr!r} must end in /p2p/<peer id> ({exc})") from None


@dataclass
class _Probe:
    """Liveness probing of one connected peer (see the module docstring)."""

    stream: INetStream | None = None
    pending: int = 0  # nonce of the probe awaiting its echo; 0 = none
    sent: dict[int, float] = field(default_factory=dict)  # recent nonces -> send time
    answered: trio.Event = field(default_factory=trio.Event)
    sent_at: float = -math.inf  # monotonic time of the last probe sent
    last_sample: float = -math.inf  # monotonic time of the last RTT sample
    misses: int = 0
    relayed: bool = False  # how the connection runs, looked up again every KIND_REFRESH_S
    kind_at: float = -math.inf


class _RxStamp:
    """Wraps a secured connection's `read`: each frame received stamps its peer as heard."""

    def __init__(self, read: Callable[..., Awaitable[bytes]], peer: ID, stamps: dict) -> None:
        self._read = read
        self._peer = peer
        self._stamps = stamps

    async def __call__(self, n: int | None = None) -> bytes:
        data = await self._read(n)
        self._stamps[self._peer] = time.monotonic()
        return data


class _ConnectionWatcher(INotifee):
    """Marks peers up on connect and down when their last connection closes."""

    def __init__(self, node: OverlayNode) -> None:
        self._node = node

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._node._on_connected(conn)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._node._on_disconnected(conn.muxed_conn.peer_id)

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass


class OverlayNode:
    """One running overlay node; create with `open_overlay_node`."""

    def __init__(self, config: OverlayConfig, host: IHost, pubsub: Pubsub, dht: OverlayDHT):
        self.config = config
        self.host = host
        self.pubsub = pubsub
        self.dht = dht
        self.peers = PeerTable(grace_period=config.peer_grace_period)
        self.peer_id: str = config.key.peer_id
        self.record: NodeRecord | None = None
        self._signed_record: bytes | None = None
        self._pending_records: dict[str, NodeRecord] = {}
        self.started_at = time.time()
        self._probes: dict[ID, _Probe] = {}
        self._lags: list[tuple[float, float]] = []  # (monotonic time, our own loop lag)
        self._last_rx: dict[ID, float] = {}  # monotonic time of the last frame per peer
        self._observed_rx: dict[ID, float] = {}
        self._probe_salt = secrets.token_bytes(PING_LENGTH - 8)
        self._next_nonce = 1
        self._record_retry: dict[str, tuple[float, float]] = {}  # pid -> (next try, delay)
        # Cost figures for benchmarks and status: probes, misses, stream opens, lookups.
        self.counters: Counter[str] = Counter()
        self.limiter = PeerLimiter()  # what one peer may make this node do (ping streams, echoes)
        self._dial_limiter = trio.CapacityLimiter(BACKGROUND_PARALLEL)
        self._fetch_limiter = trio.CapacityLimiter(BACKGROUND_PARALLEL)
        self._wake_discovery = trio.Event()
        self._published_view = 0
        self._last_dial: dict[str, float] = {}
        self._first_seen: dict[str, float] = {}
        # Peers ever connected (bounded): "new peers appeared" for discovery and record gossip.
        # The table's size is no measure: trimmed and forgotten peers come and go in it.
        self._ever_seen: set[str] = set()
        self._next_round_by = math.inf  # trio time a deferred candidate needs a round by
        # Bounded connections (overlay/connmgr.py): off unless `conn_high` > 0.
        self.connmgr = ConnManager(
            ConnLimits(low=config.conn_low, high=config.conn_high, grace_s=config.conn_grace)
        )
        self.connmgr.protect(self._bootstrap_ids)
        self._bootstrap_infos: list[PeerInfo] = []
        self.announced = trio.Event()
        self.address_book = AddressBook(announce=list(config.announce))
        self.hello = Hello(network=config.network, version=config.version)
        self.refused: dict[str, str] = {}  # peer id -> why (another network or version)
        self._hello_done: dict[str, trio.Event] = {}
        self._nursery: trio.Nursery | None = None

    # -- public face ----------------------------------------------------------------------

    @property
    def addrs(self) -> list[str]:
        """The multiaddrs we advertise (``overlay/addrs.py``: never 0.0.0.0), each ending in
        /p2p/<peer id>."""
        return [str(a) for a in self.host.get_addrs()]

    def connection_kind(self, peer_id: str) -> str | None:
        """How we reach a connected peer: "direct" or "relayed" (circuit); None when not
        connected. (No hole punching yet: a NAT'd pair stays relayed.)"""
        try:
            conns = self.host.get_network().get_connections(ID.from_base58(peer_id))
        except Exception:
            return None
        if not conns:
            return None
        kinds = set()
        for conn in conns:
            addrs = [str(a) for a in conn.get_transport_addresses()]
            relayed = any(classify(a) == "circuit" for a in addrs) or _is_relayed(conn)
            kinds.add("relayed" if relayed else "direct")
        return "direct" if "direct" in kinds else "relayed"

    async def connect(self, addr: str) -> str:
        """Dial a `/.../p2p/<id>` address; returns the peer id (`PeerUnreachable` on failure)."""
        info = parse_peer_addr(addr)
        await self._dial(info)
        return _peer_str(info.peer_id)

    async def find_providers(self, model_id: str) -> list[str]:
        """Peer ids providing `model_id`, live ones only (self included when we provide it)."""
        infos = await self.dht.find_providers(model_id)
        out = []
        for info in infos:
            pid = _peer_str(info.peer_id)
            if pid == self.peer_id or self.peers.state(pid) is not PeerState.DOWN:
                out.append(pid)
        return out

    async def get_node_record(self, peer_id: str) -> NodeRecord | None:
        """Newest signed node record of `peer_id` (ours for our own id), or None."""
        if peer_id == self.peer_id:
            return self.record
        record = await self.dht.get_record(peer_id)
        if record is not None:
            self.peers.set_record(record)
        return record

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve `protocol`; the handler's errors are logged and the stream reset, never raised."""

        async def guarded(stream: INetStream) -> None:
            try:
                await handler(stream)
            except Exception as exc:
                logger.info("handler for %s failed: %r", protocol, exc)
                with trio.move_on_after(1):
                    await _reset_quietly(stream)
            else:
                with trio.move_on_after(1):
                    await _close_quietly(stream)

        self.host.set_stream_handler(TProtocol(protocol), guarded)

    async def open_stream(
        self,
        peer_id: str,
        protocol: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109  # callers (forward.py) pass it
    ) -> INetStream:
        """New stream to `peer_id` speaking `protocol`; dials (via the DHT if needed) first."""
        pid = ID.from_base58(peer_id)
        limit = timeout if timeout is not None else self.config.connect_timeout * 2
        try:
            with trio.fail_after(limit):
                if pid not in self.host.get_connected_peers():
                    info = await self.dht.kad.find_peer(pid)
                    if info is None or not info.addrs:
                        raise PeerUnreachable(f"no known address for peer {peer_id}")
                    await self._dial(info)
                return await self.host.new_stream(pid, [TProtocol(protocol)])
        except PeerUnreachable:
            raise
        except trio.TooSlowError:
            raise PeerUnreachable(
                f"opening {protocol} to {peer_id} took longer than {limit:.1f}s"
            ) from None
        except Exception as exc:
            raise PeerUnreachable(f"cannot open {protocol} to {peer_id}: {exc}") from None

    def status(self) -> dict[str, Any]:
        """Plain-data status for CLIs and dashboards."""
        kad = self.dht.kad
        counts = {str(s): len(self.peers.peer_ids(s)) for s in PeerState}
        return {
            "peer_id": self.peer_id,
            "addrs": self.addrs,
            "version": self.config.version,
            "roles": sorted(self.config.roles),
            "models": list(self.config.models),
            "uptime_s": round(time.time() - self.started_at, 3),
            "connected": len(self.host.get_connected_peers()),
            "connections": self.connmgr.status(len(self.host.get_connected_peers())),
            "peer_counts": counts,
            "peers": [
                {**entry, "connection": self.connection_kind(entry["peer_id"])}
                for entry in self.peers.snapshot()
            ],
            "refused": dict(self.refused),
            "dht": {
                "routing_table": kad.get_routing_table_size(),
                "values": kad.get_value_store_size(),
                "provider_keys": len(kad.provider_store.providers),
            },
            "record_seq": self.record.seq if self.record else None,
            "announced": self.announced.is_set(),
            "pubsub_topics": sorted(self.pubsub.topic_ids),
            "counters": dict(self.counters),
        }

    # -- connection events --------------------------------------------------------------

    def _on_connected(self, conn: INetConn) -> None:
        peer = conn.muxed_conn.peer_id
        pid = _peer_str(peer)
        # Only a peer never seen before can teach discovery something; a flapping one would
        # otherwise trigger a round of DHT lookups per reconnect.
        is_new = pid not in self._ever_seen
        if is_new and len(self._ever_seen) < MAX_EVER_SEEN:
            self._ever_seen.add(pid)
        if pid in self.refused:
            self._spawn(self._drop, peer)
            return
        if _is_initiator(conn) and self._nursery is not None:
            self._hello_done[pid] = trio.Event()
            self._spawn(self._check_network, peer)
        self._stamp_reads(conn)
        self.peers.observe(pid)
        self.connmgr.note_connected(pid)
        pending = self._pending_records.pop(pid, None)
        if pending is not None:
            self.peers.set_record(pending)
        if is_new:
            self._wake_discovery.set()

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    async def _drop(self, peer: ID) -> None:
        with trio.move_on_after(2):
            with suppress(Exception):
                await self.host.disconnect(peer)

    def _refuse(self, peer: ID, reason: str) -> None:
        pid = _peer_str(peer)
        if pid not in self.refused:
            logger.warning("refusing peer %s: %s", pid, reason)
        self.refused[pid] = reason
        self.peers.mark_down(pid, f"refused: {reason}")
        self._spawn(self._drop, peer)

    async def _check_network(self, peer: ID) -> None:
        """Dialer side of the hello exchange (overlay/hello.py) on a new connection."""
        pid = _peer_str(peer)
        done = self._hello_done.get(pid)
        if done is None:
            done = self._hello_done[pid] = trio.Event()
        try:
            theirs = await say_hello(
                lambda: self.host.new_stream(peer, [TProtocol(HELLO_PROTOCOL)]), self.hello
            )
        except (Exception, trio.TooSlowError) as exc:
            # An old or busy peer: the other checks (records, limits) still apply.
            logger.debug("no hello from %s: %r", pid, exc)
        else:
            reason = mismatch(self.hello, theirs)
            if reason is not None:
                self._refuse(peer, reason)
        finally:
            done.set()
            self._hello_done.pop(pid, None)

    async def _serve_hello(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        theirs = await answer_hello(stream, self.hello)
        reason = mismatch(self.hello, theirs)
        if reason is not None:
            self._refuse(peer, reason)

    def _stamp_reads(self, conn: INetConn) -> None:
        peer = conn.muxed_conn.peer_id
        secured = getattr(conn.muxed_conn, "secured_conn", None)
        read = getattr(secured, "read", None)
        if read is not None and not isinstance(read, _RxStamp):
            secured.read = _RxStamp(read, peer, self._last_rx)  # type: ignore[union-attr]
        self._last_rx[peer] = time.monotonic()

    def _on_disconnected(self, peer: ID) -> None:
        if peer in self.host.get_connected_peers():
            return  # another connection to this peer is still open
        self._probes.pop(peer, None)
        self._last_rx.pop(peer, None)
        self._observed_rx.pop(peer, None)
        self.connmgr.note_disconnected(_peer_str(peer))
        self.peers.mark_down(_peer_str(peer), "connection closed")
        if not self.connmgr.may_redial(len(self.host.get_connected_peers())):
            return
        if self.connmgr.enabled:
            self._wake_discovery.set()  # below the low watermark: refill now, not in a minute

    # -- dialing ------------------------------------------------------------------------

    async def _dial(self, info: PeerInfo, *, background: float = 1.0) -> None:
        """Connect to `info` within `background` x `connect_timeout`. Discovery dials take
        `BACKGROUND_TIMEOUT_FACTOR`, bootstrap retries grow towards it: 64 nodes joining on 2 cores took more than
        `connect_timeout` per handshake, and cutting them short threw the work of both sides
        away and made every retry slower still (measured: ~900 handshakes torn down, a
        median of 15 of 63 peers connected after 200 s)."""
        pid = _peer_str(info.peer_id)
        self._last_dial[pid] = trio.current_time()
        if pid in self.refused:
            raise PeerUnreachable(f"peer {pid} was refused: {self.refused[pid]}")
        limit = self.config.connect_timeout * background
        try:
            with trio.fail_after(limit):
                await self.host.connect(info)
        except trio.TooSlowError:
            raise PeerUnreachable(
                f"dialing {info.peer_id} at {[str(a) for a in info.addrs]} timed out "
                f"after {limit:.1f}s"
            ) from None
        except Exception as exc:
            raise PeerUnreachable(
                f"dialing {info.peer_id} at {[str(a) for a in info.addrs]} failed: {exc}"
            ) from None
        # DHT tables take server-mode peers only; ours all are, and identify may lag.
        await self.dht.kad.routing_table.add_peer(info)

    async def _connect_bootstrap(self, info: PeerInfo) -> bool:
        delay = self.config.bootstrap_backoff
        last = ""
        for attempt in range(1, self.config.bootstrap_attempts + 1):
            # Like TCP's SYN retries: a busy bootstrap gets longer, an absent one fails soon.
            factor = min(2.0 ** (attempt - 1), BACKGROUND_TIMEOUT_FACTOR)
            # libp2p refuses for 60 s to dial a peer whose addresses all failed once (its
            # "negative cache"): a bootstrap too busy to finish one handshake in time then
            # got no second try, and a starved joiner stayed alone for minutes (measured:
            # 64 processes on 2 cores). These retries have their own backoff.
            unblock = getattr(self.host.get_network(), "unblock_peer", None)
            if unblock is not None:
                unblock(info.peer_id)
            try:
                await self._dial(info, background=factor)
                return True
            except PeerUnreachable as exc:
                last = str(exc)
                logger.debug("bootstrap attempt %d failed: %s", attempt, exc)
            if attempt < self.config.bootstrap_attempts:
                await trio.sleep(delay)
                delay *= 2
        logger.warning(
            "bootstrap peer unreachable after %d attempts: %s",
            self.config.bootstrap_attempts,
            last,
        )
        return False

    async def _bootstrap(self) -> None:
        reached: list[bool] = []

        async def one(info: PeerInfo) -> None:
            reached.append(await self._connect_bootstrap(info))

        async with trio.open_nursery() as nursery:
            for info in self._bootstrap_infos:
                nursery.start_soon(one, info)
        if any(reached):
            await self._require_same_network()
        if self._bootstrap_infos and not any(reached):
            message = (
                f"none of the {len(self._bootstrap_infos)} bootstrap peers answered; "
                "check the addresses and that those nodes are running"
            )
            if self.config.require_bootstrap:
                raise BootstrapFailed(message)
            logger.warning("%s (will keep retrying)", message)

    async def _require_same_network(self) -> None:
        """Wait for the hello of each bootstrap peer we reached; when all of them are of
        another network or version, this node is joining the wrong overlay: say so."""
        with trio.move_on_after(2 * self.config.connect_timeout):
            for info in self._bootstrap_infos:
                event = self._hello_done.get(_peer_str(info.peer_id))
                if event is not None:
                    await event.wait()
        reached = [_peer_str(i.peer_id) for i in self._bootstrap_infos]
        refused = [pid for pid in reached if pid in self.refused]
        connected = {_peer_str(p) for p in self.host.get_connected_peers()}
        if refused and not any(pid in connected for pid in reached if pid not in refused):
            pid = refused[0]
            raise NetworkMismatch(
                f"bootstrap peer {pid} refused: {self.refused[pid]}; use an invite or "
                "--bootstrap of this node's network, or set --network to match"
            )

    # -- publishing -----------------------------------------------------------------------

    async def publish_record(self) -> NodeRecord:
        """Sign a fresh node record (new seq) and store it in the DHT."""
        cfg = self.config
        record = new_node_record(
            cfg.key, self.addrs, cfg.models, cfg.roles, cfg.capacity, cfg.version
        )
        signed = sign_node_record(cfg.key, record)
        self._signed_record = signed
        with trio.move_on_after(10):
            await self.dht.publish_record(signed)
        self.record = record
        self._published_view = len(self.peers.up_peers())
        return record

    async def _announce(self) -> None:
        # In the background: DHT puts take 0.05-3 s (busy cores), the node is usable before.
        await self.publish_record()
        await self._provide_all()
        self.announced.set()

    async def wait_announced(self) -> None:
        """Wait until our first node record and provider records have been published."""
        await self.announced.wait()

    async def _provide_all(self) -> None:
        for model_id in self.config.models:
            await self.dht.provide(model_id)

    # -- loops --------------------------------------------------------------------------

    async def _discovery_loop(self) -> None:
        base = self.config.discovery_interval
        interval = base
        while True:
            # Growth = peers we had never heard of; reconnects of known ones do not count.
            before = len(self._ever_seen)
            self._wake_discovery = trio.Event()
            self._next_round_by = math.inf
            try:
                await self._discover_once()
            except Exception as exc:  # one bad round must not take the node down
                logger.warning("discovery round failed: %r", exc)
            self.counters["discovery_rounds"] += 1
            if len(self._ever_seen) > before:
                interval = base
            else:
                interval = min(interval * 2, self.config.discovery_max_interval)
            if not self.host.get_connected_peers():
                # Alone (every link lost, the bootstrap unanswered): nothing will wake us, so
                # no minute-long back-off (measured: 64 nodes on 2 cores, joiners left alone).
                interval = min(interval, ISOLATED_RETRY_S)
            view = len(self.peers.up_peers())
            if self.announced.is_set() and view >= max(2, 2 * self._published_view):
                # The closest-peer set changed a lot since we stored our records there.
                await self.publish_record()
                await self._provide_all()
            # Rounds stay `base` apart however many new peers connect meanwhile; a candidate
            # that waits its turn (`_dial_wait`) gets a round when its wait is over.
            await trio.sleep(base)
            wait = max(0.0, interval - base)
            wait = min(wait, max(0.0, self._next_round_by - trio.current_time()))
            with trio.move_on_after(wait):
                await self._wake_discovery.wait()

    def _known_addrs(self, peer: ID) -> list[Multiaddr]:
        try:
            return list(self.host.get_peerstore().addrs(peer))
        except Exception:  # PeerStoreError for a peer we never heard an address of
            return []

    def _record_addrs(self, pid: str) -> list[Multiaddr]:
        """The addresses a peer's signed record lists, circuits included: a NAT'd peer's
        only direct address may be one we must never dial (ours too), so the peerstore has
        none for it, and the relay fallback needs the circuits."""
        entry = self.peers.get(pid)
        record = entry.record if entry is not None else self._pending_records.get(pid)
        if record is None:
            return []
        out = []
        for addr in record.addrs:
            with suppress(Exception):  # a record is validated, but be strict anyway
                out.append(Multiaddr(addr))
        return out

    def _gossiped_record(self, data: bytes) -> NodeRecord | None:
        try:
            return verify_node_record(data)
        except IdentityError as exc:
            logger.debug("gossiped node record rejected: %s", exc)
            return None

    async def _records_gossip_loop(self) -> None:
        """Publish our signed record while new peers appear; take in the others' records."""
        self.pubsub.set_topic_validator(
            RECORDS_TOPIC,
            lambda _forwarder, msg: self._gossiped_record(bytes(msg.data)) is not None,
            False,
        )
        sub = await self.pubsub.subscribe(RECORDS_TOPIC)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_records, sub)
            published_for: tuple[int, bytes | None] = (-1, None)
            while True:
                await trio.sleep(RECORD_GOSSIP_INTERVAL)
                # Again when new peers appeared, and when our record changed (a relay slot,
                # a confirmed public address): peers holding the old one would keep it.
                now = (len(self._ever_seen), self._signed_record)
                if self._signed_record is None or now == published_for:
                    continue
                try:
                    await self.pubsub.publish(RECORDS_TOPIC, self._signed_record)
                    published_for = now
                    self.counters["record_gossip_publishes"] += 1
                except Exception as exc:  # no mesh yet: the next round tries again
                    logger.debug("record gossip publish failed: %r", exc)

    def _learn_addrs(self, record: NodeRecord) -> None:
        addrs = []
        for addr in record.addrs:
            try:
                info = parse_peer_addr(addr)
            except BadMultiaddr:
                continue
            if _peer_str(info.peer_id) == record.peer_id:
                addrs.extend(info.addrs)
        if addrs:
            peer = ID.from_base58(record.peer_id)
            self.host.get_peerstore().add_addrs(peer, addrs, GOSSIPED_ADDR_TTL)

    async def _receive_records(self, sub: Any) -> None:
        while True:
            msg = await sub.get()
            record = self._gossiped_record(bytes(msg.data))
            if record is None or record.peer_id == self.peer_id:
                continue
            self.counters["record_gossip_received"] += 1
            if record.peer_id in self.peers:
                self.peers.set_record(record)
                self._learn_addrs(record)  # a new relay slot: its circuit address
            elif len(self._pending_records) < MAX_PENDING_RECORDS:
                # Not connected yet (a table entry would wrongly say "up"): a peer we learned
                # of by gossip, so hand its signed addresses to discovery.
                old = self._pending_records.get(record.peer_id)
                if old is None or old.seq < record.seq:
                    self._pending_records[record.peer_id] = record
                    self._learn_addrs(record)
                    self._wake_discovery.set()

    async def _records_loop(self) -> None:
        while True:
            try:
                await self._fetch_missing_records()
            except Exception as exc:
                logger.warning("record fetch round failed: %r", exc)
            await trio.sleep(self.config.discovery_interval)

    async def _discover_once(self) -> None:
        connected = set(self.host.get_connected_peers())
        if not connected and self._bootstrap_infos:
            await self._bootstrap()
            connected = set(self.host.get_connected_peers())
        kad = self.dht.kad
        # Inbound peers reach the routing table only via libp2p's own bookkeeping, which lags:
        # a bootstrap whose table misses its joiners answers lookups with too few peers.
        for peer in connected:
            if not kad.routing_table.peer_in_table(peer):
                addrs = self._known_addrs(peer)
                if addrs:
                    await kad.routing_table.add_peer(PeerInfo(peer, addrs))
        candidates: set[ID] = set(kad.routing_table.get_peer_ids())
        # Peers whose signed records arrived by gossip: their addresses are in the peerstore.
        candidates.update(ID.from_base58(pid) for pid in self._pending_records)
        if self._enough_without_lookups(connected, candidates):
            # Lookups (new negotiated streams to several peers, and work for them) were the
            # largest idle cost of 16 node processes on 2 cores: a bounded node that holds its
            # low watermark and still knows untried peers has nothing to learn from one.
            self.counters["dht_lookups_skipped"] += 1
            await self._dial_candidates(candidates - connected - {self.host.get_id()})
            return
        with trio.move_on_after(BACKGROUND_TIMEOUT_FACTOR * self.config.connect_timeout):
            me = self.host.get_id()
            self.counters["dht_lookups"] += 1
            candidates.update(await kad.peer_routing.find_closest_peers_network(me.to_bytes()))
            if len(candidates) >= KAD_BUCKET_SIZE:
                # A self lookup returns the k closest peers: only a network larger than one
                # bucket hides peers from it.
                self.counters["dht_lookups"] += 1
                candidates.update(
                    await kad.peer_routing.find_closest_peers_network(secrets.token_bytes(32))
                )
        await self._dial_candidates(candidates - connected - {self.host.get_id()})

    def _enough_without_lookups(self, connected: set[ID], candidates: set[ID]) -> bool:
        mgr = self.connmgr
        if not mgr.enabled or len(connected) < mgr.limits.low:
            return False
        return any(
            _peer_str(p) not in mgr.tried for p in candidates - connected - {self.host.get_id()}
        )

    async def _dial_candidates(self, candidates: set[ID]) -> None:
        now = trio.current_time()
        connected = len(self.host.get_connected_peers())
        mgr = self.connmgr
        budget = self.config.max_peers - connected
        limit = mgr.dial_budget(connected)
        if limit >= 0:
            budget = min(budget, limit)
        may_redial = mgr.may_redial(connected)
        todo: list[PeerInfo] = []
        for peer in candidates:
            pid = _peer_str(peer)
            if pid in self.refused:
                continue
            if mgr.was_pruned(pid) and not may_redial:
                continue  # we closed it for a nearer one: not again while we have enough
            # Redial a peer we recently failed to reach only every few seconds.
            known = pid in self.peers or pid in self._pending_records
            if now - self._last_dial.get(pid, -1e9) < 5.0 and known:
                continue
            addrs = self._known_addrs(peer) or self._record_addrs(pid)
            if not addrs:
                continue
            wait = self._dial_wait(pid, addrs)
            first_seen = self._first_seen.setdefault(pid, now)
            if now - first_seen < wait:
                self._defer_discovery(first_seen + wait)
                continue
            todo.append(PeerInfo(peer, addrs))
        if mgr.enabled:
            # Untried peers first (a trim keeps the nearest of those it has seen), then the
            # nearest of the known ones.
            todo.sort(key=lambda i: (_peer_str(i.peer_id) in mgr.tried, self._rtt_of(i)))
        # Peers we lost: try them again (a SIGCONT-ed or restarted node comes back).
        for pid in self.peers.peer_ids(PeerState.DOWN) if may_redial else []:
            peer = ID.from_base58(pid)
            entry = self.peers.get(pid)
            down_for = time.monotonic() - (entry.changed_at if entry else time.monotonic())
            if pid < self.peer_id and down_for < 10.0:
                continue  # same tie-break as above: the smaller id redials first
            if now - self._last_dial.get(pid, -1e9) >= 5.0 and peer not in candidates:
                addrs = self._known_addrs(peer) or self._record_addrs(pid)
                if addrs:
                    todo.append(PeerInfo(peer, addrs))

        async def one(info: PeerInfo) -> None:
            async with self._dial_limiter:
                if info.peer_id in self.host.get_connected_peers():
                    return  # it dialed us while this dial waited for its turn
                self.counters["dials"] += 1
                try:
                    await self._dial(info, background=BACKGROUND_TIMEOUT_FACTOR)
                except PeerUnreachable as exc:
                    logger.debug("discovered peer unreachable: %s", exc)

        async with trio.open_nursery() as nursery:
            for info in todo[: max(budget, 0)]:
                nursery.start_soon(one, info)

    def _dial_wait(self, pid: str, addrs: Sequence[Multiaddr]) -> float:
        """How long after first seeing a candidate we wait before dialing it. Two peers that
        discover each other dial at once, and with one connection per peer libp2p closes one
        of the two under the streams already opened on it: so the larger id waits a few
        seconds for the smaller one. Except across a NAT: a NAT'd node (its addresses are
        circuits) reaches a public one directly, while the public one could only open a
        circuit through a relay; so the NAT'd side dials at once and the public side waits
        longer for it."""
        we_private = self.address_book.reachability == "private"
        they_private = any(classify(a) == "circuit" for a in addrs)
        if we_private and not they_private:
            return 0.0
        if they_private and not we_private:
            return PRIVATE_PEER_WAIT_S
        return TIE_BREAK_WAIT_S if pid < self.peer_id else 0.0

    def _defer_discovery(self, at: float) -> None:
        """A candidate waits until `at` (trio time): the next round must not come later."""
        self._next_round_by = min(self._next_round_by, at)

    def _rtt_of(self, info: PeerInfo) -> float:
        entry = self.peers.get(_peer_str(info.peer_id))
        return math.inf if entry is None or entry.rtt_ms is None else entry.rtt_ms

    async def _fetch_missing_records(self) -> None:
        limit = BACKGROUND_TIMEOUT_FACTOR * self.config.connect_timeout

        async def one(pid: str) -> None:
            async with self._fetch_limiter:
                with trio.move_on_after(limit):
                    try:
                        # Connected peers answer for themselves; a peer that has not
                        # published yet is asked again later (no costly DHT walk).
                        record = await self.dht.get_record(pid, walk=False, direct_timeout=limit)
                        if record is not None:
                            self.peers.set_record(record)
                    except Exception as exc:  # a misbehaving peer must not stop discovery
                        logger.debug("record of %s unavailable: %r", pid, exc)

        now = trio.current_time()
        async with trio.open_nursery() as nursery:
            for pid in self.peers.up_peers():
                entry = self.peers.get(pid)
                if entry is None or entry.record is not None:
                    self._record_retry.pop(pid, None)
                    continue
                # Asked again with a doubling delay, capped low: a peer stores its record
                # before announcing it, so a miss is mostly a slow or failed stream.
                next_try, delay = self._record_retry.get(pid, (now, 0.0))
                if now < next_try:
                    continue
                delay = min(
                    max(delay * 2, self.config.discovery_interval),
                    RECORD_RETRY_CAP_INTERVALS * self.config.discovery_interval,
                )
                self._record_retry[pid] = (now + delay, delay)
                self.counters["record_fetches"] += 1
                nursery.start_soon(one, pid)

    async def _liveness_loop(self) -> None:
        """Start a prober per connected peer; turn received frames into `observe` calls."""
        tick = min(0.25, self.config.ping_interval / 4)
        async with trio.open_nursery() as nursery:
            while True:
                now = time.monotonic()
                connected = self.host.get_connected_peers()
                # A lost disconnect notification must not leave a vanished peer "up".
                live = {_peer_str(p) for p in connected}
                for pid in self.peers.peer_ids(PeerState.UP, PeerState.SUSPECT):
                    if pid not in live:
                        self.peers.mark_down(pid, "connection closed")
                for peer in connected:
                    if peer not in self._probes:
                        probe = self._probes[peer] = _Probe()
                        nursery.start_soon(self._probe_peer, peer, probe)
                    heard = self._last_rx.get(peer)
                    if heard is not None and heard > self._observed_rx.get(peer, -math.inf):
                        self._observed_rx[peer] = heard
                        self.peers.observe(_peer_str(peer))
                await trio.sleep(tick)
                woke = time.monotonic()
                self._lags.append((woke, woke - now - tick))
                if len(self._lags) > 256:
                    del self._lags[:128]

    def _stalled(self, since: float, limit: float) -> bool:
        """Did OUR event loop lag more than `limit` s since `since`? Then silence proves
        nothing about the peer (we may not have run to read its frames)."""
        return any(lag > limit for at, lag in self._lags if at >= since)

    def _probing(self, peer: ID, probe: _Probe) -> bool:
        return self._probes.get(peer) is probe and peer in self.host.get_connected_peers()

    async def _probe_peer(self, peer: ID, probe: _Probe) -> None:
        """Probe `peer` whenever it falls silent, until it disconnects or is declared down."""
        async with trio.open_nursery() as nursery:
            try:
                await self._probe_rounds(peer, probe, nursery)
            finally:
                nursery.cancel_scope.cancel()

    async def _probe_rounds(self, peer: ID, probe: _Probe, nursery: trio.Nursery) -> None:
        cfg = self.config
        pid = _peer_str(peer)
        nursery.start_soon(self._keep_probe_stream, peer, probe)
        while self._probing(peer, probe):
            now = time.monotonic()
            interval = max(cfg.ping_interval, len(self._probes) / PROBE_BUDGET_PER_S)
            due = min(
                max(self._last_rx.get(peer, -math.inf), probe.sent_at) + interval,
                probe.last_sample + RTT_REFRESH_INTERVALS * interval,
            )
            if probe.misses == 0 and now < due:
                await trio.sleep(due - now)
                continue
            # A relayed link crosses a third node's event loop and two more hops.
            if now - probe.kind_at > KIND_REFRESH_S:
                probe.relayed = self.connection_kind(pid) == "relayed"
                probe.kind_at = now
            floor = cfg.ping_timeout * (RELAYED_TIMEOUT_FACTOR if probe.relayed else 1.0)
            rto = self.peers.rto(pid, floor, RTO_CEILING * floor)
            started = time.monotonic()
            if probe.stream is not None:
                answered = await self._send_probe(probe, rto)
            else:  # stream still opening: silence alone decides
                probe.sent_at = started
                await trio.sleep(rto)
                answered = False
            if answered or self._last_rx.get(peer, -math.inf) > started:
                probe.misses = 0  # an echo or any other frame: alive, maybe just slow
                continue
            # Woken far past the deadline, or the loop lagged meanwhile: we were starved.
            late = time.monotonic() - started > 1.5 * rto
            if late or self._stalled(started, rto / 2):
                self.counters["probe_misses_excused"] += 1
                continue  # we were starved ourselves: probe again instead of blaming it
            probe.misses += 1
            self.counters["probe_misses"] += 1
            self.peers.record_failure(pid, f"no frame within {rto:.2f}s of a ping")
            if probe.misses >= self.peers.down_after + CLOSE_AFTER_EXTRA_MISSES:
                # Still silent long after being declared down: free the connection (a hung
                # peer would hold it forever); discovery redials it later.
                with trio.move_on_after(2):
                    await self.host.disconnect(peer)
                return

    async def _keep_probe_stream(self, peer: ID, probe: _Probe) -> None:
        """Open the ping stream (never cut short: an open is the costly part), read echoes,
        reopen with backoff when it ends."""
        cfg = self.config
        delay = cfg.ping_interval
        while self._probing(peer, probe):
            self.counters["probe_stream_opens"] += 1
            try:
                with trio.fail_after(BACKGROUND_TIMEOUT_FACTOR * cfg.connect_timeout):
                    stream = await self.host.new_stream(peer, [TProtocol(PING_PROTOCOL)])
            except (Exception, trio.TooSlowError) as exc:
                logger.debug("ping stream to %s not opened: %r", peer, exc)
                await trio.sleep(delay)
                delay = min(2 * delay, RTT_REFRESH_INTERVALS * cfg.ping_interval)
                continue
            probe.stream = stream
            try:
                await self._read_echoes(peer, probe, stream)
            finally:
                probe.stream = None
                with trio.move_on_after(0.5) as cleanup:
                    cleanup.shield = True
                    await _reset_quietly(stream)
            await trio.sleep(delay)

    async def _send_probe(self, probe: _Probe, rto: float) -> bool:
        """Send one echo probe; True when its echo came back within `rto` of sending."""
        stream = probe.stream
        assert stream is not None
        nonce = self._next_nonce
        self._next_nonce += 1
        probe.pending, probe.answered = nonce, trio.Event()
        probe.sent_at = time.monotonic()
        probe.sent[nonce] = probe.sent_at
        while len(probe.sent) > 8:  # keep the few whose late echoes may still come
            del probe.sent[min(probe.sent)]
        self.counters["probes"] += 1
        with trio.move_on_after(rto):
            try:
                await stream.write(nonce.to_bytes(8, "big") + self._probe_salt)
            except Exception as exc:  # broken stream: the keeper reopens it
                logger.debug("ping write failed: %r", exc)
                await _reset_quietly(stream)
                return False
            await probe.answered.wait()
            return True
        return False

    async def _read_echoes(self, peer: ID, probe: _Probe, stream: INetStream) -> None:
        """Match echoes to probes by nonce; late echoes still give a valid RTT sample."""
        buffer = b""
        try:
            while True:
                chunk = await stream.read(PING_LENGTH)
                if not chunk:
                    return
                buffer += chunk
                while len(buffer) >= PING_LENGTH:
                    echo, buffer = buffer[:PING_LENGTH], buffer[PING_LENGTH:]
                    nonce = int.from_bytes(echo[:8], "big")
                    sent = probe.sent.pop(nonce, None)
                    if sent is None or echo[8:] != self._probe_salt:
                        continue  # not one of ours, or already too old to matter
                    now = time.monotonic()
                    probe.last_sample = now
                    self.peers.record_rtt(_peer_str(peer), now - sent)
                    if nonce == probe.pending:
                        probe.pending = 0
                        probe.answered.set()
        except Exception as exc:
            logger.debug("ping stream to %s ended: %r", peer, exc)

    # -- bounded connections (overlay/connmgr.py) -------------------------------------------

    def _bootstrap_ids(self) -> set[str]:
        return {_peer_str(i.peer_id) for i in self._bootstrap_infos}

    def _busy(self, pid: str) -> bool:
        """A stream other than the persistent ones (gossipsub, pings) is open to the peer: a
        forward, a digest pull, a circuit we relay. Closing it now would cut that short."""
        try:
            conns = self.host.get_network().get_connections(ID.from_base58(pid))
        except Exception:
            return False
        for conn in conns:
            for stream in conn.get_streams():
                if stream.get_protocol() not in IDLE_PROTOCOLS:
                    return True
        return False

    def _rtt_ms(self, pid: str) -> float | None:
        entry = self.peers.get(pid)
        return None if entry is None else entry.rtt_ms

    async def trim_connections(self) -> list[str]:
        """Close the connections the connection manager drops now (none at or below its high
        watermark); returns those peers, marked down as pruned."""
        connected = [_peer_str(p) for p in self.host.get_connected_peers()]
        drop = self.connmgr.plan_trim(self.peer_id, connected, self._rtt_ms, self._busy)
        for pid in drop:
            with trio.move_on_after(2), suppress(Exception):
                await self.host.disconnect(ID.from_base58(pid))
            self.peers.mark_down(pid, "pruned: connection limit")
        if drop:
            self.counters["pruned"] += len(drop)
            logger.debug("pruned %d connections (had %d)", len(drop), len(connected))
        return drop

    async def _trim_loop(self) -> None:
        while self.connmgr.enabled:
            await trio.sleep(TRIM_EVERY_S)
            try:
                await self.trim_connections()
            except Exception as exc:  # one bad round must not take the node down
                logger.warning("connection trim failed: %r", exc)

    async def _maintenance_loop(self) -> None:
        last_publish = trio.current_time()
        while True:
            await trio.sleep(1.0)
            for pid in self.peers.prune():
                self._last_dial.pop(pid, None)
                self._first_seen.pop(pid, None)
                logger.info("forgot peer %s (down longer than the grace period)", pid)
            if trio.current_time() - last_publish >= self.config.record_refresh:
                await self.publish_record()
                last_publish = trio.current_time()


def _is_initiator(conn: INetConn) -> bool:
    """Did we dial this connection? (yamux keeps it; the secured session too)."""
    muxed = conn.muxed_conn
    value = getattr(muxed, "is_initiator_value", None)
    if value is None:
        value = getattr(getattr(muxed, "secured_conn", None), "is_initiator", False)
    return bool(value)


def _is_relayed(conn: INetConn) -> bool:
    """A circuit-relay connection, as libp2p's secured session classifies it (its transport
    addresses name the circuit where the session cannot say)."""
    secured = getattr(conn.muxed_conn, "secured_conn", None)
    kind = getattr(secured, "get_connection_type", None)
    if kind is not None:
        t = kind()
        return str(getattr(t, "name", t)).upper() == "RELAYED"
    return any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses())


def _filtered_connect(host: IHost) -> Callable[[PeerInfo], Awaitable[None]]:
    """``host.connect`` that never dials an unspecified or own address (overlay/addrs.py)
    and tries a peer's likely path first; circuits are left to the relay fallback."""
    connect = host.connect

    async def filtered(info: PeerInfo) -> None:
        if info.peer_id in host.get_connected_peers():
            return
        addrs = list(info.addrs)
        with suppress(Exception):  # PeerStoreError: no stored address
            addrs += list(host.get_peerstore().addrs(info.peer_id))
        own = [str(a) for a in host.get_transport_addrs()] + [str(a) for a in host.get_addrs()]
        usable = dial_order(addrs, own)
        if not usable:
            raise PeerUnreachable(
                f"no dialable address for {info.peer_id} among {[str(a) for a in addrs]}"
            )
        # The peerstore holds what identify said; a bad entry must not be retried as-is.
        await connect(PeerInfo(info.peer_id, usable))

    return filtered


def _filter_peerstore(host: IHost) -> None:
    """The swarm dials the peerstore's addresses directly when a stream is opened to a peer
    not connected yet (DHT queries do), so unusable addresses never enter it: unspecified
    ones, and our own (a NAT'd node's twin behind another router has the same private
    address; dialing it reaches ourselves). Filtered on write, with string tests only: the
    DHT writes addresses for every peer of every answer (a full parse per address there
    doubled the join time of 8 nodes on 2 busy cores)."""
    store = host.get_peerstore()
    add_addrs = store.add_addrs
    own: dict[str, Any] = {"at": -math.inf, "set": frozenset()}

    def own_endpoints() -> frozenset[str]:
        now = time.monotonic()
        if now - own["at"] > OWN_ADDRS_REFRESH_S:
            bound = [str(a) for a in host.get_transport_addrs()]
            bound += [str(a) for a in host.get_addrs()]
            own["set"] = frozenset(a.split("/p2p/")[0] for a in bound)
            own["at"] = now
        return own["set"]

    def filtered(peer_id: ID, addrs: Sequence[Multiaddr], ttl: int = 0) -> None:
        if peer_id != host.get_id():
            mine = own_endpoints()
            keep = []
            for addr in addrs:
                text = str(addr)
                if text.startswith(_UNSPECIFIED) or text.split("/p2p/")[0] in mine:
                    continue
                keep.append(addr)
            addrs = keep
        add_addrs(peer_id, addrs, ttl)

    store.add_addrs = filtered  # type: ignore[method-assign]


_UNSPECIFIED = ("/ip4/0.0.0.0/", "/ip6/::/")
OWN_ADDRS_REFRESH_S = 5.0


async def _serve_ping(stream: INetStream, limiter: PeerLimiter) -> None:
    """Echo 32-byte pings until the peer closes; a silent peer is dropped after a minute. A peer
    over its ``ping`` streams or ``ping_echo`` rate (``overlay/limits.py``) is reset."""
    peer = remote_peer(stream)
    try:
        with limiter.admit(peer, "ping"):
            while True:
                with trio.fail_after(60):
                    payload = b""
                    while len(payload) < PING_LENGTH:
                        chunk = await stream.read(PING_LENGTH - len(payload))
                        if not chunk:
                            return
                        payload += chunk
                limiter.charge(peer, "ping_echo")
                await stream.write(payload)
    except (Exception, trio.TooSlowError):
        await _reset_quietly(stream)
    finally:
        await _close_quietly(stream)


async def _reset_quietly(stream: INetStream) -> None:
    with suppress(Exception):
        await stream.reset()


async def _close_quietly(stream: INetStream) -> None:
    with suppress(Exception):
        await stream.close()


@asynccontextmanager
async def open_overlay_node(config: OverlayConfig) -> AsyncIterator[OverlayNode]:
    """Start an overlay node (see module docstring); stops it on exit."""
    bootstrap = [parse_peer_addr(a) for a in config.bootstrap]  # malformed -> BadMultiaddr now
    listen = [parse_multiaddr(a) for a in config.listen_addrs]
    for addr in config.announce:
        parse_multiaddr(addr)  # malformed -> BadMultiaddr now
    book = AddressBook(announce=list(config.announce))
    host = make_host(
        config.key,
        config.listen_addrs,
        addrs_factory=book.advertise,
        dial_timeout=config.dial_timeout,
        health_ping_timeout=config.health_ping_timeout,
        health_check_interval=config.health_check_interval,
        max_connections=config.max_peers,
    )
    gossipsub = QuietGossipSub(
        protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11],
        degree=6,
        degree_low=4,
        degree_high=12,
        heartbeat_interval=config.gossip_heartbeat,  # type: ignore[arg-type]  # float works
        heartbeat_initial_delay=0.1,
    )
    pubsub = Pubsub(host, gossipsub, strict_signing=True)
    dht = OverlayDHT(host)
    node = OverlayNode(config, host, pubsub, dht)
    node.address_book = book
    host.connect = _filtered_connect(host)  # type: ignore[method-assign]
    _filter_peerstore(host)
    node.set_stream_handler(HELLO_PROTOCOL, node._serve_hello)
    node._bootstrap_infos = [b for b in bootstrap if _peer_str(b.peer_id) != node.peer_id]
    host.get_network().register_notifee(_ConnectionWatcher(node))
    host.set_stream_handler(TProtocol(PING_PROTOCOL), partial(_serve_ping, limiter=node.limiter))
    try:
        async with (
            host.run(listen_addrs=listen),
            background_trio_service(pubsub),
            background_trio_service(gossipsub),
            trio.open_nursery() as connection_tasks,
        ):
            node._nursery = connection_tasks
            try:
                await node._bootstrap()
                async with background_trio_service(dht.kad), trio.open_nursery() as nursery:
                    nursery.start_soon(node._announce)
                    nursery.start_soon(node._discovery_loop)
                    nursery.start_soon(node._liveness_loop)
                    nursery.start_soon(node._records_loop)
                    nursery.start_soon(node._records_gossip_loop)
                    nursery.start_soon(node._maintenance_loop)
                    nursery.start_soon(node._trim_loop)
                    try:
                        yield node
                    finally:
                        nursery.cancel_scope.cancel()
            finally:
                node._nursery = None
                connection_tasks.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # Our nurseries wrap everything (also the caller's own exceptions) in groups; hand a
        # lone error back as itself so `except BootstrapFailed` and friends work.
        leaves = _leaves(group)
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
