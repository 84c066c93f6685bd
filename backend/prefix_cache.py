"""The prefix-cache contract every cache honours (BasePrefixCache: match / insert / lock / evict,
stated in its docstrings), its tree node handle, and NoPrefixCache, the cache when disabled.
Promises: a cache owns the KV slots it holds and frees them to the TokenSlotAllocator itself."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from .kv_pool import TokenSlotAllocator

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

    lock_ref counts the running requests whose locked path passes through this node; a node
    with lock_ref > 0 is protected. last_access is a logical clock (larger = more recent)."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "node_id")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, last_access: int) -> None:
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


class BasePrefixCache(ABC):
    """Contract between the scheduler and a prefix cache.

    Ownership: every KV slot is free in the allocator, held by exactly one running request,
    or held by the cache — never two, never none. Slots move into the cache only through
    insert(); they leave it only through evict() / reset() (which free them) or when insert()
    frees a caller's duplicate.

    Locking: a request that reuses cached slots locks the node match_prefix returned
    (inc_lock_ref) before anything else can evict, and unlocks it (dec_lock_ref) when it no
    longer needs those slots. A lock protects the whole path node → root from eviction.
    Every inc_lock_ref is paired with exactly one dec_lock_ref on the same node object.

    Nodes stay valid handles across splits: splitting puts a new node above the split one,
    so a locked or returned node still ends at the same token.
    """

    root_node: TreeNode
    disabled: bool = False  # True only for NoPrefixCache: nothing is ever shared

    @abstractmethod
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of key: (int64 CPU tensor of its KV slots, last matched node).
        Splits a node when the match ends inside it. Updates LRU access time. Does not lock.
        The returned tensor is a copy the caller may keep."""

    @abstractmethod
    def cached_len(self, key: list[int]) -> int:
        """Length of key's longest cached prefix, read-only: no split, no LRU update."""

    @abstractmethod
    def insert(self, key: list[int], indices: torch.Tensor) -> int:
        """Cache key → slots. Returns the length of key's prefix that was already cached.
        Where a position was already cached under a DIFFERENT slot, the caller's slot is a
        duplicate and insert frees it to the allocator; positions whose slot equals the tree's
        (the caller got it from match_prefix) are left alone. After insert the tree owns all of
        key's slots (with page_size > 1: all slots of key's page-aligned part; the caller keeps
        the slots of the last, partial page)."""

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock the path node → root: none of it can be evicted until dec_lock_ref(node)."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one inc_lock_ref(node). Raises RuntimeError if the path was not locked."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens cached slots (fewer only when fewer are evictable),
        removing unlocked leaves least-recently-used first; a parent whose last child goes
        becomes a leaf and a candidate itself. Returns the number of slots freed."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Cached slots on no locked path."""

    @abstractmethod
    def protected_size(self) -> int:
        """Cached slots on some locked path."""

    def total_size(self) -> int:
        """All cached slots: evictable_size() + protected_size()."""
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def reset(self) -> None:
        """Free every cached slot. The caller ensures nothing is locked (else RuntimeError)."""


class NoPrefixCache(BasePrefixCache):
    """The cache when disabled: nothing is ever cached. match → empty; insert frees every
    given slot and returns 0; locks are no-ops; sizes are 0."""

    disabled = True

    def __init__(self, allocator: TokenSlotAllocator, page_size: int = 1) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.root_node = TreeNode([], _empty_slots(), None, 0)

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        return _empty_slots(), self.root_node

    def cached_len(self, key: list[int]) -> int:
        return 0

    def insert(self, key: list[int], indices: torch.Tensor) -> int:
        self.allocator.free(_as_slot_tensor(indices, len(_as_token_list(key))))
        return 0

    def inc_lock_ref(self, node: TreeNode) -> None:
        return None

    def dec_lock_ref(self, node: TreeNode) -> None:
        return None

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        return None

    def all_cached_sequences(self) -> dict[tuple[int, ...], list[int]]:
        return {}

    def check_invariants(self) -> None:
        return None
