"""Errors raised by ``p2pnode.identity``.

Every failure to parse, verify or accept something a peer sent is an ``IdentityError``; callers
that only need "drop it and maybe penalise the sender" catch that one class.
"""

from __future__ import annotations


class IdentityError(Exception):
    """Base class of every identity, envelope and record failure."""


class MalformedEnvelope(IdentityError):
    """The bytes are not a well-formed envelope or record (size, CBOR, field types, bounds)."""


class EnvelopeTooLarge(MalformedEnvelope):
    """The envelope is larger than the caller's ``max_size``; it was not decoded."""


class InvalidRecord(MalformedEnvelope):
    """A node record's fields are out of their allowed types or bounds."""


class BadSignature(IdentityError):
    """The signature does not verify for this key, kind and content."""


class UnknownKind(IdentityError):
    """The envelope kind is not registered (see ``register_kind``)."""


class ExpiredEnvelope(IdentityError):
    """The envelope's timestamp is older than ``max_age`` or too far in the future."""


class WrongSigner(IdentityError):
    """The envelope was signed by a key other than the one required."""


class StaleRecord(IdentityError):
    """A node record is not newer (by ``seq``) than the one already known for that peer."""


class InsecureKeyFile(IdentityError):
    """The node key file can be read by other users, or is not a regular file."""
