"""Invites: one copy-pasteable string that says how to join a network.

``p2pnode invite`` on a running node prints ``make_invite(...)``; ``p2pnode join --invite S``
reads it with ``parse_invite``. The string is ``p2pnode-invite-1.`` followed by unpadded
base64url of a CBOR map: network id ``n``, protocol version ``v``, bootstrap multiaddrs ``b``
(each ending in /p2p/<peer id>, the addresses the inviting node advertises). An open
network's invite carries no secret: anyone holding it can join, as with a bootstrap address.
A closed network's invite (``p2pnode bootstrap`` without ``--open``) adds the network's public
key ``k`` and a signed grant ``g`` (identity/membership.py) that the inviting node trades for
a membership once per joiner (overlay/net/redemption.py): keep it as secret as its uses.
``InviteError`` says what is wrong with a string (cut short, another protocol version, no
address, a grant that is expired or not signed for that network).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import cbor2

from p2pnode.errors import P2PNodeError

__all__ = ["INVITE_PREFIX", "Invite", "InviteError", "make_invite", "parse_invite"]

INVITE_PREFIX = "p2pnode-invite-1."
MAX_INVITE_CHARS = 8192
MAX_BOOTSTRAP = 16


class InviteError(P2PNodeError, ValueError):
    """An invite string cannot be used; the message says why."""

    reason = "bad_invite"


@dataclass(frozen=True)
class Invite:
    network: str
    version: str
    bootstrap: tuple[str, ...]
    network_key: bytes | None = None  # closed networks: the network's public key
    grant: bytes | None = None  # closed networks: the signed grant to redeem

    @property
    def closed(self) -> bool:
        return self.grant is not None


def make_invite(
    network: str,
    version: str,
    bootstrap: list[str],
    *,
    network_key: bytes | None = None,
    grant: bytes | None = None,
) -> str:
    addrs = [a for a in bootstrap if "/p2p/" in a][:MAX_BOOTSTRAP]
    if not addrs:
        raise InviteError("no address to put in the invite (the node advertises none)")
    fields: dict[str, object] = {"n": network, "v": version, "b": addrs}
    if grant is not None:
        fields.update(k=network_key, g=grant)
    body = cbor2.dumps(fields)
    return INVITE_PREFIX + base64.urlsafe_b64encode(body).decode().rstrip("=")


def parse_invite(text: str, *, expected_version: str | None = None) -> Invite:
    from p2pnode.overlay.net.hello import check_network_id
    from p2pnode.overlay.net.node import VERSION

    text = text.strip()
    if not text.startswith(INVITE_PREFIX):
        raise InviteError(f"an invite starts with {INVITE_PREFIX!r}; copy the whole string")
    if len(text) > MAX_INVITE_CHARS:
        raise InviteError(f"an invite is at most {MAX_INVITE_CHARS} characters")
    payload = text[len(INVITE_PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        obj = cbor2.loads(raw)
    except (binascii.Error, ValueError, cbor2.CBORDecodeError):
        raise InviteError("the invite is damaged or cut short; copy it again") from None
    if not isinstance(obj, dict) or not {"n", "v", "b"} <= obj.keys():
        raise InviteError("the invite is damaged (fields missing); copy it again")
    network, version, bootstrap = obj["n"], obj["v"], obj["b"]
    if not (isinstance(bootstrap, list) and all(isinstance(a, str) for a in bootstrap)):
        raise InviteError("the invite is damaged (bootstrap addresses); copy it again")
    if not bootstrap or len(bootstrap) > MAX_BOOTSTRAP:
        raise InviteError(f"an invite holds 1-{MAX_BOOTSTRAP} bootstrap addresses")
    try:
        check_network_id(network)
    except ValueError as exc:
        raise InviteError(str(exc)) from None
    ours = expected_version or VERSION
    if version != ours:
        raise InviteError(
            f"the invite is for protocol {version!r} but this node speaks {ours!r}: "
            "run the same p2pnode release as the network"
        )
    network_key, grant = obj.get("k"), obj.get("g")
    if grant is None:
        return Invite(network=network, version=version, bootstrap=tuple(bootstrap))
    return Invite(
        network=network,
        version=version,
        bootstrap=tuple(bootstrap),
        network_key=network_key,
        grant=_checked_grant(network_key, grant),
    )


def _checked_grant(network_key: object, grant: object) -> bytes:
    """The grant, if it is signed for ``network_key`` and not expired (checked here, so a
    joiner learns at once, not from the inviting node)."""
    import time

    from p2pnode.identity.membership import MembershipError, verify_grant

    if not isinstance(network_key, bytes) or not isinstance(grant, bytes):
        raise InviteError("the invite is damaged (network key or grant); copy it again")
    try:
        verify_grant(grant, network_key, time.time())
    except MembershipError as exc:
        raise InviteError(str(exc)) from None
    return grant
