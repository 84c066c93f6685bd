"""Hypothesis stateful test of CacheManager over both caches (RadixCache and NoPrefixCache), driven
the way the scheduler drives it: place a request (cached prefix locked on a table row), allocate
and offer prompt chunks, finish (cache it) or abort (free it), evict under pressure, flush when
idle. After every step each KV slot has exactly one owner — free, a request's own part of its row,
or the cache — and every request's cached part of its row is what its locked handle holds."""

from __future__ import annotations

import torch
from cache_checks import check_invariants
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.backend.cache_manager import CacheManager
from radixlm.backend.kv_pool import ReqToTokenTable, TokenSlotAllocator
from radixlm.backend.prefix_cache import BasePrefixCache, NoPrefixCache
from radixlm.backend.radix_cache import RadixCache
from radixlm.backend.request import Req
from radixlm.backend.sampling_params import SamplingParams
from radixlm.backend.tokenizer import IncrementalDetokenizer

POOL = 48
prompts = st.lists(st.integers(0, 2), min_size=2, max_size=12)
picks = st.integers(0, 10_000)


class CacheManagerMachine(RuleBasedStateMachine):
    def make_cache(self) -> BasePrefixCache:
        return RadixCache()

    def __init__(self) -> None:
        super().__init__()
        self.alloc = TokenSlotAllocator(POOL)
        self.cache = self.make_cache()
        self.kv = CacheManager(self.cache, self.alloc, ReqToTokenTable(8, 32, "cpu"))
        self.reqs: list[Req] = []

    def pick(self, i: int) -> Req:
        return self.reqs[i % len(self.reqs)]

    @rule(ids=prompts)
    def admit(self, ids: list[int]) -> None:
        req = Req(f"r{len(self.reqs)}", ids, SamplingParams(), lambda _: None, IncrementalDetokenizer(None))
        if not self.kv.place(req):
            return
        assert req.cache_handle is not None and req.prefix_len == req.cache_handle.cached_len
        assert req.prefix_len <= len(ids) - 1  # the last token is always computed
        self.reqs.append(req)

    @precondition(lambda self: self.reqs)
    @rule(i=picks, n=st.integers(1, 6))
    def prefill_chunk(self, i: int, n: int) -> None:
        req = self.pick(i)
        n = min(n, req.seq_len - req.kv_len)
        if n == 0 or not self.kv.make_room(n):
            return
        slots = self.kv.alloc(n)
        assert slots is not None and req.req_pool_idx is not None
        self.kv.req_table.write(req.req_pool_idx, req.kv_len, slots)
        req.kv_len += n
        self.kv.cache_unfinished(req, req.kv_len)
        assert req.prefix_len == (req.kv_len if self.cache.shares_prefixes else 0)

    @precondition(lambda self: self.reqs)
    @rule(i=picks, cache_it=st.booleans())
    def finish(self, i: int, cache_it: bool) -> None:
        req = self.pick(i)
        self.reqs.remove(req)
        self.kv.release(req, cache_it)
        assert req.req_pool_idx is None and req.cache_handle is None

    @rule(n=st.integers(0, POOL))
    def make_room(self, n: int) -> None:
        enough = self.alloc.available_size() + self.cache.evictable_size() >= n
        assert self.kv.make_room(n) == enough

    @precondition(lambda self: not self.reqs)
    @rule()
    def flush(self) -> None:
        self.kv.flush()
        assert self.alloc.available_size() == POOL and self.cache.total_size() == 0

    @invariant()
    def one_owner_per_slot(self) -> None:
        owners = [0] * (POOL + 1)
        for req in self.reqs:
            assert req.req_pool_idx is not None and req.cache_handle is not None
            row = self.kv.req_table.read(req.req_pool_idx, 0, req.kv_len)
            assert row[: req.prefix_len].tolist() == self.cache.slots_of(req.cache_handle).tolist()
            for s in row[req.prefix_len :].tolist():
                owners[s] += 1
        cached = self._cached_slots()
        assert len(cached) == self.cache.total_size()
        for s in cached:
            owners[s] += 1
        free = self.alloc.is_free_mask().tolist()
        assert [o + f for o, f in zip(owners[1:], free[1:])] == [1] * POOL

    def _cached_slots(self) -> list[int]:
        if isinstance(self.cache, RadixCache):
            check_invariants(self.cache, self.alloc)
            return [s for n in self.cache._iter_nodes() for s in n.value.tolist()]
        return []


class NoCacheManagerMachine(CacheManagerMachine):
    def make_cache(self) -> BasePrefixCache:
        return NoPrefixCache()


_settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCacheManagerRadix = CacheManagerMachine.TestCase
TestCacheManagerRadix.settings = _settings
TestCacheManagerNoCache = NoCacheManagerMachine.TestCase
TestCacheManagerNoCache.settings = _settings


def test_pinned_prefix_stays_locked_until_unpinned() -> None:
    alloc, cache = TokenSlotAllocator(16), RadixCache()
    kv = CacheManager(cache, alloc, ReqToTokenTable(4, 16, "cpu"))
    req = Req("pin", [1, 2, 3, 4], SamplingParams(), lambda _: None, IncrementalDetokenizer(None))
    req.pin_handle = 7
    assert kv.place(req) and req.req_pool_idx is not None
    kv.req_table.write(req.req_pool_idx, 0, torch.as_tensor(kv.alloc(4)))
    req.kv_len = 4
    kv.release(req, cache_it=True)
    assert cache.protected_size() == 4 and not kv.make_room(16)
    kv.unpin(7)
    assert cache.protected_size() == 0 and kv.make_room(16) and cache.total_size() == 0
