"""Closed networks on real libp2p hosts (loopback): the membership check in the hello, the
gate on every other protocol, invite redemption and revocation (overlay/net/members.py,
patches/gate.py, redemption.py, revocations.py)."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.tools.anyio_service import background_trio_service

from p2pnode.identity import NodeKey
from p2pnode.identity.memberhome import MemberHome
from p2pnode.identity.membership import Issuer, issue_grant, issue_membership, issue_revocation
from p2pnode.overlay import OverlayConfig, make_host, open_overlay_node, parse_multiaddr
from p2pnode.overlay.net import members as members_module
from p2pnode.overlay.net.config import VERSION
from p2pnode.overlay.net.hello import HELLO_PROTOCOL, Hello, NetworkMismatch, say_hello
from p2pnode.overlay.net.liveness import PING_LENGTH, PING_PROTOCOL
from p2pnode.overlay.net.members import ClosedNetwork
from p2pnode.overlay.net.redemption import RedemptionFailed, redeem_invite
from p2pnode.overlay.net.relay import open_relay
from p2pnode.overlay.seams import Membership

from testkit import wait_until

NET = NodeKey.from_seed(b"N" * 32)
KAD = TProtocol("/ipfs/kad/1.0.0")
MESHSUB = TProtocol("/meshsub/1.2.0")
TOPIC = "closed-test"


def key(i: int) -> NodeKey:
    return NodeKey.from_seed(bytes([i]) * 32)


def closed(k: NodeKey, home: Path | None = None, *, admin: bool = False) -> ClosedNetwork:
    cred = issue_membership(Issuer(NET), k.peer_id, admin=admin, now=time.time())
    return ClosedNetwork(NET.public_key, cred.raw, issuer=Issuer(NET) if admin else None, home=home)


def config(k: NodeKey, net: ClosedNetwork | None, bootstrap: list[str] = ()) -> OverlayConfig:
    return OverlayConfig(key=k, closed=net, bootstrap=list(bootstrap), connect_timeout=2.0)


def connected(node, peer_id: str) -> bool:
    return ID.from_base58(peer_id) in node.host.get_connected_peers()


async def gossip_arrives(sender, receiver, data: bytes, limit_s: float) -> bool:
    """Publish ``data`` from ``sender`` until ``receiver`` gets it (bounded)."""
    sub = await receiver.pubsub.subscribe(TOPIC)
    await sender.pubsub.subscribe(TOPIC)  # a mesh to publish into
    got = trio.Event()

    async def receive() -> None:
        while True:
            if (await sub.get()).data == data:
                got.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        with trio.move_on_after(limit_s):
            while not got.is_set():
                await sender.pubsub.publish(TOPIC, data)
                with trio.move_on_after(0.3):
                    await got.wait()
        nursery.cancel_scope.cancel()
    return got.is_set()


async def test_members_admit_each_other_and_gossip(tmp_path):
    async with AsyncExitStack() as stack:
        admin = await stack.enter_async_context(
            open_overlay_node(config(key(1), closed(key(1), tmp_path, admin=True)))
        )
        member = await stack.enter_async_context(
            open_overlay_node(config(key(2), closed(key(2)), admin.addrs))
        )
        assert isinstance(admin.membership, Membership) and admin.membership.closed
        await wait_until(
            lambda: (
                admin.membership.is_member(member.peer_id)
                and member.membership.is_member(admin.peer_id)
            ),
            10,
            "the two members admit each other",
        )
        assert await gossip_arrives(member, admin, b"from a member", 10)


async def test_a_node_without_membership_is_refused_and_says_so(tmp_path):
    async with open_overlay_node(config(key(1), closed(key(1), tmp_path, admin=True))) as admin:
        # An open node of the same network id: its hello carries no membership.
        stranger_cfg = OverlayConfig(key=key(3), bootstrap=admin.addrs, connect_timeout=2.0)
        with pytest.raises(NetworkMismatch, match="no membership of this closed network"):
            async with open_overlay_node(stranger_cfg):
                pass
        await wait_until(lambda: key(3).peer_id in admin.refused, 5, "the stranger refused")
        await wait_until(lambda: not connected(admin, key(3).peer_id), 5, "its connection closed")
        assert not admin.membership.is_member(key(3).peer_id)


async def test_a_stranger_gets_no_dht_answer_no_gossip_no_relay_slot(monkeypatch):
    # A stranger that never says hello: its streams wait for a verdict that never comes.
    monkeypatch.setattr(members_module, "VERDICT_TIMEOUT_S", 1.0)
    async with AsyncExitStack() as stack:
        admin = await stack.enter_async_context(
            open_overlay_node(config(key(1), closed(key(1), admin=True)))
        )
        await stack.enter_async_context(open_relay(admin, hop=True, auto=False))
        seen: list[bytes] = []
        sub = await admin.pubsub.subscribe(TOPIC)
        stranger = make_host(key(4), ["/ip4/127.0.0.1/tcp/0"])
        await stack.enter_async_context(
            stranger.run(listen_addrs=[parse_multiaddr("/ip4/127.0.0.1/tcp/0")])
        )
        info = info_from_p2p_addr(parse_multiaddr(admin.addrs[0]))
        await stranger.connect(info)
        streams = [
            await stranger.new_stream(info.peer_id, [proto])
            for proto in (KAD, MESHSUB, HOP_PROTOCOL, TProtocol(PING_PROTOCOL))
        ]  # each negotiates (that much is public), then waits for a verdict in vain
        for stream in streams:
            with trio.fail_after(5), pytest.raises(Exception):  # noqa: B017  # reset or EOF
                await stream.write(b"\x05hello")
                if not await stream.read(64):
                    raise EOFError(f"{stream.get_protocol()}: closed without an answer")
        await wait_until(lambda: admin.counters["gate_reset"] >= 4, 5, "four streams reset")
        with trio.move_on_after(0.5):
            seen.append((await sub.get()).data)
        assert not seen
        await wait_until(
            lambda: not connected(admin, key(4).peer_id), 15, "the stranger's connection closed"
        )
        assert not admin.membership.is_member(key(4).peer_id)


async def test_a_strangers_gossip_never_arrives():
    """A stranger that skips the hello and speaks gossipsub itself: nothing it publishes
    reaches a member, and it never hears the member's messages."""
    async with AsyncExitStack() as stack:
        admin = await stack.enter_async_context(
            open_overlay_node(config(key(1), closed(key(1), admin=True)))
        )
        host = make_host(key(4), ["/ip4/127.0.0.1/tcp/0"])
        gossip = GossipSub(
            protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11],
            degree=2,
            degree_low=1,
            degree_high=4,
            heartbeat_interval=0.2,  # type: ignore[arg-type]
            heartbeat_initial_delay=0.1,
        )
        pubsub = Pubsub(host, gossip, strict_signing=True)
        await stack.enter_async_context(
            host.run(listen_addrs=[parse_multiaddr("/ip4/127.0.0.1/tcp/0")])
        )
        await stack.enter_async_context(background_trio_service(pubsub))
        await stack.enter_async_context(background_trio_service(gossip))
        theirs = await pubsub.subscribe(TOPIC)
        ours = await admin.pubsub.subscribe(TOPIC)
        await host.connect(info_from_p2p_addr(parse_multiaddr(admin.addrs[0])))
        member_heard: list[bytes] = []
        stranger_heard: list[bytes] = []
        with trio.move_on_after(2):
            while True:
                await pubsub.publish(TOPIC, b"from a stranger")
                await admin.pubsub.publish(TOPIC, b"members only")
                with trio.move_on_after(0.1):
                    member_heard.append((await ours.get()).data)
                with trio.move_on_after(0.1):
                    stranger_heard.append((await theirs.get()).data)
        # Each hears its own messages (local delivery), never the other's.
        assert b"members only" in member_heard and b"from a stranger" not in member_heard
        assert b"from a stranger" in stranger_heard and b"members only" not in stranger_heard
        assert ID.from_base58(key(4).peer_id) not in admin.pubsub.peers


async def test_invite_redeemed_once_per_use_then_joins(tmp_path):
    admin_home = tmp_path / "admin"
    async with open_overlay_node(config(key(1), closed(key(1), admin_home, admin=True))) as admin:
        grant = issue_grant(Issuer(NET), admin.peer_id, max_uses=1, now=time.time())
        redeemed = await redeem_invite(key(5), grant.raw, admin.addrs, NET.public_key)
        # The same joiner again (it lost its file) is not a second use; another joiner is.
        await redeem_invite(key(5), grant.raw, admin.addrs, NET.public_key)
        with pytest.raises(RedemptionFailed, match="uses are spent"):
            await redeem_invite(key(6), grant.raw, admin.addrs, NET.public_key)
        expired = issue_grant(Issuer(NET), admin.peer_id, ttl=1e-6, now=time.time() - 1)
        with pytest.raises(RedemptionFailed, match="expired"):
            await redeem_invite(key(6), expired.raw, admin.addrs, NET.public_key)
        forged = issue_grant(Issuer(key(9)), admin.peer_id, now=time.time())
        with pytest.raises(RedemptionFailed):
            await redeem_invite(key(6), forged.raw, admin.addrs, NET.public_key)
        net = ClosedNetwork(NET.public_key, redeemed.membership)
        async with open_overlay_node(config(key(5), net, admin.addrs)) as joiner:
            await wait_until(
                lambda: admin.membership.is_member(joiner.peer_id), 10, "the joiner admitted"
            )


async def test_a_revoked_member_is_refused_by_every_member_within_10_s(tmp_path):
    homes = [tmp_path / f"n{i}" for i in range(4)]
    async with AsyncExitStack() as stack:
        admin = await stack.enter_async_context(
            open_overlay_node(config(key(1), closed(key(1), homes[0], admin=True)))
        )
        others = [
            await stack.enter_async_context(
                open_overlay_node(config(key(i), closed(key(i), homes[i - 1]), admin.addrs))
            )
            for i in (2, 3, 4)
        ]
        nodes = [admin, *others]
        victim = others[-1]
        await wait_until(
            lambda: (
                all(
                    n.membership.is_member(m.peer_id)
                    for n in nodes
                    for m in nodes
                    if connected(n, m.peer_id)
                )
                and all(connected(n, victim.peer_id) for n in nodes[:-1])
            ),
            15,
            "everyone connected to the victim",
        )
        rev = issue_revocation(Issuer(NET), victim.peer_id, now=time.time())
        MemberHome(homes[0]).post_revocation(rev.raw)  # what `p2pnode revoke` does
        took = await wait_until(
            lambda: all(
                victim.peer_id in n.refused and not connected(n, victim.peer_id) for n in nodes[:-1]
            ),
            10,
            "every member refused the revoked peer and closed its connection",
        )
        assert took < 10
        assert all(not n.membership.is_member(victim.peer_id) for n in nodes[:-1])
        # Persisted: a restarted member still refuses it.
        assert MemberHome(homes[1]).revocations() == [rev.raw]
        # It stays refused: dialing back in gets it closed again.
        with trio.move_on_after(3):
            await victim.connect(admin.addrs[0])
        await wait_until(
            lambda: not connected(admin, victim.peer_id), 5, "the revoked peer stays out"
        )


async def test_an_admin_member_invites_and_revokes(tmp_path):
    """Chain depth 1: an admin member (not holding the network key) signs grants, the
    memberships they buy and revocations; the network key holder accepts all three."""
    admin_key = key(7)
    admin_cred = issue_membership(Issuer(NET), admin_key.peer_id, admin=True, now=time.time())
    as_admin = Issuer(admin_key, admin_cred)
    admin_net = ClosedNetwork(NET.public_key, admin_cred.raw, issuer=as_admin, home=tmp_path / "a")
    async with AsyncExitStack() as stack:
        holder = await stack.enter_async_context(
            open_overlay_node(config(key(1), closed(key(1), tmp_path / "h", admin=True)))
        )
        admin = await stack.enter_async_context(
            open_overlay_node(config(admin_key, admin_net, holder.addrs))
        )
        grant = issue_grant(as_admin, admin.peer_id, max_uses=2, now=time.time())
        redeemed = await redeem_invite(key(8), grant.raw, admin.addrs, NET.public_key)
        joined = ClosedNetwork(NET.public_key, redeemed.membership)
        joiner = await stack.enter_async_context(
            open_overlay_node(config(key(8), joined, holder.addrs))
        )
        await wait_until(
            lambda: (
                holder.membership.is_member(joiner.peer_id)
                and joiner.membership.is_member(holder.peer_id)
            ),
            10,
            "the holder admits a member an admin made",
        )
        # An admin cannot make admins.
        admin_grant = issue_grant(as_admin, admin.peer_id, admin=True, now=time.time())
        with pytest.raises(RedemptionFailed, match="cannot make admins"):
            await redeem_invite(key(9), admin_grant.raw, admin.addrs, NET.public_key)
        rev = issue_revocation(as_admin, joiner.peer_id, now=time.time())
        MemberHome(tmp_path / "a").post_revocation(rev.raw)
        await wait_until(
            lambda: joiner.peer_id in holder.refused and not connected(holder, joiner.peer_id),
            10,
            "the holder applies the admin's revocation",
        )


async def test_an_open_network_has_no_members_and_no_gate():
    async with open_overlay_node(config(key(1), None)) as node:
        assert isinstance(node.membership, Membership)
        assert not node.membership.closed and not node.membership.is_member(key(2).peer_id)
        assert node.status()["membership"] == {"closed": False}


async def test_members_meet_through_a_members_relay_a_stranger_gets_no_slot():
    r_key, b_key, a_key, s_key = key(1), key(2), key(3), key(4)
    async with AsyncExitStack() as stack:
        r = await stack.enter_async_context(
            open_overlay_node(config(r_key, closed(r_key, admin=True)))
        )
        relay = await stack.enter_async_context(open_relay(r, hop=True))
        b = await stack.enter_async_context(
            open_overlay_node(config(b_key, closed(b_key), r.addrs))
        )
        b_relay = await stack.enter_async_context(open_relay(b, relays=r.addrs))
        a = await stack.enter_async_context(open_overlay_node(config(a_key, closed(a_key))))
        a_relay = await stack.enter_async_context(open_relay(a))
        with trio.fail_after(20):
            await b_relay.wait_reserved()
        assert await a_relay.dial(b_relay.circuit_addrs[0]) == b.peer_id
        await wait_until(
            lambda: a.membership.is_member(b.peer_id) and b.membership.is_member(a.peer_id),
            10,
            "members admit each other over the circuit",
        )
        stream = await a.open_stream(b.peer_id, PING_PROTOCOL, timeout=10)
        await stream.write(bytes(PING_LENGTH))
        with trio.fail_after(10):
            assert await stream.read(PING_LENGTH)
        # A stranger (an open node) asking the same relay for a slot gets none.
        stranger = await stack.enter_async_context(
            open_overlay_node(OverlayConfig(key=s_key, connect_timeout=2.0))
        )
        with pytest.raises(Exception):  # noqa: B017  # refused at the hello, or no reservation
            async with open_relay(stranger, relays=r.addrs) as s_relay:
                with trio.fail_after(5):
                    await s_relay.wait_reserved()
        assert not relay.protocol.resource_manager.has_reservation(ID.from_base58(s_key.peer_id))


async def test_a_refused_hello_answer_tells_why_and_nothing_else(tmp_path):
    async with AsyncExitStack() as stack:
        admin = await stack.enter_async_context(
            open_overlay_node(config(key(1), closed(key(1), tmp_path, admin=True)))
        )
        member = await stack.enter_async_context(
            open_overlay_node(config(key(2), closed(key(2)), admin.addrs))
        )
        rev = issue_revocation(Issuer(NET), key(9).peer_id, now=time.time())
        MemberHome(tmp_path).post_revocation(rev.raw)
        await wait_until(lambda: key(9).peer_id in admin.membership.revoked, 5, "revoked")
        await wait_until(lambda: admin.membership.is_member(member.peer_id), 10, "member in")
        host = make_host(key(4), ["/ip4/127.0.0.1/tcp/0"])
        await stack.enter_async_context(
            host.run(listen_addrs=[parse_multiaddr("/ip4/127.0.0.1/tcp/0")])
        )
        info = info_from_p2p_addr(parse_multiaddr(admin.addrs[0]))
        await host.connect(info)
        theirs = await say_hello(
            lambda: host.new_stream(info.peer_id, [TProtocol(HELLO_PROTOCOL)]),
            Hello(network="main", version=VERSION),
        )
        assert theirs.refused == "it has no membership of this closed network"
        assert theirs.member is None and theirs.revocations == () and theirs.peers == ()
        await wait_until(lambda: key(4).peer_id in admin.refused, 5, "the stranger refused")
