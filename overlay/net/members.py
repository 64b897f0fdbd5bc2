"""Who belongs to a closed network, as one node knows it: the verdict on each peer's
membership, the revocations it applies, and the gate's per-peer wait.

Why a module: the hello (``hello.py``) carries the credential, admission (``admission.py``)
asks for the verdict, the gate (``patches/gate.py``) holds every other protocol until there
is one, and the trust code asks ``is_member`` (``seams.Membership``). One object holds it.

Contract:
- ``ClosedNetwork(network_key, membership, issuer=None, home=None)``: the network public key,
  our own signed membership, an ``Issuer`` when this node may issue (network key holder or
  admin member; it then serves invites, ``redemption.py``), and the home whose revocations
  persist. ``OverlayConfig.closed`` holds one; None is an open network.
- ``Members(closed)``: ``closed`` (bool), ``is_member(pid)`` (a peer whose membership we
  verified, or ourselves; always False in an open network), ``check(pid, raw) -> str | None``
  (why a peer's credential is refused, or None: it is then a member), ``admitted(pid)``,
  ``settle(pid)`` (the verdict is in, admitted or not: wakes ``wait_verdict``),
  ``wait_verdict(pid) -> bool`` (bounded by ``VERDICT_TIMEOUT_S``); ``expired()``: the
  members whose membership ran out since (the node closes their connections each second).
- Revocations: ``learn_all(raws)`` (oldest first, whatever the order given) and
  ``learn(raw) -> Revocation | None`` verifies one and applies it (new ones
  only: the peer leaves the members, ``on_revoked(pid)`` callbacks run, the home file is
  rewritten); ``revocation_raws(limit)`` the newest ones, for hellos and redemptions.
  Revocations are loaded from the home at start. ``status()``: plain data for the node's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import trio

from p2pnode.identity.memberhome import MAX_REVOCATIONS, MemberHome
from p2pnode.identity.membership import (
    Issuer,
    Membership,
    MembershipError,
    Revocation,
    network_id_of,
    parse_revocation,
    verify_membership,
    verify_revocation,
)
from p2pnode.overlay.net.hello import HELLO_PROTOCOL

__all__ = ["MEMBERSHIP_PROTOCOL", "VERDICT_TIMEOUT_S", "ClosedNetwork", "Members"]

# Invite redemption (``redemption.py``): the one protocol besides the hello a non-member may
# open, served only by nodes able to issue.
MEMBERSHIP_PROTOCOL = "/p2pnode/membership/1"


logger = logging.getLogger(__name__)

# A peer that sent no hello within this long is not going to: its streams are reset.
VERDICT_TIMEOUT_S = 10.0


@dataclass
class ClosedNetwork:
    network_key: bytes  # the network's public key
    membership: bytes  # our own signed membership
    issuer: Issuer | None = None
    home: Path | None = None

    @property
    def network_id(self) -> str:
        return network_id_of(self.network_key)


class Members:
    """The membership verdicts and revocations of one node (see the module contract)."""

    def __init__(self, closed: ClosedNetwork | None, own_peer_id: str) -> None:
        self.config = closed
        self._own = own_peer_id
        self._members: dict[str, Membership] = {}
        self._denied: set[str] = set()
        self.exempt = frozenset({HELLO_PROTOCOL, MEMBERSHIP_PROTOCOL})
        self._verdicts: dict[str, trio.Event] = {}
        self._revocations: dict[str, Revocation] = {}
        self.on_revoked: list[Callable[[str], None]] = []
        self._home = MemberHome(closed.home) if closed and closed.home else None
        if closed is not None and self._home is not None:
            self.learn_all(self._home.revocations(), persist=False)

    @property
    def closed(self) -> bool:
        return self.config is not None

    @property
    def revoked(self) -> frozenset[str]:
        return frozenset(self._revocations)

    def is_member(self, peer_id: str) -> bool:
        if self.config is None or peer_id in self._revocations:
            return False
        if peer_id == self._own:
            return True
        cred = self._members.get(peer_id)
        return cred is not None and cred.expires > time.time()

    def admitted(self, peer_id: str) -> bool:
        return self.is_member(peer_id)

    def check(self, peer_id: str, raw: bytes | None) -> str | None:
        """Why ``peer_id``'s credential is refused, or None (it is a member from now on)."""
        assert self.config is not None
        if not raw:
            return "it has no membership of this closed network"
        try:
            cred = verify_membership(
                raw, self.config.network_key, peer_id, time.time(), self._revocations.keys()
            )
        except MembershipError as exc:
            return f"its membership is refused: {exc}"
        self._members[peer_id] = cred
        self._denied.discard(peer_id)
        return None

    def deny(self, peer_id: str) -> None:
        """``peer_id`` is refused: not a member, and gate waits for it end at once."""
        self._members.pop(peer_id, None)
        self._denied.add(peer_id)
        self.settle(peer_id)

    def expired(self) -> list[str]:
        """Members whose membership has expired since we admitted them (dropped from ours)."""
        now = time.time()
        gone = [pid for pid, cred in self._members.items() if cred.expires <= now]
        for pid in gone:
            del self._members[pid]
        return gone

    def settle(self, peer_id: str) -> None:
        """The verdict on ``peer_id`` is in (either way): release whoever waits for it."""
        event = self._verdicts.pop(peer_id, None)
        if event is not None:
            event.set()

    async def wait_verdict(self, peer_id: str) -> bool:
        """Wait (bounded) for ``peer_id``'s hello verdict; True when it was admitted."""
        if self.admitted(peer_id):
            return True
        if peer_id in self._denied:
            return False
        event = self._verdicts.get(peer_id)
        if event is None:
            event = self._verdicts[peer_id] = trio.Event()
        with trio.move_on_after(VERDICT_TIMEOUT_S):
            await event.wait()
        return self.admitted(peer_id)

    # -- revocations ----------------------------------------------------------------------

    def learn_all(self, raws: Iterable[bytes], *, persist: bool = True) -> None:
        """Learn several, oldest first: an admin's revocations made before it was itself
        revoked stay valid, whatever order they arrive in."""
        parsed = []
        for raw in raws:
            try:
                parsed.append((parse_revocation(raw).issued, raw))
            except MembershipError:
                continue
        for _issued, raw in sorted(parsed, key=lambda item: item[0]):
            self.learn(raw, persist=persist)

    def learn(self, raw: bytes, *, persist: bool = True) -> Revocation | None:
        """Verify and apply one revocation; None when it is invalid or known already."""
        if self.config is None:
            return None
        try:
            rev = verify_revocation(
                raw, self.config.network_key, time.time(), self._revocations.keys()
            )
        except MembershipError as exc:
            logger.info("dropped a revocation: %s", exc)
            return None
        if rev.peer in self._revocations or len(self._revocations) >= MAX_REVOCATIONS:
            return None
        self._revocations[rev.peer] = rev
        self._members.pop(rev.peer, None)
        # Members an admin admitted fall with their admin.
        for pid, cred in list(self._members.items()):
            if cred.parent is not None and cred.parent.member == rev.peer:
                del self._members[pid]
                self._revoke_effects(pid)
        if persist and self._home is not None:
            self._home.save_revocations([r.raw for r in self._revocations.values()])
        if rev.peer == self._own:
            logger.error("this node's membership has been revoked from the network")
        else:
            logger.warning("peer %s revoked from the network", rev.peer)
        self._revoke_effects(rev.peer)
        return rev

    def _revoke_effects(self, peer_id: str) -> None:
        self.settle(peer_id)
        if peer_id == self._own:
            return
        for callback in self.on_revoked:
            callback(peer_id)

    def status(self) -> dict[str, object]:
        """Plain data for the node's status: open or closed, and who we know of."""
        if self.config is None:
            return {"closed": False}
        now = time.time()
        return {
            "closed": True,
            "network_key": self.config.network_id,
            "may_issue": self.config.issuer is not None,
            "members_known": sum(1 for c in self._members.values() if c.expires > now),
            "revoked": sorted(self._revocations),
        }

    def revocation_raws(self, limit: int) -> tuple[bytes, ...]:
        newest = sorted(self._revocations.values(), key=lambda r: r.issued, reverse=True)
        return tuple(r.raw for r in newest[:limit])
