"""SchedulePolicy without a model: longest cached prefix first (FCFS among ties and beyond the
queue limit), in-batch dedup holds back requests whose uncached prefix another one computes,
the head of the queue is never held back, and a disabled cache means plain FCFS."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from radixlm.backend.kv_pool import TokenSlotAllocator
from radixlm.backend.radix_cache import NoPrefixCache, RadixCache
from radixlm.backend.schedule_policy import SchedulePolicy


@dataclass(eq=False)
class FakeReq:
    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.all_ids)

    def max_prefix_len(self) -> int:
        return self.seq_len - 1


ALLOC = TokenSlotAllocator(1 << 16)


def cache_with(*seqs: list[int]) -> RadixCache:
    cache = RadixCache()
    for s in seqs:
        prefix, _ = cache.match_prefix(s)
        cache.insert(s, torch.cat([prefix, ALLOC.alloc(len(s) - len(prefix))]))
    return cache


def rand_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_longest_cached_prefix_first_fcfs_among_ties() -> None:
    base = rand_ids(50, 0)
    cache = cache_with(base)
    reqs = [
        FakeReq(rand_ids(40, 1)),  # 0 cached
        FakeReq(base[:10] + rand_ids(30, 2)),  # 10 cached
        FakeReq(base + rand_ids(5, 3)),  # 50 cached
        FakeReq(rand_ids(40, 4)),  # 0 cached
        FakeReq(base[:10] + rand_ids(30, 5)),  # 10 cached
    ]
    policy = SchedulePolicy(cache, dedup_min_tokens=0)
    assert policy.order(reqs) == [reqs[2], reqs[1], reqs[4], reqs[0], reqs[3]]


def test_long_queue_falls_back_to_fcfs() -> None:
    base = rand_ids(50, 0)
    cache = cache_with(base)
    reqs = [FakeReq(rand_ids(20, i)) for i in range(5)] + [FakeReq(base + [1, 2])]
    assert SchedulePolicy(cache, lpm_queue_limit=4, dedup_min_tokens=0).order(reqs) == reqs
    assert SchedulePolicy(cache, lpm_queue_limit=6, dedup_min_tokens=0).order(reqs)[0] is reqs[-1]


def test_shared_uncached_prefix_goes_once() -> None:
    shared = rand_ids(64, 7)
    cache = cache_with(shared[:16])  # 16 of the 64 shared tokens are already cached
    a = FakeReq(shared + rand_ids(4, 8))
    b = FakeReq(shared + rand_ids(4, 9))
    c = FakeReq(rand_ids(40, 10))
    d = FakeReq(shared[:40] + rand_ids(4, 11))  # shares 40, 16 cached: 24 < 32 → not held back
    policy = SchedulePolicy(cache, dedup_min_tokens=32)
    assert policy.order([a, b, c, d]) == [a, d, c]
    assert policy.num_deferred == 1
    # Once a's prompt is cached, b shares nothing uncached with anyone and goes.
    cache.insert(a.all_ids, torch.cat([cache.match_prefix(a.all_ids)[0], ALLOC.alloc(52)]))
    assert policy.order([b, c]) == [b, c]


def test_inflight_prompt_holds_back_followers_but_not_others() -> None:
    cache = cache_with()
    shared = rand_ids(100, 12)
    leader = FakeReq(shared + [1])
    follower = FakeReq(shared + [2])
    other = FakeReq(rand_ids(50, 13))
    policy = SchedulePolicy(cache, dedup_min_tokens=32)
    assert policy.order([follower, other], inflight=[leader]) == [other]
    assert policy.order([follower], inflight=[]) == [follower]  # the head always goes


def test_dedup_looks_only_as_far_as_the_budget() -> None:
    cache = cache_with()
    shared = rand_ids(80, 14)
    first = FakeReq(rand_ids(60, 15))
    a, b = FakeReq(shared + [1]), FakeReq(shared + [2])
    policy = SchedulePolicy(cache, dedup_min_tokens=32)
    assert policy.order([first, a, b], budget=50) == [first, a, b]  # the step is full after `first`
    assert policy.order([first, a, b], budget=150) == [first, a]  # 60 + 81 tokens: b is looked at


def test_disabled_cache_is_plain_fcfs() -> None:
    cache = NoPrefixCache()
    shared = rand_ids(100, 16)
    reqs = [FakeReq(shared + [i]) for i in range(3)]
    assert SchedulePolicy(cache).order(reqs) == reqs
