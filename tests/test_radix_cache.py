"""Unit tests of the radix prefix cache: split, duplicate insert, LRU order, locks, parents that
become leaves, reset, pages, and the disabled cache — each against the contract that the cache
never frees a slot (evict/reset return them, insert reports duplicates through cached_len). The
randomized model check is in test_radix_cache_stateful.py."""

from __future__ import annotations

import pytest
import torch
from cache_checks import all_cached_sequences, check_invariants, path_tokens

from radixlm.backend.kv_pool import TokenSlotAllocator
from radixlm.backend.radix_cache import NoPrefixCache, RadixCache


def make(size: int = 64, page_size: int = 1) -> tuple[TokenSlotAllocator, RadixCache]:
    return TokenSlotAllocator(size), RadixCache(page_size=page_size)


def cache_seq(cache: RadixCache, alloc: TokenSlotAllocator, key: list[int]) -> list[int]:
    """Simulate a finished request: reuse the cached prefix, allocate the rest, insert."""
    prefix, _ = cache.match_prefix(key)
    new = alloc.alloc(len(key) - len(prefix))
    slots = torch.cat([prefix, new])
    res = cache.insert(key, slots)
    assert res.cached_len == len(prefix) and res.handle.cached_len == len(key)
    return slots.tolist()


def evict(cache: RadixCache, alloc: TokenSlotAllocator, n: int) -> int:
    """Evict like the cache manager does: free what the cache returns."""
    slots = cache.evict(n)
    alloc.free(slots)
    return int(slots.numel())


def test_empty_tree_matches_nothing() -> None:
    _, cache = make()
    slots, handle = cache.match_prefix([1, 2, 3])
    assert slots.numel() == 0 and slots.dtype == torch.int64
    assert handle.node is cache.root_node and handle.cached_len == 0
    assert cache.total_size() == 0
    check_invariants(cache)


def test_match_inside_node_splits_it() -> None:
    alloc, cache = make()
    slots = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], slots).cached_len == 0
    got, handle = cache.match_prefix([1, 2, 9])
    assert got.tolist() == slots[:2].tolist() and handle.cached_len == 2
    node = handle.node
    assert node.key == [1, 2] and path_tokens(node) == [1, 2]
    assert [c.key for c in node.children.values()] == [[3, 4]]
    assert all_cached_sequences(cache) == {(1, 2, 3, 4): slots.tolist()}
    full, leaf = cache.match_prefix([1, 2, 3, 4, 5])
    assert full.tolist() == slots.tolist() and path_tokens(leaf.node) == [1, 2, 3, 4]
    assert (
        cache.slots_of(leaf).tolist() == slots.tolist()
        and cache.slots_of(handle).tolist() == slots[:2].tolist()
    )
    check_invariants(cache, alloc)


def test_returned_slots_are_a_copy() -> None:
    alloc, cache = make()
    slots = alloc.alloc(3)
    cache.insert([5, 6, 7], slots)
    got, handle = cache.match_prefix([5, 6, 7])
    got[0] = 999
    cache.slots_of(handle)[1] = 999
    slots[2] = 999  # the caller's tensor after insert: the cache kept its own copy
    assert 999 not in cache.match_prefix([5, 6, 7])[0].tolist()


def test_duplicate_insert_reports_them_and_frees_nothing() -> None:
    alloc, cache = make(16)
    first = alloc.alloc(3)
    cache.insert([1, 2, 3], first)
    second = alloc.alloc(4)
    free_before = alloc.available_size()
    res = cache.insert([1, 2, 3, 4], second)
    # second[:3] duplicate cached positions: the caller (holding no lock) frees them; second[3] is cached.
    assert res.cached_len == 3 and res.handle.cached_len == 4
    assert alloc.available_size() == free_before
    alloc.free(second[:3])
    got, _ = cache.match_prefix([1, 2, 3, 4])
    assert got.tolist() == first.tolist() + [second[3].item()]
    assert cache.slots_of(res.handle).tolist() == got.tolist()
    assert cache.total_size() == 4
    check_invariants(cache, alloc)


def test_insert_with_matched_slots_takes_only_the_new_ones() -> None:
    alloc, cache = make(16)
    cache_seq(cache, alloc, [1, 2, 3])
    free_before = alloc.available_size()
    prefix, _ = cache.match_prefix([1, 2, 3, 4, 5])
    new = alloc.alloc(2)
    res = cache.insert([1, 2, 3, 4, 5], torch.cat([prefix, new]))
    assert res.cached_len == 3 and res.handle.cached_len == 5
    assert alloc.available_size() == free_before - 2
    assert cache.total_size() == 5
    check_invariants(cache, alloc)


def test_insert_mixed_same_and_different_slots() -> None:
    alloc, cache = make(16)
    cached = cache_seq(cache, alloc, [1, 2, 3, 4])
    _, held = cache.match_prefix([1, 2])  # a request that reused the first two positions
    cache.lock(held)
    other = alloc.alloc(2)
    # Positions 0-1 reuse the tree's slots, 2-3 were computed again (e.g. in the same batch).
    mine = torch.tensor(cached[:2] + other.tolist())
    res = cache.insert([1, 2, 3, 4], mine)
    assert res.cached_len == 4
    assert mine[held.cached_len : res.cached_len].tolist() == other.tolist()  # exactly the duplicates
    alloc.free(mine[held.cached_len : res.cached_len])
    cache.unlock(held)
    assert not bool(alloc.is_free_mask()[torch.tensor(cached)].any())
    check_invariants(cache, alloc)


def test_evict_lru_first_and_returns_the_slots() -> None:
    alloc, cache = make(32)
    a = cache_seq(cache, alloc, [1, 1, 1])
    b = cache_seq(cache, alloc, [2, 2, 2])
    c = cache_seq(cache, alloc, [3, 3, 3])
    cache.match_prefix([1, 1, 1])  # a is now the most recent; b the least
    free_before = alloc.available_size()
    gone = cache.evict(1)
    assert gone.tolist() == b and alloc.available_size() == free_before  # whole leaves go; nothing freed
    alloc.free(gone)
    assert set(all_cached_sequences(cache)) == {(1, 1, 1), (3, 3, 3)}
    assert cache.evict(3).tolist() == c
    alloc.free(torch.tensor(c))
    assert set(all_cached_sequences(cache)) == {(1, 1, 1)}
    assert not bool(alloc.is_free_mask()[torch.tensor(a)].any())
    check_invariants(cache, alloc)


def test_partial_match_refreshes_only_the_matched_part() -> None:
    alloc, cache = make(32)
    cache_seq(cache, alloc, [1, 2, 3, 4])
    cache_seq(cache, alloc, [7, 7])
    cache.match_prefix([1, 2])  # splits; [1,2] is fresh, its child [3,4] is still old
    assert evict(cache, alloc, 1) == 2
    assert set(all_cached_sequences(cache)) == {(1, 2), (7, 7)}
    check_invariants(cache, alloc)


def test_lock_prevents_eviction() -> None:
    alloc, cache = make(32)
    cache_seq(cache, alloc, [1, 2, 3])
    cache_seq(cache, alloc, [1, 2, 4, 5])
    cache_seq(cache, alloc, [9])
    _, handle = cache.match_prefix([1, 2, 4, 5])
    cache.lock(handle)
    assert cache.protected_size() == 4  # [1,2] and [4,5]
    assert cache.evictable_size() == 2  # [3] and [9]
    assert evict(cache, alloc, 100) == 2
    assert set(all_cached_sequences(cache)) == {(1, 2, 4, 5)}
    assert evict(cache, alloc, 100) == 0
    cache.unlock(handle)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    assert evict(cache, alloc, 100) == 4
    assert alloc.available_size() == 32
    check_invariants(cache, alloc)


def test_parent_becomes_leaf_when_children_go() -> None:
    alloc, cache = make(32)
    cache_seq(cache, alloc, [1, 2, 3])
    cache_seq(cache, alloc, [1, 2, 4])
    cache_seq(cache, alloc, [8, 8, 8, 8])
    cache.match_prefix([8, 8, 8, 8])  # the [1,2,*] branch is older
    assert evict(cache, alloc, 2) == 2  # both single-token children ([3], [4]) go
    assert set(all_cached_sequences(cache)) == {(1, 2), (8, 8, 8, 8)}
    assert evict(cache, alloc, 1) == 2  # then [1,2], now a leaf, before the more recent [8,8,8,8]
    assert set(all_cached_sequences(cache)) == {(8, 8, 8, 8)}
    check_invariants(cache, alloc)


def test_locked_child_keeps_parent_and_split_keeps_handle() -> None:
    alloc, cache = make(32)
    cache_seq(cache, alloc, [1, 2, 3, 4])
    _, handle = cache.match_prefix([1, 2, 3, 4])
    cache.lock(handle)
    cache.match_prefix([1, 2])  # splits the locked node above it
    check_invariants(cache, alloc)
    assert cache.protected_size() == 4 and path_tokens(handle.node) == [1, 2, 3, 4]
    assert evict(cache, alloc, 10) == 0
    cache.unlock(handle)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    check_invariants(cache, alloc)


def test_insert_handle_locks_what_was_inserted() -> None:
    alloc, cache = make(32)
    cache_seq(cache, alloc, [1, 2])
    res = cache.insert([1, 2, 3, 4], torch.cat([cache.match_prefix([1, 2]).slots, alloc.alloc(2)]))
    cache.lock(res.handle)
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    assert path_tokens(res.handle.node) == [1, 2, 3, 4]
    cache.unlock(res.handle)
    check_invariants(cache, alloc)


def test_unbalanced_unlock_and_stale_handles_raise() -> None:
    alloc, cache = make(32)
    cache_seq(cache, alloc, [1, 2])
    _, handle = cache.match_prefix([1, 2])
    with pytest.raises(RuntimeError):
        cache.unlock(handle)
    evict(cache, alloc, 2)
    with pytest.raises(RuntimeError):
        cache.lock(handle)
    with pytest.raises(RuntimeError):
        cache.slots_of(handle)
    # Empty-prefix locks are no-ops.
    empty = cache.match_prefix([7]).handle
    cache.lock(empty)
    cache.unlock(empty)


def test_reset_returns_everything_and_refuses_while_locked() -> None:
    alloc, cache = make(32)
    a = cache_seq(cache, alloc, [1, 2, 3])
    b = cache_seq(cache, alloc, [1, 5])
    _, handle = cache.match_prefix([1, 5])
    cache.lock(handle)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(handle)
    gone = cache.reset()
    assert sorted(gone.tolist()) == sorted(set(a + b)) and cache.total_size() == 0
    alloc.free(gone)
    assert alloc.available_size() == 32
    assert cache.match_prefix([1, 2, 3])[0].numel() == 0
    with pytest.raises(RuntimeError):
        cache.lock(handle)
    check_invariants(cache, alloc)


def test_bad_input_raises_value_error() -> None:
    alloc, cache = make()
    with pytest.raises(ValueError, match="3 tokens but 2"):
        cache.insert([1, 2, 3], alloc.alloc(2))
    with pytest.raises(ValueError):
        cache.insert([1], [5])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RadixCache(page_size=0)
    with pytest.raises(ValueError, match="2 tokens but 1"):
        NoPrefixCache().insert([1, 2], alloc.alloc(1))


def test_tensor_keys_are_accepted() -> None:
    alloc, cache = make()
    slots = alloc.alloc(3)
    cache.insert(torch.tensor([4, 5, 6]), slots)  # type: ignore[arg-type]
    assert cache.match_prefix([4, 5, 6])[0].tolist() == slots.tolist()


def test_pages_align_keys_and_caller_keeps_the_tail() -> None:
    alloc, cache = make(32, page_size=2)
    slots = alloc.alloc(5)
    res = cache.insert([1, 2, 3, 4, 5], slots)
    assert res.cached_len == 0 and res.handle.cached_len == 4  # the tail [4:] is still the caller's
    assert cache.total_size() == 4
    alloc.free(slots[res.handle.cached_len :])
    assert cache.match_prefix([1, 2, 3, 9])[0].tolist() == slots[:2].tolist()
    assert cache.match_prefix([1, 9])[0].numel() == 0
    assert cache.match_prefix([1, 2, 3, 4, 5])[0].tolist() == slots[:4].tolist()
    check_invariants(cache, alloc)


def test_no_prefix_cache_keeps_nothing() -> None:
    alloc = TokenSlotAllocator(16)
    cache = NoPrefixCache()
    slots = alloc.alloc(4)
    res = cache.insert([1, 2, 3, 4], slots)
    assert res.cached_len == 0 and res.handle.cached_len == 0  # every slot stays the caller's
    assert alloc.available_size() == 12
    got, handle = cache.match_prefix([1, 2, 3, 4])
    assert got.numel() == 0 and handle.cached_len == 0 and cache.slots_of(handle).numel() == 0
    cache.lock(handle)
    cache.unlock(handle)
    assert cache.evict(10).numel() == 0 and cache.reset().numel() == 0 and cache.total_size() == 0
    assert not cache.shares_prefixes and RadixCache().shares_prefixes


def test_common_prefix_len_matches_a_naive_scan() -> None:
    import random

    from radixlm.backend.radix_cache import _common_prefix_len

    rng = random.Random(0)
    for _ in range(500):
        node_key = [rng.randrange(3) for _ in range(rng.randint(1, 300))]
        key = node_key[: rng.randint(0, len(node_key))] + [
            rng.randrange(3) for _ in range(rng.randint(0, 300))
        ]
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
    assert list(all_cached_sequences(cache)) == [(1, 2, 3, 4)]
    assert len(cache.root_node.children[1].key) == 4  # no split happened
    assert NoPrefixCache().cached_len([1, 2]) == 0
