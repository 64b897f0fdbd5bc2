"""NAT traversal: libp2p circuit relay v2 for overlay nodes, relays found in the overlay.

One file (~520 lines) on purpose: ``RelayService`` is one state machine whose parts (reservations,
the circuit addresses it advertises, the dial fallback that uses them, the members-only admission of
circuits it relays) read and write the same reservations.

A node behind NAT can dial out but cannot be dialed. It reserves a slot on a relay (a public
member of the overlay), advertises ``<relay addr>/p2p-circuit/p2p/<its id>``, and peers
that cannot dial it directly reach it through the relay: a relayed connection is a relay stream
carrying a full Noise + yamux connection end to end, so the relay sees only ciphertext and the
rest of the overlay (pings, forwarding, gossip) runs over it unchanged.

Contract:
- ``async with open_relay(node, relays=[addr, ...], hop=False|True|"auto", auto=False) as
  relay:`` on a running ``OverlayNode``: accepts relayed connections (circuit v2 STOP);
  relays for others (HOP) with ``hop=True``, or with ``hop="auto"`` once the node's
  reachability (overlay/net/reachability.py) is "public" (it then adds the ``relay`` role to its
  signed record and provides ``RELAY_PROVIDER_KEY`` in the DHT). Relaying is for members only
  (``relay.admit``): a peer with a valid signed node record of this network, not refused,
  reserving only for itself, within its per-peer ``relay_reserve``/``relay_circuit`` budgets;
  others get PERMISSION_DENIED. Each reservation is bounded by ``DEFAULT_LIMITS``.
- Reservations: on each of ``relays`` (``/ip4/.../tcp/.../p2p/<relay id>``; malformed ->
  ``BadMultiaddr`` at once), and with ``auto=True`` and no ``relays``, on ``AUTO_RELAYS``
  members found on our own while our reachability is "private" (peers whose records carry the
  ``relay`` role, else DHT providers of ``RELAY_PROVIDER_KEY``). Each is renewed before it
  expires and an unreachable relay retried with backoff. While a reservation holds,
  ``relay.circuit_addrs`` lists our circuit addresses and the host advertises them (its
  addresses, an identify push to connected peers, a republished signed node record);
  ``await relay.wait_reserved()`` returns once the first one holds; ``on_reachability`` is
  the callback the reachability service calls.
- Dialing: ``open_relay`` makes ``node.host.connect`` fall back to circuit addresses when the
  direct dial fails: those in the ``PeerInfo`` or the peerstore, else those in the peer's node
  record (cached in the peer table, else one bounded DHT lookup, at most every
  ``LOOKUP_EVERY_S`` per peer). Between two unreachable peers the larger peer id first waits
  ``CIRCUIT_TIE_BREAK_S`` for the smaller one to dial (simultaneous circuits kill each other).
  ``await relay.dial(circuit_addr) -> peer id`` dials one circuit explicitly.
- ``is_circuit_addr(addr)``; ``circuit_addr(relay_addr, peer_id)``.
Measured with py-libp2p 0.8.1 (Noise-only, yamux-only hosts): relayed dial ~65 ms on loopback,
streams and pings over it work; tests/overlay/test_relay.py runs a node in a network namespace
with no inbound route. Uses two 0.8.1 internals, checked by those tests: the transport's
``_make_reservation``/``_reservations`` (its public ``reserve`` starts a refresher of its own),
and instance attributes shadowing the host's ``connect``/``get_addrs`` (``BasicHost.get_addrs``
strips the first ``/p2p/`` part of every address, which turns a circuit address into the
relay's address with our id; ours are appended after it).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio
from libp2p.identity.identify_push.identify_push import push_identify_to_peers
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from p2pnode.overlay._errors import OverlayError, PeerUnreachable
from p2pnode.overlay.limits import LimitExceeded, PeerLimiter
from p2pnode.overlay.net.host import parse_multiaddr

if TYPE_CHECKING:
    from libp2p.abc import INetStream
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage

    from p2pnode.overlay.net.node import OverlayNode

__all__ = [
    "RelayService",
    "circuit_addr",
    "is_circuit_addr",
    "open_relay",
]

logger = logging.getLogger(__name__)

# What a relay grants each reservation: a relayed connection closes after `duration` s or
# `data` bytes (then the peers redial: a fresh circuit, or a direct path found meanwhile);
# at most `max_circuit_conns` circuits to one reserved peer, `max_reservations` peers in all.
DEFAULT_LIMITS = RelayLimits(
    duration=1800, data=256 << 20, max_circuit_conns=16, max_reservations=64
)
# Relays found on our own (no --relay given) hold this many reservations at once.
AUTO_RELAYS = 2
# The DHT key relays provide, so NAT'd nodes find them without a flag.
RELAY_PROVIDER_KEY = "p2pnode-relay-v1"
RELAY_SEARCH_S = (2.0, 30.0)  # backoff of the search for a relay: first, cap
RENEW_MARGIN_S = 120.0  # renew this long before the reservation expires
MAX_RENEW_S = 600.0  # and at least this often (a relay that restarted forgot us)
RETRY_S = (1.0, 30.0)  # backoff of an unreachable relay: first, cap
STEP_TIMEOUT_S = 10.0  # one connect/reserve/dial exchange
CIRCUIT_TIE_BREAK_S = 8.0  # see RelayService._dialed_by_peer
LOOKUP_EVERY_S = 10.0  # DHT lookups of one unreachable peer's record, at most this often


def is_circuit_addr(addr: str | Multiaddr) -> bool:
    return "/p2p-circuit" in str(addr)


def circuit_addr(relay_addr: str, peer_id: str) -> str:
    """``/ip4/R/tcp/P/p2p/<relay>`` + our id -> the circuit address others dial us at."""
    return f"{relay_addr}/p2p-circuit/p2p/{peer_id}"


def _relay_info(addr: str) -> PeerInfo:
    from p2pnode.overlay.net.node import parse_peer_addr

    if is_circuit_addr(addr):
        raise OverlayError(f"relay address {addr!r} is itself a circuit: give the relay's own")
    return parse_peer_addr(addr)


class _MembersOnlyProtocol(CircuitV2Protocol):
    """Circuit relay v2 that relays only for members of this overlay (``RelayService.admit``):
    the internet at large gets PERMISSION_DENIED before any resource is spent."""

    def __init__(self, service: RelayService, **kwargs: Any) -> None:
        super().__init__(service.host, **kwargs)
        self._service = service

    async def _handle_reserve(self, stream: INetStream, msg: HopMessage) -> None:
        peer = str(stream.muxed_conn.peer_id)
        claimed = msg.peer.id if msg.HasField("peer") and msg.peer.id else None
        reason = await self._service.admit(peer, "relay_reserve")
        if (
            reason is None
            and claimed is not None
            and claimed != stream.muxed_conn.peer_id.to_bytes()
        ):
            reason = "a peer may reserve only for itself"
        if reason is not None:
            await self._refuse(stream, peer, "reservation", reason)
            return
        await super()._handle_reserve(stream, msg)

    async def _handle_connect(self, stream: INetStream, msg: HopMessage) -> None:
        peer = str(stream.muxed_conn.peer_id)
        reason = await self._service.admit(peer, "relay_circuit")
        if reason is not None:
            await self._refuse(stream, peer, "circuit", reason)
            return
        self._service.counters["circuits"] += 1
        await super()._handle_connect(stream, msg)

    async def _refuse(self, stream: INetStream, peer: str, what: str, reason: str) -> None:
        self._service.counters[f"{what}s_refused"] += 1
        logger.info("relay %s for %s refused: %s", what, peer, reason)
        await self._send_status(stream, StatusCode.PERMISSION_DENIED, reason)
        with contextlib.suppress(Exception):
            await stream.reset()


class RelayService:
    """Circuit relay v2 on one overlay node; create with ``open_relay`` (module doc)."""

    def __init__(
        self,
        node: OverlayNode,
        *,
        relays: Sequence[str] = (),
        hop: bool | str = False,
        auto: bool = False,
        limiter: PeerLimiter | None = None,
    ) -> None:
        if hop not in (True, False, "auto"):
            raise ValueError(f"hop must be True, False or 'auto', got {hop!r}")
        self.node = node
        self.host = node.host
        self.hop = hop
        self.auto = auto and not relays
        self.limiter = limiter or PeerLimiter()
        self.counters: dict[str, int] = collections.Counter()
        self.relays = [_relay_info(a) for a in relays]  # BadMultiaddr now, not in a loop
        self._relay_addrs = {
            str(info.peer_id): str(a) for info, a in zip(self.relays, relays, strict=True)
        }
        may_hop = hop is not False
        self.protocol = _MembersOnlyProtocol(self, limits=DEFAULT_LIMITS, allow_hop=may_hop)
        roles = RelayRole.STOP | RelayRole.CLIENT | (RelayRole.HOP if may_hop else RelayRole(0))
        self.transport = CircuitV2Transport(
            self.host, self.protocol, RelayConfig(roles=roles, limits=DEFAULT_LIMITS)
        )
        self.reservations: dict[str, float] = {}  # relay peer id -> expiry (unix time)
        self._reserved = trio.Event()
        self._direct_connect = self.host.connect
        self._own_get_addrs = self.host.get_addrs
        self._dialing: set[str] = set()
        self._looked_up: dict[str, float] = {}  # peer id -> monotonic time of its last lookup
        self._nursery: trio.Nursery | None = None
        self._kept: set[str] = set()  # relays we keep a reservation task for
        self._kept_since: dict[str, float] = {}
        self._need_relay = trio.Event()
        # A bounded node (overlay/net/connmgr.py) never closes a link a circuit depends on.
        connmgr = getattr(node, "connmgr", None)
        if connmgr is not None:
            connmgr.protect(self.circuit_peers)

    def circuit_peers(self) -> set[str]:
        """Relays we hold a slot on, and peers holding a slot on us."""
        held = {str(p) for p in self.protocol.resource_manager._reservations}
        return set(self.reservations) | self._kept | held

    @property
    def serving(self) -> bool:
        """Do we relay for others now? (``hop="auto"``: once a dial-back showed us public)"""
        if self.hop == "auto":
            return self.node.address_book.reachability == "public"
        return bool(self.hop)

    async def admit(self, peer: str, scope: str) -> str | None:
        """None when ``peer`` may use our relay for ``scope``, else why not. Members only:
        a peer with a valid signed node record of this network (fetched once from the peer
        itself when we have none yet), not refused, within its per-peer budget."""
        if not self.serving:
            return "this node does not relay (it is not publicly reachable)"
        if peer in self.node.refused:
            return f"refused peer: {self.node.refused[peer]}"
        entry = self.node.peers.get(peer)
        record = entry.record if entry is not None else None
        if record is None:
            with trio.move_on_after(STEP_TIMEOUT_S / 2):
                with contextlib.suppress(Exception):
                    record = await self.node.dht.get_record(peer, walk=False)
                    if record is not None:
                        self.node.peers.set_record(record)
        if record is None or record.peer_id != peer:
            return "no signed node record of this overlay: relays serve members only"
        try:
            self.limiter.charge(peer, scope)
        except LimitExceeded as exc:
            return str(exc)
        return None

    # -- public face --------------------------------------------------------------------

    @property
    def circuit_addrs(self) -> list[str]:
        """Our circuit addresses through every relay we hold a live reservation on."""
        now = time.time()
        return [
            circuit_addr(self._relay_addrs[rid], self.node.peer_id)
            for rid, expiry in sorted(self.reservations.items())
            if expiry > now
        ]

    async def wait_reserved(self) -> None:
        await self._reserved.wait()

    async def dial(self, addr: str) -> str:
        """Open a relayed connection to a circuit address; returns the peer id reached."""
        maddr = parse_multiaddr(addr)
        if not is_circuit_addr(maddr):
            raise OverlayError(f"{addr!r} is no circuit address (.../p2p-circuit/p2p/<id>)")
        try:
            with trio.fail_after(STEP_TIMEOUT_S):
                conn = await self.transport.dial(maddr)
        except (Exception, trio.TooSlowError) as exc:
            raise PeerUnreachable(f"relayed dial to {addr} failed: {exc!r}") from None
        return str(conn.muxed_conn.peer_id)

    def status(self) -> dict[str, Any]:
        return {
            "hop": self.hop,
            "serving": self.serving,
            "auto": self.auto,
            "relays": sorted(self._relay_addrs.values()),
            "circuit_addrs": self.circuit_addrs,
            "reservations_held_for_others": len(self.protocol.resource_manager._reservations)
            if self.serving
            else 0,
            "counters": dict(self.counters),
        }

    # -- relays found on our own --------------------------------------------------------

    async def on_reachability(self, verdict: str) -> None:
        """Reachability changed (overlay/net/reachability.py): announce or look for relays."""
        if verdict == "public" and self.hop == "auto":
            await self._announce_relay()
        if verdict == "private" and self.auto:
            self._need_relay.set()

    async def _announce_relay(self) -> None:
        if "relay" not in self.node.config.roles:
            self.node.config.roles.add("relay")
            with trio.move_on_after(STEP_TIMEOUT_S):
                await self.node.publish_record()
        with trio.move_on_after(STEP_TIMEOUT_S):
            with contextlib.suppress(Exception):
                await self.node.dht.provide(RELAY_PROVIDER_KEY)

    def _relay_candidates(self) -> list[tuple[str, str]]:
        """(peer id, address) of up peers whose signed record has the relay role."""
        out = []
        for pid in self.node.peers.up_peers():
            entry = self.node.peers.get(pid)
            record = entry.record if entry is not None else None
            if record is None or "relay" not in record.roles or pid in self.node.refused:
                continue
            direct = [a for a in record.addrs if not is_circuit_addr(a)]
            if direct and self.node.connection_kind(pid) == "direct":
                out.append((pid, direct[0]))
        return out

    async def _find_relays(self) -> None:
        """While we are private and hold fewer than AUTO_RELAYS reservations: pick relays
        among the peers whose records say relay, else ask the DHT for providers."""
        await self._need_relay.wait()
        delay = RELAY_SEARCH_S[0]
        while True:
            if self.node.address_book.reachability == "private":
                # A relay counts while it holds our slot, or while its first try is young.
                now = time.monotonic()
                live = [
                    rid
                    for rid in self._kept
                    if rid in self.reservations or now - self._kept_since.get(rid, 0.0) < 30.0
                ]
                wanted = AUTO_RELAYS - len(live)
                candidates = [c for c in self._relay_candidates() if c[0] not in self._kept]
                if wanted > 0 and not candidates:
                    with trio.move_on_after(STEP_TIMEOUT_S):
                        with contextlib.suppress(Exception):
                            for info in await self.node.dht.find_providers(RELAY_PROVIDER_KEY):
                                pid = str(info.peer_id)
                                if pid != self.node.peer_id and pid not in self._kept:
                                    with contextlib.suppress(Exception):
                                        await self.node.get_node_record(pid)
                    candidates = [c for c in self._relay_candidates() if c[0] not in self._kept]
                for pid, addr in candidates[: max(wanted, 0)]:
                    self._add_relay(f"{addr.split('/p2p/')[0]}/p2p/{pid}")
                    delay = RELAY_SEARCH_S[0]
            await trio.sleep(delay)
            delay = min(2 * delay, RELAY_SEARCH_S[1])

    def _add_relay(self, addr: str) -> None:
        info = _relay_info(addr)
        rid = str(info.peer_id)
        if rid in self._kept or self._nursery is None:
            return
        logger.info("using relay %s (found in the overlay)", addr)
        self._kept.add(rid)
        self._kept_since[rid] = time.monotonic()
        self._relay_addrs[rid] = addr
        self._nursery.start_soon(self._keep_reservation, info)

    # -- dialing with fallback ----------------------------------------------------------

    async def connect(self, info: PeerInfo) -> None:
        """``host.connect`` with a fallback to the peer's circuit addresses."""
        try:
            await self._direct_connect(info)
            return
        except Exception as exc:
            pid = str(info.peer_id)
            if pid in self._dialing:
                raise
            direct_error = exc
        self._dialing.add(pid)
        try:
            if await self._dialed_by_peer(info):
                return
            circuits = self._circuits_of(info) or await self._circuits_from_record(pid)
            for addr in circuits:
                try:
                    await self.dial(addr)
                    logger.info("reached %s through relay %s", pid, addr)
                    return
                except (PeerUnreachable, OverlayError) as exc:
                    logger.debug("circuit %s failed: %s", addr, exc)
        finally:
            self._dialing.discard(pid)
        raise direct_error

    async def _dialed_by_peer(self, info: PeerInfo) -> bool:
        """Two NAT'd peers that learn of each other at once would both dial a circuit, and
        with one connection per peer libp2p closes one of the two under the streams already
        on it. So the larger peer id, itself unreachable, waits a while for the smaller one
        to dial it; True when that connection came."""
        pid = str(info.peer_id)
        if self.node.address_book.reachability != "private" or self.node.peer_id < pid:
            return False
        with trio.move_on_after(CIRCUIT_TIE_BREAK_S):
            while info.peer_id not in self.host.get_connected_peers():  # noqa: ASYNC110 (libp2p state, no event)
                await trio.sleep(0.2)
            return True
        return False

    async def _circuits_from_record(self, pid: str) -> list[str]:
        """Circuit addresses in the peer's signed node record: the cached one, else one
        bounded DHT lookup. Needed because identify did not spread them: after the NAT'd
        node's identify push the relay's peerstore still lacked them (0.8.1 logs "Failed to
        update the Certified-Addr-Book"); the record carries them."""
        entry = self.node.peers.get(pid)
        record = entry.record if entry is not None else None
        now = time.monotonic()
        # A cached record without circuits may predate the peer's reservation: look again.
        stale = record is None or not any(is_circuit_addr(a) for a in record.addrs)
        # one walk per peer every LOOKUP_EVERY_S: a dead peer's redials must not become walks
        if stale and now - self._looked_up.get(pid, -1e9) >= LOOKUP_EVERY_S:
            self._looked_up[pid] = now
            with trio.move_on_after(STEP_TIMEOUT_S / 2):
                try:
                    record = await self.node.dht.get_record(pid)
                except Exception as exc:  # a failing lookup only means: no circuit known
                    logger.debug("record of %s unavailable: %r", pid, exc)
        if record is None or record.peer_id != pid:
            return []
        return [a for a in record.addrs if is_circuit_addr(a)]

    def _circuits_of(self, info: PeerInfo) -> list[str]:
        addrs = [str(a) for a in info.addrs]
        # PeerStoreError: we never heard an address of this peer
        with contextlib.suppress(Exception):
            addrs += [str(a) for a in self.host.get_peerstore().addrs(info.peer_id)]
        pid = str(info.peer_id)
        out: list[str] = []
        for a in addrs:
            if is_circuit_addr(a) and a not in out:
                out.append(a if a.endswith(f"/p2p/{pid}") else f"{a}/p2p/{pid}")
        return out

    # -- reservations -------------------------------------------------------------------

    async def _reserve_once(self, info: PeerInfo) -> float:
        """Connect to the relay and reserve; returns the expiry (`OverlayError` on refusal)."""
        rid = str(info.peer_id)
        with trio.fail_after(STEP_TIMEOUT_S):
            await self._direct_connect(info)
            stream = await self.host.new_stream(info.peer_id, [HOP_PROTOCOL])
            try:
                ok = await self.transport._make_reservation(stream, info.peer_id)
            finally:
                await stream.close()
        if not ok:
            raise OverlayError(f"relay {rid} refused the reservation")
        # 0.8.1 keeps the expiry it was granted in `_reservations` (unix seconds)
        return float(self.transport._reservations.get(info.peer_id, time.time() + 3600))

    async def _keep_reservation(self, info: PeerInfo) -> None:
        rid = str(info.peer_id)
        backoff = RETRY_S[0]
        while True:
            try:
                expiry = await self._reserve_once(info)
            except (Exception, trio.TooSlowError) as exc:
                self.reservations.pop(rid, None)
                logger.warning(
                    "no reservation on relay %s (retry in %.0f s): %r", rid, backoff, exc
                )
                await trio.sleep(backoff)
                backoff = min(RETRY_S[1], 2 * backoff)
                continue
            backoff = RETRY_S[0]
            is_new = rid not in self.reservations
            self.reservations[rid] = expiry
            if is_new:
                logger.info("reserved a relay slot on %s until %s", rid, time.ctime(expiry))
                await self._advertise()
            renew_in = min(MAX_RENEW_S, max(1.0, expiry - time.time() - RENEW_MARGIN_S))
            await trio.sleep(renew_in)

    async def _advertise(self) -> None:
        """Make our circuit addresses known: identify, a push to connected peers, our record."""
        self._reserved.set()
        with trio.move_on_after(STEP_TIMEOUT_S):
            await push_identify_to_peers(self.host)
        with trio.move_on_after(STEP_TIMEOUT_S):
            await self.node.publish_record()

    def _get_addrs(self) -> list[Multiaddr]:
        return [*self._own_get_addrs(), *(Multiaddr(a) for a in self.circuit_addrs)]


def _install(service: RelayService) -> None:
    host = service.host
    # Instance attributes shadow the host's methods for this host only. Circuit addresses are
    # appended after BasicHost.get_addrs(): its own rewriting (0.8.1: strip the first /p2p/
    # component, append ours) would turn a circuit into the relay's address with OUR id.
    service._own_get_addrs = host.get_addrs
    host.get_addrs = service._get_addrs
    host.connect = service.connect


def _uninstall(service: RelayService) -> None:
    host = service.host
    host.get_addrs = service._own_get_addrs
    host.connect = service._direct_connect


@asynccontextmanager
async def open_relay(
    node: OverlayNode,
    *,
    relays: Sequence[str] = (),
    hop: bool | str = False,
    auto: bool = False,
    limiter: PeerLimiter | None = None,
) -> AsyncIterator[RelayService]:
    """Run circuit relay v2 on a running overlay node (module doc); stops it on exit."""
    service = RelayService(node, relays=relays, hop=hop, auto=auto, limiter=limiter)
    _install(service)
    try:
        async with background_trio_service(service.protocol), trio.open_nursery() as nursery:
            service._nursery = nursery
            for info in service.relays:
                service._kept.add(str(info.peer_id))
                nursery.start_soon(service._keep_reservation, info)
            if service.auto:
                nursery.start_soon(service._find_relays)
            try:
                yield service
            finally:
                nursery.cancel_scope.cancel()
    finally:
        _uninstall(service)
