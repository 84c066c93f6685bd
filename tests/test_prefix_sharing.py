"""RadixAttention end to end: greedy outputs do not depend on the prefix cache; a repeated prompt
prefills only its last token; a second chat turn reuses the first turn's prompt and output KV;
requests sharing an uncached prefix compute it once; under memory pressure only unlocked
leaves are evicted, least recently used first, and nothing a running request reads."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from cache_checks import check_invariants

from radixlm.backend.engine import Engine
from radixlm.backend.radix_cache import RadixCache

WORDS = "alpha beta gamma delta river stone cloud night music paper green window seven orange".split()
GREEDY = {"temperature": 0, "ignore_eos": True}


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def greedy(n: int) -> dict[str, Any]:
    return {**GREEDY, "max_new_tokens": n}


def shared_prefix_workload(tok: Any) -> list[list[int]]:
    """Few-shot questions behind one prefix, a tree of branches, and exact repeats."""
    shot = tok.encode("Examples: " + words(70, 1), add_special_tokens=False)
    root = tok.encode("Story: " + words(30, 2), add_special_tokens=False)
    few = [
        shot + tok.encode(f" Question {i}: " + words(5, 10 + i), add_special_tokens=False) for i in range(6)
    ]
    tree = [root + tok.encode(f" Branch {i} " + words(4, 20 + i), add_special_tokens=False) for i in range(4)]
    return few + tree + [few[0], tree[0]]


def output_ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def nocache() -> Engine:
    eng = Engine(disable_radix_cache=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def workload(engine) -> list[list[int]]:
    return shared_prefix_workload(engine.tokenizer)


@pytest.fixture(scope="module")
def reference(nocache, workload) -> list[list[int]]:
    return output_ids(nocache.generate(input_ids=workload, sampling_params=greedy(12)))


def _restored(eng: Engine) -> None:
    assert eng.flush_cache()
    st = eng.get_stats()
    assert st["kv_free_slots"] == st["kv_total_slots"] and st["kv_cached_slots"] == 0


@pytest.mark.slow
def test_greedy_outputs_same_with_cache_on_and_off(engine, nocache, workload, reference) -> None:
    assert nocache.get_stats()["cached_prompt_tokens"] == 0
    engine.flush_cache()
    before = engine.get_stats()
    first = engine.generate(input_ids=workload, sampling_params=greedy(12))
    again = engine.generate(input_ids=workload, sampling_params=greedy(12))  # everything cached now
    assert output_ids(first) == reference
    assert output_ids(again) == reference
    st = engine.get_stats()
    total_prompt = 2 * sum(len(p) for p in workload)
    cached = st["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    computed = st["computed_prompt_tokens"] - before["computed_prompt_tokens"]
    assert cached + computed == total_prompt
    assert cached == sum(o["meta_info"]["cached_tokens"] for o in first + again)
    # The second pass finds each prompt whole in the cache (its prompt and outputs went in).
    assert all(o["meta_info"]["cached_tokens"] == o["meta_info"]["prompt_tokens"] - 1 for o in again)
    engine._call(lambda: check_invariants(engine.cache, engine.runner.allocator))
    _restored(engine)


def test_second_identical_prompt_prefills_only_its_last_token(engine) -> None:
    ids = engine.tokenizer.encode("Repeat after me: " + words(40, 3), add_special_tokens=False)
    engine.flush_cache()
    a = engine.generate(input_ids=ids, sampling_params=greedy(4))
    assert a["meta_info"]["cached_tokens"] == 0
    before = engine.get_stats()["computed_prompt_tokens"]
    b = engine.generate(input_ids=ids, sampling_params=greedy(4))
    assert b["meta_info"]["cached_tokens"] >= len(ids) - 1
    assert engine.get_stats()["computed_prompt_tokens"] - before == len(ids) - b["meta_info"]["cached_tokens"]
    assert b["output_ids"] == a["output_ids"]
    _restored(engine)


@pytest.mark.slow
def test_second_chat_turn_reuses_first_turn_prompt_and_output(engine, nocache) -> None:
    tok = engine.tokenizer

    def encode_chat(messages: list[dict], add_prompt: bool = True) -> list[int]:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_prompt)
        return tok.encode(text, add_special_tokens=False)

    turn1 = encode_chat([{"role": "user", "content": "Name three colours. " + words(20, 4)}])
    engine.flush_cache()
    out1 = engine.generate(input_ids=turn1, sampling_params=greedy(10))
    follow = tok.encode("<|im_end|>\n", add_special_tokens=False)
    turn2 = (
        turn1 + out1["output_ids"] + follow + encode_chat([{"role": "user", "content": "And two more?"}])[1:]
    )
    out2 = engine.generate(input_ids=turn2, sampling_params=greedy(10))
    # Everything but the last output token's KV (never forwarded) is reused from turn 1.
    assert out2["meta_info"]["cached_tokens"] >= len(turn1) + len(out1["output_ids"]) - 1
    ref2 = nocache.generate(input_ids=turn2, sampling_params=greedy(10))
    assert out2["output_ids"] == ref2["output_ids"]
    _restored(engine)


@pytest.mark.slow
def test_requests_sharing_an_uncached_prefix_compute_it_once(engine, nocache) -> None:
    tok = engine.tokenizer
    prefix = tok.encode("Shared context: " + words(120, 5), add_special_tokens=False)
    prompts = [
        prefix + tok.encode(f" Item {i}: " + words(3, 30 + i), add_special_tokens=False) for i in range(6)
    ]
    engine.flush_cache()
    before = engine.get_stats()["computed_prompt_tokens"]
    deferred = engine.scheduler.policy.num_deferred
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(4))
    computed = engine.get_stats()["computed_prompt_tokens"] - before
    suffixes = sum(len(p) - len(prefix) for p in prompts)
    assert computed <= len(prefix) + suffixes + len(prompts)  # not 6 × the prefix
    assert sum(o["meta_info"]["cached_tokens"] >= len(prefix) for o in outs) >= len(prompts) - 1
    assert engine.scheduler.policy.num_deferred > deferred
    assert output_ids(outs) == output_ids(nocache.generate(input_ids=prompts, sampling_params=greedy(4)))
    _restored(engine)


# ---- memory pressure ---------------------------------------------------------------------


def cached_slots_along(cache: RadixCache, ids: list[int]) -> list[int]:
    """Slots of the longest cached prefix of ids, read without touching the tree."""
    node, pos, out = cache.root_node, 0, []
    while pos < len(ids) and ids[pos] in node.children:
        node = node.children[ids[pos]]
        n = 0
        while n < len(node.key) and pos + n < len(ids) and node.key[n] == ids[pos + n]:
            n += 1
        out += node.value[:n].tolist()
        pos += n
        if n < len(node.key):
            break
    return out


class EvictionAudit:
    """Wraps the engine's cache.evict (it runs on the scheduler thread) and checks each call."""

    def __init__(self, eng: Engine) -> None:
        self.cache: RadixCache = eng.cache  # type: ignore[assignment]
        self.sched = eng.scheduler
        self.errors: list[str] = []
        self.freed = 0
        self._evict = self.cache.evict
        self.cache.evict = self.evict  # type: ignore[method-assign]

    def evict(self, n: int) -> torch.Tensor:
        nodes = [x for x in self.cache._iter_nodes() if x.parent is not None]
        users = self._users()
        gone = self._evict(n)
        self.freed += int(gone.numel())
        try:
            self._check(nodes, users, gone)
        except AssertionError as e:
            self.errors.append(str(e))
        return gone

    def _users(self) -> list[tuple[list[int], list[int], int]]:
        """(token ids, KV slots, tree-owned prefix length) of every request holding KV."""
        reqs = [
            *self.sched.running,
            *self.sched.waiting,
            *([self.sched.chunked] if self.sched.chunked else []),
        ]
        table = self.sched.req_table.table
        return [
            (r.all_ids[: r.kv_len], table[r.req_pool_idx, : r.kv_len].tolist(), r.prefix_len)
            for r in reqs
            if r.req_pool_idx is not None
        ]

    def _check(self, nodes: list, users: list, returned: torch.Tensor) -> None:
        check_invariants(self.cache)
        gone = [x for x in nodes if x.parent is None]
        left = sorted(s for x in gone for s in x.value.tolist())
        assert left == sorted(returned.tolist()), "evict returned other slots than those that left"
        assert all(x.lock_ref == 0 for x in gone), "a locked node was evicted"
        stay = [x.last_access for x in self.cache._evictable_leaves]
        if gone and stay:
            assert max(x.last_access for x in gone) <= min(stay), "evicted a leaf newer than one kept"
        free = self.sched.kv.allocator.is_free_mask()
        evicted = set(left)
        for ids, slots, prefix_len in users:
            assert not bool(free[slots].any()), "a running request's KV slot was freed"
            assert not evicted & set(slots), "a running request's KV slot was evicted"
            assert cached_slots_along(self.cache, ids)[:prefix_len] == slots[:prefix_len], "prefix evicted"


@pytest.mark.slow
def test_memory_pressure_evicts_only_unlocked_leaves_lru_first(nocache) -> None:
    eng = Engine(max_total_tokens=360, chunked_prefill_size=64)
    try:
        audit = EvictionAudit(eng)
        tok = eng.tokenizer
        shared = tok.encode("Common header: " + words(40, 6), add_special_tokens=False)
        warm = [tok.encode(f"Old {i}: " + words(30, 40 + i), add_special_tokens=False) for i in range(4)]
        live = [
            shared + tok.encode(f" Task {i}: " + words(6, 50 + i), add_special_tokens=False)
            for i in range(10)
        ]
        for p in warm:  # fill the cache with finished, unlocked sequences
            eng.generate(input_ids=p, sampling_params=greedy(6))
        outs = eng.generate(input_ids=live, sampling_params=greedy(16))
        assert audit.errors == []
        assert audit.freed > 0, "the pool was never under pressure"
        want = nocache.generate(input_ids=live, sampling_params=greedy(16))
        assert output_ids(outs) == output_ids(want)
        eng._call(lambda: check_invariants(eng.cache, eng.runner.allocator))
        _restored(eng)
    finally:
        eng.shutdown()
