"""The radix tree prefix cache (RadixAttention) over KV slot ids. It honours BasePrefixCache's
contract: it holds slots but never frees one (evict and reset return them), a locked prefix is
never evicted, evictable + protected == total, and match_prefix returns the longest cached prefix.
The invariant walk over the whole tree lives with the tests (tests/cache_checks.py)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

import torch

from .prefix_cache import (
    BasePrefixCache,
    CacheHandle,
    InsertResult,
    NoPrefixCache,
    PrefixMatch,
    TreeNode,
    _as_slot_tensor,
    _as_token_list,
    _empty_slots,
)

__all__ = [
    "BasePrefixCache",
    "CacheHandle",
    "InsertResult",
    "NoPrefixCache",
    "PrefixMatch",
    "RadixCache",
    "TreeNode",
]


def _common_prefix_len(node_key: list[int], key: list[int], start: int, stop: int) -> int:
    """Length of the common prefix of node_key and key[start:stop]. Slice compares run in C;
    on a mismatch, 64-token blocks find the differing block before a short Python scan."""
    n = min(len(node_key), stop - start)
    head = node_key if n == len(node_key) else node_key[:n]
    if key[start : start + n] == head:
        return n
    i = 0
    while key[start + i : start + i + 64] == node_key[i : i + 64]:
        i += 64
    while node_key[i] == key[start + i]:
        i += 1
    return i


class RadixCache(BasePrefixCache):
    """Radix tree over token ids; children are keyed by their first token (first page when
    page_size > 1), keys are lists of ints, values int64 CPU tensors of KV slots.

    Costs: match_prefix / insert are O(len(key)) plus O(depth) tensor ops; lock/unlock are
    O(depth); evict is O(L + k log L) for L unlocked leaves and k evicted nodes (the set of
    unlocked leaves is kept up to date, so no walk over the tree)."""

    def __init__(self, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._clock = itertools.count(1)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root_node = TreeNode([], _empty_slots(), None, 0)
        self._evictable = 0
        self._protected = 0
        self._evictable_leaves: set[TreeNode] = set()

    # ---- public API -------------------------------------------------------------------

    def match_prefix(self, key: list[int]) -> PrefixMatch:
        key = _as_token_list(key)
        node, matched, values = self._walk(key, next(self._clock))
        return PrefixMatch(torch.cat(values) if values else _empty_slots(), CacheHandle(node, matched))

    def cached_len(self, key: list[int]) -> int:
        key = _as_token_list(key)
        node, pos = self.root_node, 0
        stop = len(key) - len(key) % self.page_size
        while pos < stop:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            m = _common_prefix_len(child.key, key, pos, stop)
            pos += m - m % self.page_size
            if m < len(child.key):
                break
            node = child
        return pos

    def insert(self, key: list[int], slots: torch.Tensor) -> InsertResult:
        key = _as_token_list(key)
        slots = _as_slot_tensor(slots, len(key))
        tick = next(self._clock)
        node, matched, _ = self._walk(key, tick)
        aligned = len(key) - len(key) % self.page_size
        if matched < aligned:
            node = self._add_leaf(node, key[matched:aligned], slots[matched:aligned].clone(), tick)
        return InsertResult(matched, CacheHandle(node, aligned))

    def slots_of(self, handle: CacheHandle) -> torch.Tensor:
        self._check_attached(handle.node)
        values, node = [], handle.node
        while node.parent is not None:
            values.append(node.value)
            node = node.parent
        return torch.cat(values[::-1]) if values else _empty_slots()

    def lock(self, handle: CacheHandle) -> None:
        node = handle.node
        self._check_attached(node)
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: CacheHandle) -> None:
        node = handle.node
        self._check_attached(node)
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked prefix at {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                if not node.children:
                    self._evictable_leaves.add(node)
            node = node.parent

    def evict(self, num_tokens: int) -> torch.Tensor:
        if num_tokens <= 0 or not self._evictable_leaves:
            return _empty_slots()
        heap = [(n.last_access, n.node_id, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed, slots = 0, []
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[2]
            slots.append(node.value)
            freed += len(node.key)
            parent = self._detach_leaf(node)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                self._evictable_leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return torch.cat(slots)

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def reset(self) -> torch.Tensor:
        if self._protected:
            raise RuntimeError(f"reset while {self._protected} cached tokens are locked")
        slots = [n.value for n in self._iter_nodes() if n.parent is not None]
        for node in self._iter_nodes():
            node.parent = None  # stale handles now fail _check_attached
        self._init_tree()
        return torch.cat(slots) if slots else _empty_slots()

    # ---- tree mechanics ---------------------------------------------------------------

    def _child_key(self, key: list[int], pos: int) -> int | tuple[int, ...]:
        if self.page_size == 1:
            return key[pos]
        return tuple(key[pos : pos + self.page_size])

    def _walk(self, key: list[int], tick: int) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow key's page-aligned part down the tree, splitting where the match ends inside
        a node; stamp every matched node with tick. Returns (last node, matched length, the
        matched nodes' slot tensors in order)."""
        node, pos, values = self.root_node, 0, []
        stop = len(key) - len(key) % self.page_size
        while pos < stop:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            m = _common_prefix_len(child.key, key, pos, stop)
            m -= m % self.page_size  # >= page_size: the child's first page matched
            partial = m < len(child.key)
            if partial:
                child = self._split(child, m)
            child.last_access = tick
            values.append(child.value)
            pos += m
            node = child
            if partial:
                break
        return node, pos, values

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split child after its first m tokens; the new upper node is returned. The lower
        part stays the same object so handles to it (locks) stay valid."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[:m], child.value[:m], parent, child.last_access)
        upper.lock_ref = child.lock_ref
        parent.children[self._child_key(child.key, 0)] = upper
        child.key = child.key[m:]
        child.value = child.value[m:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor, tick: int) -> TreeNode:
        leaf = TreeNode(key, value, parent, tick)
        parent.children[self._child_key(key, 0)] = leaf
        self._evictable += len(key)
        self._evictable_leaves.discard(parent)
        self._evictable_leaves.add(leaf)
        return leaf

    def _detach_leaf(self, node: TreeNode) -> TreeNode:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[self._child_key(node.key, 0)]
        self._evictable_leaves.discard(node)
        self._evictable -= len(node.key)
        node.parent = None
        return parent

    def _check_attached(self, node: TreeNode) -> None:
        if node.parent is None and node is not self.root_node:
            raise RuntimeError(f"{node} is not in the tree (evicted or reset)")

    def _iter_nodes(self) -> Iterator[TreeNode]:
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
