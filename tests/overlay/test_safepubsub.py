"""overlay/net/patches/safepubsub.py on real nodes: a malformed pubsub RPC costs its stream, not the node;
RPCs written at once to one stream never interleave, and a write cut short resets the stream;
gossip of a topic with an expiry that is too old is neither delivered, forwarded nor sent;
what is queued for a peer leaves in one write, and what arrived is parsed from one read."""

from __future__ import annotations

import time

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.rpc_queue import RpcQueue
from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX
from libp2p.stream_muxer.exceptions import MuxedStreamError
from libp2p.utils.varint import encode_uvarint, read_varint_prefixed_bytes_limited

from p2pnode.identity import NodeKey, peek_timestamp, seal
from p2pnode.overlay.net.node import OverlayNode
from p2pnode.overlay.net.patches.safepubsub import _ChunkedReader

from testkit import wait_until
from testkit.cluster import overlay_nodes

TOPIC = "test/safepubsub"
MAX_AGE_S = 120.0


class HalvingStream:
    """Writes each message in two halves with a checkpoint between (as yamux does when the
    window is short); ``fail_after_half`` makes the next write fail after its first half."""

    def __init__(self, peer: ID) -> None:
        self.data = bytearray()
        self.writes = 0
        self.resets = 0
        self.fail_after_half = False
        self.muxed_conn = type("Conn", (), {"peer_id": peer})()

    async def write(self, data: bytes) -> None:
        self.writes += 1
        half = len(data) // 2
        self.data += data[:half]
        await trio.sleep(0.01)
        if self.fail_after_half:
            self.fail_after_half = False
            raise MuxedStreamError("Timed out waiting for window update after 5 seconds.")
        self.data += data[half:]

    async def reset(self) -> None:
        self.resets += 1


def _frames(data: bytes) -> list[rpc_pb2.RPC]:
    out, pos = [], 0
    while pos < len(data):
        size, shift = 0, 0
        while True:
            byte = data[pos]
            pos += 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        rpc = rpc_pb2.RPC()
        rpc.ParseFromString(bytes(data[pos : pos + size]))  # DecodeError on a torn message
        out.append(rpc)
        pos += size
    return out


async def test_a_malformed_rpc_resets_its_stream_and_the_node_keeps_gossiping() -> None:
    async with overlay_nodes(2) as (_keys, (a, b)):
        sub = await a.pubsub.subscribe(TOPIC)
        await b.pubsub.subscribe(TOPIC)
        stream = await b.host.new_stream(ID.from_base58(a.peer_id), [TProtocol(PROTOCOL_ID_V12)])
        garbage = b"\x0f\x0f\x0f\x0f"  # field 1 with wire type 7: no protobuf parses it
        await stream.write(encode_uvarint(len(garbage)) + garbage)
        await wait_until(
            lambda: a.pubsub.counters["malformed_rpcs"] == 1, 10, "the bad RPC contained"
        )
        # Still alive, and gossip between the two flows again (libp2p opens a fresh stream).
        got = []
        with trio.move_on_after(15):
            while not got:
                await b.pubsub.publish(TOPIC, b"still here")
                with trio.move_on_after(0.5):
                    got.append(await sub.get())
        assert got and got[0].data == b"still here"
        assert a.status()["counters"]["malformed_rpcs"] == 1


async def test_rpcs_written_at_once_never_interleave_and_a_torn_write_resets() -> None:
    async with overlay_nodes(1) as (_keys, (a,)):
        stream = HalvingStream(ID.from_base58(a.peer_id))
        rpcs = [rpc_pb2.RPC(publish=[rpc_pb2.Message(data=bytes([i]) * 300)]) for i in range(6)]
        async with trio.open_nursery() as nursery:
            for rpc in rpcs:
                nursery.start_soon(a.pubsub.write_msg, stream, rpc)
        assert sorted(r.publish[0].data for r in _frames(stream.data)) == sorted(
            r.publish[0].data for r in rpcs
        )
        assert stream.resets == 0
        # What leaves is tallied by what it carries (an idle node's CPU is mostly this traffic).
        before = a.pubsub.counters["rpc_out_publish"]
        ctl = rpc_pb2.RPC(control=rpc_pb2.ControlMessage(ihave=[rpc_pb2.ControlIHave()]))
        await a.pubsub.write_msg(stream, ctl)
        assert a.pubsub.counters["rpc_out_ihave"] == 1
        assert a.pubsub.counters["rpc_out_publish"] == before >= 6
        stream.fail_after_half = True
        try:
            await a.pubsub.write_msg(stream, rpcs[0])
        except MuxedStreamError:
            pass
        else:
            raise AssertionError("the failed write was swallowed")
        assert stream.resets == 1 and a.pubsub.counters["torn_writes"] == 1


def _stamped(key: NodeKey, age_s: float, text: str) -> bytes:
    """An envelope issued ``age_s`` ago (the clock is only read, never waited on)."""
    return seal(key, "digest", {"text": text}, now=time.time() - age_s)


async def test_gossip_older_than_its_topics_expiry_is_dropped_on_arrival() -> None:
    """``a`` has no expiry (an old release, or a node whose queue held the message); ``b``
    drops the expired message before delivering or forwarding it, and takes the fresh one
    sent after it on the same stream."""
    async with overlay_nodes(2) as (keys, (a, b)):
        heard: list[str] = []
        b.pubsub.set_topic_expiry(TOPIC, peek_timestamp, MAX_AGE_S, heard.append)
        sub = await b.pubsub.subscribe(TOPIC)
        await a.pubsub.subscribe(TOPIC)
        got: list[bytes] = []
        with trio.fail_after(30):  # until the two meshed: a fresh one gets through
            while not got:
                await a.pubsub.publish(TOPIC, _stamped(keys[0], 0.0, "warm"))
                with trio.move_on_after(0.5):
                    got.append(bytes((await sub.get()).data))
        await a.pubsub.publish(TOPIC, _stamped(keys[0], MAX_AGE_S + 30, "expired"))
        fresh = _stamped(keys[0], 0.0, "fresh")
        await a.pubsub.publish(TOPIC, fresh)
        with trio.fail_after(30):
            while (data := bytes((await sub.get()).data)) != fresh:
                assert peek_timestamp(data) is not None
                assert time.time() - peek_timestamp(data) < MAX_AGE_S  # type: ignore[operator]
        assert b.pubsub.counters["gossip_expired_in"] == 1
        assert heard == [a.peer_id]  # who published it, once its pubsub signature verified
        assert b.pubsub.counters["gossip_age_in_ge120"] == 1
        tallied = [k for k in b.pubsub.counters if k.startswith("gossip_age_in_lt")]
        assert sum(b.pubsub.counters[k] for k in tallied) >= 2  # warm and fresh, however slow


def _signed(node: OverlayNode, data: bytes) -> rpc_pb2.Message:
    """A message of ``node``'s, as its pubsub would publish it (next sequence number, signed)."""
    msg = rpc_pb2.Message(
        data=data,
        topicIDs=[TOPIC],
        from_id=ID.from_base58(node.peer_id).to_bytes(),
        seqno=node.pubsub._next_seqno(),
    )
    assert node.pubsub.sign_key is not None
    signature = node.pubsub.sign_key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
    msg.key = node.host.get_public_key().serialize()
    msg.signature = signature
    return msg


async def test_gossip_older_than_what_its_publisher_already_sent_is_dropped() -> None:
    """A late copy (issued, and numbered, before a message ``b`` already took from ``a``) is
    neither delivered nor forwarded; a later-numbered message with an earlier stamp (``a``'s
    clock stepped back) still is; a forged message with ``a``'s id, a later stamp and number
    but no valid pubsub signature is refused and does not make ``a``'s real messages look
    old."""
    async with overlay_nodes(2) as (keys, (a, b)):
        b.pubsub.set_topic_expiry(TOPIC, peek_timestamp, MAX_AGE_S)
        sub = await b.pubsub.subscribe(TOPIC)
        sender = ID.from_base58(a.peer_id)
        first = _signed(a, _stamped(keys[0], 20.0, "first"))
        second = _signed(a, _stamped(keys[0], 10.0, "second"))
        stepped_back = _signed(a, _stamped(keys[0], 30.0, "clock stepped back"))
        forged = rpc_pb2.Message(
            data=_stamped(keys[0], -60.0, "forged"),  # stamped a minute ahead
            topicIDs=[TOPIC],
            from_id=sender.to_bytes(),
            seqno=(2**63).to_bytes(8, "big"),
        )
        for msg in (second, first, stepped_back, forged):  # second overtook first on the way
            await b.pubsub.push_msg(sender, msg)
        fresh = _signed(a, _stamped(keys[0], 0.0, "fresh"))
        await b.pubsub.push_msg(sender, fresh)
        with trio.fail_after(10):
            delivered = [bytes((await sub.get()).data) for _ in range(3)]
        assert delivered == [second.data, stepped_back.data, fresh.data]
        assert b.pubsub.counters["gossip_superseded_in"] == 1  # first


async def test_gossip_that_expired_in_a_send_queue_is_not_written() -> None:
    async with overlay_nodes(1) as (keys, (a,)):
        a.pubsub.set_topic_expiry(TOPIC, peek_timestamp, MAX_AGE_S)
        stream = HalvingStream(ID.from_base58(a.peer_id))
        me = ID.from_base58(a.peer_id).to_bytes()

        def message(age_s: float, text: str) -> rpc_pb2.Message:
            data = _stamped(keys[0], age_s, text)
            return rpc_pb2.Message(data=data, topicIDs=[TOPIC], from_id=me)

        other = rpc_pb2.Message(data=b"no envelope", topicIDs=["other/topic"])
        rpc = rpc_pb2.RPC(publish=[message(MAX_AGE_S + 1, "old"), message(5.0, "new"), other])
        await a.pubsub.write_msg(stream, rpc)
        (written,) = _frames(stream.data)
        assert [m.data for m in written.publish] == [rpc.publish[1].data, b"no envelope"]
        assert a.pubsub.counters["gossip_expired_out"] == 1
        assert a.pubsub.counters["gossip_age_out_lt10"] == 1  # our own: it waited 5 s
        # Nothing left to send: nothing is written.
        await a.pubsub.write_msg(stream, rpc_pb2.RPC(publish=[message(MAX_AGE_S + 1, "old")]))
        assert len(_frames(stream.data)) == 1
        assert a.pubsub.counters["gossip_expired_out"] == 2


async def test_what_is_queued_for_a_peer_leaves_in_one_write() -> None:
    async with overlay_nodes(1) as (_keys, (a,)):
        peer = ID.from_base58(a.peer_id)
        stream = HalvingStream(peer)
        queue = RpcQueue()
        rpcs = [rpc_pb2.RPC(publish=[rpc_pb2.Message(data=bytes([i]) * 100)]) for i in range(5)]
        for rpc in rpcs:
            assert queue.push(rpc)
        queue.close()  # the loop ends once the queue is drained
        await a.pubsub.handle_sending_messages(peer, stream, queue)
        assert stream.writes == 1
        assert [r.publish[0].data for r in _frames(stream.data)] == [
            r.publish[0].data for r in rpcs
        ]
        assert a.pubsub.counters["rpcs_batched"] == 5


class ChunkStream:
    """Hands out what it holds in one read, and counts the reads."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.reads = 0
        self.muxed_conn = "the stream's connection"

    async def read(self, n: int = -1) -> bytes:
        self.reads += 1
        data, self.data = self.data, b""
        return data


async def test_rpcs_that_arrived_together_are_parsed_from_one_read() -> None:
    payloads = [bytes([i]) * (50 + 100 * i) for i in range(4)]
    inner = ChunkStream(b"".join(encode_uvarint(len(p)) + p for p in payloads))
    reader = _ChunkedReader(inner)  # type: ignore[arg-type]
    got = [await read_varint_prefixed_bytes_limited(reader, 1 << 20) for _ in payloads]
    assert got == payloads and inner.reads == 1
    assert reader.muxed_conn == "the stream's connection"  # the rest is the stream's
    assert await reader.read(1) == b"" and inner.reads == 2  # its end, as the stream says
