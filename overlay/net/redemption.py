"""Invite redemption: a joiner trades an invite's grant for a membership of its own peer id.

Why its own protocol: the hello needs a membership, and a joiner has none yet. So before its
node starts, the joiner dials the node the grant names (``Grant.issuer``) from a throwaway
host with its own key, and opens ``MEMBERSHIP_PROTOCOL`` (the gate lets it through, and only
nodes able to issue serve it). The issuer checks the grant (signature, network, expiry, that
it is the issuer named, uses counted per joiner and persisted in its home before it answers)
and signs a membership for the peer id of the secured connection, never one named in the
message. The answer also carries the revocations the issuer knows.

Contract:
- ``serve_redemption(members, issuer, here, home)`` (``here``: this node's peer id, the one
  a grant must name) -> the stream handler (one request frame
  ``RedeemRequest``, one answer ``RedeemAnswer``: ``member`` or ``error``).
- ``redeem_invite(key, grant, addrs, network_key) -> Redeemed`` (membership bytes verified
  for ``key``'s peer id, revocations); ``RedemptionFailed`` (an ``OverlayError``) with the
  issuer's reason (at once), or why it could not be reached: rounds over ``addrs`` with
  jittered backoff for up to ``REDEEM_PATIENCE_S`` (a busy issuer is retried), or
  ``REDEEM_REFUSED_ROUNDS`` rounds in a row where nothing listens.
"""

from __future__ import annotations

import logging
import random
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import PeerInfo

from p2pnode.identity import NodeKey
from p2pnode.identity.memberhome import GrantLedger
from p2pnode.identity.membership import (
    DEFAULT_MEMBERSHIP_TTL,
    Grant,
    Issuer,
    MembershipError,
    issue_membership,
    verify_grant,
    verify_membership,
)
from p2pnode.overlay._errors import OverlayError
from p2pnode.overlay.net.members import MEMBERSHIP_PROTOCOL, Members
from p2pnode.overlay.seams import StreamHandler
from p2pnode.overlay.wire import bounded_field, from_wire, message, read_frame, to_wire, write_frame

__all__ = ["Redeemed", "RedemptionFailed", "redeem_invite", "serve_redemption"]

logger = logging.getLogger(__name__)

MAX_CREDENTIAL = 2048
MAX_ANSWER_REVOCATIONS = 256
REQUEST_LIMIT = MAX_CREDENTIAL + 64
ANSWER_LIMIT = MAX_CREDENTIAL + 512 + MAX_ANSWER_REVOCATIONS * (MAX_CREDENTIAL + 8)
REDEEM_TIMEOUT_S = 10.0
# An issuer that a join storm keeps busy turns dials away at once (patches/busy.py), in no
# order: the joiner tries again, jittered, at least every REDEEM_MAX_BACKOFF_S (a turned-away
# dial costs the issuer an accept and a close), for up to REDEEM_PATIENCE_S. Measured: 64
# joiners redeeming at once, one still turned away 7 times over a minute. An address where
# nothing listens (connection refused) REDEEM_REFUSED_ROUNDS times in a row ends it sooner.
REDEEM_BACKOFF_S = 0.5
REDEEM_MAX_BACKOFF_S = 4.0
REDEEM_PATIENCE_S = 300.0
REDEEM_REFUSED_ROUNDS = 3


class RedemptionFailed(OverlayError):
    """The invite could not be redeemed; the message says why."""

    reason = "redemption_failed"


@message("redeem")
class RedeemRequest:
    grant: bytes = bounded_field(max_len=MAX_CREDENTIAL)


@message("redeemed")
class RedeemAnswer:
    member: bytes | None = bounded_field(default=None, max_len=MAX_CREDENTIAL)
    error: str | None = bounded_field(default=None, max_len=256)
    revocations: tuple[bytes, ...] = bounded_field(
        default=(), max_len=MAX_ANSWER_REVOCATIONS, item_max_len=MAX_CREDENTIAL
    )


@dataclass(frozen=True)
class Redeemed:
    membership: bytes
    revocations: tuple[bytes, ...]


def _grant_for(
    issuer: Issuer, here: str, members: Members, ledger: GrantLedger, raw: bytes, joiner: str
) -> bytes:
    """The membership ``raw`` (a grant) buys ``joiner``; ``MembershipError`` says why not."""
    grant: Grant = verify_grant(raw, issuer.network, time.time(), members.revoked)
    if grant.issuer != here:
        raise MembershipError(f"the invite is to be redeemed at {grant.issuer}, not here")
    if grant.admin and issuer.admin is not None:
        raise MembershipError("an admin member cannot make admins (one level of admins)")
    if joiner in members.revoked:
        raise MembershipError("this peer has been revoked from the network")
    if not ledger.redeem(grant.nonce, joiner, grant.max_uses):
        raise MembershipError("the invite's uses are spent: ask for a new one")
    cred = issue_membership(
        issuer, joiner, admin=grant.admin, ttl=DEFAULT_MEMBERSHIP_TTL, now=time.time()
    )
    return cred.raw


def serve_redemption(
    members: Members, issuer: Issuer, here: str, home: Path | None
) -> StreamHandler:
    """The handler of ``MEMBERSHIP_PROTOCOL`` on a node able to issue (module contract)."""
    ledger = GrantLedger(home)

    async def handle(stream: INetStream) -> None:
        joiner = stream.muxed_conn.peer_id.to_base58()  # the secured connection's, not claimed
        with trio.fail_after(REDEEM_TIMEOUT_S):
            obj = await read_frame(stream, limit=REQUEST_LIMIT)
            if obj is None:
                return
            request = from_wire(obj, RedeemRequest)
            try:
                member = _grant_for(issuer, here, members, ledger, request.grant, joiner)
            except MembershipError as exc:
                logger.info("refused an invite of %s: %s", joiner, exc)
                answer = RedeemAnswer(error=str(exc)[:256])
            else:
                logger.info("peer %s joined the network with an invite", joiner)
                answer = RedeemAnswer(
                    member=member, revocations=members.revocation_raws(MAX_ANSWER_REVOCATIONS)
                )
            await write_frame(stream, to_wire(answer), limit=ANSWER_LIMIT)

    return handle


async def redeem_invite(
    key: NodeKey, grant: bytes, addrs: list[str], network_key: bytes
) -> Redeemed:
    """Redeem ``grant`` at the first of ``addrs`` (the issuer's) that answers."""
    from p2pnode.overlay.net.dialing import jittered, parse_peer_addr
    from p2pnode.overlay.net.host import make_host, parse_multiaddr

    host = make_host(key, ["/ip4/127.0.0.1/tcp/0"])
    errors: list[str] = []
    # Outcomes leave the host's nursery as values: raised inside, they would come out wrapped.
    outcome: Redeemed | RedemptionFailed | None = None
    rng = random.Random()
    refused_in_a_row = 0
    async with host.run(listen_addrs=[parse_multiaddr("/ip4/127.0.0.1/tcp/0")]):
        delay = REDEEM_BACKOFF_S
        deadline = trio.current_time() + REDEEM_PATIENCE_S
        while outcome is None and trio.current_time() < deadline:
            if errors:
                await trio.sleep(jittered(delay, rng))
                delay = min(2 * delay, REDEEM_MAX_BACKOFF_S)
            refused = 0
            for addr in addrs:
                info = parse_peer_addr(addr)
                # libp2p refuses for a minute to dial a peer whose addresses all failed once.
                unblock = getattr(host.get_network(), "unblock_peer", None)
                if unblock is not None:
                    unblock(info.peer_id)
                try:
                    answer = await _ask(host, info, grant)
                except (Exception, trio.TooSlowError) as exc:
                    errors.append(f"{addr}: {exc!r}")
                    refused += _nothing_listens(exc)
                    continue
                outcome = _outcome(answer, key, network_key)
                break
            # Nothing listens at any address (not a busy issuer, which greets and closes):
            # a few such rounds are enough to say so.
            refused_in_a_row = refused_in_a_row + 1 if refused == len(addrs) else 0
            if refused_in_a_row >= REDEEM_REFUSED_ROUNDS:
                break
    if outcome is None:
        raise RedemptionFailed(
            "could not reach the inviting node to redeem the invite (is it running?): "
            + "; ".join(errors[-len(addrs) :])[:400]
        )
    if isinstance(outcome, RedemptionFailed):
        raise outcome
    return outcome


def _nothing_listens(exc: BaseException, depth: int = 0) -> bool:
    """Was the dial refused by the OS (no listener)? libp2p wraps that in several layers."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    if depth >= 8:
        return False
    inner = list(getattr(exc, "exceptions", None) or getattr(exc, "errors", None) or [])
    inner.append(exc.__cause__ or exc.__context__)
    return any(e is not None and _nothing_listens(e, depth + 1) for e in inner)


async def _ask(host: IHost, info: PeerInfo, grant: bytes) -> RedeemAnswer:
    try:
        with trio.fail_after(REDEEM_TIMEOUT_S):
            await host.connect(info)
            stream = await host.new_stream(info.peer_id, [TProtocol(MEMBERSHIP_PROTOCOL)])
            await write_frame(stream, to_wire(RedeemRequest(grant=grant)), limit=REQUEST_LIMIT)
            obj = await read_frame(stream, limit=ANSWER_LIMIT)
    finally:
        with trio.move_on_after(2), suppress(Exception):
            await host.disconnect(info.peer_id)
    if obj is None:
        raise OverlayError("closed without an answer")
    return from_wire(obj, RedeemAnswer)


def _outcome(answer: RedeemAnswer, key: NodeKey, network_key: bytes) -> Redeemed | RedemptionFailed:
    if answer.error is not None or answer.member is None:
        return RedemptionFailed(f"the inviting node refused the invite: {answer.error}")
    try:
        verify_membership(answer.member, network_key, key.peer_id, time.time())
    except MembershipError as exc:
        return RedemptionFailed(f"the inviting node sent a bad membership: {exc}")
    return Redeemed(answer.member, answer.revocations)
