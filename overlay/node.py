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
- Background loops: discovery (DHT self/random lookups + routing table -> connect to unknown
  peers, fetch their node records; fast while the view grows, backing off to
  `discovery_max_interval` once stable); ping (one persistent /ipfs/ping stream per peer,
  `ping_timeout` each, feeding `PeerTable` RTT EWMA and failures: a dead or hung peer is down
  after 2 failed pings, i.e. within ~2 * (ping_interval + ping_timeout) s, and at once when
  its connection drops); pruning of peers down longer than `peer_grace_period`; republishing
  our node record every `record_refresh` s and whenever our view of the network has doubled.
- Public face: `peer_id`, `addrs` (multiaddrs ending in /p2p/<id>), `host`, `pubsub`, `dht`,
  `peers` (PeerTable), `record` (our NodeRecord), `find_providers`, `get_node_record`,
  `set_stream_handler`, `open_stream`, `connect`, `status()`.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from p2pnode.identity import NodeKey, NodeRecord, new_node_record, sign_node_record
from p2pnode.overlay._errors import BadMultiaddr, BootstrapFailed, PeerUnreachable
from p2pnode.overlay.dht import OverlayDHT
from p2pnode.overlay.host import make_host, parse_multiaddr
from p2pnode.overlay.peers import PeerState, PeerTable

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
StreamHandler = Callable[[INetStream], Awaitable[None]]


@dataclass
class OverlayConfig:
    key: NodeKey
    listen_addrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    bootstrap: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    roles: set[str] = field(default_factory=lambda: {"router"})
    capacity: dict[str, float] = field(default_factory=dict)
    ping_interval: float = 1.0
    gossip_heartbeat: float = 1.0
    ping_timeout: float = 1.0
    connect_timeout: float = 3.0
    dial_timeout: float = 5.0  # libp2p's own dial limit; keep it above connect_timeout
    health_ping_timeout: float = 2.0
    bootstrap_attempts: int = 4
    bootstrap_backoff: float = 0.2  # first retry delay; doubles per attempt
    require_bootstrap: bool = False
    discovery_interval: float = 0.5  # while the view grows
    discovery_max_interval: float = 10.0  # once it is stable
    peer_grace_period: float = 60.0
    record_refresh: float = 600.0
    max_peers: int = 128  # stop dialing discovered peers beyond this many connections
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


class _ConnectionWatcher(INotifee):
    """Marks peers up on connect and down when their last connection closes."""

    def __init__(self, node: OverlayNode) -> None:
        self._node = node

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._node._on_connected(conn.muxed_conn.peer_id)

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
        self.started_at = time.time()
        self._ping_streams: dict[ID, INetStream] = {}
        self._wake_discovery = trio.Event()
        self._published_view = 0
        self._last_dial: dict[str, float] = {}
        self._first_seen: dict[str, float] = {}
        self._bootstrap_infos: list[PeerInfo] = []
        self.announced = trio.Event()

    # -- public face ----------------------------------------------------------------------

    @property
    def addrs(self) -> list[str]:
        """Our listen multiaddrs, each ending in /p2p/<peer id>."""
        return [str(a) for a in self.host.get_addrs()]

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
            "peer_counts": counts,
            "peers": self.peers.snapshot(),
            "dht": {
                "routing_table": kad.get_routing_table_size(),
                "values": kad.get_value_store_size(),
                "provider_keys": len(kad.provider_store.providers),
            },
            "record_seq": self.record.seq if self.record else None,
            "announced": self.announced.is_set(),
            "pubsub_topics": sorted(self.pubsub.topic_ids),
        }

    # -- connection events --------------------------------------------------------------

    def _on_connected(self, peer: ID) -> None:
        pid = _peer_str(peer)
        is_new = pid not in self.peers or not self.peers.is_up(pid)
        self.peers.observe(pid)
        if is_new:
            self._wake_discovery.set()

    def _on_disconnected(self, peer: ID) -> None:
        if peer in self.host.get_connected_peers():
            return  # another connection to this peer is still open
        self._ping_streams.pop(peer, None)
        self.peers.mark_down(_peer_str(peer), "connection closed")

    # -- dialing ------------------------------------------------------------------------

    async def _dial(self, info: PeerInfo) -> None:
        self._last_dial[_peer_str(info.peer_id)] = trio.current_time()
        try:
            with trio.fail_after(self.config.connect_timeout):
                await self.host.connect(info)
        except trio.TooSlowError:
            raise PeerUnreachable(
                f"dialing {info.peer_id} at {[str(a) for a in info.addrs]} timed out "
                f"after {self.config.connect_timeout:.1f}s"
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
            try:
                await self._dial(info)
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
        if self._bootstrap_infos and not any(reached):
            message = (
                f"none of the {len(self._bootstrap_infos)} bootstrap peers answered; "
                "check the addresses and that those nodes are running"
            )
            if self.config.require_bootstrap:
                raise BootstrapFailed(message)
            logger.warning("%s (will keep retrying)", message)

    # -- publishing -----------------------------------------------------------------------

    async def publish_record(self) -> NodeRecord:
        """Sign a fresh node record (new seq) and store it in the DHT."""
        cfg = self.config
        record = new_node_record(
            cfg.key, self.addrs, cfg.models, cfg.roles, cfg.capacity, cfg.version
        )
        signed = sign_node_record(cfg.key, record)
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
        interval = self.config.discovery_interval
        while True:
            before = len(self.peers.up_peers())
            try:
                await self._discover_once()
            except Exception as exc:  # one bad round must not take the node down
                logger.warning("discovery round failed: %r", exc)
            if len(self.peers.up_peers()) > before:
                interval = self.config.discovery_interval
            else:
                interval = min(interval * 2, self.config.discovery_max_interval)
            view = len(self.peers.up_peers())
            if self.announced.is_set() and view >= max(2, 2 * self._published_view):
                # The closest-peer set changed a lot since we stored our records there.
                await self.publish_record()
                await self._provide_all()
            with trio.move_on_after(interval):
                await self._wake_discovery.wait()
            self._wake_discovery = trio.Event()

    def _known_addrs(self, peer: ID) -> list[Multiaddr]:
        try:
            return list(self.host.get_peerstore().addrs(peer))
        except Exception:  # PeerStoreError for a peer we never heard an address of
            return []

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
        candidates: set[ID] = set(kad.routing_table.get_peer_ids())
        with trio.move_on_after(5):
            me = self.host.get_id()
            candidates.update(await kad.peer_routing.find_closest_peers_network(me.to_bytes()))
            candidates.update(
                await kad.peer_routing.find_closest_peers_network(secrets.token_bytes(32))
            )
        await self._dial_candidates(candidates - connected - {self.host.get_id()})

    async def _dial_candidates(self, candidates: set[ID]) -> None:
        now = trio.current_time()
        budget = self.config.max_peers - len(self.host.get_connected_peers())
        todo = []
        for peer in candidates:
            pid = _peer_str(peer)
            # Redial a peer we recently failed to reach only every few seconds.
            if now - self._last_dial.get(pid, -1e9) < 5.0 and pid in self.peers:
                continue
            # Two peers discovering each other dial at once, and with one connection per
            # peer libp2p closes one of the two under the streams already opened on it. So
            # the larger id waits a few seconds for the smaller one to dial first.
            first_seen = self._first_seen.setdefault(pid, now)
            if pid < self.peer_id and now - first_seen < 3.0:
                continue
            addrs = self._known_addrs(peer)
            if addrs:
                todo.append(PeerInfo(peer, addrs))
        # Peers we lost: try them again (a SIGCONT-ed or restarted node comes back).
        for pid in self.peers.peer_ids(PeerState.DOWN):
            peer = ID.from_base58(pid)
            entry = self.peers.get(pid)
            down_for = time.monotonic() - (entry.changed_at if entry else time.monotonic())
            if pid < self.peer_id and down_for < 10.0:
                continue  # same tie-break as above: the smaller id redials first
            if now - self._last_dial.get(pid, -1e9) >= 5.0 and peer not in candidates:
                addrs = self._known_addrs(peer)
                if addrs:
                    todo.append(PeerInfo(peer, addrs))

        async def one(info: PeerInfo) -> None:
            try:
                await self._dial(info)
            except PeerUnreachable as exc:
                logger.debug("discovered peer unreachable: %s", exc)

        async with trio.open_nursery() as nursery:
            for info in todo[: max(budget, 0)]:
                nursery.start_soon(one, info)

    async def _fetch_missing_records(self) -> None:
        limiter = trio.CapacityLimiter(8)

        async def one(pid: str) -> None:
            async with limiter:
                with trio.move_on_after(5):
                    try:
                        # Connected peers answer for themselves; a peer that has not
                        # published yet is asked again next round (no costly DHT walk).
                        record = await self.dht.get_record(pid, walk=False)
                        if record is not None:
                            self.peers.set_record(record)
                    except Exception as exc:  # a misbehaving peer must not stop discovery
                        logger.debug("record of %s unavailable: %r", pid, exc)

        async with trio.open_nursery() as nursery:
            for pid in self.peers.up_peers():
                entry = self.peers.get(pid)
                if entry is not None and entry.record is None:
                    nursery.start_soon(one, pid)

    async def _ping_loop(self) -> None:
        while True:
            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                for peer in self.host.get_connected_peers():
                    nursery.start_soon(self._ping_one, peer)
            elapsed = trio.current_time() - started
            await trio.sleep(max(0.0, self.config.ping_interval - elapsed))

    async def _ping_one(self, peer: ID) -> None:
        pid = _peer_str(peer)
        stream = self._ping_streams.get(peer)
        try:
            with trio.fail_after(self.config.ping_timeout):
                if stream is None:
                    stream = await self.host.new_stream(peer, [TProtocol(PING_PROTOCOL)])
                    self._ping_streams[peer] = stream
                payload = os.urandom(PING_LENGTH)
                started = time.perf_counter()
                await stream.write(payload)
                echoed = b""
                while len(echoed) < PING_LENGTH:
                    chunk = await stream.read(PING_LENGTH - len(echoed))
                    if not chunk:
                        raise EOFError("ping stream closed")
                    echoed += chunk
                rtt = time.perf_counter() - started
            if echoed != payload:
                raise ValueError("ping echo mismatch")
            self.peers.record_rtt(pid, rtt)
        except (Exception, trio.TooSlowError) as exc:
            reason = "ping timed out" if isinstance(exc, trio.TooSlowError) else repr(exc)
            dropped = self._ping_streams.pop(peer, None)
            if dropped is not None:
                with trio.move_on_after(0.5):
                    await _reset_quietly(dropped)
            if pid in self.peers:
                self.peers.record_failure(pid, reason)

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


async def _serve_ping(stream: INetStream) -> None:
    """Echo 32-byte pings until the peer closes; a silent peer is dropped after a minute."""
    try:
        while True:
            with trio.fail_after(60):
                payload = b""
                while len(payload) < PING_LENGTH:
                    chunk = await stream.read(PING_LENGTH - len(payload))
                    if not chunk:
                        return
                    payload += chunk
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
    host = make_host(
        config.key,
        config.listen_addrs,
        dial_timeout=config.dial_timeout,
        health_ping_timeout=config.health_ping_timeout,
    )
    gossipsub = GossipSub(
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
    node._bootstrap_infos = [b for b in bootstrap if _peer_str(b.peer_id) != node.peer_id]
    host.get_network().register_notifee(_ConnectionWatcher(node))
    host.set_stream_handler(TProtocol(PING_PROTOCOL), _serve_ping)
    try:
        async with (
            host.run(listen_addrs=listen),
            background_trio_service(pubsub),
            background_trio_service(gossipsub),
        ):
            await node._bootstrap()
            async with background_trio_service(dht.kad), trio.open_nursery() as nursery:
                nursery.start_soon(node._announce)
                nursery.start_soon(node._discovery_loop)
                nursery.start_soon(node._ping_loop)
                nursery.start_soon(node._records_loop)
                nursery.start_soon(node._maintenance_loop)
                try:
                    yield node
                finally:
                    nursery.cancel_scope.cancel()
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
