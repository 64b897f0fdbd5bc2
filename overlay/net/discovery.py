"""Discovery of a node's peers: DHT lookups and signed node records gossiped, then dialed.

Contract:
- `Discovery(...)` is owned by the node and gets only what it uses: the host, DHT, pubsub,
  peer table, config and counters, the node's `Dialer` and `ConnManager`, its
  `AddressBook` (are we NAT'd?), its refusals, and two callbacks: `signed_record()` (our
  current signed record, None before the first publish) and `after_round()` (awaited after
  every discovery round; the node republishes there when its view has doubled).
- The node reports its connection events: `remember(pid) -> bool` (a peer never seen
  before?), `connected(pid, is_new)` (hands a gossiped record waiting for that peer to the
  table; a new peer wakes discovery), `wake()` (a lost peer to replace now), `forget(pid)`
  (a peer pruned from the table).
- `run()`: rounds of DHT self lookup, plus a random-key lookup once the network outgrows one
  Kademlia bucket, + routing table -> connect to unknown peers; rounds at least
  `discovery_interval` apart, woken early only by a peer never seen before, backing off to
  `discovery_max_interval` while nothing new turns up; an isolated node retries its
  bootstrap peers at least every `ISOLATED_RETRY_S`, or, when they all answered busy, when
  the first one's retry-after has passed (dialing the peers they named meanwhile).
- Bounded connections (``overlay/net/connmgr.py``): new peers are dialed only below the low
  watermark (then one untried peer now and then below the high one), lost or trimmed peers
  are redialed only below the low one. Two candidates that discover each other: the larger
  id waits ``TIE_BREAK_WAIT_S`` for the smaller one's dial, except across a NAT: a NAT'd
  node dials a public one at once, and a public node waits ``PRIVATE_PEER_WAIT_S`` for a
  NAT'd one (which can reach it directly; it could only open a circuit) (`dial_wait`).
- `run_record_gossip()`: node records also travel over gossipsub (`RECORDS_TOPIC`): our
  signed record is published again while new peers keep appearing and when it changes, at
  most every `record_gossip_interval()` s: `RECORD_GOSSIP_INTERVAL`, stretched so that the
  whole topic stays within `OverlayConfig.records_budget` messages a second (default
  `RECORDS_TOPIC_BUDGET`) however many nodes
  publish (each node receives and checks every record gossiped). Received ones are verified
  once per distinct bytes (invalid ones are not forwarded) and the newest seq kept; the
  signed addresses of a peer not yet connected go to discovery, which dials it.
- Referrals (``overlay/net/hello.py``): `referrals(asker)` names up to `REFERRAL_PEERS` peers we
  hold a direct link to and whose signed record we have (chosen at random, so joiners spread
  over the swarm), up to two addresses each from that record; `referred(addrs)` takes those
  named to us: candidates of the next round (bounded, `MAX_REFERRED`), which comes at once.
- `run_record_fetches()`: the DHT fetch of the records still missing, with per-peer
  backoff; the fallback of the gossip.
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress

import trio
from libp2p.abc import IHost, ISubscriptionAPI
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.pubsub.pubsub import Pubsub
from multiaddr import Multiaddr

from p2pnode.identity import IdentityError, NodeRecord, verify_node_record
from p2pnode.overlay._errors import BadMultiaddr, PeerUnreachable
from p2pnode.overlay.net.addrs import AddressBook, classify
from p2pnode.overlay.net.config import BACKGROUND_TIMEOUT_FACTOR, OverlayConfig
from p2pnode.overlay.net.connmgr import ConnManager, pair_rank
from p2pnode.overlay.net.dht import OverlayDHT
from p2pnode.overlay.net.dialing import Dialer, parse_peer_addr
from p2pnode.overlay.net.hello import MAX_REFERRAL_LEN
from p2pnode.overlay.peers import PeerState, PeerTable

__all__ = ["PRIVATE_PEER_WAIT_S", "RECORDS_TOPIC", "TIE_BREAK_WAIT_S", "Discovery"]

logger = logging.getLogger(__name__)

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
# Records a second on the whole topic. Every node receives, checks and forwards each one, so
# without a budget the topic grew with the swarm: 64 nodes joining at once gossiped ~32 a
# second, and their bootstrap spent ~10 % of a saturated core checking signatures on them.
RECORDS_TOPIC_BUDGET = 2.0
# A record publisher counts towards the budget this long after we last heard from it.
RECORD_PUBLISHER_MEMORY_S = 60.0
# Distinct record bytes whose check result is kept (the topic validator and the reader both
# need it, and an unchanged record comes again with every republish).
VERIFIED_RECORDS_CACHE = 512
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
# Peers named in one hello answer, and referred candidates kept for discovery (bounded).
REFERRAL_PEERS = 4
MAX_REFERRED = 256
# Distinct peers remembered as seen (beyond it every peer counts as known).
MAX_EVER_SEEN = 65536


class Discovery:
    """Finding and dialing the peers of one node (see the module contract)."""

    def __init__(
        self,
        host: IHost,
        dht: OverlayDHT,
        pubsub: Pubsub,
        peers: PeerTable,
        config: OverlayConfig,
        counters: Counter[str],
        *,
        dialer: Dialer,
        connmgr: ConnManager,
        address_book: AddressBook,
        refused: Mapping[str, str],
        signed_record: Callable[[], bytes | None],
        after_round: Callable[[], Awaitable[None]],
        connection_kind: Callable[[str], str | None] = lambda _pid: "direct",
    ) -> None:
        self._host = host
        self._dht = dht
        self._pubsub = pubsub
        self._peers = peers
        self._config = config
        self._counters = counters
        self._dialer = dialer
        self._connmgr = connmgr
        self._address_book = address_book
        self._refused = refused
        self._signed_record = signed_record
        self._after_round = after_round
        self._connection_kind = connection_kind
        self._peer_id = config.key.peer_id
        self._pending_records: dict[str, NodeRecord] = {}
        self._record_retry: dict[str, tuple[float, float]] = {}  # pid -> (next try, delay)
        self._dial_limiter = trio.CapacityLimiter(BACKGROUND_PARALLEL)
        self._fetch_limiter = trio.CapacityLimiter(BACKGROUND_PARALLEL)
        self._wake_discovery = trio.Event()
        self._first_seen: dict[str, float] = {}
        # Peers ever connected (bounded): "new peers appeared" for discovery and record gossip.
        # The table's size is no measure: trimmed and forgotten peers come and go in it.
        self._ever_seen: set[str] = set()
        self._next_round_by = math.inf  # trio time a deferred candidate needs a round by
        self._verified: OrderedDict[bytes, NodeRecord | None] = OrderedDict()
        self._record_publishers: dict[str, float] = {}  # peer id -> trio time last heard
        self._referred: OrderedDict[ID, None] = OrderedDict()

    # -- the node's connection events ---------------------------------------------------

    def remember(self, pid: str) -> bool:
        """Note a connected peer; True when it was never seen before."""
        # Only a peer never seen before can teach discovery something; a flapping one would
        # otherwise trigger a round of DHT lookups per reconnect.
        is_new = pid not in self._ever_seen
        if is_new and len(self._ever_seen) < MAX_EVER_SEEN:
            self._ever_seen.add(pid)
        return is_new

    def connected(self, pid: str, is_new: bool) -> None:
        """A peer connected: its gossiped record (if one waits) goes to the table."""
        pending = self._pending_records.pop(pid, None)
        if pending is not None:
            self._peers.set_record(pending)
        if is_new:
            self._wake_discovery.set()

    def wake(self) -> None:
        """Run the next round now (a lost peer to replace)."""
        self._wake_discovery.set()

    def forget(self, pid: str) -> None:
        """The table forgot the peer: so do the dial timestamps."""
        self._dialer.last_dial.pop(pid, None)
        self._first_seen.pop(pid, None)

    # -- referrals ------------------------------------------------------------------------

    def referrals(self, asker: str) -> tuple[str, ...]:
        """Addresses of a few peers to name in our hello answer to `asker`."""
        connected = {p.to_base58() for p in self._host.get_connected_peers()}
        pool = []
        for pid in self._peers.peer_ids(PeerState.UP):
            entry = self._peers.get(pid)
            if pid == asker or pid not in connected or entry is None or entry.record is None:
                continue
            if self._connection_kind(pid) != "direct" or any(
                "/p2p-circuit" in a for a in entry.record.addrs
            ):
                continue  # a NAT'd peer (relayed to us, or holding a relay slot): not dialable
            pool.append(entry.record)
        out: list[str] = []
        for record in random.sample(pool, min(REFERRAL_PEERS, len(pool))):
            out.extend([a for a in record.addrs if len(a) <= MAX_REFERRAL_LEN][:2])
        return tuple(out)

    def referred_peers(self) -> list[str]:
        """Peers named to us by hello answers (newest last; bounded)."""
        return [p.to_base58() for p in self._referred]

    def referred(self, addrs: tuple[str, ...]) -> None:
        """Peers a hello answer named: their addresses to the peerstore, and a round now."""
        me = self._host.get_id()
        for addr in addrs:
            try:
                info = parse_peer_addr(addr)
            except BadMultiaddr:
                continue
            if info.peer_id == me or not info.addrs:
                continue
            self._host.get_peerstore().add_addrs(info.peer_id, info.addrs, GOSSIPED_ADDR_TTL)
            self._referred[info.peer_id] = None
            self._referred.move_to_end(info.peer_id)
            self._counters["referrals_received"] += 1
        while len(self._referred) > MAX_REFERRED:
            self._referred.popitem(last=False)
        self._wake_discovery.set()

    # -- discovery rounds ---------------------------------------------------------------

    async def run(self) -> None:
        """Discovery rounds for as long as the node runs (see the module contract)."""
        base = self._config.discovery_interval
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
            self._counters["discovery_rounds"] += 1
            if len(self._ever_seen) > before:
                interval = base
            else:
                interval = min(interval * 2, self._config.discovery_max_interval)
            if not self._host.get_connected_peers():
                # Alone (every link lost, the bootstrap unanswered): nothing will wake us, so
                # no minute-long back-off (measured: 64 nodes on 2 cores, joiners left alone).
                interval = min(interval, ISOLATED_RETRY_S)
            await self._after_round()
            # Rounds stay `base` apart however many new peers connect meanwhile; a candidate
            # that waits its turn (`dial_wait`) gets a round when its wait is over.
            await trio.sleep(base)
            wait = max(0.0, interval - base)
            wait = min(wait, max(0.0, self._next_round_by - trio.current_time()))
            with trio.move_on_after(wait):
                await self._wake_discovery.wait()

    def _known_addrs(self, peer: ID) -> list[Multiaddr]:
        try:
            return list(self._host.get_peerstore().addrs(peer))
        except Exception:  # PeerStoreError for a peer we never heard an address of
            return []

    def _record_addrs(self, pid: str) -> list[Multiaddr]:
        """The addresses a peer's signed record lists, circuits included: a NAT'd peer's
        only direct address may be one we must never dial (ours too), so the peerstore has
        none for it, and the relay fallback needs the circuits."""
        entry = self._peers.get(pid)
        record = entry.record if entry is not None else self._pending_records.get(pid)
        if record is None:
            return []
        out = []
        for addr in record.addrs:
            with suppress(Exception):  # a record is validated, but be strict anyway
                out.append(Multiaddr(addr))
        return out

    def _gossiped_record(self, data: bytes) -> NodeRecord | None:
        if data in self._verified:
            self._verified.move_to_end(data)
            return self._verified[data]
        try:
            record: NodeRecord | None = verify_node_record(data)
        except IdentityError as exc:
            logger.debug("gossiped node record rejected: %s", exc)
            record = None
        self._verified[data] = record
        if len(self._verified) > VERIFIED_RECORDS_CACHE:
            self._verified.popitem(last=False)
        return record

    def _note_record_publisher(self, pid: str) -> None:
        now = trio.current_time()
        self._record_publishers[pid] = now
        if len(self._record_publishers) > MAX_PENDING_RECORDS:
            for old, t in list(self._record_publishers.items()):
                if now - t >= RECORD_PUBLISHER_MEMORY_S:
                    del self._record_publishers[old]
            while len(self._record_publishers) > MAX_PENDING_RECORDS:
                del self._record_publishers[next(iter(self._record_publishers))]

    def record_gossip_interval(self) -> float:
        """Seconds between our record's republications (see the module contract)."""
        now = trio.current_time()
        heard = sum(
            1 for t in self._record_publishers.values() if now - t < RECORD_PUBLISHER_MEMORY_S
        )
        return max(RECORD_GOSSIP_INTERVAL, (1 + heard) / self._config.records_budget)

    async def run_record_gossip(self) -> None:
        """Publish our signed record while new peers appear; take in the others' records."""
        self._pubsub.set_topic_validator(
            RECORDS_TOPIC,
            lambda _forwarder, msg: self._gossiped_record(bytes(msg.data)) is not None,
            False,
        )
        sub = await self._pubsub.subscribe(RECORDS_TOPIC)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_records, sub)
            published_for: tuple[int, bytes | None] = (-1, None)
            while True:
                await trio.sleep(self.record_gossip_interval())
                # Again when new peers appeared, and when our record changed (a relay slot,
                # a confirmed public address): peers holding the old one would keep it.
                signed = self._signed_record()
                now = (len(self._ever_seen), signed)
                if signed is None or now == published_for:
                    continue
                try:
                    await self._pubsub.publish(RECORDS_TOPIC, signed)
                    published_for = now
                    self._counters["record_gossip_publishes"] += 1
                except Exception as exc:  # no mesh yet: the next round tries again
                    logger.debug("record gossip publish failed: %r", exc)

    def _learn_addrs(self, record: NodeRecord) -> None:
        addrs = []
        for addr in record.addrs:
            try:
                info = parse_peer_addr(addr)
            except BadMultiaddr:
                continue
            if info.peer_id.to_base58() == record.peer_id:
                addrs.extend(info.addrs)
        if addrs:
            peer = ID.from_base58(record.peer_id)
            self._host.get_peerstore().add_addrs(peer, addrs, GOSSIPED_ADDR_TTL)

    async def _receive_records(self, sub: ISubscriptionAPI) -> None:
        while True:
            msg = await sub.get()
            record = self._gossiped_record(bytes(msg.data))
            if record is None or record.peer_id == self._peer_id:
                continue
            self._counters["record_gossip_received"] += 1
            self._note_record_publisher(record.peer_id)
            if record.peer_id in self._peers:
                self._peers.set_record(record)
                self._learn_addrs(record)  # a new relay slot: its circuit address
            elif len(self._pending_records) < MAX_PENDING_RECORDS:
                # Not connected yet (a table entry would wrongly say "up"): a peer we learned
                # of by gossip, so hand its signed addresses to discovery.
                old = self._pending_records.get(record.peer_id)
                if old is None or old.seq < record.seq:
                    self._pending_records[record.peer_id] = record
                    self._learn_addrs(record)
                    self._wake_discovery.set()

    async def run_record_fetches(self) -> None:
        while True:
            try:
                await self._fetch_missing_records()
            except Exception as exc:
                logger.warning("record fetch round failed: %r", exc)
            await trio.sleep(self._config.discovery_interval)

    async def _discover_once(self) -> None:
        connected = set(self._host.get_connected_peers())
        if not connected and self._dialer.bootstrap_infos:
            busy_s = self._dialer.bootstrap_busy_s()
            if busy_s > 0:
                # Every bootstrap peer answered busy: a round when the first may be dialed
                # again, and meanwhile the peers they named (below).
                self._next_round_by = min(self._next_round_by, trio.current_time() + busy_s)
            else:
                await self._dialer.bootstrap()
            connected = set(self._host.get_connected_peers())
        kad = self._dht.kad
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
        candidates.update(self._referred)
        if self._enough_without_lookups(connected, candidates):
            # Lookups (new negotiated streams to several peers, and work for them) were the
            # largest idle cost of 16 node processes on 2 cores: a bounded node that holds its
            # low watermark and still knows untried peers has nothing to learn from one.
            self._counters["dht_lookups_skipped"] += 1
            await self._dial_candidates(candidates - connected - {self._host.get_id()})
            return
        # A bounded node asks only the peers it is connected to: libp2p's iterative walk dials
        # every peer it queries, and those dials, not discovery's, made the links of 32 node
        # processes on 2 cores grow to a median of 27-30 against a high mark of 12 (892 walk
        # dials against 241 of discovery in a minute), each trimmed and dialed again.
        lookup = (
            self._dht.ask_connected
            if self._connmgr.enabled
            else kad.peer_routing.find_closest_peers_network
        )
        with trio.move_on_after(BACKGROUND_TIMEOUT_FACTOR * self._config.connect_timeout):
            me = self._host.get_id()
            self._counters["dht_lookups"] += 1
            candidates.update(await lookup(me.to_bytes()))
            if len(candidates) >= KAD_BUCKET_SIZE:
                # A self lookup returns the k closest peers: only a network larger than one
                # bucket hides peers from it.
                self._counters["dht_lookups"] += 1
                candidates.update(await lookup(secrets.token_bytes(32)))
        await self._dial_candidates(candidates - connected - {self._host.get_id()})

    def _enough_without_lookups(self, connected: set[ID], candidates: set[ID]) -> bool:
        mgr = self._connmgr
        if not mgr.enabled or len(connected) < mgr.limits.low:
            return False
        return any(
            p.to_base58() not in mgr.tried for p in candidates - connected - {self._host.get_id()}
        )

    async def _dial_candidates(self, candidates: set[ID]) -> None:
        now = trio.current_time()
        connected = len(self._host.get_connected_peers())
        mgr = self._connmgr
        budget = self._config.max_peers - connected
        limit = mgr.dial_budget(connected)
        if limit >= 0:
            budget = min(budget, limit)
        may_redial = mgr.may_redial(connected)
        todo: list[PeerInfo] = []
        for peer in candidates:
            pid = peer.to_base58()
            if pid in self._refused:
                continue
            if mgr.was_pruned(pid) and not may_redial:
                continue  # we closed it for a nearer one: not again while we have enough
            # Redial a peer we recently failed to reach only every few seconds.
            known = pid in self._peers or pid in self._pending_records
            if now - self._dialer.last_dial.get(pid, -1e9) < 5.0 and known:
                continue
            addrs = self._known_addrs(peer) or self._record_addrs(pid)
            if not addrs:
                continue
            wait = self.dial_wait(pid, addrs)
            first_seen = self._first_seen.setdefault(pid, now)
            if now - first_seen < wait:
                self._defer_discovery(first_seen + wait)
                continue
            todo.append(PeerInfo(peer, addrs))
        if mgr.enabled:
            # Untried peers first (a trim keeps the nearest of those it has seen), then the
            # nearest of the known ones; ties (every untried peer's RTT is unknown) by the pair
            # hash a trim also ranks by, so nodes spread their dials over different peers and
            # dial those they would keep. In the set's own order every node forked from one
            # process (one hash seed) dialed the same few peers, whose trims then cut 9 links
            # at a time.
            todo.sort(
                key=lambda i: (
                    i.peer_id.to_base58() in mgr.tried,
                    self._rtt_of(i),
                    -pair_rank(self._peer_id, i.peer_id.to_base58()),
                )
            )
        # Peers we lost: try them again (a SIGCONT-ed or restarted node comes back).
        for pid in self._peers.peer_ids(PeerState.DOWN) if may_redial else []:
            peer = ID.from_base58(pid)
            entry = self._peers.get(pid)
            down_for = time.monotonic() - (entry.changed_at if entry else time.monotonic())
            if pid < self._peer_id and down_for < 10.0:
                continue  # same tie-break as above: the smaller id redials first
            if now - self._dialer.last_dial.get(pid, -1e9) >= 5.0 and peer not in candidates:
                addrs = self._known_addrs(peer) or self._record_addrs(pid)
                if addrs:
                    todo.append(PeerInfo(peer, addrs))

        async def one(info: PeerInfo) -> None:
            async with self._dial_limiter:
                if info.peer_id in self._host.get_connected_peers():
                    return  # it dialed us while this dial waited for its turn
                self._counters["dials"] += 1
                try:
                    await self._dialer.dial(info, background=BACKGROUND_TIMEOUT_FACTOR)
                except PeerUnreachable as exc:
                    logger.debug("discovered peer unreachable: %s", exc)

        async with trio.open_nursery() as nursery:
            for info in todo[: max(budget, 0)]:
                nursery.start_soon(one, info)

    def dial_wait(self, pid: str, addrs: Sequence[Multiaddr]) -> float:
        """How long after first seeing a candidate we wait before dialing it. Two peers that
        discover each other dial at once, and with one connection per peer libp2p closes one
        of the two under the streams already opened on it: so the larger id waits a few
        seconds for the smaller one. Except across a NAT: a NAT'd node (its addresses are
        circuits) reaches a public one directly, while the public one could only open a
        circuit through a relay; so the NAT'd side dials at once and the public side waits
        longer for it."""
        we_private = self._address_book.reachability == "private"
        they_private = any(classify(a) == "circuit" for a in addrs)
        if we_private and not they_private:
            return 0.0
        if they_private and not we_private:
            return PRIVATE_PEER_WAIT_S
        return TIE_BREAK_WAIT_S if pid < self._peer_id else 0.0

    def _defer_discovery(self, at: float) -> None:
        """A candidate waits until `at` (trio time): the next round must not come later."""
        self._next_round_by = min(self._next_round_by, at)

    def _rtt_of(self, info: PeerInfo) -> float:
        entry = self._peers.get(info.peer_id.to_base58())
        return math.inf if entry is None or entry.rtt_ms is None else entry.rtt_ms

    async def _fetch_missing_records(self) -> None:
        limit = BACKGROUND_TIMEOUT_FACTOR * self._config.connect_timeout

        async def one(pid: str) -> None:
            async with self._fetch_limiter:
                with trio.move_on_after(limit):
                    try:
                        # Connected peers answer for themselves; a peer that has not
                        # published yet is asked again later (no costly DHT walk).
                        record = await self._dht.get_record(pid, walk=False, direct_timeout=limit)
                        if record is not None:
                            self._peers.set_record(record)
                    except Exception as exc:  # a misbehaving peer must not stop discovery
                        logger.debug("record of %s unavailable: %r", pid, exc)

        now = trio.current_time()
        async with trio.open_nursery() as nursery:
            for pid in self._peers.up_peers():
                entry = self._peers.get(pid)
                if entry is None or entry.record is not None:
                    self._record_retry.pop(pid, None)
                    continue
                # Asked again with a doubling delay, capped low: a peer stores its record
                # before announcing it, so a miss is mostly a slow or failed stream.
                next_try, delay = self._record_retry.get(pid, (now, 0.0))
                if now < next_try:
                    continue
                delay = min(
                    max(delay * 2, self._config.discovery_interval),
                    RECORD_RETRY_CAP_INTERVALS * self._config.discovery_interval,
                )
                self._record_retry[pid] = (now + delay, delay)
                self._counters["record_fetches"] += 1
                nursery.start_soon(one, pid)
