"""Pubsub whose streams stay framed, and whose node survives a peer's malformed RPC.

py-libp2p 0.8.1's ``Pubsub`` had two faults that a 64-node trial on 2 cores hit (a node died
while the overlay formed: ``DecodeError: Error parsing message with type 'pubsub.pb.RPC'``
escaped the read loop and took the whole node down):

- Reading: ``continuously_read_stream`` catches closed streams and oversized RPCs, but not an
  RPC that fails to parse, so one malformed message from any peer (a bug, or a stranger on
  purpose) ends the node. Here it resets that stream (libp2p then opens a fresh one while the
  peer stays connected) and logs the peer, as for any other bad input.
- Writing: yamux splits a write the peer's receive window cannot take whole into several
  frames and waits for credit between them, with its lock held per frame, not per message.
  Two tasks writing RPCs to one stream (gossipsub's heartbeat and the per-peer send queue
  both do) could interleave frames of two messages, and a write that failed or was cancelled
  half way (yamux gives up on credit after 5 s; on starved cores that happens) left half a
  message on the stream, so the next RPC read as garbage. Here whole messages go out one at a
  time per stream, and a write that did not finish resets the stream, so the reader sees a
  reset, never a torn message.

Expiry: gossip that carries state stamped when it was issued (cache digests) is worthless
past an age its receivers refuse anyway, and py-libp2p forwards it all the same: it holds
each message as "seen" for 120 s, which is also the digests' lifetime, so a copy that a
backlog delayed past that is new to it again, and every node forwarded it to its whole mesh
once more (64 node processes on 2 cores: 6,427 digests arrived expired, 30 % of all,
each one forwarded on before its receiver dropped it). ``set_topic_expiry(topic,
issued_at, max_age_s, on_expired)``: a message of that topic whose ``issued_at(data)`` (unix
time, None when unreadable: the checks after decide) is older than ``max_age_s`` is dropped
when it arrives, before its delivery and forwarding (``gossip_expired_in``; once its pubsub
signature verifies, ``on_expired(publisher id)`` hears of it: it still says who publishes),
and when it is about to be written, after waiting in a peer's send queue
(``gossip_expired_out``).
Superseded: for the same topics, a message older than the newest one already delivered from
its publisher, by both its issue time and its pubsub sequence number, is dropped on arrival
too (``gossip_superseded_in``), not forwarded: it carries a state its publisher has since
replaced. Both must be older: a publisher whose clock stepped back still counts up its
sequence numbers, and one that restarted (its counter starts from the clock again) still
stamps later times. Under load such
late copies (a backlog, or an IWANT answered from an older cache window) were half of all
digests a node received in a formed 64-process swarm (131 of 254 in 62 s), and every one was
forwarded to the whole mesh before its receivers found it stale. The newest time and number
are recorded only once a message passed pubsub's signature and topic checks, so a forged
stamp or number cannot make a publisher's real messages look old.
The age of each such message is tallied as it arrives (``gossip_age_in_<bucket>``) and as
our own leaves (``gossip_age_out_<bucket>``, the time it waited in our send queues): which
of the two a delay comes from.

Batches: py-libp2p wrote each RPC as its own write (a yamux frame and a Noise message each)
and read each one with 2-3 reads (its varint length a byte at a time); every read and write
is a schedule point, and on starved cores a task waits a whole round of the event loop at
each (0.2-1 s at 64 node processes on 2 cores, where a ping's round trip took 2.4 s): a
stream then carried a fraction of an RPC a second, and what a peer sent faster queued up in
the 256 KiB yamux window, minutes deep. Here the sending loop writes what is queued for a
peer at that moment (up to ``BATCH_BYTES``) in one write, and the reading loop reads what
has arrived (up to ``READ_CHUNK``) at once and parses every RPC in it without another
schedule point (``rpcs_batched`` counts RPCs that shared a write).

On a libp2p upgrade, recheck: ``Pubsub.handle_sending_messages(peer_id, stream, queue)`` is
still the per-peer sending loop and ``RpcQueue._queue.pop()`` still takes one queued RPC
without waiting; ``continuously_read_stream`` reads only through ``stream.read`` (and
reaches ``muxed_conn``, ``reset`` and ``metric_send_channel`` on it); ``push_msg(forwarder,
msg)`` still starts every received message's processing.

Contract: ``SafePubsub`` takes ``Pubsub``'s arguments; ``counters`` (``malformed_rpcs``,
``torn_writes``) say how often each fault was contained, and ``rpcs_out`` / ``rpc_out_<part>``
(publish, subscribe, ihave, iwant, graft, prune, idontwant) how many RPCs left and what they
carried: on shared cores the overlay's own traffic is most of an idle node's CPU, and these say
which part of it to cut.
"""

from __future__ import annotations

import functools
import logging
import math
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

import trio
from google.protobuf.message import DecodeError
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamClosed, StreamReset
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.rpc_queue import RpcQueue
from libp2p.pubsub.validators import signature_validator
from libp2p.utils.varint import encode_uvarint

__all__ = ["SafePubsub"]

logger = logging.getLogger(__name__)

# A reset is one frame; if even that cannot go out in this long, the connection is gone anyway.
RESET_TIMEOUT_S = 2.0
# One write takes what is queued for a peer up to this many bytes (a yamux frame's worth).
BATCH_BYTES = 64 * 1024
# One read takes what has arrived up to this many bytes (then the loop yields once).
READ_CHUNK = 64 * 1024
# Messages whose issue time is remembered per topic (each is read once, however many peers it
# goes to, within moments); the cache holds their bytes, a full digest up to 64 KiB each.
ISSUED_CACHE = 128
# Publishers whose newest delivered issue time and sequence number are kept per topic (least
# recently heard go first).
NEWEST_PUBLISHERS = 4096
# Upper bounds (s) of the age buckets tallied for topics with an expiry.
AGE_BUCKETS_S = (2.0, 10.0, 30.0, 60.0, 120.0)


class SafePubsub(Pubsub):
    """``Pubsub`` with framing kept per stream and malformed RPCs contained (module doc)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.counters: Counter[str] = Counter()
        self._write_locks: weakref.WeakKeyDictionary[INetStream, trio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self._expiry: dict[str, _Expiry] = {}
        # (topic, publisher) -> (newest issue time, highest sequence number) delivered
        self._newest: OrderedDict[tuple[str, bytes], tuple[float, int]] = OrderedDict()

    def set_topic_expiry(
        self,
        topic: str,
        issued_at: Callable[[bytes], float | None],
        max_age_s: float,
        on_expired: Callable[[str], None] | None = None,
    ) -> None:
        """Drop messages of ``topic`` older than ``max_age_s`` (module doc)."""
        # One message is judged on arrival and again for each peer it is forwarded to.
        cached = functools.lru_cache(maxsize=ISSUED_CACHE)(issued_at)
        self._expiry[topic] = _Expiry(cached, max_age_s, on_expired)

    def _issued(self, msg: rpc_pb2.Message) -> tuple[str, float, _Expiry] | None:
        """(topic, issue time, rule) of a message of a topic with an expiry; None for others."""
        for topic in msg.topicIDs:
            rule = self._expiry.get(topic)
            if rule is not None:
                try:
                    issued = rule.issued_at(bytes(msg.data))
                except Exception:  # a peek that fails on garbage must not end a peer's loop
                    logger.exception("issued_at raised on a %s message; not aged", topic)
                    issued = None
                return None if issued is None else (topic, issued, rule)
        return None

    def _age(self, msg: rpc_pb2.Message) -> tuple[float, _Expiry] | None:
        """(age, rule) of a message of a topic with an expiry; None for others."""
        issued = self._issued(msg)
        return None if issued is None else (time.time() - issued[1], issued[2])

    def _mark_msg_seen(self, msg: rpc_pb2.Message) -> None:
        # Pubsub marks a message seen once its signature and topic checks passed.
        super()._mark_msg_seen(msg)
        issued = self._issued(msg) if self._expiry else None
        if issued is None:
            return
        key = (issued[0], bytes(msg.from_id))
        at, seqno = self._newest.get(key, (-math.inf, -1))
        self._newest[key] = (max(at, issued[1]), max(seqno, _seqno(msg)))
        self._newest.move_to_end(key)
        while len(self._newest) > NEWEST_PUBLISHERS:
            self._newest.popitem(last=False)

    def _superseded(self, topic: str, msg: rpc_pb2.Message, issued: float) -> bool:
        newest = self._newest.get((topic, bytes(msg.from_id)))
        return newest is not None and issued <= newest[0] and _seqno(msg) <= newest[1]

    def _tally_age(self, direction: str, age: float) -> None:
        bucket = next((f"lt{b:g}" for b in AGE_BUCKETS_S if age < b), f"ge{AGE_BUCKETS_S[-1]:g}")
        self.counters[f"gossip_age_{direction}_{bucket}"] += 1

    async def push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        if msg_forwarder != self.my_id and not self._is_msg_seen(msg):
            found = self._issued(msg)
            if found is not None:
                topic, issued, rule = found
                age = time.time() - issued
                self._tally_age("in", age)
                if age > rule.max_age_s:
                    self.counters["gossip_expired_in"] += 1
                    signed = not self.strict_signing or signature_validator(msg)
                    if rule.on_expired is not None and signed:
                        rule.on_expired(ID(msg.from_id).to_base58())
                    return
                if self._superseded(topic, msg, issued):
                    self.counters["gossip_superseded_in"] += 1
                    return
        await super().push_msg(msg_forwarder, msg)

    def _unexpired(self, rpc: rpc_pb2.RPC) -> rpc_pb2.RPC | None:
        """``rpc`` without the messages that expired while it waited; None if nothing is left."""
        if not rpc.publish or not self._expiry:
            return rpc
        keep = []
        for msg in rpc.publish:
            aged = self._age(msg)
            if aged is not None and aged[0] > aged[1].max_age_s:
                self.counters["gossip_expired_out"] += 1
                continue
            if aged is not None and msg.from_id == self.my_id.to_bytes():
                self._tally_age("out", aged[0])
            keep.append(msg)
        if len(keep) == len(rpc.publish):
            return rpc
        if not keep and not rpc.subscriptions and not rpc.HasField("control"):
            return None
        trimmed = rpc_pb2.RPC()
        trimmed.CopyFrom(rpc)
        del trimmed.publish[:]
        trimmed.publish.extend(keep)
        return trimmed

    async def continuously_read_stream(self, stream: INetStream) -> None:
        try:
            await super().continuously_read_stream(_ChunkedReader(stream))  # type: ignore[arg-type]
        except DecodeError as exc:
            self.counters["malformed_rpcs"] += 1
            logger.warning(
                "peer %s sent a pubsub message that does not parse (%s); its stream is reset",
                stream.muxed_conn.peer_id,
                exc,
            )
            await _reset(stream)

    async def handle_sending_messages(
        self, peer_id: ID, stream: INetStream, queue: RpcQueue
    ) -> None:
        """py-libp2p's per-peer sending loop, writing what is queued at once (module doc)."""
        try:
            while True:
                rpc = await queue.pop()
                if rpc is None:
                    return  # closed: the peer left
                batch, size = [rpc], rpc.ByteSize()
                while size < BATCH_BYTES and (more := queue._queue.pop()) is not None:
                    batch.append(more)
                    size += more.ByteSize()
                if not await self.write_msgs(stream, batch):
                    return
        except Exception:
            logger.debug("sending loop for %s ended with an error", peer_id)
            self._handle_dead_peer(peer_id)

    async def write_msg(self, stream: INetStream, rpc_msg: rpc_pb2.RPC) -> bool:
        return await self.write_msgs(stream, [rpc_msg])

    async def write_msgs(self, stream: INetStream, rpcs: list[rpc_pb2.RPC]) -> bool:
        """Write ``rpcs`` in one write, each framed; False if the stream is gone."""
        lock = self._write_locks.get(stream)
        if lock is None:
            lock = self._write_locks[stream] = trio.Lock()
        async with lock:
            # Judged when they go out, not when they were queued: they may have waited long.
            frames = []
            for rpc in rpcs:
                unexpired = self._unexpired(rpc)
                if unexpired is None:
                    continue
                self._tally(unexpired)
                data = unexpired.SerializeToString()
                frames.append(encode_uvarint(len(data)) + data)
            if not frames:
                return True
            if len(frames) > 1:
                self.counters["rpcs_batched"] += len(frames)
            done = False
            try:
                await stream.write(b"".join(frames))
                done = True
                return True
            except (StreamClosed, StreamReset):
                done = True  # nothing torn: the stream is gone
                logger.debug("pubsub stream to %s closed or reset", stream.muxed_conn.peer_id)
                self._handle_dead_peer(stream.muxed_conn.peer_id)
                return False
            finally:
                if not done:
                    # Cancelled or failed part way: what went out may be half a message.
                    self.counters["torn_writes"] += 1
                    with trio.CancelScope(shield=True):
                        await _reset(stream)

    def _tally(self, rpc: rpc_pb2.RPC) -> None:
        self.counters["rpcs_out"] += 1
        if rpc.publish:
            self.counters["rpc_out_publish"] += 1
            for msg in rpc.publish:
                topic = msg.topicIDs[0] if msg.topicIDs else ""
                kind = (
                    "digest"
                    if "/digest/" in topic
                    else "records"
                    if "records" in topic
                    else "other"
                )
                self.counters[f"msgs_out_{kind}"] += 1
        if rpc.subscriptions:
            self.counters["rpc_out_subscribe"] += 1
        if rpc.HasField("control"):
            for part in ("ihave", "iwant", "graft", "prune", "idontwant"):
                if getattr(rpc.control, part):
                    self.counters[f"rpc_out_{part}"] += 1


class _ChunkedReader:
    """A pubsub stream read a chunk at a time: ``read(n)`` serves what already arrived without
    a schedule point, and reads the stream (up to ``READ_CHUNK``) only when it has nothing."""

    def __init__(self, stream: INetStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)

    async def read(self, n: int | None = -1) -> bytes:
        if not self._buffer:
            chunk = await self._stream.read(READ_CHUNK)
            if not chunk:
                return b""
            self._buffer += chunk
        if n is None or n < 0:
            n = len(self._buffer)
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data


def _seqno(msg: rpc_pb2.Message) -> int:
    return int.from_bytes(bytes(msg.seqno), "big")


@dataclass(frozen=True)
class _Expiry:
    issued_at: Callable[[bytes], float | None]
    max_age_s: float
    on_expired: Callable[[str], None] | None


async def _reset(stream: INetStream) -> None:
    with trio.move_on_after(RESET_TIMEOUT_S), suppress(StreamClosed, StreamReset, Exception):
        await stream.reset()
