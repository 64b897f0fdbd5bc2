"""Exact radix prefix cache over token ids (SGLang RadixAttention style), with block-hash events.

Contract:
- Each node owns a span of tokens and the KV tensor computed for exactly those tokens. The KV
  layout is the caller's choice as long as the token axis is ``-2`` (the engine uses
  ``[layers, 2, kv_heads, tokens, head_dim]`` fp32 on CPU; tests use tiny fake tensors). ``None``
  KV is allowed (the emulated backend keeps only token structure).
- ``match(tokens)`` returns the longest cached prefix (``Match.length``) in O(len(tokens)):
  children are looked up by their first token and spans compared as tuples. ``gather(m)``
  concatenates the KV of the first ``m.length`` tokens along the token axis (a new tensor);
  ``gather_parts(m)`` returns the nodes' views instead, for a reader that copies them once.
- ``insert(tokens, kv)`` stores what a request computed; ``kv`` is a tensor covering
  ``tokens`` (token axis -2) or a callable ``kv(begin, end)`` returning the slice for tokens
  ``[begin, end)`` (called only for the part not already cached). A divergence inside a node
  splits it (the shorter side is copied; the longer keeps a view of the old storage and is
  charged for all of it, so the byte count is the memory the tree really holds).
- ``lock(m)`` pins every node on ``m``'s root path (reference counts) and returns a
  ``LockHandle``; ``release()`` (idempotent) unpins. Pinned nodes are never evicted, so the
  budget can be exceeded while pins hold more than it.
- Eviction removes least-recently-used unpinned leaves (whole nodes) until the tree is within
  ``max_tokens`` / ``max_bytes`` (``None`` = unbounded); it runs after every insert.
- Block events: a block (``blockhash.BLOCK_SIZE`` tokens, chained hash salted with
  ``model_salt(model_id)``) is cached iff all its tokens lie in the tree along one root path.
  Each node records the hashes of the blocks that END inside its span, so listeners get
  ``BlockStored(hashes, parent)`` when an insert completes blocks (``parent`` is the previous
  block's hash, ``None`` for the first block), ``BlockRemoved(hashes)`` when eviction drops
  them, and ``AllBlocksCleared()`` on ``clear()``. ``cached_block_hashes()`` is a snapshot set.
- Listeners run synchronously on the thread that mutated the tree. All public methods are
  guarded by one re-entrant lock, so a worker thread may mutate while another thread reads.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from p2pnode.inference.blockhash import (
    BLOCK_SIZE,
    AllBlocksCleared,
    BlockEvent,
    BlockRemoved,
    BlockStored,
    block_hashes,
    model_salt,
)

if TYPE_CHECKING:
    import torch

# torch only in annotations: the emulated engine keeps no KV and never loads it
KVSource: TypeAlias = "torch.Tensor | Callable[[int, int], torch.Tensor | None] | None"
Listener = Callable[[BlockEvent], None]


# Creation order breaks ties between leaves of equal last access when evicting: deterministic
# within a run, where ``id(node)`` (a memory address) made two runs of the same seeded
# simulation evict different leaves.
_SERIALS = itertools.count()


class _Node:
    __slots__ = (
        "key",
        "kv",
        "children",
        "parent",
        "ref",
        "last_access",
        "start",
        "blocks",
        "serial",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        kv: torch.Tensor | None,
        parent: _Node | None,
        start: int,
    ) -> None:
        self.key = key
        self.kv = kv
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.ref = 0
        self.last_access = 0
        self.start = start
        self.blocks: list[int] = []
        self.serial = next(_SERIALS)

    @property
    def end(self) -> int:
        return self.start + len(self.key)


def _nbytes(kv: torch.Tensor | None) -> int:
    """The memory ``kv`` holds: its whole storage (a split leaves one side a view of it)."""
    return 0 if kv is None else kv.untyped_storage().nbytes()


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class Match:
    """Longest cached prefix: ``length`` tokens, ending inside (or at the end of) ``_node``."""

    length: int
    _node: _Node


class LockHandle:
    """Pins a matched prefix against eviction until ``release()`` (idempotent)."""

    def __init__(self, tree: RadixCache, node: _Node, length: int) -> None:
        self._tree = tree
        self._node: _Node | None = node
        self.length = length

    @property
    def released(self) -> bool:
        return self._node is None

    def release(self) -> None:
        with self._tree._lock:
            node, self._node = self._node, None
            while node is not None and node.parent is not None:
                node.ref -= 1
                node = node.parent

    def __enter__(self) -> LockHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RadixCache:
    """Radix tree of token spans with their KV; see the module contract."""

    def __init__(
        self,
        model_id: str,
        *,
        max_tokens: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 or None, got {max_tokens}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.model_id = model_id
        self.salt = model_salt(model_id)
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self._lock = threading.RLock()
        self._root = _Node((), None, None, 0)
        self._root.ref = 1  # the root is never evicted
        self._tick = 0
        self._listeners: list[Listener] = []
        self._hashes: set[int] = set()
        self.num_tokens = 0
        self.num_bytes = 0
        self.num_nodes = 0
        self.evicted_tokens = 0

    # ---- listeners -------------------------------------------------------------------------
    def add_listener(self, fn: Listener) -> None:
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Listener) -> None:
        with self._lock:
            self._listeners.remove(fn)

    def _emit(self, event: BlockEvent) -> None:
        for fn in list(self._listeners):
            fn(event)

    def cached_block_hashes(self) -> set[int]:
        with self._lock:
            return set(self._hashes)

    # ---- lookup ----------------------------------------------------------------------------
    def _walk(self, tokens: tuple[int, ...], touch: bool) -> Match:
        node, pos, n = self._root, 0, len(tokens)
        if touch:
            self._tick += 1
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            if touch:
                child.last_access = self._tick
            span = len(child.key)
            seg = tokens[pos : pos + span]
            if seg == child.key:
                node, pos = child, pos + span
                continue
            return Match(pos + _common_prefix(child.key, seg), child)
        return Match(pos, node)

    def match(self, tokens: Sequence[int]) -> Match:
        """Longest cached prefix of ``tokens``; marks the path as recently used."""
        with self._lock:
            return self._walk(tuple(tokens), touch=True)

    def prefix_len(self, tokens: Sequence[int]) -> int:
        """Cached prefix length of ``tokens`` without touching LRU order."""
        with self._lock:
            return self._walk(tuple(tokens), touch=False).length

    def gather_parts(
        self, m: Match | LockHandle, length: int | None = None
    ) -> list[torch.Tensor] | None:
        """Like ``gather`` without the concatenation: views of each node's KV on the path, in
        order, covering the first ``length`` tokens (a reader copies them once, where it needs
        them). The views stay valid while the path is pinned."""
        with self._lock:
            node = m._node
            if node is None:
                raise ValueError("gather on a released LockHandle")
            length = m.length if length is None else length
            if length > m.length or length < 0:
                raise ValueError(f"length {length} outside the match (0..{m.length})")
            if length == 0:
                return None
            parts: list[torch.Tensor] = []
            while node is not None and node.parent is not None:
                if node.start < length:
                    if node.kv is None:
                        return None
                    parts.append(node.kv[..., : length - node.start, :])
                node = node.parent
            parts.reverse()
            return parts

    def gather(self, m: Match | LockHandle, length: int | None = None) -> torch.Tensor | None:
        """KV of the first ``length`` (default: all matched) tokens, concatenated on axis -2."""
        parts = self.gather_parts(m, length)
        if parts is None:
            return None
        import torch

        return torch.cat(parts, dim=-2)

    def lock(self, m: Match) -> LockHandle:
        with self._lock:
            node: _Node | None = m._node
            while node is not None and node.parent is not None:
                node.ref += 1
                node = node.parent
            return LockHandle(self, m._node, m.length)

    # ---- mutation --------------------------------------------------------------------------
    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child`` after ``at`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        upper_kv = lower_kv = None
        if child.kv is not None:
            # Copy the shorter side only (a hit that diverges after a long cached prefix would
            # otherwise copy that whole prefix on the request's path); the longer side keeps a
            # view and with it the old storage, whose full size it is charged for.
            kv = child.kv
            if at <= len(child.key) - at:
                upper_kv, lower_kv = kv[..., :at, :].clone(), kv[..., at:, :]
            else:
                upper_kv, lower_kv = kv[..., :at, :], kv[..., at:, :].clone()
            self.num_bytes += _nbytes(upper_kv) + _nbytes(lower_kv) - _nbytes(kv)
        upper = _Node(child.key[:at], upper_kv, parent, child.start)
        upper.ref = child.ref
        upper.last_access = child.last_access
        n_upper_blocks = (child.start + at) // BLOCK_SIZE - child.start // BLOCK_SIZE
        upper.blocks = child.blocks[:n_upper_blocks]
        child.blocks = child.blocks[n_upper_blocks:]
        child.key = child.key[at:]
        child.kv = lower_kv
        child.start += at
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        self.num_nodes += 1
        return upper

    def _last_block_hash(self, node: _Node) -> int | None:
        while node is not None and node.parent is not None:
            if node.blocks:
                return node.blocks[-1]
            node = node.parent
        return None

    def insert(self, tokens: Sequence[int], kv: KVSource) -> int:
        """Cache ``tokens`` with their KV; returns how many tokens were newly stored."""
        with self._lock:
            toks = tuple(tokens)
            n = len(toks)
            self._tick += 1
            node, pos = self._root, 0
            while pos < n:
                child = node.children.get(toks[pos])
                if child is None:
                    break
                child.last_access = self._tick
                span = len(child.key)
                seg = toks[pos : pos + span]
                if seg == child.key:
                    node, pos = child, pos + span
                    continue
                common = _common_prefix(child.key, seg)
                if common == len(seg):  # tokens end inside this node: nothing new
                    return 0
                node, pos = self._split(child, common), pos + common
                break
            if pos >= n:
                return 0
            leaf_kv = self._slice_kv(kv, pos, n)
            leaf = _Node(toks[pos:], leaf_kv, node, pos)
            leaf.last_access = self._tick
            node.children[toks[pos]] = leaf
            self.num_nodes += 1
            self.num_tokens += n - pos
            self.num_bytes += _nbytes(leaf_kv)
            first_block = pos // BLOCK_SIZE
            parent_hash = self._last_block_hash(node) if first_block > 0 else None
            start_parent = 0 if parent_hash is None else parent_hash
            leaf.blocks = block_hashes(
                toks[first_block * BLOCK_SIZE : n], self.salt, start_parent=start_parent
            )
            if leaf.blocks:
                self._hashes.update(leaf.blocks)
                self._emit(BlockStored(tuple(leaf.blocks), parent_hash))
            self._evict_to_budget()
            return n - pos

    @staticmethod
    def _slice_kv(kv: KVSource, begin: int, end: int) -> torch.Tensor | None:
        if kv is None:
            return None
        torch = sys.modules.get("torch")  # a tensor means torch is loaded already
        if callable(kv) and not (torch is not None and isinstance(kv, torch.Tensor)):
            out = kv(begin, end)
        else:
            out = kv[..., begin:end, :].clone()
        if out is not None and out.shape[-2] != end - begin:
            raise ValueError(f"KV for tokens [{begin}, {end}) has {out.shape[-2]} tokens")
        return out

    def _over_budget(self) -> bool:
        return (self.max_tokens is not None and self.num_tokens > self.max_tokens) or (
            self.max_bytes is not None and self.num_bytes > self.max_bytes
        )

    def _evict_to_budget(self) -> None:
        if self._over_budget():
            self._evict(lambda: not self._over_budget())

    def evict(self, num_tokens: int) -> int:
        """Evict LRU unpinned leaves until ``num_tokens`` are freed (or none is left)."""
        with self._lock:
            target = self.num_tokens - num_tokens
            return self._evict(lambda: self.num_tokens <= target)

    def _evict(self, done: Callable[[], bool]) -> int:
        heap: list[tuple[int, int, _Node]] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.ref == 0:
                heap.append((node.last_access, node.serial, node))
        heapq.heapify(heap)
        freed = 0
        while heap and not done():
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            leaf.parent = None
            self.num_nodes -= 1
            self.num_tokens -= len(leaf.key)
            self.num_bytes -= _nbytes(leaf.kv)
            freed += len(leaf.key)
            if leaf.blocks:
                self._hashes.difference_update(leaf.blocks)
                self._emit(BlockRemoved(tuple(leaf.blocks)))
            if not parent.children and parent.ref == 0 and parent.parent is not None:
                heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        self.evicted_tokens += freed
        return freed

    def clear(self) -> None:
        """Drop everything (pinned or not); pins held by old handles become no-ops."""
        with self._lock:
            self._root.children = {}
            self._hashes.clear()
            self.num_tokens = self.num_bytes = self.num_nodes = 0
            self._emit(AllBlocksCleared())

    # ---- introspection (tests, stats) ------------------------------------------------------
    def pinned_tokens(self) -> int:
        with self._lock:
            total, stack = 0, list(self._root.children.values())
            while stack:
                node = stack.pop()
                if node.ref > 0:
                    total += len(node.key)
                stack.extend(node.children.values())
            return total
