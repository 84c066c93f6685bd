"""CacheManager: the scheduler's only owner of the prefix cache, the KV slot allocator and the
request→token table. Places a request on a table row with its cached prefix locked, allocates
slots (evicting from the cache only what it must), shares a prompt's computed part while the rest
is prefilled, and hands a finished request's KV to the cache or the free list. Invariant: every
slot is free, held by exactly one request's row, or held by the cache (pinned prefixes included)."""

from __future__ import annotations

import torch

from .kv_pool import ReqToTokenTable, TokenSlotAllocator
from .prefix_cache import BasePrefixCache, CacheHandle
from .request import Req


class CacheManager:
    def __init__(
        self, cache: BasePrefixCache, allocator: TokenSlotAllocator, req_table: ReqToTokenTable
    ) -> None:
        self.cache = cache
        self.allocator = allocator
        self.req_table = req_table
        self.pinned: dict[int, CacheHandle] = {}  # pin id → locked prefix (engine.pin_prefix)

    def available(self) -> int:
        return self.allocator.available_size()

    def evict(self, n: int) -> None:
        """Evict at least n cached slots (fewer if fewer are evictable) and free them."""
        if n > 0:
            self.allocator.free(self.cache.evict(n))

    def make_room(self, need: int) -> bool:
        """Evict cached prefixes until `need` slots are free, if the cache holds enough; True if so."""
        self.evict(need - self.allocator.available_size())
        return need <= self.allocator.available_size()

    def alloc(self, n: int) -> torch.Tensor | None:
        return self.allocator.alloc(n)

    def room(self) -> int:
        """Slots a new request could get now: free ones and those the cache could evict."""
        return self.allocator.available_size() + self.cache.evictable_size()

    def alloc_for_prefill(self, want: int, reserve: int, anyone_running: bool) -> torch.Tensor | None:
        """Slots for up to `want` prompt tokens, keeping `reserve` free for running decodes
        (unless nothing runs). Evicts from the cache only what is needed; None if nothing fits."""
        room = self.room()
        n = min(want, room - reserve if anyone_running else room)
        if n <= 0:
            return None
        self.evict(n - self.allocator.available_size())
        n = min(n, self.allocator.available_size())
        return self.allocator.alloc(n) if n > 0 else None

    def flush(self) -> None:
        """Empty the cache and free its slots (nothing may be locked)."""
        self.allocator.free(self.cache.reset())

    def place(self, req: Req) -> bool:
        """Give a request a table row and its cached prefix (locked); False when no row is free."""
        row = self.req_table.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        match = self.cache.match_prefix(req.all_ids[: req.max_prefix_len()])
        self.cache.lock(match.handle)
        req.cache_handle = match.handle
        req.prefix_len = req.kv_len = match.handle.cached_len
        if match.handle.cached_len:
            self.req_table.write(row, 0, match.slots)
        return True

    def release(self, req: Req, cache_it: bool) -> None:
        """Give the request's KV to the cache (or free it) and unlock its prefix. Slots past its
        known tokens (written for an in-flight token) are freed, never cached."""
        row, held = req.req_pool_idx, req.cache_handle
        assert row is not None and held is not None
        slots = self.req_table.read(row, 0, req.kv_len)
        keep = req.prefix_len  # the cache's slots: [0, keep) after this
        if cache_it:
            n = max(min(req.kv_len, req.seq_len), req.prefix_len)
            res = self.cache.insert(req.all_ids[:n], slots[:n])
            self.allocator.free(slots[req.prefix_len : res.cached_len])  # duplicates of cached KV
            keep = max(keep, res.handle.cached_len)
            if req.pin_handle is not None:
                self.cache.lock(res.handle)
                self.pinned[req.pin_handle] = res.handle
        self.allocator.free(slots[keep:])
        self.cache.unlock(held)
        self.req_table.free(row)
        req.req_pool_idx, req.cache_handle, req.prefix_len, req.kv_len = None, None, 0, 0

    def truncate(self, req: Req, n: int) -> None:
        """Keep only the first n tokens' KV of a request (rejected draft tokens' slots go back
        to the free list; they are the request's own, never the cache's)."""
        row = req.req_pool_idx
        assert row is not None and req.prefix_len <= n
        if n < req.kv_len:
            self.allocator.free(self.req_table.read(row, n, req.kv_len))
            req.kv_len = n

    def cache_unfinished(self, req: Req, upto: int) -> None:
        """After a prompt chunk: offer its first `upto` tokens (computed) to the cache and lock what
        it keeps, so others can share them while the rest is still being prefilled."""
        row, held = req.req_pool_idx, req.cache_handle
        assert row is not None and held is not None
        slots = self.req_table.read(row, 0, upto)
        res = self.cache.insert(req.all_ids[:upto], slots)
        if res.cached_len > req.prefix_len:  # another request cached these tokens meanwhile: read its KV
            self.allocator.free(slots[req.prefix_len : res.cached_len])
            shared = self.cache.slots_of(res.handle)[req.prefix_len : res.cached_len]
            self.req_table.write(row, req.prefix_len, shared)
        self.cache.lock(res.handle)
        self.cache.unlock(held)
        req.cache_handle, req.prefix_len = res.handle, res.handle.cached_len

    def unpin(self, pin_id: int) -> None:
        handle = self.pinned.pop(pin_id, None)
        if handle is not None:
            self.cache.unlock(handle)
