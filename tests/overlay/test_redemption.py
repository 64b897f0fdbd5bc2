"""Invite redemption's server (overlay/net/redemption.py) fed garbage: only wire errors, never
a membership, and it still answers a valid grant afterwards. (The network path, uses and
refusals: tests/overlay/test_closed.py.)"""

from __future__ import annotations

import time
from types import SimpleNamespace

import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.peer.id import ID

from p2pnode.identity import NodeKey
from p2pnode.identity.membership import Issuer, issue_grant, issue_membership, verify_membership
from p2pnode.overlay.net.members import ClosedNetwork, Members
from p2pnode.overlay.net.redemption import (
    ANSWER_LIMIT,
    RedeemAnswer,
    RedeemRequest,
    serve_redemption,
)
from p2pnode.overlay.wire import WireError, from_wire

from testkit.streams import feed, frame_bytes, read_frames

NET = NodeKey.from_seed(b"N" * 32)
HERE, JOINER = NodeKey.from_seed(b"H" * 32), NodeKey.from_seed(b"J" * 32)


class _FromPeer:
    """A trio stream that says which peer it comes from, as a secured libp2p stream does."""

    def __init__(self, inner: trio.abc.Stream, peer: NodeKey) -> None:
        self.inner = inner
        self.muxed_conn = SimpleNamespace(peer_id=ID.from_base58(peer.peer_id))

    async def read(self, n: int) -> bytes:
        return await self.inner.receive_some(n)

    async def write(self, data: bytes) -> None:
        await self.inner.send_all(data)


def _handler():
    own = issue_membership(Issuer(NET), HERE.peer_id, admin=True, now=time.time())
    members = Members(ClosedNetwork(NET.public_key, own.raw, issuer=Issuer(NET)), HERE.peer_id)
    serve = serve_redemption(members, Issuer(NET), HERE.peer_id, None)

    async def handle(stream: trio.abc.Stream) -> None:
        await serve(_FromPeer(stream, JOINER))

    return handle


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_gets_no_membership_then_a_valid_grant_does(data: bytes) -> None:
    handle = _handler()

    async def main() -> None:
        out, raised = await feed(handle, data)
        assert raised is None or isinstance(raised, WireError), repr(raised)
        for obj in read_frames(out, ANSWER_LIMIT):
            assert from_wire(obj, RedeemAnswer).member is None
        grant = issue_grant(Issuer(NET), HERE.peer_id, now=time.time())
        out, raised = await feed(handle, frame_bytes(RedeemRequest(grant=grant.raw), 4096))
        assert raised is None
        (answer,) = [from_wire(f, RedeemAnswer) for f in read_frames(out, ANSWER_LIMIT)]
        # Made for the peer of the connection, whoever the message might have named.
        verify_membership(answer.member, NET.public_key, JOINER.peer_id, time.time())

    trio.run(main)
