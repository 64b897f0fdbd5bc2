"""Errors raised by ``p2pnode.identity``.

Every failure to parse, verify or accept something a peer sent is an ``IdentityError``; callers
that only need "drop it and maybe penalise the sender" catch that one class. Each class's
``reason`` (see ``p2pnode.errors``) is the label callers count drops under: the digest layer
passes ``oversized``, ``malformed``, ``bad_signature``, ``expired`` and ``wrong_signer`` on as
its own drop reasons, so those slugs are metric labels and stay as they are.
"""

from __future__ import annotations

from p2pnode.errors import P2PNodeError


class IdentityError(P2PNodeError):
    """Base class of every identity, envelope and record failure."""

    reason = "identity_error"


class MalformedEnvelope(IdentityError):
    """The bytes are not a well-formed envelope or record (size, CBOR, field types, bounds)."""

    reason = "malformed"


class EnvelopeTooLarge(MalformedEnvelope):
    """The envelope is larger than the caller's ``max_size``; it was not decoded."""

    reason = "oversized"


class InvalidRecord(MalformedEnvelope):
    """A node record's fields are out of their allowed types or bounds."""

    reason = "invalid_record"


class BadSignature(IdentityError):
    """The signature does not verify for this key, kind and content."""

    reason = "bad_signature"


class UnknownKind(IdentityError):
    """The envelope kind is not registered (see ``register_kind``)."""

    reason = "unknown_kind"


class ExpiredEnvelope(IdentityError):
    """The envelope's timestamp is older than ``max_age`` or too far in the future."""

    reason = "expired"


class WrongSigner(IdentityError):
    """The envelope was signed by a key other than the one required."""

    reason = "wrong_signer"


class StaleRecord(IdentityError):
    """A node record is not newer (by ``seq``) than the one already known for that peer."""

    reason = "stale"


class InsecureKeyFile(IdentityError):
    """The node key file can be read by other users, or is not a regular file."""

    reason = "insecure_key_file"
