"""Kademlia DHT of a p2pnode: signed node records and model provider records.

Contract:
- `OverlayDHT(host)` wraps py-libp2p's `KadDHT` in server mode with `strict_validation=True`
  and one namespace, "p2pnode": keys `/p2pnode/<peer_id>` hold signed node records
  (`identity.sign_node_record`). `NodeRecordValidator` rejects (raises `InvalidNodeRecord`)
  a value that fails `identity.verify_node_record`, whose record names another peer than the
  key, or whose seq is older than one this node has already validated for that peer (replay);
  `select` picks the highest seq. Any other namespace is refused by strict validation.
- `publish_record(signed)` stores our record; `get_record(peer_id)` returns the newest valid
  `NodeRecord` known to the target peer itself (fast path, always fresh) or, failing that,
  to the peers closest to the key; None when nobody has one.
- `provide(model_id)` announces us as a provider and then waits (bounded) until at least one
  remote peer answers with us among the providers: libp2p's provide is fire-and-forget and
  returns before the record lands. Returns how many remote peers confirmed.
- `keep_to_links()`: from then on libp2p's own walks (record puts, provider announcements,
  routing-table refreshes) use only the peers we are connected to, or walk as before while we
  have none: a node with bounded connections (``overlay/net/connmgr.py``) calls it, since every
  such walk dialed each peer it queried or stored at (up to 20 a walk), links the connection
  manager then trimmed again. Lookups the node asks for itself (`find_providers`,
  `get_record`'s walk) still walk the network: an edge whose one linked verifier just stopped
  must find the others through peers it is not linked to.
- `ask_connected(key, limit)`: the peers that up to `limit` of our connected peers (the
  closest to `key` first) name as closest to it, in one hop over links we already hold: a
  bounded node's discovery wants candidates, not the exact k closest, and libp2p's iterative
  walk dials every peer it queries (see `Discovery`).
- `find_providers(model_id)` always asks the network (libp2p's version returns only local
  records once any exist) and returns peers deduplicated, local record included.
The DHT keeps dead peers and their provider records for hours: callers filter liveness with
their own `PeerTable`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable

import trio
from libp2p.abc import IHost
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.records.validator import Validator

from p2pnode.identity import IdentityError, NodeRecord, verify_node_record
from p2pnode.overlay._errors import OverlayError

__all__ = [
    "NAMESPACE",
    "InvalidNodeRecord",
    "NodeRecordValidator",
    "OverlayDHT",
    "model_key",
    "record_key",
]

logger = logging.getLogger(__name__)

NAMESPACE = "p2pnode"
# How long one remote query may take before we give up on that peer (loopback: ~5-60 ms).
QUERY_TIMEOUT = 3.0
MAX_PARALLEL_QUERIES = 8


class InvalidNodeRecord(OverlayError, ValueError):
    """A `/p2pnode/<peer_id>` value is not a valid, current, signed record for that peer."""

    reason = "invalid_node_record"


def record_key(peer_id: str) -> str:
    """DHT key of a peer's node record."""
    return f"/{NAMESPACE}/{peer_id}"


def model_key(model_id: str) -> bytes:
    """Provider key of a model: a sha2-256 multihash, so any model id string is safe."""
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model id must be a non-empty string, got {model_id!r}")
    digest = hashlib.sha256(b"p2pnode/model/" + model_id.encode()).digest()
    return b"\x12\x20" + digest


def _peer_id_of_key(key: str) -> str:
    prefix = f"/{NAMESPACE}/"
    if not key.startswith(prefix) or len(key) == len(prefix) or "/" in key[len(prefix) :]:
        raise InvalidNodeRecord(f"node record key must be /{NAMESPACE}/<peer_id>, got {key!r}")
    return key[len(prefix) :]


class NodeRecordValidator(Validator):
    """Validates `/p2pnode/<peer_id>` values; remembers the newest seq seen per peer."""

    def __init__(self) -> None:
        self._newest_seq: dict[str, int] = {}

    def decode(self, key: str, value: bytes) -> NodeRecord:
        """Verify `value` for `key` and return the record (`InvalidNodeRecord` otherwise)."""
        peer_id = _peer_id_of_key(key)
        try:
            record = verify_node_record(value)
        except IdentityError as exc:
            raise InvalidNodeRecord(f"node record for {peer_id} rejected: {exc}") from None
        if record.peer_id != peer_id:
            raise InvalidNodeRecord(
                f"node record of {record.peer_id} stored under the key of {peer_id}"
            )
        return record

    def validate(self, key: str, value: bytes) -> None:
        record = self.decode(key, value)
        known = self._newest_seq.get(record.peer_id, -1)
        if record.seq < known:
            raise InvalidNodeRecord(
                f"node record for {record.peer_id} has seq {record.seq}, older than the "
                f"known seq {known} (replayed or stale)"
            )
        self._newest_seq[record.peer_id] = record.seq

    def select(self, key: str, values: list[bytes]) -> int:
        best_index, best_seq = -1, -1
        for index, value in enumerate(values):
            try:
                seq = self.decode(key, value).seq
            except InvalidNodeRecord:
                continue
            if seq > best_seq:
                best_index, best_seq = index, seq
        if best_index < 0:
            raise InvalidNodeRecord(f"no valid node record among {len(values)} for {key}")
        return best_index


class OverlayDHT:
    """Our use of the Kademlia DHT; run `kad` as a service (`background_trio_service`)."""

    def __init__(self, host: IHost) -> None:
        self.host = host
        self.kad = KadDHT(host, DHTMode.SERVER, strict_validation=True)
        self.validator = NodeRecordValidator()
        self.kad.register_validator(NAMESPACE, self.validator)
        # The iterative lookup, kept for our own lookups whatever `keep_to_links` does.
        self._walk = self.kad.peer_routing.find_closest_peers_network

    def keep_to_links(self) -> None:
        """libp2p's own walks go over existing connections only (see the module contract)."""
        walk = self._walk

        async def connected_closest(target_key: bytes, count: int = 20) -> list[ID]:
            connected = list(self.host.get_connected_peers())
            if not connected:
                return list(await walk(target_key, count))
            return _closest(connected, target_key)[:count]

        self.kad.peer_routing.find_closest_peers_network = connected_closest  # type: ignore[method-assign]

    async def ask_connected(self, key: bytes, limit: int = 4) -> set[ID]:
        """Peers named closest to `key` by up to `limit` connected peers (one hop, no dials)."""
        connected = list(self.host.get_connected_peers())
        if not connected:
            return set()
        found: set[ID] = set()
        routing = self.kad.peer_routing

        async def one(peer: ID) -> None:
            with trio.move_on_after(QUERY_TIMEOUT):
                found.update(await routing._query_peer_for_closest(peer, key))

        async with trio.open_nursery() as nursery:
            for peer in _closest(connected, key)[:limit]:
                nursery.start_soon(one, peer)
        return found - {self.host.get_id()}

    # -- node records -------------------------------------------------------------------

    async def publish_record(self, signed: bytes) -> None:
        """Store our signed node record locally and at the closest peers."""
        record = self.validator.decode(record_key(str(self.host.get_id())), signed)
        await self.kad.put_value(record_key(record.peer_id), signed)

    async def get_record(
        self,
        peer_id: str,
        *,
        direct: bool = True,
        walk: bool = True,
        direct_timeout: float = QUERY_TIMEOUT,
    ) -> NodeRecord | None:
        """Newest valid node record of `peer_id`, or None. See the module docstring.

        `direct`: ask the peer itself when connected (within `direct_timeout` s); `walk`: ask
        the closest peers when the direct answer is missing (a full iterative lookup)."""
        key = record_key(peer_id)
        key_bytes = key.encode()
        target = ID.from_base58(peer_id)
        found: list[bytes] = []
        local = self.kad.value_store.get(key_bytes)
        if local is not None:
            found.append(local.value)
        direct_value = None
        if direct and target in self.host.get_connected_peers():
            direct_value = await self._get_from(target, key_bytes, direct_timeout)
        if direct_value is not None:
            found.append(direct_value)
        elif walk:  # nothing from the peer itself: walk the DHT
            closest = await self._closest(key_bytes)
            found.extend(await self._get_from_many([p for p in closest if p != target], key_bytes))
        return self._newest(key, found)

    async def _get_from(
        self, peer: ID, key_bytes: bytes, limit_s: float = QUERY_TIMEOUT
    ) -> bytes | None:
        with trio.move_on_after(limit_s):
            try:
                result = await self.kad.value_store._get_from_peer(peer, key_bytes)
            except Exception as exc:  # a dead or misbehaving peer: skip it
                logger.debug("get %s from %s failed: %s", key_bytes, peer, exc)
                return None
            return result if isinstance(result, bytes) else None
        return None

    async def _get_from_many(self, peers: Iterable[ID], key_bytes: bytes) -> list[bytes]:
        values: list[bytes] = []
        limiter = trio.CapacityLimiter(MAX_PARALLEL_QUERIES)

        async def one(peer: ID) -> None:
            async with limiter:
                value = await self._get_from(peer, key_bytes)
            if value is not None:
                values.append(value)

        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(one, peer)
        return values

    def _newest(self, key: str, values: list[bytes]) -> NodeRecord | None:
        records: list[NodeRecord] = []
        for value in values:
            try:
                records.append(self.validator.decode(key, value))
            except InvalidNodeRecord as exc:
                logger.info("ignoring %s", exc)
        if not records:
            return None
        newest = max(records, key=lambda r: r.seq)
        self.validator._newest_seq[newest.peer_id] = max(
            newest.seq, self.validator._newest_seq.get(newest.peer_id, -1)
        )
        return newest

    async def _closest(self, key_bytes: bytes, *, as_libp2p: bool = False) -> list[ID]:
        """The k closest peers to the key by an iterative walk of the network; with
        ``as_libp2p``, where libp2p's own puts and announcements went (links only after
        `keep_to_links`)."""
        find = self.kad.peer_routing.find_closest_peers_network if as_libp2p else self._walk
        with trio.move_on_after(QUERY_TIMEOUT * 2):
            return list(await find(key_bytes))
        return self.kad.routing_table.find_local_closest_peers(key_bytes)

    # -- providers ----------------------------------------------------------------------

    async def provide(self, model_id: str, *, confirm_timeout: float = 3.0) -> int:
        """Announce us as a provider of `model_id`; number of remote peers that confirmed."""
        key = model_key(model_id)
        await self.kad.provider_store.provide(key)
        me = self.host.get_id()
        with trio.move_on_after(confirm_timeout):
            while True:
                closest = [p for p in await self._closest(key, as_libp2p=True) if p != me][:3]
                if not closest:
                    return 0  # alone in the network: the local record is all there is
                confirmed = [0]

                async def check(peer: ID, confirmed: list[int] = confirmed) -> None:
                    providers = await self._providers_from(peer, key)
                    confirmed[0] += any(info.peer_id == me for info in providers)

                async with trio.open_nursery() as nursery:
                    for peer in closest:
                        nursery.start_soon(check, peer)
                if confirmed[0]:
                    return confirmed[0]
                await trio.sleep(0.05)
        logger.info("provide(%s): no remote peer confirmed within %.1fs", model_id, confirm_timeout)
        return 0

    async def _providers_from(self, peer: ID, key: bytes) -> list[PeerInfo]:
        with trio.move_on_after(QUERY_TIMEOUT):
            store = self.kad.provider_store
            providers, _closer = await store._get_providers_from_peer_with_closers(peer, key)
            return providers
        return []

    async def find_providers(self, model_id: str, *, count: int = 20) -> list[PeerInfo]:
        """Providers of `model_id` from the network plus the local store, deduplicated."""
        key = model_key(model_id)
        merged: dict[ID, PeerInfo] = {}
        for info in self.kad.provider_store.get_providers(key):
            merged.setdefault(info.peer_id, info)
        me = self.host.get_id()
        closest = [p for p in await self._closest(key) if p != me]
        limiter = trio.CapacityLimiter(MAX_PARALLEL_QUERIES)

        async def one(peer: ID) -> None:
            async with limiter:
                for info in await self._providers_from(peer, key):
                    merged.setdefault(info.peer_id, info)

        async with trio.open_nursery() as nursery:
            for peer in closest:
                nursery.start_soon(one, peer)
        return list(merged.values())[:count]


def _closest(peers: list[ID], key: bytes) -> list[ID]:
    """`peers` by XOR distance of their SHA-256 to the key's (Kademlia's metric)."""
    target = int.from_bytes(hashlib.sha256(key).digest(), "big")
    return sorted(
        peers, key=lambda p: int.from_bytes(hashlib.sha256(p.to_bytes()).digest(), "big") ^ target
    )
