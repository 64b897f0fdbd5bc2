"""Invites: one copy-pasteable string that says how to join a network.

``p2pnode invite`` on a running node prints ``make_invite(...)``; ``p2pnode join --invite S``
reads it with ``parse_invite``. The string is ``p2pnode-invite-1.`` followed by unpadded
base64url of a CBOR map: network id ``n``, protocol version ``v``, bootstrap multiaddrs ``b``
(each ending in /p2p/<peer id>, the addresses the inviting node advertises). It carries no
secret: anyone holding it can join, as with a bootstrap address. ``InviteError`` says what
is wrong with a string (cut short, another protocol version, no address).
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


def make_invite(network: str, version: str, bootstrap: list[str]) -> str:
    addrs = [a for a in bootstrap if "/p2p/" in a][:MAX_BOOTSTRAP]
    if not addrs:
        raise InviteError("no address to put in the invite (the node advertises none)")
    body = cbor2.dumps({"n": network, "v": version, "b": addrs})
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
    return Invite(network=network, version=version, bootstrap=tuple(bootstrap))
