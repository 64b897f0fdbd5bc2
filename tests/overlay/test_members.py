"""The membership verdicts and revocations one node keeps (overlay/net/members.py), without
hosts."""

from __future__ import annotations

import time

import trio
import trio.lowlevel

from p2pnode.identity import NodeKey
from p2pnode.identity.memberhome import MemberHome
from p2pnode.identity.membership import Issuer, issue_membership, issue_revocation
from p2pnode.overlay.net import members as members_module
from p2pnode.overlay.net.members import ClosedNetwork, Members
from p2pnode.overlay.seams import Membership

NET = NodeKey.from_seed(b"N" * 32)
US, ADMIN, BOB, CAROL = (NodeKey.from_seed(bytes([i]) * 32) for i in (1, 2, 3, 4))


def members(home=None) -> Members:
    own = issue_membership(Issuer(NET), US.peer_id, now=time.time())
    return Members(ClosedNetwork(NET.public_key, own.raw, home=home), US.peer_id)


def test_check_admits_members_and_says_why_not():
    m = members()
    assert isinstance(m, Membership) and m.closed and m.is_member(US.peer_id)
    bob = issue_membership(Issuer(NET), BOB.peer_id, now=time.time())
    assert m.check(BOB.peer_id, bob.raw) is None and m.is_member(BOB.peer_id)
    assert "no membership" in m.check(CAROL.peer_id, None)
    assert "names peer" in m.check(CAROL.peer_id, bob.raw)  # someone else's credential
    expired = issue_membership(Issuer(NET), CAROL.peer_id, ttl=1, now=time.time() - 10)
    assert "expired" in m.check(CAROL.peer_id, expired.raw)
    assert not m.is_member(CAROL.peer_id)


async def test_wait_verdict_is_bounded_and_denial_is_immediate(monkeypatch):
    monkeypatch.setattr(members_module, "VERDICT_TIMEOUT_S", 0.2)
    m = members()
    with trio.fail_after(2):
        assert not await m.wait_verdict(BOB.peer_id)  # no hello ever came
        m.deny(CAROL.peer_id)
        assert not await m.wait_verdict(CAROL.peer_id)
    bob = issue_membership(Issuer(NET), BOB.peer_id, now=time.time())
    async with trio.open_nursery() as nursery:
        got: list[bool] = []

        async def wait() -> None:
            got.append(await m.wait_verdict(BOB.peer_id))

        nursery.start_soon(wait)
        await trio.lowlevel.checkpoint()
        m.check(BOB.peer_id, bob.raw)
        m.settle(BOB.peer_id)
    assert got == [True]


def test_revocations_apply_persist_and_take_an_admins_members_along(tmp_path):
    m = members(tmp_path)
    revoked: list[str] = []
    m.on_revoked.append(revoked.append)
    admin = issue_membership(Issuer(NET), ADMIN.peer_id, admin=True, now=time.time())
    by_admin = issue_membership(Issuer(ADMIN, admin), BOB.peer_id, now=time.time())
    assert m.check(ADMIN.peer_id, admin.raw) is None and m.check(BOB.peer_id, by_admin.raw) is None
    # The admin revoked CAROL, then was revoked itself; they arrive newest first.
    earlier = issue_revocation(Issuer(ADMIN, admin), CAROL.peer_id, now=time.time() - 5)
    later = issue_revocation(Issuer(NET), ADMIN.peer_id, now=time.time())
    m.learn_all([later.raw, earlier.raw])
    assert m.revoked == {CAROL.peer_id, ADMIN.peer_id}
    assert not m.is_member(ADMIN.peer_id) and not m.is_member(BOB.peer_id)
    assert set(revoked) == {CAROL.peer_id, ADMIN.peer_id, BOB.peer_id}
    assert m.learn(later.raw) is None  # known already
    assert members(tmp_path).revoked == {CAROL.peer_id, ADMIN.peer_id}  # from the home
    assert len(MemberHome(tmp_path).revocations()) == 2
    assert m.status()["revoked"] == sorted([CAROL.peer_id, ADMIN.peer_id])


def test_an_open_network_has_no_members():
    m = Members(None, US.peer_id)
    assert not m.closed and not m.is_member(US.peer_id) and m.status() == {"closed": False}


def test_expired_members_are_reported_once(monkeypatch):
    m = members()
    short = issue_membership(Issuer(NET), BOB.peer_id, ttl=60, now=time.time())
    assert m.check(BOB.peer_id, short.raw) is None
    assert m.expired() == []
    later = time.time() + 61
    monkeypatch.setattr(time, "time", lambda: later)
    assert m.expired() == [BOB.peer_id] and m.expired() == []
    assert not m.is_member(BOB.peer_id)
