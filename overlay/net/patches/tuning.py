"""Per-message costs of py-libp2p 0.8.1 that starve many nodes sharing a few cores.

Profiled with py-spy on 16 idle node processes on 2 cores (they used ~1.8 cores between them):
~60 % of each node's CPU went to gossipsub's read and write paths, and most of that was not
our messages but libp2p's bookkeeping around each RPC:

- Every gossipsub RPC carries the sender's signed peer record, and the receiver checks its
  Ed25519 signature twice (once in ``Pubsub``, once in ``GossipSub.handle_rpc``) and rewrites
  the sender's addresses in the peerstore each time (~17-20 % of a node's samples). A record
  already accepted from that peer, byte for byte, proves nothing new: ``install`` remembers it
  and re-checks it only every ``RECORD_RECHECK_S`` (so address TTLs still get refreshed).
- The sender rebuilds that record's address set for every RPC (``host.get_addrs()``: relay
  and address-book work, ~8 %); it is cached per host for ``LOCAL_RECORD_CACHE_S``, and only
  while it is still the host's newest record: libp2p refuses the WHOLE RPC when its record is
  older (lower seq) than one already stored for that peer, and identify and the DHT issue
  newer records on their own (a relay reservation adds a circuit address and pushes identify
  at once). A cached older record sent after that lost a NAT'd node's subscription at its
  relayed peer for good (the hello and a SUBSCRIBE are sent once): no digest of it arrived.
- For the same reason a receiver keeps an RPC whose record is valid, signed by the sender,
  but older than the one stored (it ignores the record, not the RPC): identify and pubsub run
  on different streams, so a record issued between two RPCs can overtake the earlier one.
- yamux (``PY_YAMUX_RELEASE_ON_READ``, on by default there) sends a WINDOW_UPDATE frame for
  every read, and gossipsub reads each RPC's varint length a byte at a time: 2-3 extra
  encrypted frames per RPC. Off, yamux credits the window in half-window batches, as go-yamux
  does. Even off, its "partial slack" rule still credited every read of a small message at
  once (one more encrypted frame per message received: 10-13 % of an idle node's samples at
  16 nodes); ``_batched_window_updates`` holds such credit back until half a window is due,
  which is when the sender could first run short.
- yamux reads its ``PY_YAMUX_*`` settings from the environment on every frame it handles
  (``os.getenv``: ~4 % of an idle node's samples at 16 nodes); ``install`` reads each once
  per process, after setting the default above, so set them before the node starts.
- Gossipsub v1.2 sends an IDONTWANT to every mesh peer for every message it forwards, however
  small: 6-12 more RPCs per message. ``QuietGossipSub`` sends them only for messages of at
  least ``IDONTWANT_MIN_BYTES`` (go-libp2p's default threshold), where a duplicate costs more
  than the notice.

Contract: ``install()`` is idempotent and process-wide (it wraps two module-level functions of
``libp2p.pubsub``; results per host and peer, so many hosts in one process stay separate).
``QuietGossipSub`` takes ``GossipSub``'s arguments.
"""

from __future__ import annotations

import functools
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from libp2p.peer.envelope import consume_envelope
from libp2p.peer.id import ID
from libp2p.pubsub import gossipsub as _gossipsub_mod
from libp2p.pubsub import pubsub as _pubsub_mod
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.stream_muxer.yamux import yamux as _yamux_mod
from libp2p.stream_muxer.yamux.yamux import YamuxStream

if TYPE_CHECKING:
    from libp2p.abc import IHost
    from libp2p.peer.envelope import Envelope
    from libp2p.pubsub.pb import rpc_pb2

__all__ = [
    "IDONTWANT_MIN_BYTES",
    "LOCAL_RECORD_CACHE_S",
    "RECORD_RECHECK_S",
    "SUPERSEDED_RECORDS",
    "QuietGossipSub",
    "install",
]

# A peer record already accepted from the same peer is checked again after this long.
RECORD_RECHECK_S = 60.0
# Our own signed record's bytes are reused this long before the address set is compared again
# (the comparison lists the interfaces: at 1 s it was a visible share of an idle node's CPU).
LOCAL_RECORD_CACHE_S = 5.0
# go-libp2p's IDontWantMessageThreshold: below it a duplicate costs less than the notice.
IDONTWANT_MIN_BYTES = 1024
# Accepted (host, peer, record bytes) entries kept (one or two per peer in practice).
MAX_REMEMBERED_RECORDS = 8192

# The domain libp2p signs peer records under (libp2p.pubsub.utils uses the same literal).
PEER_RECORD_DOMAIN = "libp2p-peer-record"
# RPCs kept although their record was older than the stored one (process-wide, for tests and
# diagnostics: a count that grows says records overtake each other between streams).
SUPERSEDED_RECORDS = [0]

_installed = False


def _memo_consume(
    real: Callable[[rpc_pb2.RPC, IHost, ID], bool],
) -> Callable[[rpc_pb2.RPC, IHost, ID], bool]:
    accepted: OrderedDict[tuple[int, bytes, bytes], float] = OrderedDict()

    def consume(msg: rpc_pb2.RPC, host: IHost, peer_id: ID) -> bool:
        if not msg.HasField("senderRecord"):
            return True
        key = (id(host), peer_id.to_bytes(), bytes(msg.senderRecord))
        now = time.monotonic()
        at = accepted.get(key)
        if at is not None and now - at < RECORD_RECHECK_S:
            accepted.move_to_end(key)
            return True
        ok = real(msg, host, peer_id)
        if not ok and _superseded(msg, host, peer_id):
            SUPERSEDED_RECORDS[0] += 1
            return True  # the RPC stands; the newer record already stored stays
        if ok:
            accepted[key] = now
            accepted.move_to_end(key)
            while len(accepted) > MAX_REMEMBERED_RECORDS:
                accepted.popitem(last=False)
        return ok

    consume.__wrapped__ = real  # type: ignore[attr-defined]
    return consume


def _superseded(msg: rpc_pb2.RPC, host: IHost, peer_id: ID) -> bool:
    """The RPC's record is valid and the sender's own, but older than the one stored."""
    try:
        envelope, record = consume_envelope(msg.senderRecord, PEER_RECORD_DOMAIN)
        if record.peer_id != peer_id or ID.from_pubkey(envelope.public_key) != peer_id:
            return False
        stored = host.get_peerstore().get_peer_record(peer_id)
        return stored is not None and stored.record().seq > record.seq
    except Exception:  # not an envelope, bad signature: refused as libp2p refuses it
        return False


def _cached_local_record(
    real: Callable[[IHost], tuple[bytes, bool]],
) -> Callable[[IHost], tuple[bytes, bool]]:
    cache: dict[int, tuple[float, IHost, Envelope | None, bytes]] = {}

    def env(host: IHost) -> tuple[bytes, bool]:
        now = time.monotonic()
        hit = cache.get(id(host))
        current = host.get_peerstore().get_local_record()
        # The host object itself is kept in the entry: an id is only unique while it lives.
        # The record must still be the host's newest (identify or the DHT may have issued one).
        if (
            hit is not None
            and hit[1] is host
            and current is not None
            and hit[2] is current
            and now - hit[0] < LOCAL_RECORD_CACHE_S
        ):
            return hit[3], False
        data, fresh = real(host)
        cache[id(host)] = (now, host, host.get_peerstore().get_local_record(), data)
        if len(cache) > 1024:  # hosts of finished tests in one process
            for key in list(cache)[:512]:
                del cache[key]
        return data, fresh

    env.__wrapped__ = real  # type: ignore[attr-defined]
    return env


def _batched_window_updates(
    real: Callable[..., Awaitable[None]],
) -> Callable[..., Awaitable[None]]:
    """Credit small reads in half-window batches (see the module docstring)."""

    async def update(self: YamuxStream, *, bytes_read: int = 0) -> None:
        if bytes_read > 0:
            async with self.window_lock:
                threshold = self._grow_threshold()
                buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
                delta = self.target_recv_window - (self.recv_window + buffered)
                if 0 <= delta < threshold and self._pending_recv_release + bytes_read < threshold:
                    # The sender still has more than half a window: nothing to send yet.
                    self._pending_recv_release += bytes_read
                    return
        await real(self, bytes_read=bytes_read)

    update.__wrapped__ = real  # type: ignore[attr-defined]
    return update


def install() -> None:
    """Apply the cuts above to this process (once; later calls do nothing)."""
    global _installed
    if _installed:
        return
    _installed = True
    os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")
    _yamux_mod._py_yamux_env = functools.lru_cache(maxsize=64)(_yamux_mod._py_yamux_env)  # type: ignore[attr-defined]
    YamuxStream._auto_tune_and_send_window_update = _batched_window_updates(  # type: ignore[method-assign]
        YamuxStream._auto_tune_and_send_window_update
    )
    consume = _memo_consume(_pubsub_mod.maybe_consume_signed_record)
    local = _cached_local_record(_pubsub_mod.env_to_send_in_RPC)
    for module in (_pubsub_mod, _gossipsub_mod):
        module.maybe_consume_signed_record = consume  # type: ignore[attr-defined]
        module.env_to_send_in_RPC = local  # type: ignore[attr-defined]


class QuietGossipSub(GossipSub):
    """GossipSub that sends IDONTWANT only for messages of ``IDONTWANT_MIN_BYTES`` or more,
    and counts the RPCs it drops because a peer's send queue was full (``rpcs_dropped_<why>``
    in its pubsub's ``counters``, when it has them): gossip lost before it left."""

    _idontwant_worth_it = True

    def _handle_dropped_rpc(self, peer_id: ID, rpc: rpc_pb2.RPC, reason: str) -> None:
        counters = getattr(self.pubsub, "counters", None)
        if counters is not None:
            counters[f"rpcs_dropped_{reason}"] += 1
        super()._handle_dropped_rpc(peer_id, rpc, reason)

    async def publish(self, msg_forwarder: ID, pubsub_msg: rpc_pb2.Message) -> None:
        # GossipSub.publish emits its IDONTWANTs before its first await, so the flag set here
        # is the one this message's emit reads.
        self._idontwant_worth_it = pubsub_msg.ByteSize() >= IDONTWANT_MIN_BYTES
        await super().publish(msg_forwarder, pubsub_msg)

    async def _emit_idontwant_for_message(self, msg_id: bytes, topic_ids: Iterable[str]) -> None:
        if self._idontwant_worth_it:
            await super()._emit_idontwant_for_message(msg_id, topic_ids)
