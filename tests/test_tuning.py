"""The per-RPC cuts of overlay/tuning.py keep libp2p's checks: only a record already accepted
from that peer skips its signature check, a bad one is still refused every time."""

from __future__ import annotations

from libp2p.peer.id import ID
from libp2p.pubsub import gossipsub as gossipsub_mod
from libp2p.pubsub import pubsub as pubsub_mod
from libp2p.pubsub.pb import rpc_pb2

from p2pnode.identity import NodeKey
from p2pnode.overlay import tuning


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
