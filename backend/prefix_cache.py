"""The prefix-cache contract every cache honours (BasePrefixCache: match / insert / lock / evict,
stated in its docstrings), the handle a cache gives out for a cached prefix, and NoPrefixCache, the
cache when disabled. Promises: a cache never frees KV slots itself; slots it gives up (evict, reset)
are returned to the caller, which owns the allocator."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

_node_ids = itertools.count()


def _empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


def _as_token_list(key: Sequence[int] | torch.Tensor) -> list[int]:
    # Tensor elements would hash by identity in the children dict: always use plain ints.
    if isinstance(key, torch.Tensor):
        return key.tolist()
    return key if isinstance(key, list) else list(key)


def _as_slot_tensor(indices: torch.Tensor, n: int) -> torch.Tensor:
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"KV slot indices must be a tensor, got {type(indices).__name__}")
    if indices.numel() != n:
        raise ValueError(f"key has {n} tokens but {indices.numel()} KV slots were given")
    if indices.device.type != "cpu" or indices.dtype != torch.int64:
        indices = indices.to(device="cpu", dtype=torch.int64)
    return indices.reshape(-1)


class TreeNode:
    """One edge of the radix tree: a run of tokens (key) and their KV slots (value).

    lock_ref counts the locked handles whose path passes through this node; a node with
    lock_ref > 0 is protected. last_access is a logical clock (larger = more recent)."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "node_id")

    def __init__(
        self, key: list[int], value: torch.Tensor, parent: TreeNode | None, last_access: int
    ) -> None:
        self.key = key
        self.value = value
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access
        self.node_id = next(_node_ids)

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        head = self.key[:4]
        more = "..." if len(self.key) > 4 else ""
        return f"TreeNode(id={self.node_id}, key={head}{more}, len={len(self.key)}, lock={self.lock_ref})"


@dataclass(frozen=True, eq=False)
class CacheHandle:
    """A cached prefix of cached_len tokens, ending at `node` (the root for an empty prefix).

    Splits keep it valid: a split puts the new node above, so `node` still ends at the same
    token. Eviction or reset of an unlocked handle's node makes it stale (lock raises). Readers
    of the tree's shape (cascade grouping) follow node.parent; nothing else looks inside."""

    node: TreeNode
    cached_len: int


class PrefixMatch(NamedTuple):
    slots: torch.Tensor  # int64 CPU copy of the prefix's KV slots; len == handle.cached_len
    handle: CacheHandle


class InsertResult(NamedTuple):
    cached_len: int  # length of the key's prefix that was already cached before this insert
    handle: CacheHandle  # the prefix the cache now holds for this key (not locked)


class BasePrefixCache(ABC):
    """Contract between the cache manager and a prefix cache.

    Ownership: every KV slot is free in the allocator, held by exactly one running request, or
    held by the cache — never two, never none. Slots move into the cache only through insert();
    they leave it only through evict() and reset(), which return them: the caller frees them.
    A cache holds no allocator and never frees a slot.

    Locking: a request that reuses cached slots locks the handle match_prefix returned before
    anything else can evict, and unlocks it when it no longer needs those slots. A lock protects
    the whole prefix from eviction. Every lock is paired with exactly one unlock of the same
    handle. The prefix-length bookkeeping (which of a request's slots are the cache's) is the
    caller's: the first handle.cached_len slots of a locked request are the cache's."""

    # Whether match_prefix can ever return a non-empty prefix. Admission policies that order by
    # reuse skip their work when it is False.
    shares_prefixes: bool = True

    @abstractmethod
    def match_prefix(self, key: list[int]) -> PrefixMatch:
        """Longest cached prefix of key, as its slots and an unlocked handle. Marks the matched
        part as recently used and may split a node so the handle ends on a node boundary; the
        set of cached tokens does not change. The slots are safe to use once the handle is locked."""

    @abstractmethod
    def cached_len(self, key: list[int]) -> int:
        """Length of key's longest cached prefix, read-only: no split, no recency update."""

    @abstractmethod
    def insert(self, key: list[int], slots: torch.Tensor) -> InsertResult:
        """Offer key → slots to the cache; returns (cached_len, handle).

        The cache takes the slots of positions [cached_len, handle.cached_len): they are its own
        from now on. Positions below cached_len were already cached: where the caller's slot is
        one it got from match_prefix (below its locked handle's cached_len) it is the cache's
        already; the others — [caller's locked cached_len, cached_len) — are duplicates the caller
        frees (and stops reading: slots_of(handle) has the cache's). Positions from
        handle.cached_len on stay the caller's (a partial page, or a cache that keeps nothing)."""

    @abstractmethod
    def slots_of(self, handle: CacheHandle) -> torch.Tensor:
        """The KV slots of the handle's prefix (int64 CPU copy, handle.cached_len long)."""

    @abstractmethod
    def lock(self, handle: CacheHandle) -> None:
        """Protect the handle's prefix from eviction until unlock(handle). Raises RuntimeError
        for a stale handle (its prefix was evicted or reset)."""

    @abstractmethod
    def unlock(self, handle: CacheHandle) -> None:
        """Undo one lock(handle). Raises RuntimeError if the prefix was not locked."""

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Remove at least num_tokens cached slots (fewer only when fewer are evictable), unlocked
        leaves least-recently-used first; a parent whose last child goes becomes a candidate
        itself. Returns the removed slots (int64 CPU): the caller frees them."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Cached slots no locked handle protects."""

    @abstractmethod
    def protected_size(self) -> int:
        """Cached slots some locked handle protects."""

    def total_size(self) -> int:
        """All cached slots: evictable_size() + protected_size()."""
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def reset(self) -> torch.Tensor:
        """Drop everything; returns every cached slot for the caller to free. Raises RuntimeError
        while anything is locked. Handles given out before are stale afterwards."""


class NoPrefixCache(BasePrefixCache):
    """The cache when disabled: it keeps nothing. Every match is empty; insert takes no slot
    (cached_len 0, an empty handle), so the caller keeps and frees all of them; locks are no-ops."""

    shares_prefixes = False

    def __init__(self) -> None:
        self._empty = CacheHandle(TreeNode([], _empty_slots(), None, 0), 0)

    def match_prefix(self, key: list[int]) -> PrefixMatch:
        return PrefixMatch(_empty_slots(), self._empty)

    def cached_len(self, key: list[int]) -> int:
        return 0

    def insert(self, key: list[int], slots: torch.Tensor) -> InsertResult:
        _as_slot_tensor(slots, len(_as_token_list(key)))  # the same input checks as a real cache
        return InsertResult(0, self._empty)

    def slots_of(self, handle: CacheHandle) -> torch.Tensor:
        return _empty_slots()

    def lock(self, handle: CacheHandle) -> None:
        return None

    def unlock(self, handle: CacheHandle) -> None:
        return None

    def evict(self, num_tokens: int) -> torch.Tensor:
        return _empty_slots()

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> torch.Tensor:
        return _empty_slots()
