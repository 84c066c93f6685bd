"""find_cascade_groups on real radix trees: requests placed by the scheduler's CacheManager
(cached prefix locked on a table row, prefill, the prompt offered to the cache and re-locked,
decode tokens). Checked
against the request table (every member's row agrees on the shared part) and a naive reference
(longest common prefix of the members' token lists, capped by their cached lengths); then the
groups drive make_cascade_plan + cascade_decode_attention, compared with plain decode attention."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import random
import subprocess
import sys
from unittest import mock

import pytest
import torch
from cache_checks import check_invariants as check_tree
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from radixlm.backend import cascade_groups
from radixlm.backend.cache_manager import CacheManager
from radixlm.backend.cascade_groups import CascadeGrouper, CascadeGroups, find_cascade_groups
from radixlm.backend.kv_pool import ReqToTokenTable, TokenSlotAllocator
from radixlm.backend.radix_cache import NoPrefixCache, RadixCache
from radixlm.backend.request import Req
from radixlm.backend.sampling_params import SamplingParams
from radixlm.backend.tokenizer import IncrementalDetokenizer

LOW = {"min_shared_len": 1, "min_saved_fraction": 0.0, "min_saved_tokens": 0}  # thresholds off
LOW_SAVINGS = {"min_saved_fraction": 0.0, "min_saved_tokens": 0}


class Placer:
    """A CPU KV pool, request table and prefix cache, driven like the scheduler drives them."""

    def __init__(self, radix: bool = True, size: int = 1 << 15) -> None:
        self.alloc = TokenSlotAllocator(size)
        self.cache = RadixCache() if radix else NoPrefixCache()
        self.table = ReqToTokenTable(64, 4096, "cpu")
        self.kv = CacheManager(self.cache, self.alloc, self.table)

    def run(self, prompt: list[int], n_out: int) -> Req:
        """Place, prefill, offer the prompt to the cache and re-lock it, decode n_out tokens."""
        req = Req(
            f"r{self.table.available_size()}",
            list(prompt),
            SamplingParams(),
            lambda _: None,
            IncrementalDetokenizer(None),
        )
        assert self.kv.place(req) and req.req_pool_idx is not None
        self.table.write(req.req_pool_idx, req.prefix_len, self.alloc.alloc(req.seq_len - req.prefix_len))
        req.kv_len = req.seq_len
        self.kv.cache_unfinished(req, req.seq_len)
        for k in range(n_out):  # the sampled token is appended; the next decode step writes its KV
            if k:
                self.table.write(req.req_pool_idx, req.kv_len, self.alloc.alloc(1))
                req.kv_len += 1
            req.output_ids.append(100_000 + k)
        return req

    def row(self, req: Req, n: int) -> list[int]:
        return self.table.read(req.req_pool_idx, 0, n).tolist()  # type: ignore[arg-type]


def common_cached_prefix(reqs: list[Req]) -> int:
    """Naive reference: longest common prefix of the token lists, capped by each cached length."""
    n = min(r.prefix_len for r in reqs)
    for i in range(n):
        if len({r.all_ids[i] for r in reqs}) > 1:
            return i
    return n


def check_invariants(placer: Placer, reqs: list[Req], groups: CascadeGroups, min_shared_len: int = 1) -> None:
    assert sorted(groups.order) == list(range(len(reqs)))
    assert sum(groups.group_sizes) == len(reqs) and len(groups.shared_lens) == len(groups.group_sizes)
    saved, start = 0, 0
    for n, shared in zip(groups.group_sizes, groups.shared_lens):
        members = [reqs[i] for i in groups.order[start : start + n]]
        start += n
        assert n >= 1 and shared >= 0
        if n == 1:
            assert shared == 0
            continue
        assert shared >= min_shared_len
        assert shared <= common_cached_prefix(members)
        first = placer.row(members[0], shared)
        for m in members:
            assert shared <= m.prefix_len and shared < m.kv_len + 1
            assert placer.row(m, shared) == first
        saved += (n - 1) * shared
    assert saved == groups.saved_tokens


def rand_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def test_forks_make_one_group_with_the_full_shared_prefix() -> None:
    rng = random.Random(0)
    placer = Placer()
    doc = rand_ids(4000, rng)  # default thresholds: 5 * 4000 saved of ~24,000 reads
    reqs = [placer.run(doc + rand_ids(5, rng), 3) for _ in range(6)]
    # each re-locked its own node under the shared one
    assert len({id(r.cache_handle.node) for r in reqs}) == 6
    groups = find_cascade_groups(reqs)
    assert groups is not None
    check_invariants(placer, reqs, groups, 512)
    assert groups.group_sizes == [6] and groups.shared_lens == [4000]
    assert groups.saved_tokens == 5 * 4000


def test_answer_follows_a_changed_batch() -> None:
    """The last grouping is reused only while every request keeps its node and cached length."""
    rng = random.Random(6)
    placer = Placer()
    doc = rand_ids(600, rng)
    reqs = [placer.run(doc + rand_ids(3, rng), 2) for _ in range(4)]
    grouper = CascadeGrouper()
    first = grouper.find(reqs, **LOW)
    assert first is not None and first.group_sizes == [4] and first == grouper.find(reqs, **LOW)
    reqs[2].cache_handle = placer.cache.match_prefix([]).handle  # as if re-placed without a match
    reqs[2].prefix_len = 0
    again = grouper.find(reqs, **LOW)
    assert again is not None and again == find_cascade_groups(reqs, **LOW)
    assert again.order == [0, 1, 3, 2] and again.group_sizes == [3, 1]
    assert again.shared_lens == [600, 0] and again.saved_tokens == 2 * 600
    rest = reqs[:2] + reqs[3:]
    assert grouper.find(rest, **LOW) == grouper.find(rest, **LOW) == find_cascade_groups(rest, **LOW)
    # The memo belongs to its grouper: another one (another engine's planner) starts empty.
    assert CascadeGrouper()._last is None and grouper._last is not None


def test_two_families_and_a_stranger() -> None:
    rng = random.Random(1)
    placer = Placer()
    doc_a, doc_b = rand_ids(600, rng), rand_ids(900, rng)
    reqs = [placer.run(doc_a + rand_ids(4, rng), 2) for _ in range(3)]
    reqs.insert(1, placer.run(rand_ids(650, rng), 2))
    reqs += [placer.run(doc_b + rand_ids(4, rng), 2) for _ in range(4)]
    groups = find_cascade_groups(reqs, min_saved_fraction=0.0, min_saved_tokens=0)
    assert groups is not None
    check_invariants(placer, reqs, groups, 512)
    assert sorted(zip(groups.group_sizes, groups.shared_lens)) == [(1, 0), (3, 600), (4, 900)]
    assert groups.order == [0, 2, 3, 1, 4, 5, 6, 7]  # groups contiguous, in order of first member
    assert groups.shared_shape() == (2, 4)  # the stranger shares nothing and is not counted


def test_cost_model_asks_the_graphs_about_the_groups_shape() -> None:
    """A cascade step that no graph holds pays the eager penalty: the same savings are taken
    when the plan's shape has a graph and declined when it has none."""
    from radixlm.backend.cascade_cost import CascadeCostModel

    asked: list[tuple[int, int, int]] = []

    def graph_fit(batch: int, shared_groups: int, max_members: int) -> tuple[bool, bool]:
        asked.append((batch, shared_groups, max_members))
        return True, max_members <= 32

    model = CascadeCostModel(kv_row_s=1e-8, cascade_extra_s=1e-4, eager_penalty_s=1e-2, graph_fit=graph_fit)
    assert model.pays(100_000, 256, 32, 8)  # 1 ms saved against 0.125 ms of kernels
    assert not model.pays(100_000, 256, 5, 40)  # the same, plus a 10 ms eager step
    assert asked == [(256, 32, 8), (256, 5, 40)]


def test_deeper_pair_inside_a_big_family_does_not_split_it() -> None:
    """Two of the forks share 40 more tokens: one group of all at the fork point reads the prefix
    once; a separate pair group would read it twice for 40 extra tokens."""
    rng = random.Random(2)
    placer = Placer()
    doc, extra = rand_ids(1000, rng), rand_ids(40, rng)
    reqs = [placer.run(doc + extra + rand_ids(3, rng), 2) for _ in range(2)]
    reqs += [placer.run(doc + rand_ids(3, rng), 2) for _ in range(6)]
    groups = find_cascade_groups(reqs, min_saved_tokens=0)
    assert groups is not None
    check_invariants(placer, reqs, groups, 512)
    assert groups.group_sizes == [8] and groups.shared_lens == [1000]


def test_two_deep_families_under_a_shallow_common_prefix_stay_apart() -> None:
    rng = random.Random(3)
    placer = Placer()
    sys_prompt = rand_ids(600, rng)
    fam = [sys_prompt + rand_ids(400, rng) for _ in range(2)]
    reqs = [placer.run(fam[k] + rand_ids(3, rng), 2) for k in (0, 1, 0, 1)]
    groups = find_cascade_groups(reqs, min_saved_fraction=0.0, min_saved_tokens=0)
    assert groups is not None
    check_invariants(placer, reqs, groups, 512)
    assert groups.saved_tokens == 2 * 1000 and sorted(groups.shared_lens) == [1000, 1000]


def test_unrelated_short_or_uncached_batches_give_none() -> None:
    rng = random.Random(4)
    placer = Placer()
    assert find_cascade_groups([placer.run(rand_ids(800, rng), 2) for _ in range(4)]) is None
    doc = rand_ids(100, rng)  # shared, but shorter than min_shared_len
    reqs = [placer.run(doc + rand_ids(5, rng), 2) for _ in range(4)]
    assert find_cascade_groups(reqs, min_saved_fraction=0.0, min_saved_tokens=0) is None
    assert (
        find_cascade_groups(reqs, min_shared_len=100, min_saved_fraction=0.0, min_saved_tokens=0) is not None
    )
    doc = rand_ids(600, rng)  # shared, but the own parts dominate the reads: 1800 saved of ~6000
    reqs = [placer.run(doc + rand_ids(900, rng), 2) for _ in range(4)]
    assert find_cascade_groups(reqs, min_saved_tokens=0) is None
    assert find_cascade_groups(reqs, min_saved_tokens=0, min_saved_fraction=0.25) is not None
    assert find_cascade_groups(reqs, min_saved_tokens=1801, min_saved_fraction=0.0) is None
    assert find_cascade_groups([placer.run(doc + rand_ids(2, rng), 2)]) is None  # a single request
    off = Placer(radix=False)
    reqs = [off.run(doc + rand_ids(5, rng), 2) for _ in range(4)]
    assert all(r.cache_handle is not None and r.cache_handle.cached_len == r.prefix_len == 0 for r in reqs)
    assert find_cascade_groups(reqs, **LOW) is None
    with pytest.raises(ValueError, match="min_group_size"):
        find_cascade_groups(reqs, min_group_size=1)


def best_partition_saving(reqs: list[Req], min_shared_len: int) -> int:
    """Brute force over all partitions (small batches): the most KV reads any grouping saves."""

    def value(group: list[Req]) -> int:
        s = common_cached_prefix(group) if len(group) > 1 else 0
        return (len(group) - 1) * s if s >= min_shared_len else 0

    def partitions(items: list[int]):
        if not items:
            yield []
            return
        head, rest = items[0], items[1:]
        for k in range(len(rest) + 1):
            for mates in itertools.combinations(rest, k):
                left = [i for i in rest if i not in mates]
                for p in partitions(left):
                    yield [[head, *mates], *p]

    return max(sum(value([reqs[i] for i in g]) for g in p) for p in partitions(list(range(len(reqs)))))


@st.composite
def request_sets(draw):
    """Prompts built from a few random trunks and branches, so they share prefixes at varied depths."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    trunks = [rand_ids(draw(st.integers(1, 40)), rng) for _ in range(draw(st.integers(1, 3)))]
    branches = [rand_ids(draw(st.integers(0, 30)), rng) for _ in range(draw(st.integers(1, 4)))]
    prompts = []
    for _ in range(draw(st.integers(1, 7))):
        p = rng.choice(trunks)[: draw(st.integers(1, 40))] + rng.choice(branches)
        prompts.append(p + rand_ids(draw(st.integers(0, 5)), rng) if p else [1])
    return prompts, [draw(st.integers(1, 4)) for _ in prompts], draw(st.integers(1, 30))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_sets())
def test_invariants_against_naive_reference(case) -> None:
    prompts, outs, min_shared = case
    placer = Placer(size=4096)
    reqs = [placer.run(p, n) for p, n in zip(prompts, outs)]
    check_tree(placer.cache, placer.alloc)
    groups = find_cascade_groups(reqs, min_shared_len=min_shared, min_saved_fraction=0.0, min_saved_tokens=0)
    best = best_partition_saving(reqs, min_shared)
    if groups is None:
        assert best == 0  # something worth sharing is always found
        return
    check_invariants(placer, reqs, groups, min_shared)
    assert 0 < groups.saved_tokens <= best
    pair = max((common_cached_prefix([a, b]) for a, b in itertools.combinations(reqs, 2)), default=0)
    assert groups.saved_tokens >= pair  # at least as good as the best single pair


def _grouping_of_everyone(reqs, min_shared_len, min_group_size):
    return [i for i, r in enumerate(reqs) if cascade_groups._limit(r) >= min_shared_len]


_TRUNK, _BRANCH = [3706, 6002, 5562, 23662, 11081, 48232], [43891, 20194, 16487, 39711, 13907, 39767]
# filtered: one group of four sharing the trunk; whole: pairs sharing trunk + branch and trunk
_TIE = ([[3706], _TRUNK + _BRANCH, [3706, *_BRANCH], [3706], _TRUNK, _TRUNK, _TRUNK + _BRANCH], [1] * 7, 2)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_sets())
@example(_TIE)
def test_prompt_filter_keeps_the_groups_of_the_whole_batch(case) -> None:
    """Grouping only the requests whose first tokens match another's saves as many tokens as
    grouping every request with enough shareable tokens. The partitions may differ where two
    save the same (one group of four sharing 6 tokens, or pairs sharing 12 and 6)."""
    prompts, outs, min_shared = case
    placer = Placer(size=4096)
    reqs = [placer.run(p, n) for p, n in zip(prompts, outs)]
    kw = {"min_shared_len": min_shared, "min_saved_fraction": 0.0, "min_saved_tokens": 0}
    filtered = CascadeGrouper().find(reqs, **kw)
    with mock.patch.object(cascade_groups, "sharing_candidates", _grouping_of_everyone):
        whole = CascadeGrouper().find(reqs, **kw)
    assert (filtered is None) == (whole is None)
    if filtered is not None and whole is not None:
        check_invariants(placer, reqs, filtered, min_shared)
        assert filtered.saved_tokens == whole.saved_tokens


def test_prompt_filter_drops_strangers_and_keeps_families() -> None:
    rng = random.Random(8)
    placer = Placer()
    doc = rand_ids(300, rng)
    strangers = [placer.run(rand_ids(400, rng), 2) for _ in range(3)]
    assert cascade_groups.sharing_candidates(strangers, 256, 2) == []
    assert find_cascade_groups(strangers, min_shared_len=256, **LOW_SAVINGS) is None
    family = [placer.run(doc + rand_ids(5, rng), 2) for _ in range(2)]
    short = placer.run(doc[:100] + rand_ids(5, rng), 2)  # shares 100 tokens: below the bar
    reqs = [strangers[0], family[0], short, strangers[1], family[1]]
    assert cascade_groups.sharing_candidates(reqs, 256, 2) == [1, 4]
    assert cascade_groups.sharing_candidates(reqs, 256, 3) == []
    groups = find_cascade_groups(reqs, min_shared_len=256, **LOW_SAVINGS)
    assert groups is not None and groups.order == [0, 1, 4, 2, 3] and groups.shared_lens == [0, 300, 0, 0]


def test_a_request_cached_past_its_prompt_makes_everyone_a_candidate() -> None:
    """A re-admitted request's cached part includes its outputs, so its prompt alone cannot key it:
    it may share with any request, and the filter leaves the whole batch to the tree."""
    rng = random.Random(9)
    placer = Placer()
    doc = rand_ids(300, rng)
    first = placer.run(doc + rand_ids(5, rng), 2)
    back = Req("back", doc[:200], SamplingParams(), lambda _: None, IncrementalDetokenizer(None))
    back.output_ids = doc[200:] + rand_ids(3, rng)  # as after a retraction: outputs kept
    assert placer.kv.place(back) and back.prefix_len == 300
    back.kv_len = back.prefix_len
    stranger = placer.run(rand_ids(400, rng), 2)
    assert cascade_groups.sharing_candidates([first, stranger, back], 256, 2) == [0, 1, 2]
    groups = find_cascade_groups([first, stranger, back], min_shared_len=256, **LOW_SAVINGS)
    assert groups is not None and groups.order == [0, 2, 1] and groups.shared_lens == [300, 0]


@pytest.mark.slow
def test_engine_runs_fork_batches_through_groups(engine, monkeypatch) -> None:
    """A real CPU engine with cascade switched on (thresholds lowered: CPU-sized prefixes): forks of
    a pinned document decode as one reordered group, and every request gets the same greedy output
    as with cascade off (the torch backend ignores the plan, so this checks the grouping and the
    reordering, not the kernel)."""
    grouper = engine.scheduler.planner.grouper
    seen: list[CascadeGroups | None] = []

    def low(reqs, **kw):
        seen.append(find(reqs, **LOW))
        return seen[-1]

    find = grouper.find
    monkeypatch.setattr(grouper, "find", low)
    rng = random.Random(7)
    doc = [rng.randrange(100, 40_000) for _ in range(48)]
    prompts = [doc + [rng.randrange(100, 40_000) for _ in range(1 + k % 3)] for k in range(4)]
    prompts.insert(2, [rng.randrange(100, 40_000) for _ in range(20)])  # a stranger in the batch
    params = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}
    outs = {}
    was = engine.scheduler.cfg.enable_cascade
    try:
        for cascade in (True, False):
            engine.scheduler.cfg.enable_cascade = cascade
            assert engine.flush_cache()
            handle = engine.pin_prefix(doc)
            before = engine.get_stats().get("cascade_steps", 0)
            res = engine.generate(input_ids=prompts, sampling_params=params)
            engine.unpin_prefix(handle)
            outs[cascade] = [r["output_ids"] for r in res]
            steps = engine.get_stats().get("cascade_steps", 0) - before
            assert (steps > 0) == cascade
    finally:
        engine.scheduler.cfg.enable_cascade = was
    assert outs[True] == outs[False]
    assert len({tuple(o) for o in outs[True]}) > 1  # distinct outputs: a mix-up would show
    full = [g for g in seen if g is not None and len(g.order) == 5]
    assert full and all(sorted(zip(g.group_sizes, g.shared_lens)) == [(1, 0), (4, 48)] for g in full)


def _attention_check() -> dict:
    """Run in a subprocess with TRITON_INTERPRET=1: a decode step over a batch of forks (two
    families, one stranger) through the groups' plan vs plain decode attention, same order."""
    from radixlm.backend.cascade_groups import make_cascade_plan
    from radixlm.backend.kv_pool import KVPool
    from radixlm.kernels._triton import use_triton
    from radixlm.kernels.cascade_attention import cascade_decode_attention
    from radixlm.kernels.decode_attention import decode_attention_ref

    torch.manual_seed(0)
    rng = random.Random(5)
    hq, hkv, d = 8, 2, 32
    placer = Placer(size=2048)
    docs = [rand_ids(40, rng), rand_ids(25, rng)]
    prompts = [docs[k] + rand_ids(rng.randrange(1, 6), rng) for k in (0, 1, 0, 0, 1, 0)] + [rand_ids(30, rng)]
    reqs = [placer.run(p, rng.randrange(1, 8)) for p in prompts]
    groups = find_cascade_groups(reqs, min_shared_len=8, min_saved_fraction=0.0, min_saved_tokens=0)
    assert groups is not None
    check_invariants(placer, reqs, groups, 8)
    batch = [reqs[i] for i in groups.order]
    for r in batch:  # the decode step's new token gets its own slot at kv_len
        placer.table.write(r.req_pool_idx, r.kv_len, placer.alloc.alloc(1))  # type: ignore[arg-type]
    seq = [r.kv_len + 1 for r in batch]
    out = {"groups": [list(x) for x in zip(groups.group_sizes, groups.shared_lens)]}
    for dtype in (torch.float32, torch.bfloat16):
        pool = KVPool(1, placer.alloc.size, hkv, d, dtype, "cpu")
        pool.k_buffers[0].normal_()
        pool.v_buffers[0].normal_()
        q = torch.randn(len(batch), hq, d, dtype=dtype)
        rows = torch.tensor([r.req_pool_idx for r in batch])
        lens = torch.tensor(seq)
        plan = make_cascade_plan(groups.group_sizes, groups.shared_lens, seq, "cpu")
        assert use_triton(q), "the interpreter is not on"
        got = cascade_decode_attention(
            q,
            pool.k_buffers[0],
            pool.v_buffers[0],
            placer.table.table,
            rows,
            lens,
            plan,
            block_m=16,
            block_n=16,
        ).double()
        ref, _ = decode_attention_ref(
            q.double(), pool.k_buffers[0].double(), pool.v_buffers[0].double(), placer.table.table, rows, lens
        )
        out[str(dtype)] = float((got - ref).norm() / ref.norm())
    return out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_groups_drive_cascade_attention_like_plain_decode() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert lines, f"checker crashed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    res = json.loads(lines[-1][len("RESULTS ") :])
    assert sorted(map(tuple, res["groups"])) == [(1, 0), (2, 25), (4, 40)]
    assert res["torch.float32"] < 1e-4  # the bounds of tests/kernel_checks.BOUND
    assert res["torch.bfloat16"] < 1e-2


if __name__ == "__main__":
    print("RESULTS " + json.dumps(_attention_check()))
