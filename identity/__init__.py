"""p2pnode.identity: node keys, peer ids, signed envelopes and node records.

Imports nothing else of p2pnode and not libp2p. Everything public is re-exported here:
``from p2pnode.identity import NodeKey, seal, open_envelope, ...``.
"""

from p2pnode.identity.envelope import (
    DEFAULT_MAX_AGE,
    DEFAULT_MAX_SIZE,
    KINDS,
    MAX_FUTURE_SKEW,
    Opened,
    domain_tag,
    known_kinds,
    open_envelope,
    register_kind,
    seal,
)
from p2pnode.identity.errors import (
    BadSignature,
    EnvelopeTooLarge,
    ExpiredEnvelope,
    IdentityError,
    InsecureKeyFile,
    InvalidRecord,
    MalformedEnvelope,
    StaleRecord,
    UnknownKind,
    WrongSigner,
)
from p2pnode.identity.keys import NodeKey, peer_id_from_public_key, verify_signature
from p2pnode.identity.records import (
    NODE_RECORD_KIND,
    NODE_RECORD_MAX_AGE,
    ROLES,
    NodeRecord,
    RecordBook,
    new_node_record,
    sign_node_record,
    verify_node_record,
)

__all__ = [
    "BadSignature",
    "DEFAULT_MAX_AGE",
    "DEFAULT_MAX_SIZE",
    "EnvelopeTooLarge",
    "ExpiredEnvelope",
    "IdentityError",
    "InsecureKeyFile",
    "InvalidRecord",
    "KINDS",
    "MAX_FUTURE_SKEW",
    "MalformedEnvelope",
    "NODE_RECORD_KIND",
    "NODE_RECORD_MAX_AGE",
    "NodeKey",
    "NodeRecord",
    "Opened",
    "ROLES",
    "RecordBook",
    "StaleRecord",
    "UnknownKind",
    "WrongSigner",
    "domain_tag",
    "known_kinds",
    "new_node_record",
    "open_envelope",
    "peer_id_from_public_key",
    "register_kind",
    "seal",
    "sign_node_record",
    "verify_node_record",
    "verify_signature",
]
