"""overlay/net/patches/safepubsub.py on real nodes: a malformed pubsub RPC costs its stream, not the node;
RPCs written at once to one stream never interleave, and a write cut short resets the stream."""

from __future__ import annotations

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12
from libp2p.pubsub.pb import rpc_pb2
from libp2p.stream_muxer.exceptions import MuxedStreamError
from libp2p.utils.varint import encode_uvarint

from testkit import wait_until
from testkit.cluster import overlay_nodes

TOPIC = "test/safepubsub"


class HalvingStream:
    """Writes each message in two halves with a checkpoint between (as yamux does when the
    window is short); ``fail_after_half`` makes the next write fail after its first half."""

    def __init__(self, peer: ID) -> None:
        self.data = bytearray()
        self.resets = 0
        self.fail_after_half = False
        self.muxed_conn = type("Conn", (), {"peer_id": peer})()

    async def write(self, data: bytes) -> None:
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
