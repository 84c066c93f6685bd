"""The radix tree prefix cache (RadixAttention) over the KV pool. The tree owns the KV slots it
caches and frees them to the TokenSlotAllocator (duplicate insert, evict, reset); it promises that
a locked path is never evicted, that evictable + protected == total, and that match_prefix returns
the longest cached prefix."""

from __future__ import annotations

import heapq
import itertools

import torch

from .kv_pool import TokenSlotAllocator
from .prefix_cache import (
    BasePrefixCache,
    NoPrefixCache,
    TreeNode,
    _as_slot_tensor,
    _as_token_list,
    _empty_slots,
)

__all__ = ["BasePrefixCache", "NoPrefixCache", "RadixCache", "TreeNode"]


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

    def __init__(self, allocator: TokenSlotAllocator, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._clock = itertools.count(1)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root_node = TreeNode([], _empty_slots(), None, 0)
        self._evictable = 0
        self._protected = 0
        self._evictable_leaves: set[TreeNode] = set()

    # ---- public API -------------------------------------------------------------------

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        key = _as_token_list(key)
        node, _, values = self._walk(key, next(self._clock))
        return (torch.cat(values) if values else _empty_slots()), node

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

    def insert(self, key: list[int], indices: torch.Tensor) -> int:
        key = _as_token_list(key)
        indices = _as_slot_tensor(indices, len(key))
        tick = next(self._clock)
        node, matched, values = self._walk(key, tick)
        if matched:
            mine = indices[:matched]
            duplicate = mine != torch.cat(values)
            if bool(duplicate.any()):
                self.allocator.free(mine[duplicate])
        aligned = len(key) - len(key) % self.page_size
        if matched < aligned:
            self._add_leaf(node, key[matched:aligned], indices[matched:aligned].clone(), tick)
        return matched

    def inc_lock_ref(self, node: TreeNode) -> None:
        self._check_attached(node)
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        self._check_attached(node)
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on an unlocked node {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                if not node.children:
                    self._evictable_leaves.add(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0 or not self._evictable_leaves:
            return 0
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
        self.allocator.free(torch.cat(slots))
        return freed

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"reset while {self._protected} cached tokens are locked")
        slots = [n.value for n in self._iter_nodes() if n.parent is not None]
        if slots:
            self.allocator.free(torch.cat(slots))
        for node in self._iter_nodes():
            node.parent = None  # stale handles now fail _check_attached
        self._init_tree()

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

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor, tick: int) -> None:
        leaf = TreeNode(key, value, parent, tick)
        parent.children[self._child_key(key, 0)] = leaf
        self._evictable += len(key)
        self._evictable_leaves.discard(parent)
        self._evictable_leaves.add(leaf)

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

    def _iter_nodes(self):
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- debugging / tests ------------------------------------------------------------

    def all_cached_sequences(self) -> dict[tuple[int, ...], list[int]]:
        """Every root → leaf path: its tokens → their KV slots (O(total); for tests)."""
        out: dict[tuple[int, ...], list[int]] = {}
        stack: list[tuple[TreeNode, tuple[int, ...], list[int]]] = [(self.root_node, (), [])]
        while stack:
            node, toks, slots = stack.pop()
            toks, slots = toks + tuple(node.key), slots + node.value.tolist()
            if node.children:
                stack.extend((c, toks, slots) for c in node.children.values())
            elif node.parent is not None:
                out[toks] = slots
        return out

    def check_invariants(self) -> None:
        """Walk the whole tree and raise AssertionError on any broken invariant (for tests)."""
        evictable = protected = 0
        leaves: set[TreeNode] = set()
        slots: list[torch.Tensor] = []
        for node in self._iter_nodes():
            for k, child in node.children.items():
                _require(child.parent is node, f"{child} has a wrong parent")
                _require(k == self._child_key(child.key, 0), f"{child} is filed under {k}")
            if node is self.root_node:
                _require(not node.key and node.lock_ref == 0, "root holds tokens or locks")
                continue
            self._check_node(node)
            if node.parent is not self.root_node:
                _require(node.parent.lock_ref >= node.lock_ref, f"{node} locked more than its parent")
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    leaves.add(node)
            slots.append(node.value)
        _require(evictable == self._evictable, f"evictable {self._evictable} != walked {evictable}")
        _require(protected == self._protected, f"protected {self._protected} != walked {protected}")
        _require(leaves == self._evictable_leaves, "evictable-leaf set out of date")
        self._check_slots(torch.cat(slots) if slots else _empty_slots())

    def _check_node(self, node: TreeNode) -> None:
        _require(len(node.key) > 0, f"{node} is empty")
        _require(len(node.key) % self.page_size == 0, f"{node} is not page-aligned")
        _require(node.value.dtype == torch.int64 and node.value.device.type == "cpu", f"{node} value type")
        _require(node.value.numel() == len(node.key), f"{node} has {node.value.numel()} slots")
        _require(node.lock_ref >= 0, f"{node} has a negative lock count")

    def _check_slots(self, slots: torch.Tensor) -> None:
        _require(slots.unique().numel() == slots.numel(), "a KV slot is cached twice")
        _require(bool((slots > 0).all()) and bool((slots <= self.allocator.size).all()), "bad slot id")
        if self.allocator.debug_checks and slots.numel():
            _require(not bool(self.allocator.is_free_mask()[slots].any()), "a cached slot is free")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)
