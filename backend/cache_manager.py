"""CacheManager: the scheduler's only owner of the prefix cache, the KV slot allocator and the
request→token table. Places a request on a table row with its cached prefix locked, allocates
slots (evicting from the cache only what it must), shares a prompt's computed part while the rest
is prefilled, and hands a finished request's KV to the cache or the free list. Invariant: every
slot is free, held by exactly one request's row, or held by the cache (pinned prefixes included)."""

from __future__ import annotations

from typing import Any

import torch

from .kv_pool import ReqToTokenTable, TokenSlotAllocator
from .request import Req


class CacheManager:
    def __init__(self, cache: Any, allocator: TokenSlotAllocator, req_table: ReqToTokenTable) -> None:
        self.cache = cache
        self.allocator = allocator
        self.req_table = req_table
        self.pinned: dict[int, Any] = {}  # handle → locked cache node (engine.pin_prefix)

    def available(self) -> int:
        return self.allocator.available_size()

    def make_room(self, need: int) -> bool:
        """Evict cached prefixes until `need` slots are free, if the cache holds enough; True if so."""
        short = need - self.allocator.available_size()
        if short > 0:
            self.cache.evict(short)
        return need <= self.allocator.available_size()

    def alloc(self, n: int) -> torch.Tensor | None:
        return self.allocator.alloc(n)

    def alloc_for_prefill(self, want: int, reserve: int, anyone_running: bool) -> torch.Tensor | None:
        """Slots for up to `want` prompt tokens, keeping `reserve` free for running decodes
        (unless nothing runs). Evicts from the cache only what is needed; None if nothing fits."""
        room = self.allocator.available_size() + self.cache.evictable_size()
        n = min(want, room - reserve if anyone_running else room)
        if n <= 0:
            return None
        if n > self.allocator.available_size():
            self.cache.evict(n - self.allocator.available_size())
        n = min(n, self.allocator.available_size())
        return self.allocator.alloc(n) if n > 0 else None

    def place(self, req: Req) -> bool:
        """Give a request a table row and its cached prefix (locked); False when no row is free."""
        row = self.req_table.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        prefix_slots, node = self.cache.match_prefix(req.all_ids[: req.max_prefix_len()])
        self.cache.inc_lock_ref(node)
        req.last_node = node
        req.prefix_len = req.kv_len = int(prefix_slots.numel())
        if prefix_slots.numel():
            self.req_table.write(row, 0, prefix_slots)
        return True

    def release(self, req: Req, cache_it: bool) -> None:
        """Give the request's KV to the cache (or free it) and unlock its prefix. Slots past its
        known tokens (written for an in-flight token) are freed, never cached."""
        row = req.req_pool_idx
        assert row is not None
        slots = self.req_table.read(row, 0, req.kv_len)
        keep = req.prefix_len
        if cache_it:
            keep = max(min(req.kv_len, req.seq_len), req.prefix_len)
            ids = req.all_ids[:keep]
            self.cache.insert(ids, slots[:keep])
            if req.pin_handle is not None:
                _, node = self.cache.match_prefix(ids)
                self.cache.inc_lock_ref(node)
                self.pinned[req.pin_handle] = node
        self.allocator.free(slots[keep:])
        self.cache.dec_lock_ref(req.last_node)
        self.req_table.free(row)
        req.req_pool_idx, req.last_node, req.prefix_len, req.kv_len = None, None, 0, 0
        req.pending, req.pending_step = -1, None

    def cache_unfinished(self, req: Req, upto: int) -> None:
        """After a prompt chunk: put its first `upto` tokens (computed) in the cache and lock them
        there, so others can share them while the rest is still being prefilled."""
        if self.cache.disabled:  # NoPrefixCache.insert would free the request's own slots
            return
        row = req.req_pool_idx
        assert row is not None
        ids = req.all_ids[:upto]
        self.cache.insert(ids, self.req_table.read(row, 0, upto))
        slots, node = self.cache.match_prefix(ids)
        self.req_table.write(row, 0, slots)
        self.cache.dec_lock_ref(req.last_node)
        self.cache.inc_lock_ref(node)
        req.last_node, req.prefix_len = node, int(slots.numel())

    def unpin(self, handle: int) -> None:
        node = self.pinned.pop(handle, None)
        if node is not None:
            self.cache.dec_lock_ref(node)
