"""Placement on misses: where the cache a prompt is about to create should live.

Contract:
- When no candidate (local included, skipped peers excluded) holds the prompt's leading
  ``blocks`` blocks (its *placement key*), the cache it is about to create should live where the
  next request for that prefix will look: its rendezvous home, the candidate with the highest
  ``hash(key, peer id)`` among those whose total is within ``share`` of a full prefill of the
  best total. Every entry node ranks the same peers the same way, so misses of one prefix
  converge on one home; a home in push-back (or with a queue that takes it out of the budget)
  drops out and the next in rank becomes a second home. Far peers never qualify: their network
  cost exceeds the budget.
- Given a ``pool``, the ranking runs over those peers only (and this node): with scoped views,
  the node's cell (``overlay/cache/scope.py``), one set every node of the cell has in view, where
  the peers of each node's own scope differ from node to node.
- The router places one-shot requests only: a chat turn whose session has later turns to come
  stays a miss at its entry (``Router.decide``), which then holds the prefix for others.
- ``placement_home`` returns the home's peer id, ``"local"`` for this node, or None when the
  prompt is no miss (ordinary cost routing finds its holder) or nobody qualifies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol

LOCAL = "local"  # the name of this node among the candidates (router.LOCAL)
_BLOCK_SLACK = 1  # the last prompt token is always computed, so a full key shows one short


class Candidate(Protocol):
    """What placement reads of a router's estimate for one candidate."""

    @property
    def peer_id(self) -> str: ...
    @property
    def is_local(self) -> bool: ...
    @property
    def cached_tokens(self) -> int: ...
    @property
    def total_s(self) -> float: ...
    @property
    def skipped(self) -> str | None: ...


def placement_key(prompt_block_hashes: Sequence[int], placement_blocks: int) -> bytes:
    """The key a prompt's cache is placed by on a miss: its leading blocks' chained hash."""
    blocks = min(placement_blocks, len(prompt_block_hashes))
    return prompt_block_hashes[blocks - 1].to_bytes(8, "little")


def rendezvous_rank(key: bytes, peer_id: str) -> int:
    """A peer's rank for a placement key: the highest-ranked candidate within budget is home."""
    return int.from_bytes(hashlib.blake2b(key + peer_id.encode(), digest_size=8).digest(), "big")


def placement_home(
    candidates: Sequence[Candidate],
    prompt_block_hashes: Sequence[int],
    full_prefill_s: float,
    *,
    blocks: int,
    share: float,
    block_size: int,
    pool: Callable[[str], bool] | None = None,
    self_id: str | None = None,
) -> str | None:
    """The rendezvous home of a prompt nobody eligible holds, or None (see the contract)."""
    if not prompt_block_hashes:
        return None
    n = min(blocks, len(prompt_block_hashes))
    ranked = [c for c in candidates if c.is_local or c.skipped is None]
    if not ranked or any(c.cached_tokens >= n * block_size - _BLOCK_SLACK for c in ranked):
        return None  # somebody holds the key: ordinary cost routing finds them
    if pool is not None:
        ranked = [c for c in ranked if c.is_local or pool(c.peer_id)]
        if not ranked:
            return None  # nobody of the pool is a candidate (no local engine either)
    if any(c.is_local for c in ranked) and self_id is None:
        return None  # without our own name the ranking would differ from our peers'
    budget = min(c.total_s for c in ranked) + share * full_prefill_s
    key = placement_key(prompt_block_hashes, blocks)
    me = self_id or ""  # set whenever a local candidate is ranked (checked above)
    home = max(
        (c for c in ranked if c.total_s <= budget),
        key=lambda c: rendezvous_rank(key, me if c.is_local else c.peer_id),
    )
    return LOCAL if home.is_local else home.peer_id
