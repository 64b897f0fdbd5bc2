"""Which network a starting node belongs to, from its home and its invite: closed (with its
membership) or open. And who in a home may issue invites and revocations.

Contract:
- ``await closed_network(settings, key) -> ClosedNetwork | None``:
  - a home that holds the network key signs itself an admin membership at each start; a
    ``bootstrap`` node without ``--open`` and without an invite creates that key first (mode
    0600) and so starts a new closed network;
  - a ``bootstrap`` given an invite (``--bootstrap INVITE``, best an ``--admin`` one, so it can
    invite too) joins that network instead, like ``join``;
  - a closed invite (``--invite`` or ``--bootstrap``): the membership saved in the home is
    reused when it is valid for the invite's network, else the grant is redeemed at the
    inviting node and the membership (and the revocations it sent) saved in the home;
  - no invite, a membership in the home: reused (a member restarted with a plain address);
  - none of these: None, an open network.
  ``NodeStartError`` (one line: which, and what to do) when a membership is expired, revoked
  or refused, or the invite cannot be redeemed.
- ``issuer_in(home) -> (Issuer | None, why)``: the network key of the home, or its node key
  with an admin membership; None and the reason when this home may not issue.
- ``invite_text(home, running, admin=, uses=, ttl=) -> (invite, note)`` and
  ``revoke_peer(home, running, peer)``: what ``p2pnode invite`` and ``p2pnode revoke`` do for
  the node running on ``home`` (``running``: its runtime file); ``CommandRefused`` says why not.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from p2pnode.bootstrap.config import NodeSettings
from p2pnode.bootstrap.node import NodeStartError
from p2pnode.errors import P2PNodeError
from p2pnode.identity import NodeKey
from p2pnode.identity.memberhome import MemberHome
from p2pnode.identity.membership import (
    Issuer,
    MembershipError,
    issue_membership,
    load_network_key,
    load_or_create_network_key,
    parse_membership,
    verify_membership,
)

__all__ = ["CommandRefused", "closed_network", "invite_text", "issuer_in", "revoke_peer"]

log = logging.getLogger("p2pnode.node")


def _as_holder(home: Path, key: NodeKey, network_key: NodeKey):
    from p2pnode.overlay.net.members import ClosedNetwork

    own = issue_membership(Issuer(network_key), key.peer_id, admin=True, now=time.time())
    return ClosedNetwork(network_key.public_key, own.raw, issuer=Issuer(network_key), home=home)


async def closed_network(settings: NodeSettings, key: NodeKey):
    from p2pnode.overlay.net.members import ClosedNetwork

    home = settings.home
    if settings.open and "bootstrap" in settings.role:
        return None
    network_key = load_network_key(home)
    if network_key is None and "bootstrap" in settings.role and not settings.invite:
        network_key = load_or_create_network_key(home)
    if network_key is not None:
        log.info("closed network %s: members join by invite", _short(network_key.public_key))
        return _as_holder(home, key, network_key)
    store = MemberHome(home)
    raw = store.membership
    invite = None
    if settings.invite:
        from p2pnode.bootstrap.invite import parse_invite

        invite = parse_invite(settings.invite)
    if invite is not None and invite.closed:
        assert invite.network_key is not None and invite.grant is not None
        if raw is None or _invalid(raw, invite.network_key, key.peer_id, store) is not None:
            redeemed = await _redeem(key, invite.grant, list(invite.bootstrap), invite.network_key)
            store.save_membership(redeemed.membership)
            if redeemed.revocations:
                store.save_revocations([*store.revocations(), *redeemed.revocations])
            raw = redeemed.membership
            log.info("joined closed network %s with the invite", _short(invite.network_key))
    if raw is None:
        return None
    try:
        cred = parse_membership(raw)
    except MembershipError as exc:
        raise NodeStartError(
            f"the membership in {home} is damaged ({exc}); join with an invite"
        ) from None
    why = _invalid(raw, cred.network, key.peer_id, store)
    if why is not None:
        raise NodeStartError(
            f"this node is not a member of its closed network: {why}; ask an admin for a new "
            "invite (`p2pnode invite` on the network's bootstrap)"
        )
    issuer = Issuer(key, cred) if cred.admin and cred.parent is None else None
    return ClosedNetwork(cred.network, raw, issuer=issuer, home=home)


def _invalid(raw: bytes, network_key: bytes, peer_id: str, store: MemberHome) -> str | None:
    from p2pnode.identity.membership import parse_revocation

    revoked = set()
    for rev in store.revocations():
        try:
            revoked.add(parse_revocation(rev).peer)
        except MembershipError:
            continue
    try:
        verify_membership(raw, network_key, peer_id, time.time(), revoked)
    except MembershipError as exc:
        return str(exc)
    return None


async def _redeem(key: NodeKey, grant: bytes, addrs: list[str], network_key: bytes):
    from p2pnode.overlay.net.redemption import RedemptionFailed, redeem_invite

    try:
        return await redeem_invite(key, grant, addrs, network_key)
    except RedemptionFailed as exc:
        raise NodeStartError(f"this node could not join the closed network: {exc}") from None


def issuer_in(home: Path) -> tuple[Issuer | None, str]:
    network_key = load_network_key(home)
    if network_key is not None:
        return Issuer(network_key), "the network key"
    raw = MemberHome(home).membership
    if raw is None:
        return None, "this node's network is open (it holds no network key and no membership)"
    try:
        cred = parse_membership(raw)
    except MembershipError as exc:
        return None, f"its membership is damaged: {exc}"
    if not cred.admin or cred.parent is not None:
        return None, "only the network key holder or an admin member may do this"
    return Issuer(NodeKey.load_or_create(home), cred), "an admin membership"


def _short(network_key: bytes) -> str:
    from p2pnode.identity.membership import network_id_of

    return network_id_of(network_key)


class CommandRefused(P2PNodeError):
    """``p2pnode invite`` or ``revoke`` cannot be done here; the message says why."""

    reason = "command_refused"


def invite_text(
    home: Path, running: dict[str, Any], *, admin: bool, uses: int | None, ttl: float
) -> tuple[str, str]:
    """The invite of the network of the node running on ``home``, and a note for the user
    (empty for an open network)."""
    from p2pnode.bootstrap.invite import InviteError, make_invite
    from p2pnode.identity.membership import issue_grant
    from p2pnode.overlay.net.node import VERSION

    network, addrs = running.get("network", "main"), list(running["addrs"])
    try:
        if not running.get("closed"):
            if admin or uses is not None:
                raise CommandRefused("--admin and --uses are for closed networks only")
            return make_invite(network, VERSION, addrs), ""
        issuer, why = issuer_in(home)
        if issuer is None:
            raise CommandRefused(f"this node cannot issue invites: {why}")
        if admin and issuer.admin is not None:
            raise CommandRefused("an admin member cannot make admins; ask the network key holder")
        grant = issue_grant(
            issuer, running["peer_id"], admin=admin, max_uses=uses, ttl=ttl, now=time.time()
        )
        text = make_invite(network, VERSION, addrs, network_key=issuer.network, grant=grant.raw)
    except (InviteError, MembershipError) as exc:
        raise CommandRefused(str(exc)) from None
    uses_text = f"{uses} joiner(s)" if uses is not None else "any number of joiners"
    role = "admins" if admin else "members"
    return text, f"invite to the closed network for {uses_text} as {role}"


def revoke_peer(home: Path, running: dict[str, Any], peer: str) -> None:
    """Sign a revocation of ``peer`` and hand it to the running node, which applies and
    gossips it."""
    from p2pnode.identity.membership import issue_revocation

    if not running.get("closed"):
        raise CommandRefused("this node's network is open: there is nothing to revoke")
    issuer, why = issuer_in(home)
    if issuer is None:
        raise CommandRefused(f"this node cannot revoke: {why}")
    if peer == running["peer_id"]:
        raise CommandRefused("a node cannot revoke itself")
    try:
        rev = issue_revocation(issuer, peer, now=time.time())
    except MembershipError as exc:
        raise CommandRefused(str(exc)) from None
    MemberHome(home).post_revocation(rev.raw)
