"""The per-RPC cuts of overlay/net/patches/tuning.py keep libp2p's checks: only a record already accepted
from that peer skips its signature check, a bad one is still refused every time."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.identity.identify_push.identify_push import push_identify_to_peers
from libp2p.peer.envelope import consume_envelope
from libp2p.peer.id import ID
from libp2p.peer.peerstore import create_signed_peer_record
from libp2p.pubsub import gossipsub as gossipsub_mod
from libp2p.pubsub import pubsub as pubsub_mod
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12
from libp2p.pubsub.pb import rpc_pb2
from multiaddr import Multiaddr

from p2pnode.identity import NodeKey
from p2pnode.overlay.net.patches import tuning

from testkit import wait_until


def test_bad_sender_records_are_refused_every_time_and_absent_ones_pass() -> None:
    tuning.install()
    consume = pubsub_mod.maybe_consume_signed_record
    assert consume is gossipsub_mod.maybe_consume_signed_record
    assert hasattr(consume, "__wrapped__")  # installed once, in both modules
    peer = ID.from_base58(NodeKey.generate().peer_id)
    bad = rpc_pb2.RPC(senderRecord=b"\x0a\x03not an envelope")
    host = object()
    assert consume(bad, host, peer) is False
    assert consume(bad, host, peer) is False  # never remembered as accepted
    assert consume(rpc_pb2.RPC(), host, peer) is True


def test_install_is_idempotent() -> None:
    tuning.install()
    first = pubsub_mod.maybe_consume_signed_record
    tuning.install()
    assert pubsub_mod.maybe_consume_signed_record is first


async def test_a_record_issued_elsewhere_never_makes_pubsub_send_an_older_one(
    overlay_network, monkeypatch
) -> None:
    """A relay reservation adds a circuit address and pushes identify (a newer record) at
    once; the cached record pubsub sends must follow it, and a SUBSCRIBE sent right after it
    must reach the peer (libp2p drops a whole RPC whose record is older than the stored one)."""
    async with overlay_network(2) as (a, b):
        await wait_until(lambda: a.host.get_id() in b.pubsub.peers, 10, "pubsub peered")
        send = pubsub_mod.env_to_send_in_RPC
        # What open_relay does to a host on each reservation: a circuit address more. The
        # first one is issued and cached by pubsub but not sent (b never accepted it), the
        # second goes out at once in an identify push.
        own = a.host.get_addrs
        first = Multiaddr(f"/ip4/10.9.9.9/tcp/1/p2p/{b.peer_id}/p2p-circuit/p2p/{a.peer_id}")
        circuit = Multiaddr(f"{b.addrs[0]}/p2p-circuit/p2p/{a.peer_id}")
        a.host.get_addrs = lambda: [*own(), first]  # type: ignore[method-assign]
        monkeypatch.setattr(tuning, "LOCAL_RECORD_CACHE_S", 0.0)
        send(a.host)
        # From here on the cache would hold whatever it has, however long the test takes.
        monkeypatch.setattr(tuning, "LOCAL_RECORD_CACHE_S", 3600.0)
        a.host.get_addrs = lambda: [*own(), first, circuit]  # type: ignore[method-assign]
        await push_identify_to_peers(a.host)
        stored = lambda: b.host.get_peerstore().get_peer_record(a.host.get_id())  # noqa: E731
        await wait_until(
            lambda: stored() is not None and circuit in stored().record().addrs,
            10,
            "identify push stored at b",
        )
        newest = a.host.get_peerstore().get_local_record().record().seq
        _, record = consume_envelope(send(a.host)[0], tuning.PEER_RECORD_DOMAIN)
        assert record.seq == newest and circuit in record.addrs
        await a.pubsub.subscribe("tuning-test")
        await wait_until(
            lambda: a.host.get_id() in b.pubsub.peer_topics.get("tuning-test", set()),
            10,
            "b learns a's subscription",
        )


async def test_an_rpc_with_a_superseded_record_of_its_sender_is_kept(overlay_network) -> None:
    """Identify and pubsub run on different streams: a record issued between two RPCs can
    arrive first. The older record is ignored, the RPC it came with is not."""
    tuning.install()
    consume = pubsub_mod.maybe_consume_signed_record
    async with overlay_network(1) as (b,):
        kp = create_new_key_pair(NodeKey.generate().seed)
        pid = ID.from_pubkey(kp.public_key)
        old = create_signed_peer_record(pid, [Multiaddr("/ip4/10.0.0.1/tcp/1")], kp.private_key)
        new = create_signed_peer_record(pid, [Multiaddr("/ip4/10.0.0.2/tcp/1")], kp.private_key)
        assert new.record().seq > old.record().seq
        assert consume(rpc_pb2.RPC(senderRecord=new.marshal_envelope()), b.host, pid)
        before = tuning.SUPERSEDED_RECORDS[0]
        assert consume(rpc_pb2.RPC(senderRecord=old.marshal_envelope()), b.host, pid)
        assert tuning.SUPERSEDED_RECORDS[0] == before + 1
        kept = b.host.get_peerstore().get_peer_record(pid).record()
        assert kept.seq == new.record().seq  # the newer record stays
        # The same older record under another sender's id is still refused.
        other = ID.from_base58(NodeKey.generate().peer_id)
        assert not consume(rpc_pb2.RPC(senderRecord=old.marshal_envelope()), b.host, other)


async def test_small_reads_are_credited_in_batches_and_a_large_transfer_still_flows(
    overlay_network, monkeypatch
) -> None:
    """yamux credits the sender's window in half-window batches, not one frame per message
    read; a transfer of several windows still completes (credit arrives before it runs out)."""
    import trio
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    from p2pnode.overlay.wire import PROTOCOL_LIMITS, read_frame, write_frame

    tuning.install()
    proto = "/p2pnode/control/1"
    limit = PROTOCOL_LIMITS[proto]
    updates: list[int] = []
    real = YamuxStream.send_window_update

    async def counted(self, delta: int, *args, **kwargs) -> None:
        updates.append(delta)
        await real(self, delta, *args, **kwargs)

    monkeypatch.setattr(YamuxStream, "send_window_update", counted)
    async with overlay_network(2) as (server, client):
        got: list[int] = []

        async def sink(stream) -> None:
            while (frame := await read_frame(stream, limit=limit)) is not None:
                got.append(len(frame["pad"]))

        server.set_stream_handler(proto, sink)
        with trio.fail_after(60):
            stream = await client.open_stream(server.peer_id, proto)
            updates.clear()
            for _ in range(50):  # 50 small messages: ~10 KB, far below half a window
                await write_frame(stream, {"pad": "x" * 100}, limit=limit)
            await wait_until(lambda: len(got) == 50, 30, "50 small frames read")
            assert len(updates) <= 1, updates  # was one WINDOW_UPDATE per message
            big = "y" * 60_000
            for _ in range(40):  # 2.4 MB: ~10 windows of 256 KB, so credit must flow back
                await write_frame(stream, {"pad": big}, limit=limit)
            await wait_until(lambda: len(got) == 90, 30, "the large transfer read")
        # 2.4 MB is ~10 initial windows: it completes only if credit came back (how many
        # updates carried it depends on yamux's window auto-tuning and timing).
        assert updates


def test_rpcs_dropped_for_a_full_send_queue_are_counted() -> None:
    """Gossip lost before it left (a peer's send queue full) shows in the pubsub's counters."""
    router = tuning.QuietGossipSub(
        protocols=[PROTOCOL_ID_V12], degree=6, degree_low=4, degree_high=12
    )
    router.pubsub = SimpleNamespace(counters=Counter())  # type: ignore[assignment]
    peer = ID.from_base58(NodeKey.generate().peer_id)
    rpc = rpc_pb2.RPC(publish=[rpc_pb2.Message(data=b"x")])
    router._handle_dropped_rpc(peer, rpc, "queue_full")
    router._handle_dropped_rpc(peer, rpc, "queue_full")
    assert router.pubsub.counters == {"rpcs_dropped_queue_full": 2}  # type: ignore[union-attr]
