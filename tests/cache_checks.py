"""Test helpers for the prefix cache: the whole-tree invariant walk of a RadixCache (sizes, the
evictable-leaf set, parents, page alignment, one owner per slot) and its cached sequences. They read
the tree's private bookkeeping on purpose: the library keeps no self-check of its own."""

from __future__ import annotations

import torch

from radixlm.backend.kv_pool import TokenSlotAllocator
from radixlm.backend.radix_cache import RadixCache, TreeNode


def all_cached_sequences(cache: RadixCache) -> dict[tuple[int, ...], list[int]]:
    """Every root → leaf path: its tokens → their KV slots."""
    out: dict[tuple[int, ...], list[int]] = {}
    stack: list[tuple[TreeNode, tuple[int, ...], list[int]]] = [(cache.root_node, (), [])]
    while stack:
        node, toks, slots = stack.pop()
        toks, slots = toks + tuple(node.key), slots + node.value.tolist()
        if node.children:
            stack.extend((c, toks, slots) for c in node.children.values())
        elif node.parent is not None:
            out[toks] = slots
    return out


def path_tokens(node: TreeNode) -> list[int]:
    """The tokens from the root down to the end of node."""
    out: list[int] = []
    while node.parent is not None:
        out = node.key + out
        node = node.parent
    return out


def check_invariants(cache: RadixCache, allocator: TokenSlotAllocator | None = None) -> None:
    """Walk the whole tree; AssertionError on any broken invariant. With the allocator: no cached
    slot is free and every slot id is in range."""
    evictable = protected = 0
    leaves: set[TreeNode] = set()
    slots: list[torch.Tensor] = []
    for node in cache._iter_nodes():
        for k, child in node.children.items():
            assert child.parent is node, f"{child} has a wrong parent"
            assert k == cache._child_key(child.key, 0), f"{child} is filed under {k}"
        if node is cache.root_node:
            assert not node.key and node.lock_ref == 0, "root holds tokens or locks"
            continue
        _check_node(cache, node)
        if node.lock_ref:
            protected += len(node.key)
        else:
            evictable += len(node.key)
            if not node.children:
                leaves.add(node)
        slots.append(node.value)
    assert evictable == cache._evictable, f"evictable {cache._evictable} != walked {evictable}"
    assert protected == cache._protected, f"protected {cache._protected} != walked {protected}"
    assert leaves == cache._evictable_leaves, "evictable-leaf set out of date"
    flat = torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)
    assert flat.unique().numel() == flat.numel(), "a KV slot is cached twice"
    if allocator is not None and flat.numel():
        assert bool((flat > 0).all()) and bool((flat <= allocator.size).all()), "bad slot id"
        if allocator.debug_checks:
            assert not bool(allocator.is_free_mask()[flat].any()), "a cached slot is free"


def _check_node(cache: RadixCache, node: TreeNode) -> None:
    assert len(node.key) > 0, f"{node} is empty"
    assert len(node.key) % cache.page_size == 0, f"{node} is not page-aligned"
    assert node.value.dtype == torch.int64 and node.value.device.type == "cpu", f"{node} value type"
    assert node.value.numel() == len(node.key), f"{node} has {node.value.numel()} slots"
    assert node.lock_ref >= 0, f"{node} has a negative lock count"
    parent = node.parent
    assert parent is not None
    if parent is not cache.root_node:
        assert parent.lock_ref >= node.lock_ref, f"{node} locked more than its parent"
