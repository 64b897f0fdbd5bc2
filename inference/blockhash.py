"""Block hashing of token prefixes, and the events an engine emits as its prefix cache changes.

A prompt is cut into full blocks of ``BLOCK_SIZE`` tokens. Block ``i``'s hash covers the hash of
block ``i-1`` and block ``i``'s tokens (vLLM-style chained hashing), so a single 64-bit value
names a whole prefix: a peer that holds the hash of block ``i`` holds the first
``(i + 1) * BLOCK_SIZE`` tokens. A trailing partial block is never hashed or advertised.

Hashes are unsigned 64-bit ints (blake2b, keyed by a per-model salt so two models never collide
by construction). A 64-bit collision can only make a routing estimate wrong, never an answer:
the serving node always checks its own exact radix tree.

This is the one definition shared by the engine (which emits events) and the overlay (which
gossips digests of them). Changing it changes the wire meaning of digests: bump
``BLOCK_HASH_VERSION``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_SIZE = 16
BLOCK_HASH_VERSION = 1
ROOT_HASH = 0

BlockHash = int


def hash_block(parent: BlockHash, tokens: Sequence[int], salt: bytes = b"") -> BlockHash:
    """Hash of one full block given its parent's hash (``ROOT_HASH`` for the first block)."""
    if len(tokens) != BLOCK_SIZE:
        raise ValueError(f"a block has exactly {BLOCK_SIZE} tokens, got {len(tokens)}")
    h = hashlib.blake2b(digest_size=8, key=salt[:64], person=b"p2pnode-blk-v1")
    h.update(struct.pack("<Q", parent))
    h.update(struct.pack(f"<{BLOCK_SIZE}I", *tokens))
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    tokens: Sequence[int], salt: bytes = b"", *, start_parent: BlockHash = ROOT_HASH
) -> list[BlockHash]:
    """Chained hashes of every full block of ``tokens`` (O(len(tokens)))."""
    out: list[BlockHash] = []
    parent = start_parent
    for i in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash_block(parent, tokens[i : i + BLOCK_SIZE], salt)
        out.append(parent)
    return out


def model_salt(model_id: str) -> bytes:
    """The hash key for one model: hashes of different models never coincide."""
    return hashlib.sha256(model_id.encode()).digest()[:32]


def cached_prefix_tokens(hashes: Sequence[BlockHash], contains) -> int:
    """Tokens of the longest prefix whose block hashes all satisfy ``contains`` (e.g. a set)."""
    n = 0
    for h in hashes:
        if not contains(h):
            break
        n += 1
    return n * BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly held in the cache, in prefix order; ``parent`` is the block before the first."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared
