"""The per-RPC cuts of overlay/tuning.py keep libp2p's checks: only a record already accepted
from that peer skips its signature check, a bad one is still refused every time."""

from __future__ import annotations

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.identity.identify_push.identify_push import push_identify_to_peers
from libp2p.peer.envelope import consume_envelope
from libp2p.peer.id import ID
from libp2p.peer.peerstore import create_signed_peer_record
from libp2p.pubsub import gossipsub as gossipsub_mod
from libp2p.pubsub import pubsub as pubsub_mod
from libp2p.pubsub.pb import rpc_pb2
from multiaddr import Multiaddr

from p2pnode.identity import NodeKey
from p2pnode.overlay import tuning

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
