"""Closed networks: the network key, membership credentials, invite grants and revocations.

Why: an address alone let anyone join. A closed network has one Ed25519 network key (made by
``p2pnode bootstrap``, kept in its home, never sent); a node is a member when it holds a
``Membership`` naming its peer id, signed by the network key or by an admin member. Invites
carry a ``Grant`` (a signed promise of a membership), redeemed once per joiner; admins sign
``Revocation``s that every member applies.

Contract:
- ``load_or_create_network_key(home)`` / ``load_network_key(home)``: ``home/network_key``
  (32-byte seed, mode 0600, same rules as the node key); the latter returns None when absent.
- ``Issuer``: who signs: the network key itself (``Issuer(key)``) or an admin member
  (``Issuer(node_key, admin=<its admin Membership>)``). ``issue_membership``,
  ``issue_grant`` and ``issue_revocation`` return signed bytes (``Membership.raw`` etc.).
- ``parse_membership`` / ``parse_grant`` / ``parse_revocation`` decode (bounded sizes; only
  the shape is checked); ``verify_membership(cred, network_pub, peer_id, now, revoked)``,
  ``verify_grant(grant, network_pub, now, revoked)`` and ``verify_revocation(rev,
  network_pub, now, revoked)`` check signatures, the admin chain (depth 1: an admin's
  membership must be signed by the network key), expiry, network and peer, and return the
  parsed object. Each failure is a ``MembershipError`` (``p2pnode.errors`` root) whose class
  and message say which: ``MalformedCredential``, ``CredentialExpired``, ``WrongNetwork``,
  ``WrongMember``, ``BadCredentialSignature``, ``RevokedCredential``.
- ``network_id_of(network_pub)``: the short printable form of a network key (its peer id).
- Signatures are domain separated (``p2pnode/v1/<kind>\\0``): a grant never verifies as a
  membership, nor a revocation as either.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from p2pnode.identity import plaincbor
from p2pnode.identity.errors import BadSignature, IdentityError
from p2pnode.identity.keys import (
    PUBLIC_KEY_SIZE,
    SEED_SIZE,
    SIGNATURE_SIZE,
    NodeKey,
    _create_key_file,
    _read_key_file,
    peer_id_from_public_key,
    verify_signature,
)

__all__ = [
    "DEFAULT_GRANT_TTL",
    "DEFAULT_MEMBERSHIP_TTL",
    "MAX_CREDENTIAL_SIZE",
    "NETWORK_KEY_FILE",
    "BadCredentialSignature",
    "CredentialExpired",
    "Grant",
    "Issuer",
    "MalformedCredential",
    "Membership",
    "MembershipError",
    "Revocation",
    "RevokedCredential",
    "WrongMember",
    "WrongNetwork",
    "issue_grant",
    "issue_membership",
    "issue_revocation",
    "load_network_key",
    "load_or_create_network_key",
    "network_id_of",
    "parse_grant",
    "parse_membership",
    "parse_revocation",
    "verify_grant",
    "verify_membership",
    "verify_revocation",
]

NETWORK_KEY_FILE = "network_key"
DEFAULT_MEMBERSHIP_TTL = 365 * 86400.0
DEFAULT_GRANT_TTL = 7 * 86400.0
# One signed credential with its admin's membership inside: ~0.5 KB. Bounded well above.
MAX_CREDENTIAL_SIZE = 2048
MAX_PEER_ID_LEN = 64
NONCE_SIZE = 16
MAX_USES = 1_000_000
_DOMAIN = b"p2pnode/v1/"


class MembershipError(IdentityError):
    """A credential, grant or revocation cannot be accepted; the message says why."""

    reason = "membership"


class MalformedCredential(MembershipError):
    """Not a well-formed credential, grant or revocation (size, CBOR, fields, bounds)."""

    reason = "malformed_credential"


class CredentialExpired(MembershipError):
    """Past its expiry."""

    reason = "credential_expired"


class WrongNetwork(MembershipError):
    """Signed for another network, or by a key that is not the network's."""

    reason = "wrong_network"


class WrongMember(MembershipError):
    """Names another peer than the one presenting it."""

    reason = "wrong_member"


class BadCredentialSignature(MembershipError, BadSignature):
    """The signature does not verify, or the signer may not sign it."""

    reason = "bad_credential_signature"


class RevokedCredential(MembershipError):
    """The member, or the admin who signed it, has been revoked."""

    reason = "revoked"


# -- the network key ----------------------------------------------------------------------


def load_network_key(home: Path) -> NodeKey | None:
    """The network key kept in ``home``, or None when this home holds none."""
    path = Path(home) / NETWORK_KEY_FILE
    try:
        return NodeKey(_read_key_file(path))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise IdentityError(f"cannot read the network key {path}: {exc}") from exc


def load_or_create_network_key(home: Path) -> NodeKey:
    """``home/network_key``, created (mode 0600) with a fresh key if absent."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = load_network_key(home)
    if key is not None:
        return key
    try:
        _create_key_file(home / NETWORK_KEY_FILE, secrets.token_bytes(SEED_SIZE))
    except OSError as exc:
        raise IdentityError(f"cannot create the network key in {home}: {exc}") from exc
    created = load_network_key(home)  # read back: a concurrent creator may have won
    assert created is not None
    return created


def network_id_of(network_pub: bytes) -> str:
    """Printable form of a network public key (the peer id it would have)."""
    return peer_id_from_public_key(network_pub)


# -- what is signed -------------------------------------------------------------------------


@dataclass(frozen=True)
class Membership:
    network: bytes  # the network public key
    member: str  # peer id
    admin: bool
    expires: float  # unix s
    issuer: bytes  # public key that signed: the network key, or an admin member's node key
    parent: Membership | None  # the admin's own membership when an admin signed
    raw: bytes  # the signed bytes, as sent


@dataclass(frozen=True)
class Grant:
    network: bytes
    expires: float
    max_uses: int | None  # None: any number of joiners until it expires
    admin: bool  # the membership redeemed is an admin one
    nonce: bytes  # names the grant: uses are counted per nonce
    issuer: str  # peer id of the node that redeems it (it counts the uses)
    signer: bytes  # the network key, or the issuing admin's node key
    parent: Membership | None
    raw: bytes


@dataclass(frozen=True)
class Revocation:
    network: bytes
    peer: str  # the revoked peer id
    issued: float
    signer: bytes
    parent: Membership | None
    raw: bytes


@dataclass(frozen=True)
class Issuer:
    """A signer: the network key (``admin`` None) or an admin member (its node key and its
    admin membership)."""

    key: NodeKey
    admin: Membership | None = None

    def __post_init__(self) -> None:
        if self.admin is not None and (
            not self.admin.admin or self.admin.member != self.key.peer_id
        ):
            raise MembershipError(
                "only an admin member may issue: this membership is not an admin one of this key"
            )

    @property
    def network(self) -> bytes:
        return self.admin.network if self.admin is not None else self.key.public_key


def _sign(kind: str, issuer: Issuer, fields: dict[str, object]) -> bytes:
    parent = issuer.admin.raw if issuer.admin is not None else None
    body = plaincbor.encode({**fields, "signer": issuer.key.public_key, "parent": parent})
    sig = issuer.key.sign(_DOMAIN + kind.encode() + b"\0" + body)
    return plaincbor.encode([body, sig])


def issue_membership(
    issuer: Issuer,
    member: str,
    *,
    admin: bool = False,
    ttl: float = DEFAULT_MEMBERSHIP_TTL,
    now: float,
) -> Membership:
    expires = now + ttl
    if issuer.admin is not None:
        expires = min(expires, issuer.admin.expires)  # never outlives its admin's own
    raw = _sign(
        "membership",
        issuer,
        {"network": issuer.network, "member": member, "admin": admin, "expires": expires},
    )
    return parse_membership(raw)


def issue_grant(
    issuer: Issuer,
    redeemer: str,
    *,
    admin: bool = False,
    max_uses: int | None = None,
    ttl: float = DEFAULT_GRANT_TTL,
    now: float,
) -> Grant:
    if max_uses is not None and not 1 <= max_uses <= MAX_USES:
        raise MembershipError(f"an invite's uses are 1-{MAX_USES}, got {max_uses}")
    if not (math.isfinite(ttl) and ttl > 0):
        raise MembershipError(f"an invite's lifetime must be positive, got {ttl}")
    raw = _sign(
        "grant",
        issuer,
        {
            "network": issuer.network,
            "expires": now + ttl,
            "uses": max_uses,
            "admin": admin,
            "nonce": os.urandom(NONCE_SIZE),
            "issuer": redeemer,
        },
    )
    return parse_grant(raw)


def issue_revocation(issuer: Issuer, peer: str, *, now: float) -> Revocation:
    raw = _sign("revocation", issuer, {"network": issuer.network, "peer": peer, "issued": now})
    return parse_revocation(raw)


# -- decoding (shape only) ------------------------------------------------------------------


def _open(raw: object, kind: str, keys: frozenset[str]) -> tuple[dict[str, object], bytes, bytes]:
    """(fields, body, sig) of a signed ``kind``; shape only, the signature is not checked."""
    if not isinstance(raw, bytes):
        raise MalformedCredential(f"a {kind} is bytes, got {type(raw).__name__}")
    if len(raw) > MAX_CREDENTIAL_SIZE:
        raise MalformedCredential(
            f"a {kind} is at most {MAX_CREDENTIAL_SIZE} bytes, got {len(raw)}"
        )
    try:
        outer = plaincbor.decode(raw, max_depth=4)
        if not (isinstance(outer, list) and len(outer) == 2):
            raise MalformedCredential(f"a {kind} is [body, signature]")
        body, sig = outer
        if not isinstance(body, bytes) or not isinstance(sig, bytes) or len(sig) != SIGNATURE_SIZE:
            raise MalformedCredential(f"a {kind}'s body or signature has the wrong type or size")
        fields = plaincbor.decode(body, max_depth=4)
    except plaincbor.PlainCBORError as exc:
        raise MalformedCredential(f"a {kind} that is not valid CBOR: {exc}") from None
    want = keys | {"network", "signer", "parent"}
    if not isinstance(fields, dict) or set(fields) != want:
        raise MalformedCredential(f"a {kind} has the fields {sorted(want)}")
    for name in ("network", "signer"):
        value = fields[name]
        if not isinstance(value, bytes) or len(value) != PUBLIC_KEY_SIZE:
            raise MalformedCredential(f"a {kind}'s {name} is a {PUBLIC_KEY_SIZE}-byte key")
    return fields, body, sig


def _time(value: object, what: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        raise MalformedCredential(f"{what} is a finite number of seconds")
    return float(value)  # type: ignore[arg-type]


def _peer(value: object, what: str) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_PEER_ID_LEN:
        raise MalformedCredential(f"{what} is a peer id of 1-{MAX_PEER_ID_LEN} characters")
    return value


def _bool(value: object, what: str) -> bool:
    if type(value) is not bool:
        raise MalformedCredential(f"{what} is true or false")
    return value


def _parent(value: object, kind: str) -> Membership | None:
    if value is None:
        return None
    parent = parse_membership(value)
    if parent.parent is not None:
        raise MalformedCredential(f"a {kind} signed by an admin of an admin (only one level)")
    return parent


def parse_membership(raw: object) -> Membership:
    fields, body, sig = _open(raw, "membership", frozenset({"member", "admin", "expires"}))
    cred = Membership(
        network=fields["network"],  # type: ignore[arg-type]
        member=_peer(fields["member"], "the member"),
        admin=_bool(fields["admin"], "admin"),
        expires=_time(fields["expires"], "expires"),
        issuer=fields["signer"],  # type: ignore[arg-type]
        parent=_parent(fields["parent"], "membership"),
        raw=raw,  # type: ignore[arg-type]
    )
    return cred


def parse_grant(raw: object) -> Grant:
    fields, _body, _sig = _open(
        raw, "grant", frozenset({"expires", "uses", "admin", "nonce", "issuer"})
    )
    uses = fields["uses"]
    if uses is not None and (type(uses) is not int or not 1 <= uses <= MAX_USES):
        raise MalformedCredential(f"an invite's uses are none or 1-{MAX_USES}")
    nonce = fields["nonce"]
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_SIZE:
        raise MalformedCredential(f"an invite's nonce is {NONCE_SIZE} bytes")
    return Grant(
        network=fields["network"],  # type: ignore[arg-type]
        expires=_time(fields["expires"], "expires"),
        max_uses=uses,
        admin=_bool(fields["admin"], "admin"),
        nonce=nonce,
        issuer=_peer(fields["issuer"], "the issuer"),
        signer=fields["signer"],  # type: ignore[arg-type]
        parent=_parent(fields["parent"], "grant"),
        raw=raw,  # type: ignore[arg-type]
    )


def parse_revocation(raw: object) -> Revocation:
    fields, _body, _sig = _open(raw, "revocation", frozenset({"peer", "issued"}))
    return Revocation(
        network=fields["network"],  # type: ignore[arg-type]
        peer=_peer(fields["peer"], "the revoked peer"),
        issued=_time(fields["issued"], "issued"),
        signer=fields["signer"],  # type: ignore[arg-type]
        parent=_parent(fields["parent"], "revocation"),
        raw=raw,  # type: ignore[arg-type]
    )


# -- verification ---------------------------------------------------------------------------


def _check_signature(kind: str, raw: bytes, signer: bytes) -> None:
    body, sig = plaincbor.decode(raw, max_depth=4)
    try:
        verify_signature(signer, sig, _DOMAIN + kind.encode() + b"\0" + body)
    except BadSignature:
        raise BadCredentialSignature(
            f"the {kind}'s signature does not verify (tampered, or not signed by the key it names)"
        ) from None


def _check_signer(
    kind: str,
    raw: bytes,
    signer: bytes,
    parent: Membership | None,
    network_pub: bytes,
    now: float,
    revoked: Collection[str],
) -> None:
    """The signature is the network key's, or an admin member's whose own membership (signed by
    the network key) is valid and not revoked."""
    if parent is None:
        if signer != network_pub:
            raise BadCredentialSignature(
                f"the {kind} is signed by {network_id_of(signer)}, neither the network key nor an "
                "admin member"
            )
    else:
        signer_id = peer_id_from_public_key(signer)
        if not parent.admin or parent.member != signer_id:
            raise BadCredentialSignature(
                f"the {kind} is signed by {signer_id}, whose membership is not an admin one"
            )
        try:
            _check_membership(parent, network_pub, signer_id, now, revoked)
        except MembershipError as exc:
            raise type(exc)(f"the {kind}'s issuing admin {signer_id}: {exc}") from None
        if parent.parent is not None:
            raise MalformedCredential(f"a {kind} signed by an admin of an admin (only one level)")
    _check_signature(kind, raw, signer)


def _check_membership(
    cred: Membership,
    network_pub: bytes,
    peer_id: str,
    now: float,
    revoked: Collection[str],
) -> None:
    if cred.network != network_pub:
        raise WrongNetwork(
            f"the membership is for network {network_id_of(cred.network)}, this one is "
            f"{network_id_of(network_pub)}"
        )
    if cred.member != peer_id:
        raise WrongMember(f"the membership names peer {cred.member}, not {peer_id}")
    if cred.member in revoked:
        raise RevokedCredential(f"peer {cred.member} has been revoked from this network")
    if cred.expires <= now:
        raise CredentialExpired(f"the membership of {cred.member} has expired")
    _check_signer("membership", cred.raw, cred.issuer, cred.parent, network_pub, now, revoked)
    if cred.parent is not None and cred.expires > cred.parent.expires:
        raise MalformedCredential("a membership that outlives its issuing admin's")


def verify_membership(
    cred: Membership | bytes,
    network_pub: bytes,
    peer_id: str,
    now: float,
    revoked: Collection[str] = frozenset(),
) -> Membership:
    """``cred`` parsed, if it makes ``peer_id`` a member of ``network_pub`` at ``now``; else a
    ``MembershipError`` saying why (see module contract)."""
    if not isinstance(cred, Membership):
        cred = parse_membership(cred)
    _check_membership(cred, network_pub, peer_id, now, revoked)
    return cred


def verify_grant(
    grant: Grant | bytes,
    network_pub: bytes,
    now: float,
    revoked: Collection[str] = frozenset(),
) -> Grant:
    if not isinstance(grant, Grant):
        grant = parse_grant(grant)
    if grant.network != network_pub:
        raise WrongNetwork(f"the invite is for network {network_id_of(grant.network)}")
    if grant.expires <= now:
        raise CredentialExpired("the invite has expired: ask for a new one")
    if grant.parent is not None and grant.issuer != grant.parent.member:
        raise WrongMember("the invite names another issuer than the admin who signed it")
    _check_signer("grant", grant.raw, grant.signer, grant.parent, network_pub, now, revoked)
    return grant


def verify_revocation(
    rev: Revocation | bytes,
    network_pub: bytes,
    now: float,
    revoked: Collection[str] = frozenset(),
) -> Revocation:
    if not isinstance(rev, Revocation):
        rev = parse_revocation(rev)
    if rev.network != network_pub:
        raise WrongNetwork(f"the revocation is for network {network_id_of(rev.network)}")
    _check_signer("revocation", rev.raw, rev.signer, rev.parent, network_pub, now, revoked)
    return rev
