"""Hypothesis stateful test of RadixCache against a naive model: a dict from every cached
prefix (tuple of tokens, whole pages) to its last page's KV slots and last-access tick, plus simulated
running requests that own slots and lock what they matched, driven the way the cache manager
drives the cache (it frees what evict returns and the duplicates insert reports). After every
step: the tree caches exactly the model's prefixes with the same slots; each slot is free, owned
by one request, or cached — never two, never none; sizes match the locks; nothing locked is
evicted; evictions go least-recently-used first; the cache itself never frees a slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from cache_checks import all_cached_sequences, check_invariants, path_tokens
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.backend.kv_pool import TokenSlotAllocator
from radixlm.backend.radix_cache import CacheHandle, RadixCache

POOL = 40
keys = st.lists(st.integers(0, 1), min_size=1, max_size=10)
picks = st.integers(0, 10_000)


@dataclass
class Req:
    key: list[int]
    slots: list[int]
    cached_len: int  # slots[:cached_len] belong to the tree (locked); the rest to the request
    handle: CacheHandle


class RadixModelMachine(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.alloc = TokenSlotAllocator(POOL)
        self.cache = RadixCache(page_size=self.page_size)
        self.slot_of: dict[tuple[int, ...], tuple[int, ...]] = {}  # cached prefix → its last page's slots
        self.tick_of: dict[tuple[int, ...], int] = {}  # ... → when it was last matched/inserted
        self.clock = 0
        self.reqs: dict[int, Req] = {}
        self.next_rid = 0

    # ---- model helpers ----------------------------------------------------------------

    def aligned(self, n: int) -> int:
        return n - n % self.page_size

    def page_ends(self, n: int) -> range:
        """Lengths of key's page-aligned prefixes up to n tokens (n is aligned)."""
        return range(self.page_size, n + 1, self.page_size)

    def expected_match(self, key: list[int]) -> int:
        j = 0
        while j + self.page_size <= len(key) and tuple(key[: j + self.page_size]) in self.slot_of:
            j += self.page_size
        return j

    def slots_of(self, key: list[int], n: int) -> list[int]:
        return [s for j in self.page_ends(n) for s in self.slot_of[tuple(key[:j])]]

    def stamp(self, key: list[int], n: int) -> None:
        self.clock += 1
        for j in self.page_ends(n):
            self.tick_of[tuple(key[:j])] = self.clock

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        return {tuple(r.key[:j]) for r in self.reqs.values() for j in self.page_ends(r.cached_len)}

    def tree_prefixes(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        out: dict[tuple[int, ...], tuple[int, ...]] = {}
        for toks, slots in all_cached_sequences(self.cache).items():
            for j in self.page_ends(len(toks)):
                out[toks[:j]] = tuple(slots[j - self.page_size : j])
        return out

    # ---- checked operations -----------------------------------------------------------

    def match(self, key: list[int]) -> tuple[list[int], CacheHandle]:
        want = self.expected_match(key)
        assert self.cache.cached_len(key) == want
        got, handle = self.cache.match_prefix(key)
        assert got.dtype == torch.int64 and got.numel() == want == handle.cached_len
        assert got.tolist() == self.slots_of(key, want)
        assert path_tokens(handle.node) == key[:want]
        self.stamp(key, want)
        return got.tolist(), handle

    def insert(self, key: list[int], slots: list[int], held: int) -> CacheHandle:
        """Insert as a request whose first `held` slots came from its locked match, update the
        model, and free the duplicates the way the cache manager does: slots[held:cached_len]."""
        n = self.aligned(len(key))
        want_prefix = self.expected_match(key)
        dups = []
        for j in self.page_ends(n):
            p, mine = tuple(key[:j]), tuple(slots[j - self.page_size : j])
            if p not in self.slot_of:
                self.slot_of[p] = mine
            else:
                dups += [a for a, b in zip(mine, self.slot_of[p]) if a != b]
        free_before = self.alloc.available_size()
        res = self.cache.insert(key, torch.tensor(slots, dtype=torch.int64))
        assert self.alloc.available_size() == free_before  # the cache frees nothing itself
        assert res.cached_len == want_prefix and res.handle.cached_len == n
        assert path_tokens(res.handle.node) == key[:n]
        assert sorted(slots[held : res.cached_len]) == sorted(dups), "the caller's duplicate rule is wrong"
        self.alloc.free(torch.tensor(slots[held : res.cached_len], dtype=torch.int64))
        assert self.cache.slots_of(res.handle).tolist() == self.slots_of(key, n)
        self.stamp(key, n)
        return res.handle

    def evict(self, n: int) -> None:
        before = dict(self.slot_of)
        locked = self.locked_prefixes()
        evictable = len(before) - len(locked)
        free_before = self.alloc.available_size()
        gone = self.cache.evict(n)
        assert self.alloc.available_size() == free_before  # returned, not freed
        after = self.tree_prefixes()
        assert all(p in before and before[p] == s for p, s in after.items())
        removed = set(before) - set(after)
        assert not removed & locked, "evicted a locked prefix"
        assert sorted(gone.tolist()) == sorted(s for p in removed for s in before[p])
        self.alloc.free(gone)
        freed = int(gone.numel())
        evictable *= self.page_size
        assert freed >= n if n <= evictable else freed == evictable
        self.check_lru(removed, after, locked)
        self.slot_of = after
        for p in removed:
            del self.tick_of[p]

    def check_lru(self, removed: set, after: dict, locked: set) -> None:
        """Nothing evicted was used more recently than an unlocked leaf that stayed."""
        if not removed:
            return
        parents = {p[: -self.page_size] for p in after}
        kept_leaves = [p for p in after if p not in parents and p not in locked]
        if kept_leaves:
            assert max(self.tick_of[p] for p in removed) <= min(self.tick_of[p] for p in kept_leaves)

    # ---- rules ------------------------------------------------------------------------

    @rule(key=keys)
    def start_request(self, key: list[int]) -> None:
        prefix, handle = self.match(key)
        self.cache.lock(handle)
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.reqs[rid] = req = Req(key, prefix, len(prefix), handle)  # its lock counts while evicting
        need = len(key) - len(prefix)
        if need > self.alloc.available_size():
            self.evict(need - self.alloc.available_size())
        new = self.alloc.alloc(need)
        if new is None:
            del self.reqs[rid]
            self.cache.unlock(handle)
            return
        req.slots = prefix + new.tolist()

    @rule(key=keys)
    def run_request_to_end(self, key: list[int]) -> None:
        """A request that starts and finishes at once: fills the tree faster."""
        before = set(self.reqs)
        self.start_request(key)
        for rid in set(self.reqs) - before:
            self.finish_request(sorted(self.reqs).index(rid))

    def pick(self, i: int) -> int:
        return sorted(self.reqs)[i % len(self.reqs)]

    @precondition(lambda self: self.reqs)
    @rule(i=picks, cut=picks)
    def cache_partial(self, i: int, cut: int) -> None:
        """Chunked prefill: cache key[:k] while the request keeps running on the tree's slots."""
        req = self.reqs[self.pick(i)]
        k = req.cached_len + cut % (len(req.key) - req.cached_len + 1)
        handle = self.insert(req.key[:k], req.slots[:k], req.cached_len)
        assert handle.cached_len >= req.cached_len
        self.cache.lock(handle)
        self.cache.unlock(req.handle)
        req.slots[: handle.cached_len] = self.cache.slots_of(handle).tolist()  # duplicates replaced
        req.cached_len, req.handle = handle.cached_len, handle

    @precondition(lambda self: self.reqs)
    @rule(i=picks)
    def finish_request(self, i: int) -> None:
        req = self.reqs.pop(self.pick(i))
        handle = self.insert(req.key, req.slots, req.cached_len)
        self.alloc.free(torch.tensor(req.slots[handle.cached_len :], dtype=torch.int64))
        self.cache.unlock(req.handle)

    @precondition(lambda self: self.reqs)
    @rule(i=picks)
    def abort_request(self, i: int) -> None:
        req = self.reqs.pop(self.pick(i))
        self.alloc.free(torch.tensor(req.slots[req.cached_len :], dtype=torch.int64))
        self.cache.unlock(req.handle)

    @rule(key=keys)
    def match_only(self, key: list[int]) -> None:
        self.match(key)

    @rule(n=st.integers(0, 6))  # small: some leaves stay, so LRU order is checked (start_request evicts more)
    def evict_some(self, n: int) -> None:
        self.evict(n)

    @precondition(lambda self: not self.reqs)
    @rule()
    def reset(self) -> None:
        gone = self.cache.reset()
        assert sorted(gone.tolist()) == sorted(s for page in self.slot_of.values() for s in page)
        self.alloc.free(gone)
        self.slot_of.clear()
        self.tick_of.clear()
        assert self.alloc.available_size() == POOL

    # ---- invariants -------------------------------------------------------------------

    @invariant()
    def tree_matches_model(self) -> None:
        check_invariants(self.cache, self.alloc)
        assert self.tree_prefixes() == self.slot_of
        locked = self.locked_prefixes()
        assert self.cache.protected_size() == len(locked) * self.page_size
        assert self.cache.evictable_size() == (len(self.slot_of) - len(locked)) * self.page_size
        for r in self.reqs.values():  # what a running request reads is still cached, unchanged
            assert self.slots_of(r.key, r.cached_len) == r.slots[: r.cached_len]

    @invariant()
    def every_slot_has_exactly_one_owner(self) -> None:
        owners = [0] * (POOL + 1)
        for page in self.slot_of.values():
            for s in page:
                owners[s] += 1
        for r in self.reqs.values():
            for s in r.slots[r.cached_len :]:
                owners[s] += 1
        free = self.alloc.is_free_mask().tolist()
        for s in range(1, POOL + 1):
            owners[s] += free[s]
        assert owners[1:] == [1] * POOL
        assert self.alloc.available_size() == sum(free)


class PagedRadixModelMachine(RadixModelMachine):
    page_size = 2


_settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRadixCacheModel = RadixModelMachine.TestCase
TestRadixCacheModel.settings = _settings
TestPagedRadixCacheModel = PagedRadixModelMachine.TestCase
TestPagedRadixCacheModel.settings = _settings
