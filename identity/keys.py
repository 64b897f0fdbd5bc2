"""Node keys (Ed25519) and libp2p-compatible peer ids.

Contract:
- A node's identity is one Ed25519 key. ``NodeKey.load_or_create(home)`` keeps its 32-byte
  private seed in ``home/node_key`` (raw bytes, mode 0600, created atomically: two processes
  racing on an empty home end up with the same key) and refuses a key file that group or
  others may read.
- ``peer_id`` is the libp2p peer id of the key: base58btc of the identity multihash of the
  protobuf ``PublicKey{Type=Ed25519, Data=pub}``. It equals libp2p's ``ID.from_pubkey``; this
  module does not import libp2p.
- ``verify_signature`` raises ``BadSignature`` (never returns False).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2pnode.identity.errors import BadSignature, IdentityError, InsecureKeyFile

KEY_FILE_NAME = "node_key"
SEED_SIZE = 32
PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
# protobuf PublicKey: field 1 (KeyType) varint = 1 (Ed25519), field 2 (Data) length-delimited 32.
_PROTO_ED25519_PREFIX = b"\x08\x01\x12\x20"
# multihash "identity" code 0x00; the protobuf key is 36 bytes, inlined rather than hashed.
_IDENTITY_MULTIHASH_PREFIX = b"\x00" + bytes([len(_PROTO_ED25519_PREFIX) + PUBLIC_KEY_SIZE])


def b58encode(data: bytes) -> str:
    """Base58btc (Bitcoin alphabet), as used for libp2p peer ids."""
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, rem = divmod(n, 58)
        out.append(_B58_ALPHABET[rem])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def peer_id_from_public_key(pub: bytes) -> str:
    """libp2p peer id (``12D3KooW...``) of a raw 32-byte Ed25519 public key."""
    if not isinstance(pub, bytes) or len(pub) != PUBLIC_KEY_SIZE:
        raise IdentityError(
            f"an Ed25519 public key is {PUBLIC_KEY_SIZE} raw bytes, got {_describe_len(pub)}"
        )
    return b58encode(_IDENTITY_MULTIHASH_PREFIX + _PROTO_ED25519_PREFIX + pub)


def verify_signature(pub: bytes, sig: bytes, data: bytes) -> None:
    """Return if ``sig`` is ``pub``'s Ed25519 signature of ``data``; else raise BadSignature."""
    if not isinstance(pub, bytes) or len(pub) != PUBLIC_KEY_SIZE:
        raise BadSignature(f"public key must be {PUBLIC_KEY_SIZE} bytes, got {_describe_len(pub)}")
    if not isinstance(sig, bytes) or len(sig) != SIGNATURE_SIZE:
        raise BadSignature(f"signature must be {SIGNATURE_SIZE} bytes, got {_describe_len(sig)}")
    try:
        Ed25519PublicKey.from_public_bytes(pub).verify(sig, data)
    except (InvalidSignature, ValueError) as exc:
        raise BadSignature("Ed25519 signature does not verify") from exc


def _describe_len(value: object) -> str:
    if isinstance(value, bytes | bytearray):
        return f"{len(value)} bytes"
    return type(value).__name__


class NodeKey:
    """One node's Ed25519 signing key. ``seed`` is secret: never log or send it."""

    __slots__ = ("_private", "seed", "public_key", "peer_id")

    def __init__(self, seed: bytes) -> None:
        if not isinstance(seed, bytes) or len(seed) != SEED_SIZE:
            raise IdentityError(f"an Ed25519 seed is {SEED_SIZE} bytes, got {_describe_len(seed)}")
        self._private = Ed25519PrivateKey.from_private_bytes(seed)
        self.seed = seed
        self.public_key = self._private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = peer_id_from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> NodeKey:
        """A fresh random key."""
        return cls(secrets.token_bytes(SEED_SIZE))

    @classmethod
    def from_seed(cls, seed: bytes) -> NodeKey:
        """The key whose 32-byte Ed25519 private seed is ``seed`` (deterministic; for tests)."""
        return cls(seed)

    @classmethod
    def load_or_create(cls, home: Path) -> NodeKey:
        """Load ``home/node_key``, creating it (mode 0600) with a fresh key if absent."""
        home = Path(home)
        path = home / KEY_FILE_NAME
        try:
            home.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                return cls(_read_key_file(path))
            except FileNotFoundError:
                pass
            _create_key_file(path, secrets.token_bytes(SEED_SIZE))
            # Read back rather than trusting our seed: a concurrent creator may have won.
            return cls(_read_key_file(path))
        except OSError as exc:
            raise IdentityError(
                f"cannot load or create the node key {path}: {exc}. Check that the directory "
                "exists, is writable, and belongs to this user."
            ) from exc

    def sign(self, data: bytes) -> bytes:
        """64-byte Ed25519 signature of ``data``."""
        return self._private.sign(bytes(data))

    def __repr__(self) -> str:
        return f"NodeKey(peer_id={self.peer_id!r})"


def _read_key_file(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InsecureKeyFile(f"node key {path} is not a regular file; remove it or fix it")
        if st.st_mode & 0o077:
            raise InsecureKeyFile(
                f"node key {path} has mode {st.st_mode & 0o777:04o}: other users may read it. "
                f"Run `chmod 600 {path}` (and consider the key leaked if it was shared)."
            )
        data = os.read(fd, SEED_SIZE + 1)
    finally:
        os.close(fd)
    if len(data) != SEED_SIZE:
        raise IdentityError(
            f"node key {path} holds {len(data)}{'+' if len(data) > SEED_SIZE else ''} bytes, "
            f"expected a {SEED_SIZE}-byte Ed25519 seed. Restore it from a backup, or delete it "
            "to create a new identity (this changes the peer id)."
        )
    return data


def _create_key_file(path: Path, seed: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # the umask may have narrowed 0600 further; set it exactly
            os.write(fd, seed)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            # link() never replaces an existing file, unlike rename(): the first creator wins.
            os.link(tmp, path)
        except FileExistsError:
            return
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)
