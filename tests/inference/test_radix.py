"""Pure radix-tree tests with tiny fake KV tensors (no model).

The fake KV of a token span is a ``[1, T, 1]`` tensor holding the token ids themselves, so a
gathered prefix must read back exactly the matched tokens.
"""

from __future__ import annotations

import pytest
import torch

from p2pnode.inference.blockhash import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_hashes,
    cached_prefix_tokens,
)
from p2pnode.inference.radix import RadixCache

MODEL = "fake-model@0"


def fake_kv(tokens: list[int]) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1)


def insert(tree: RadixCache, tokens: list[int]) -> int:
    return tree.insert(tokens, fake_kv(tokens))


def held_bytes(tree: RadixCache) -> int:
    """The bytes of the distinct storages the tree's nodes hold (what it really keeps alive)."""
    storages, stack = {}, list(tree._root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.kv is not None:
            st = node.kv.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def test_match_insert_and_split_keep_exact_kv() -> None:
    tree = RadixCache(MODEL)
    a = list(range(1, 11))
    b = [1, 2, 3, 70, 80]
    assert insert(tree, a) == 10
    assert insert(tree, b) == 2  # only the divergent tail is new
    assert tree.num_tokens == 12 and tree.num_nodes == 3  # split: [1,2,3] -> {a-tail, b-tail}
    for probe, expect in ((a, 10), (b, 5), ([1, 2, 3, 4, 99], 4), ([9], 0), ([1, 2], 2)):
        m = tree.match(probe)
        assert m.length == expect
        if expect:
            assert tree.gather(m).view(-1).tolist() == probe[:expect]
    assert insert(tree, a[:7]) == 0  # a prefix of a cached path adds nothing
    assert tree.gather(tree.match(a), 5).view(-1).tolist() == a[:5]


def test_byte_count_is_exact_after_splits() -> None:
    tree = RadixCache(MODEL)
    insert(tree, list(range(100)))
    insert(tree, list(range(50)) + [999])
    insert(tree, list(range(20)) + [998])
    assert tree.num_tokens == 102
    # A split copies its shorter side; the longer keeps a view of (and is charged for) the old
    # storage: 100 + 50 copied at the first split + 1, then + 20 copied + 1.
    assert tree.num_bytes == (100 + 50 + 1 + 20 + 1) * 4
    assert tree.num_bytes == held_bytes(tree)
    assert tree.match(list(range(100))).length == 100  # the views still read the right KV
    assert tree.gather(tree.match(list(range(100)))).view(-1).tolist() == list(range(100))
    tree.evict(102)
    assert tree.num_tokens == 0 and tree.num_bytes == 0 == held_bytes(tree)


def test_byte_count_is_the_memory_held_after_any_splits() -> None:
    tree = RadixCache(MODEL)
    insert(tree, list(range(64)))
    for cut in (60, 3, 33, 1, 62):  # each cut splits a node on either side of its middle
        insert(tree, list(range(cut)) + [1000 + cut])
        assert tree.num_bytes == held_bytes(tree)
        for probe in (list(range(64)), list(range(cut)) + [1000 + cut]):
            got = tree.gather(tree.match(probe)).view(-1).tolist()
            assert got == probe


def test_lru_eviction_under_token_budget() -> None:
    tree = RadixCache(MODEL, max_tokens=12)
    insert(tree, [1] * 6)
    insert(tree, [2] * 6)
    tree.match([1] * 6)  # touch [1]*6: [2]*6 becomes least recently used
    insert(tree, [3] * 6)
    assert tree.num_tokens == 12
    assert tree.prefix_len([1] * 6) == 6
    assert tree.prefix_len([2] * 6) == 0
    assert tree.prefix_len([3] * 6) == 6


def test_locked_prefix_is_never_evicted() -> None:
    tree = RadixCache(MODEL, max_tokens=10)
    insert(tree, [1] * 8)
    handle = tree.lock(tree.match([1] * 8))
    insert(tree, [2] * 8)  # over budget: only the unpinned newcomer may go
    assert tree.prefix_len([1] * 8) == 8
    assert tree.prefix_len([2] * 8) == 0
    assert tree.pinned_tokens() == 8
    handle.release()
    handle.release()  # idempotent
    assert tree.pinned_tokens() == 0
    insert(tree, [3] * 8)
    assert tree.prefix_len([1] * 8) == 0 and tree.prefix_len([3] * 8) == 8


def test_split_of_a_locked_node_keeps_both_halves_pinned() -> None:
    tree = RadixCache(MODEL)
    insert(tree, list(range(10)))
    handle = tree.lock(tree.match(list(range(10))))
    insert(tree, list(range(5)) + [77])  # splits the pinned node at 5
    assert tree.evict(100) == 1  # only the unpinned [77] leaf can go
    assert tree.pinned_tokens() == 10
    handle.release()
    assert tree.evict(100) == 10 and tree.num_tokens == 0 and tree.num_nodes == 0


def test_partial_match_lock_pins_the_whole_node() -> None:
    tree = RadixCache(MODEL, max_tokens=20)
    insert(tree, list(range(10)))
    handle = tree.lock(tree.match([0, 1, 2, 50]))
    assert handle.length == 3
    assert tree.evict(100) == 0
    handle.release()
    assert tree.evict(100) == 10


def test_block_events_follow_the_cached_paths() -> None:
    tree = RadixCache(MODEL, max_tokens=100)
    events: list = []
    tree.add_listener(events.append)
    a = list(range(1000, 1040))  # 40 tokens: 2 full blocks
    insert(tree, a)
    ha = block_hashes(a, tree.salt)
    assert events == [BlockStored(tuple(ha), None)]
    b = a[:20] + list(range(2000, 2030))  # shares block 0, diverges inside block 1
    insert(tree, b)
    hb = block_hashes(b, tree.salt)
    assert hb[0] == ha[0] and hb[1] != ha[1]
    assert events[-1] == BlockStored(tuple(hb[1:]), ha[0])
    assert tree.cached_block_hashes() == set(ha) | set(hb)
    for p in (a, b, a[:30], b[:33]):
        got = cached_prefix_tokens(
            block_hashes(p, tree.salt), tree.cached_block_hashes().__contains__
        )
        assert got == tree.prefix_len(p) // 16 * 16
    tree.match(b)  # a's tail becomes LRU
    tree.evict(1)
    assert events[-1] == BlockRemoved((ha[1],))
    assert tree.cached_block_hashes() == set(hb)
    tree.clear()
    assert events[-1] == AllBlocksCleared() and tree.cached_block_hashes() == set()


def test_salt_separates_models() -> None:
    toks = list(range(32))
    t1, t2 = RadixCache("m1"), RadixCache("m2")
    insert(t1, toks)
    insert(t2, toks)
    assert t1.cached_block_hashes().isdisjoint(t2.cached_block_hashes())


def test_bad_inputs_raise() -> None:
    tree = RadixCache(MODEL)
    with pytest.raises(ValueError, match="tokens"):
        tree.insert([1, 2, 3], lambda b, e: torch.zeros(1, 1, 1))
    with pytest.raises(ValueError):
        RadixCache(MODEL, max_tokens=-1)
    m = tree.match([5])
    with pytest.raises(ValueError):
        tree.gather(m, 3)


def test_callable_kv_is_asked_only_for_the_new_part() -> None:
    tree = RadixCache(MODEL)
    asked: list[tuple[int, int]] = []

    def kv(begin: int, end: int) -> torch.Tensor:
        asked.append((begin, end))
        return fake_kv(list(range(begin, end)))

    tree.insert(list(range(10)), kv)
    tree.insert(list(range(12)), kv)
    assert asked == [(0, 10), (10, 12)]
    assert tree.gather(tree.match(list(range(12)))).view(-1).tolist() == list(range(12))
