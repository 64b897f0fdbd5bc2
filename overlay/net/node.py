"""The assembled overlay of one p2pnode: host + gossipsub + DHT, and the collaborators that
keep it connected. This module is the assembly and the public face; each job has its module:

- ``config.py``: `OverlayConfig`, every knob.
- ``admission.py``: the hello exchange on new connections; refused peers.
- ``dialing.py``: dialing one peer, the bootstrap with backoff, which addresses to dial.
- ``discovery.py``: DHT lookups and gossiped signed records -> candidates to dial.
- ``liveness.py``: frames as signs of life, echo probes of silent peers, the ping server
  (its probe floor and when not to close follow the machine's starvation: ``starvation.py``).
- ``trimming.py``: closing connections above the high watermark (policy: ``connmgr.py``).

Contract:
- `async with open_overlay_node(OverlayConfig(key=...)) as node:` starts a Noise/yamux host,
  gossipsub (strict signing, ~1 s heartbeat; built before any connection so it sees them all)
  and a server-mode DHT; connects to `bootstrap` peers (exponential backoff, bounded by
  `bootstrap_attempts`; a malformed address raises `BadMultiaddr` at once, unreachable ones are
  logged in one line each and retried by the discovery loop; with `require_bootstrap=True`
  `BootstrapFailed` is raised instead); publishes the signed node record to the DHT and
  provides each model id in the background (`await node.wait_announced()` to wait for it).
  Leaving the block closes every connection (bounded by `CLOSE_ON_STOP_S`, so neighbours see
  the leave at once), then stops everything.
- Background loops: discovery and record gossip (``discovery.py``); node-record fetches
  (per-peer backoff); liveness (``liveness.py``); the connection trim (``trimming.py``);
  pruning of peers down longer than `peer_grace_period`; republishing our node record every
  `record_refresh` s and whenever our view of the network has doubled.
- The node turns connection events into calls on its collaborators: a new connection is
  screened (`Admission.admit`), its reads stamped (`Liveness.stamp_reads`), the peer observed
  and handed to the connection manager and discovery; a peer's last connection closing marks
  it down (and, below the low watermark, wakes discovery to replace it).
- libp2p's own health monitor (a new negotiated stream per connection per check, connection
  aborted on ONE late answer) is off unless `health_check_interval` > 0;
  `health_ping_timeout` is its probe timeout then.
- Public face: `peer_id`, `addrs` (multiaddrs ending in /p2p/<id>), `host`, `pubsub`, `dht`,
  `peers` (PeerTable), `record` (our NodeRecord), `find_providers`, `get_node_record`,
  `publish_record`, `wait_announced`, `set_stream_handler`, `open_stream`, `connect`,
  `connection_kind`, `trim_connections`, `status()`; and `refused`, `counters`, `connmgr`,
  `address_book`, `limiter` for the services built on it; `membership` (``members.py``,
  the ``seams.Membership`` the trust code reads: `closed`, `is_member(peer_id)`).
- A closed network (`OverlayConfig.closed`, ``members.py``): the hello carries memberships,
  the gate (``patches/gate.py``) holds every other protocol until a peer's is verified,
  revocations are gossiped (``revocations.py``), and a node able to issue serves invite
  redemption (``redemption.py``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Protocol

import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from p2pnode.identity import NodeRecord, new_node_record, sign_node_record
from p2pnode.overlay._errors import PeerUnreachable
from p2pnode.overlay._streams import close_quietly, reset_quietly
from p2pnode.overlay.limits import PeerLimiter
from p2pnode.overlay.net.addrs import AddressBook, classify
from p2pnode.overlay.net.admission import Admission
from p2pnode.overlay.net.config import VERSION, OverlayConfig
from p2pnode.overlay.net.connmgr import ConnLimits, ConnManager
from p2pnode.overlay.net.dht import OverlayDHT
from p2pnode.overlay.net.dialing import Dialer, filter_peerstore, filtered_connect, parse_peer_addr
from p2pnode.overlay.net.discovery import Discovery
from p2pnode.overlay.net.hello import HELLO_PROTOCOL, Hello
from p2pnode.overlay.net.host import make_host, parse_multiaddr
from p2pnode.overlay.net.liveness import PING_LENGTH, PING_PROTOCOL, Liveness, serve_ping
from p2pnode.overlay.net.members import MEMBERSHIP_PROTOCOL, Members
from p2pnode.overlay.net.patches.busy import AdmissionLoad, install_busy_limits
from p2pnode.overlay.net.patches.containment import contain_stream_errors
from p2pnode.overlay.net.patches.gate import install_gate
from p2pnode.overlay.net.patches.safepubsub import SafePubsub
from p2pnode.overlay.net.patches.tuning import QuietGossipSub
from p2pnode.overlay.net.trimming import Trimmer
from p2pnode.overlay.peers import PeerState, PeerTable
from p2pnode.overlay.seams import StreamHandler

__all__ = [
    "PING_LENGTH",
    "PING_PROTOCOL",
    "VERSION",
    "OverlayConfig",
    "OverlayNode",
    "open_overlay_node",
    "parse_peer_addr",
]

logger = logging.getLogger(__name__)

# How long a stopping node spends closing its connections: a peer that does not take the close
# (a hung process) must not hold the stop up; its socket goes with our process anyway.
CLOSE_ON_STOP_S = 2.0


class _NodeEvents(Protocol):
    """What the connection watcher calls on the node."""

    def _on_connected(self, conn: INetConn) -> None: ...

    def _on_disconnected(self, peer: ID) -> None: ...


class _ConnectionWatcher(INotifee):
    """Marks peers up on connect and down when their last connection closes."""

    def __init__(self, node: _NodeEvents) -> None:
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

    def __init__(
        self,
        config: OverlayConfig,
        host: IHost,
        pubsub: Pubsub,
        dht: OverlayDHT,
        *,
        address_book: AddressBook | None = None,
    ):
        self.config = config
        self.host = host
        self.pubsub = pubsub
        self.dht = dht
        self.peers = PeerTable(grace_period=config.peer_grace_period)
        self.peer_id: str = config.key.peer_id
        self.record: NodeRecord | None = None
        self._signed_record: bytes | None = None
        self.started_at = time.time()
        # Cost figures for benchmarks and status: probes, misses, stream opens, lookups.
        self.counters: Counter[str] = Counter()
        self.limiter = PeerLimiter()  # what one peer may make this node do (ping streams, echoes)
        self._published_view = 0
        self.announced = trio.Event()
        if address_book is None:
            address_book = AddressBook(announce=list(config.announce))
        self.address_book = address_book
        # Set by hole punching (holepunch.py): did a punch make this connection; why a
        # relayed peer is still relayed.
        self.link_kind: Callable[[INetConn], bool] | None = None
        self.why_relayed: Callable[[str], str | None] | None = None
        self._nursery: trio.Nursery | None = None
        # Inbound work in flight (patches/busy.py), once the host serves.
        self.load: AdmissionLoad | None = None
        # Who belongs to a closed network (members.py); in an open one, no one and no gate.
        self.membership = Members(config.closed, self.peer_id)
        self.admission = Admission(
            host,
            self.peers,
            Hello(network=config.network, version=config.version),
            self._spawn,
            self.membership,
            self.counters,
        )
        self.refused = self.admission.refused  # peer id -> why (another network or version)
        self.dialer = Dialer(host, dht, config, self.admission, self.counters)
        # Bounded connections (overlay/net/connmgr.py): off unless `conn_high` > 0.
        self.connmgr = ConnManager(
            ConnLimits(low=config.conn_low, high=config.conn_high, grace_s=config.conn_grace)
        )
        self.connmgr.protect(self.dialer.bootstrap_ids)
        if self.connmgr.enabled:
            dht.keep_to_links()
        self.liveness = Liveness(
            host,
            self.peers,
            config,
            self.counters,
            self.connection_kind,
            keep_open=self.dialer.bootstrap_ids,
        )
        self.discovery = Discovery(
            host,
            dht,
            pubsub,
            self.peers,
            config,
            self.counters,
            dialer=self.dialer,
            connmgr=self.connmgr,
            address_book=self.address_book,
            refused=self.refused,
            signed_record=lambda: self._signed_record,
            after_round=self._republish_if_grown,
            connection_kind=self.connection_kind,
        )
        self.admission.use_referrals(
            self.discovery.referrals, self.discovery.referred, lambda: self.addrs
        )
        self.trimmer = Trimmer(host, self.peers, self.connmgr, self.counters, self.peer_id)

    @property
    def hello(self) -> Hello:
        return self.admission.hello

    # -- public face ----------------------------------------------------------------------

    @property
    def addrs(self) -> list[str]:
        """The multiaddrs we advertise (``overlay/net/addrs.py``: never 0.0.0.0), each ending in
        /p2p/<peer id>."""
        return [str(a) for a in self.host.get_addrs()]

    def connection_kind(self, peer_id: str) -> str | None:
        """How we reach a connected peer: "direct", "hole-punched" (a direct connection that
        a hole punch made, ``holepunch.py``) or "relayed" (circuit); None when not connected."""
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
            punched = not relayed and self.link_kind is not None and self.link_kind(conn)
            kinds.add("relayed" if relayed else "hole-punched" if punched else "direct")
        if "direct" in kinds:
            return "direct"
        return "hole-punched" if "hole-punched" in kinds else "relayed"

    async def connect(self, addr: str) -> str:
        """Dial a `/.../p2p/<id>` address; returns the peer id (`PeerUnreachable` on failure)."""
        info = parse_peer_addr(addr)
        await self.dialer.dial(info)
        return info.peer_id.to_base58()

    async def find_providers(self, model_id: str) -> list[str]:
        """Peer ids providing `model_id`, live ones only (self included when we provide it)."""
        infos = await self.dht.find_providers(model_id)
        out = []
        for info in infos:
            pid = info.peer_id.to_base58()
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

    def swap_digests_on_hello(
        self,
        give: Callable[[], tuple[bytes, ...]],
        take: Callable[[str, tuple[bytes, ...]], None],
    ) -> None:
        """Each new link's hello carries ``give()`` (our sealed cache digests); a checked
        peer's go to ``take(peer_id, digests)`` (``admission.py``)."""
        self.admission.use_digests(give, take)

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve `protocol`; the handler's errors are logged and the stream reset, never raised."""

        async def guarded(stream: INetStream) -> None:
            try:
                await handler(stream)
            except Exception as exc:
                logger.info("handler for %s failed: %r", protocol, exc)
                with trio.move_on_after(1):
                    await reset_quietly(stream)
            else:
                with trio.move_on_after(1):
                    await close_quietly(stream)

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
                    await self.dialer.dial(info)
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
            "libp2p": _libp2p_admission(self.host),
            "liveness": self.liveness.status(),
            "peer_counts": counts,
            "peers": [self._peer_status(entry) for entry in self.peers.snapshot()],
            "refused": dict(self.refused),
            "membership": self.membership.status(),
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

    def _peer_status(self, entry: dict[str, Any]) -> dict[str, Any]:
        kind = self.connection_kind(entry["peer_id"])
        out = {**entry, "connection": kind}
        if kind == "relayed" and self.why_relayed is not None:
            out["relayed_because"] = self.why_relayed(entry["peer_id"])
        return out

    async def trim_connections(self) -> list[str]:
        """Close the connections the connection manager drops now (none at or below its high
        watermark); returns those peers, marked down as pruned (``trimming.py``)."""
        return await self.trimmer.trim()

    # -- connection events --------------------------------------------------------------

    def _on_connected(self, conn: INetConn) -> None:
        pid = conn.muxed_conn.peer_id.to_base58()
        is_new = self.discovery.remember(pid)
        if not self.admission.admit(conn):
            return
        self.liveness.stamp_reads(conn)
        self.peers.observe(pid)
        self.connmgr.note_connected(pid)
        self.discovery.connected(pid, is_new)

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> bool:
        if self._nursery is None:
            return False
        self._nursery.start_soon(fn, *args)
        return True

    def _on_disconnected(self, peer: ID) -> None:
        if peer in self.host.get_connected_peers():
            return  # another connection to this peer is still open
        self.liveness.forget(peer)
        self.membership.settle(peer.to_base58())  # whoever waits for its hello stops waiting
        self.connmgr.note_disconnected(peer.to_base58())
        self.peers.mark_down(peer.to_base58(), "connection closed")
        if not self.connmgr.may_redial(len(self.host.get_connected_peers())):
            return
        if self.connmgr.enabled:
            self.discovery.wake()  # below the low watermark: refill now, not in a minute

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

    async def _republish_if_grown(self) -> None:
        view = len(self.peers.up_peers())
        if self.announced.is_set() and view >= max(2, 2 * self._published_view):
            # The closest-peer set changed a lot since we stored our records there.
            await self.publish_record()
            await self._provide_all()

    async def _maintenance_loop(self) -> None:
        last_publish = trio.current_time()
        while True:
            await trio.sleep(1.0)
            for pid in self.peers.prune():
                self.discovery.forget(pid)
                logger.info("forgot peer %s (down longer than the grace period)", pid)
            self.admission.refuse_expired()
            if trio.current_time() - last_publish >= self.config.record_refresh:
                await self.publish_record()
                last_publish = trio.current_time()


def _is_relayed(conn: INetConn) -> bool:
    """A circuit-relay connection, as libp2p's secured session classifies it (its transport
    addresses name the circuit where the session cannot say)."""
    secured = getattr(conn.muxed_conn, "secured_conn", None)
    kind = getattr(secured, "get_connection_type", None)
    if kind is not None:
        t = kind()
        return str(getattr(t, "name", t)).upper() == "RELAYED"
    return any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses())


def _libp2p_admission(host: IHost) -> dict[str, Any]:
    """What libp2p's own admission counts: its connection table (its fast refusal compares
    it with ``max_connections``) and its resource manager's connection count and circuit
    breaker (either one refuses a dial before the handshake, as a busy node does)."""
    swarm: Any = host.get_network()
    out: dict[str, Any] = {"connections": len(swarm.get_connections())}
    rcmgr = getattr(swarm, "_resource_manager", None)
    if rcmgr is not None:
        out["rcmgr_connections"] = getattr(rcmgr, "_current_connections", None)
        breaker = getattr(rcmgr, "circuit_breaker", None)
        out["rcmgr_breaker"] = str(getattr(breaker, "state", None))
    return out


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
        degree=config.gossip_degree,
        degree_low=max(1, config.gossip_degree - 2),
        degree_high=2 * config.gossip_degree,
        heartbeat_interval=config.gossip_heartbeat,  # type: ignore[arg-type]  # float works
        heartbeat_initial_delay=0.1,
    )
    pubsub = SafePubsub(host, gossipsub, strict_signing=True)
    dht = OverlayDHT(host)
    node = OverlayNode(config, host, pubsub, dht, address_book=book)
    host.connect = filtered_connect(host)  # type: ignore[method-assign]
    filter_peerstore(host)
    contain_stream_errors(host, node.counters)
    pubsub.counters = node.counters  # its contained faults show with the node's own
    node.set_stream_handler(HELLO_PROTOCOL, node.admission.serve_hello)
    closed = config.closed
    if closed is not None:
        # Before the host serves: not one stream of a non-member may slip past (gate.py).
        install_gate(host, node.membership, node.counters)
        if closed.issuer is not None:
            from p2pnode.overlay.net.redemption import serve_redemption

            node.set_stream_handler(
                MEMBERSHIP_PROTOCOL,
                serve_redemption(node.membership, closed.issuer, node.peer_id, closed.home),
            )
    # After the gate (it wraps the same negotiation): the bound counts gated streams too.
    node.load = install_busy_limits(host, node.counters)
    node.admission.use_load(node.load.retry_after_s)
    node.dialer.bootstrap_infos = [b for b in bootstrap if b.peer_id.to_base58() != node.peer_id]
    host.get_network().register_notifee(_ConnectionWatcher(node))
    host.set_stream_handler(TProtocol(PING_PROTOCOL), partial(serve_ping, limiter=node.limiter))
    try:
        async with (
            host.run(listen_addrs=listen),
            background_trio_service(pubsub),
            background_trio_service(gossipsub),
            trio.open_nursery() as connection_tasks,
        ):
            node._nursery = connection_tasks
            try:
                await node.dialer.bootstrap()
                async with background_trio_service(dht.kad), trio.open_nursery() as nursery:
                    nursery.start_soon(node._announce)
                    nursery.start_soon(node.discovery.run)
                    nursery.start_soon(node.liveness.run)
                    nursery.start_soon(node.discovery.run_record_fetches)
                    nursery.start_soon(node.discovery.run_record_gossip)
                    nursery.start_soon(node._maintenance_loop)
                    nursery.start_soon(node.trimmer.run)
                    if closed is not None:
                        from p2pnode.overlay.net.revocations import Revocations

                        revocations = Revocations(node.membership, pubsub, closed.home)
                        nursery.start_soon(revocations.run)
                    try:
                        yield node
                    finally:
                        nursery.cancel_scope.cancel()
            finally:
                node._nursery = None
                await _close_connections(host)  # before the cancel below: it would cut it short
                connection_tasks.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # Our nurseries wrap everything (also the caller's own exceptions) in groups; hand a
        # lone error back as itself so `except BootstrapFailed` and friends work.
        leaves = _leaves(group)
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


async def _close_connections(host: IHost) -> None:
    """Close every connection ourselves, at once and shielded (this runs on the way out, maybe
    under a cancel), errors ignored.

    libp2p's own stop path closes them inside its cancelled service, so the installed build
    gives up at the first await and leaves them open at the transport: neighbours kept a stopped
    node up until a probe of theirs went unanswered (seconds with the default `ping_interval`,
    a minute with a long one), and the sockets lived as long as the process.
    """
    network = host.get_network()

    async def close(peer: ID) -> None:
        with contextlib.suppress(Exception):
            await network.close_peer(peer)

    with trio.move_on_after(CLOSE_ON_STOP_S) as scope:
        scope.shield = True
        async with trio.open_nursery() as nursery:
            for peer in list(network.connections):
                nursery.start_soon(close, peer)


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
