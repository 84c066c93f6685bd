"""Unit tests of the radix prefix cache: split, duplicate insert, LRU order, locks, parents that
become leaves, reset, pages, and the disabled cache. The randomized model check is in
test_radix_cache_stateful.py."""

from __future__ import annotations

import pytest
import torch

from radixlm.backend.kv_pool import TokenSlotAllocator
from radixlm.backend.radix_cache import NoPrefixCache, RadixCache, TreeNode


def make(size: int = 64, page_size: int = 1) -> tuple[TokenSlotAllocator, RadixCache]:
    alloc = TokenSlotAllocator(size)
    return alloc, RadixCache(alloc, page_size=page_size)


def cache_seq(cache: RadixCache, alloc: TokenSlotAllocator, key: list[int]) -> list[int]:
    """Simulate a finished request: reuse the cached prefix, allocate the rest, insert."""
    prefix, _ = cache.match_prefix(key)
    new = alloc.alloc(len(key) - len(prefix))
    slots = torch.cat([prefix, new])
    cache.insert(key, slots)
    return slots.tolist()


def path_tokens(node: TreeNode) -> list[int]:
    out: list[int] = []
    while node.parent is not None:
        out = node.key + out
        node = node.parent
    return out


def test_empty_tree_matches_nothing() -> None:
    _, cache = make()
    slots, node = cache.match_prefix([1, 2, 3])
    assert slots.numel() == 0 and slots.dtype == torch.int64
    assert node is cache.root_node
    assert cache.total_size() == 0
    cache.check_invariants()


def test_match_inside_node_splits_it() -> None:
    alloc, cache = make()
    slots = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], slots) == 0
    got, node = cache.match_prefix([1, 2, 9])
    assert got.tolist() == slots[:2].tolist()
    assert node.key == [1, 2] and path_tokens(node) == [1, 2]
    assert [c.key for c in node.children.values()] == [[3, 4]]
    assert cache.all_cached_sequences() == {(1, 2, 3, 4): slots.tolist()}
    full, leaf = cache.match_prefix([1, 2, 3, 4, 5])
    assert full.tolist() == slots.tolist() and path_tokens(leaf) == [1, 2, 3, 4]
    cache.check_invariants()


def test_returned_slots_are_a_copy() -> None:
    alloc, cache = make()
    slots = alloc.alloc(3)
    cache.insert([5, 6, 7], slots)
    got, _ = cache.match_prefix([5, 6, 7])
    got[0] = 999
    assert cache.match_prefix([5, 6, 7])[0].tolist() == slots.tolist()


def test_duplicate_insert_frees_the_callers_slots() -> None:
    alloc, cache = make(16)
    first = alloc.alloc(3)
    cache.insert([1, 2, 3], first)
    second = alloc.alloc(4)
    free_before = alloc.available_size()
    assert cache.insert([1, 2, 3, 4], second) == 3
    # second[:3] duplicated cached positions and went back to the allocator; second[3] is cached.
    assert alloc.available_size() == free_before + 3
    assert bool(alloc.is_free_mask()[second[:3]].all())
    got, _ = cache.match_prefix([1, 2, 3, 4])
    assert got.tolist() == first.tolist() + [second[3].item()]
    assert cache.total_size() == 4
    cache.check_invariants()


def test_insert_with_matched_slots_frees_nothing() -> None:
    alloc, cache = make(16)
    cache_seq(cache, alloc, [1, 2, 3])
    free_before = alloc.available_size()
    prefix, _ = cache.match_prefix([1, 2, 3, 4, 5])
    new = alloc.alloc(2)
    assert cache.insert([1, 2, 3, 4, 5], torch.cat([prefix, new])) == 3
    assert alloc.available_size() == free_before - 2
    assert cache.total_size() == 5
    cache.check_invariants()


def test_insert_mixed_same_and_different_slots() -> None:
    alloc, cache = make(16)
    cached = cache_seq(cache, alloc, [1, 2, 3, 4])
    other = alloc.alloc(2)
    # Positions 0-1 reuse the tree's slots, 2-3 were computed again (e.g. in the same batch).
    mine = torch.tensor(cached[:2] + other.tolist())
    assert cache.insert([1, 2, 3, 4], mine) == 4
    assert bool(alloc.is_free_mask()[other].all())
    assert not bool(alloc.is_free_mask()[torch.tensor(cached)].any())
    cache.check_invariants()


def test_evict_lru_first() -> None:
    alloc, cache = make(32)
    a = cache_seq(cache, alloc, [1, 1, 1])
    b = cache_seq(cache, alloc, [2, 2, 2])
    c = cache_seq(cache, alloc, [3, 3, 3])
    cache.match_prefix([1, 1, 1])  # a is now the most recent; b the least
    assert cache.evict(1) == 3  # whole leaves go
    assert set(cache.all_cached_sequences()) == {(1, 1, 1), (3, 3, 3)}
    assert bool(alloc.is_free_mask()[torch.tensor(b)].all())
    assert cache.evict(3) == 3
    assert set(cache.all_cached_sequences()) == {(1, 1, 1)}
    assert bool(alloc.is_free_mask()[torch.tensor(c)].all())
    assert not bool(alloc.is_free_mask()[torch.tensor(a)].any())
    cache.check_invariants()


def test_partial_match_refreshes_only_the_matched_part() -> None:
    alloc, cache = make(32)
    cache_seq(cache, alloc, [1, 2, 3, 4])
    cache_seq(cache, alloc, [7, 7])
    cache.match_prefix([1, 2])  # splits; [1,2] is fresh, its child [3,4] is still old
    assert cache.evict(1) == 2
    assert set(cache.all_cached_sequences()) == {(1, 2), (7, 7)}
    cache.check_invariants()


def test_lock_prevents_eviction() -> None:
    alloc, cache = make(32)
    cache_seq(cache, alloc, [1, 2, 3])
    cache_seq(cache, alloc, [1, 2, 4, 5])
    cache_seq(cache, alloc, [9])
    _, node = cache.match_prefix([1, 2, 4, 5])
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 4  # [1,2] and [4,5]
    assert cache.evictable_size() == 2  # [3] and [9]
    assert cache.evict(100) == 2
    assert set(cache.all_cached_sequences()) == {(1, 2, 4, 5)}
    assert cache.evict(100) == 0
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    assert cache.evict(100) == 4
    assert alloc.available_size() == 32
    cache.check_invariants()


def test_parent_becomes_leaf_when_children_go() -> None:
    alloc, cache = make(32)
    cache_seq(cache, alloc, [1, 2, 3])
    cache_seq(cache, alloc, [1, 2, 4])
    cache_seq(cache, alloc, [8, 8, 8, 8])
    cache.match_prefix([8, 8, 8, 8])  # the [1,2,*] branch is older
    assert cache.evict(2) == 2  # both single-token children ([3], [4]) go
    assert set(cache.all_cached_sequences()) == {(1, 2), (8, 8, 8, 8)}
    assert cache.evict(1) == 2  # then [1,2], now a leaf, before the more recent [8,8,8,8]
    assert set(cache.all_cached_sequences()) == {(8, 8, 8, 8)}
    cache.check_invariants()


def test_locked_child_keeps_parent_and_split_keeps_handle() -> None:
    alloc, cache = make(32)
    cache_seq(cache, alloc, [1, 2, 3, 4])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    cache.match_prefix([1, 2])  # splits the locked node above it
    cache.check_invariants()
    assert cache.protected_size() == 4
    assert cache.evict(10) == 0
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    cache.check_invariants()


def test_unbalanced_unlock_and_stale_handles_raise() -> None:
    alloc, cache = make(32)
    cache_seq(cache, alloc, [1, 2])
    _, node = cache.match_prefix([1, 2])
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    cache.evict(2)
    with pytest.raises(RuntimeError):
        cache.inc_lock_ref(node)
    # Root locks are no-ops (empty match).
    cache.inc_lock_ref(cache.root_node)
    cache.dec_lock_ref(cache.root_node)


def test_reset_frees_everything_and_refuses_while_locked() -> None:
    alloc, cache = make(32)
    cache_seq(cache, alloc, [1, 2, 3])
    cache_seq(cache, alloc, [1, 5])
    _, node = cache.match_prefix([1, 5])
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert alloc.available_size() == 32 and cache.total_size() == 0
    assert cache.match_prefix([1, 2, 3])[0].numel() == 0
    with pytest.raises(RuntimeError):
        cache.inc_lock_ref(node)
    cache.check_invariants()


def test_bad_input_raises_value_error() -> None:
    alloc, cache = make()
    with pytest.raises(ValueError, match="3 tokens but 2"):
        cache.insert([1, 2, 3], alloc.alloc(2))
    with pytest.raises(ValueError):
        cache.insert([1], [5])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RadixCache(alloc, page_size=0)


def test_tensor_keys_are_accepted() -> None:
    alloc, cache = make()
    slots = alloc.alloc(3)
    cache.insert(torch.tensor([4, 5, 6]), slots)  # type: ignore[arg-type]
    assert cache.match_prefix([4, 5, 6])[0].tolist() == slots.tolist()


def test_pages_align_keys_and_caller_keeps_the_tail() -> None:
    alloc, cache = make(32, page_size=2)
    slots = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    assert cache.total_size() == 4
    assert not bool(alloc.is_free_mask()[slots[4:]].any())  # the tail is still the caller's
    alloc.free(slots[4:])
    assert cache.match_prefix([1, 2, 3, 9])[0].tolist() == slots[:2].tolist()
    assert cache.match_prefix([1, 9])[0].numel() == 0
    assert cache.match_prefix([1, 2, 3, 4, 5])[0].tolist() == slots[:4].tolist()
    cache.check_invariants()


def test_no_prefix_cache_frees_everything_it_is_given() -> None:
    alloc = TokenSlotAllocator(16)
    cache = NoPrefixCache(alloc)
    slots = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], slots) == 0
    assert alloc.available_size() == 16
    got, node = cache.match_prefix([1, 2, 3, 4])
    assert got.numel() == 0 and node is cache.root_node
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    assert cache.evict(10) == 0 and cache.total_size() == 0


def test_common_prefix_len_matches_a_naive_scan() -> None:
    import random

    from radixlm.backend.radix_cache import _common_prefix_len

    rng = random.Random(0)
    for _ in range(500):
        node_key = [rng.randrange(3) for _ in range(rng.randint(1, 300))]
        key = node_key[: rng.randint(0, len(node_key))] + [rng.randrange(3) for _ in range(rng.randint(0, 300))]
        start = rng.randint(0, 3)
        key = [rng.randrange(3) for _ in range(start)] + key
        stop = rng.randint(start, len(key))
        want = 0
        while want < min(len(node_key), stop - start) and node_key[want] == key[start + want]:
            want += 1
        assert _common_prefix_len(node_key, key, start, stop) == want


def test_cached_len_is_read_only() -> None:
    alloc, cache = make()
    cache_seq(cache, alloc, [1, 2, 3, 4])
    assert cache.cached_len([1, 2, 9]) == 2
    assert cache.cached_len([1, 2, 3, 4, 5]) == 4 and cache.cached_len([7]) == 0
    assert list(cache.all_cached_sequences()) == [(1, 2, 3, 4)]
    assert len(cache.root_node.children[1].key) == 4  # no split happened
    assert NoPrefixCache(alloc).cached_len([1, 2]) == 0
