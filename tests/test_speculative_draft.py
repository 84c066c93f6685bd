"""The draft-model proposer on the default model (CPU). The default model drafts for itself (its
Q4_1 blocks for the target dequantized to fp32, so nearly every draft is the target's own greedy
token): greedy outputs, finish reasons and a JSON-schema output equal plain decoding's; the draft
model's KV slots and table rows all come back when the requests end, also when its pool is too
small for every request at once; its drafts follow the request's tokens after a rejection;
refusals."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_speculative import CASES, SCHEMA

from radixlm.backend.engine import Engine
from radixlm.backend.kv_pool import TokenSlotAllocator
from radixlm.backend.loader import default_model_path
from radixlm.backend.request import Req
from radixlm.backend.sampling_params import SamplingParams
from radixlm.backend.speculative_draft import DraftModelProposer


def greedy(params: dict, algorithm: str) -> dict:
    return {**params, "temperature": 0, "speculative_algorithm": algorithm}


@pytest.fixture(scope="module")
def draft_engine():
    eng = Engine(
        quantization="dequantize",
        max_total_tokens=8192,
        speculative_policy="always",
        speculative_draft_model_path=default_model_path(),
    )
    yield eng
    eng.shutdown()


def proposer(eng: Engine) -> DraftModelProposer:
    p = eng.scheduler.spec.proposers["draft"]
    assert isinstance(p, DraftModelProposer)
    return p


def test_greedy_outputs_equal_plain_decoding(draft_engine):
    cases = [CASES[0], CASES[2], CASES[4], CASES[5]]  # copy, JSON schema, stop string, short
    prompts = [c[0] for c in cases]
    plain = draft_engine.generate(prompts, [greedy(c[1], "none") for c in cases])
    before = dict(draft_engine.get_stats())
    drafted = draft_engine.generate(prompts, [greedy(c[1], "draft") for c in cases])
    stats = draft_engine.get_stats()
    for a, b in zip(plain, drafted):
        assert b["output_ids"] == a["output_ids"]
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
    jsonschema.validate(json.loads(drafted[1]["text"]), SCHEMA)
    drafts = stats["spec_draft_tokens"] - before.get("spec_draft_tokens", 0)
    accepted = stats["spec_accepted_tokens"] - before.get("spec_accepted_tokens", 0)
    assert drafts > 0 and accepted >= 0.9 * drafts  # the same weights draft their own greedy tokens
    p = proposer(draft_engine)
    assert p.free_slots == p.runner.allocator.size  # every request's draft KV released
    assert p.runner.req_table.available_size() == p.runner.req_table.max_requests


def test_drafts_follow_the_tokens_after_a_rejection(draft_engine):
    """A proposal after tokens other than its drafts keeps only the matching prefix's KV and reads
    the rest: its drafts equal those of a proposer that never saw the rejected ones."""
    tok = draft_engine.tokenizer
    ids = tok.encode(CASES[0][0])
    p = proposer(draft_engine)

    def req(rid: str) -> Req:
        return Req(rid=rid, input_ids=list(ids), params=SamplingParams(), sink=lambda _: None, detok=None)  # type: ignore[arg-type]

    a = req("a")
    first = draft_engine._call(lambda: p.propose(a, 4))
    assert len(first) == 4
    a.output_ids = [first[0], (first[1] + 1) % 1000]  # the second draft rejected
    fresh = req("b")
    fresh.output_ids = list(a.output_ids)
    assert draft_engine._call(lambda: p.propose(a, 3)) == draft_engine._call(lambda: p.propose(fresh, 3))
    for r in (a, fresh):
        draft_engine._call(lambda r=r: p.observe_finished(r))
    assert p.free_slots == p.runner.allocator.size


def test_small_draft_pool_evicts_and_still_matches(draft_engine):
    """With room for about one request's draft KV, a batch drafts for the requests that fit and
    the others decode plainly that step; a request outside the batch is evicted (least recently
    used) to make room. Outputs still equal plain decoding's and everything is released."""
    p = proposer(draft_engine)
    runner = p.runner
    saved, evictions = runner.allocator, p.evictions
    runner.allocator = TokenSlotAllocator(160)
    try:
        prompts = [CASES[0][0], CASES[4][0], CASES[5][0]]
        params = [greedy({"max_new_tokens": 16}, a) for a in ("none", "draft")]
        plain = draft_engine.generate(prompts, [params[0]] * 3)
        drafted = draft_engine.generate(prompts, [params[1]] * 3)
        assert [o["output_ids"] for o in drafted] == [o["output_ids"] for o in plain]
        assert p.free_slots == 160

        ids = [draft_engine.tokenizer.encode(t) for t in prompts[:2]]
        a, b = (
            Req(rid=r, input_ids=i, params=SamplingParams(), sink=lambda _: None, detok=None)  # type: ignore[arg-type]
            for r, i in zip("ab", ids)
        )
        assert len(draft_engine._call(lambda: p.propose(a, 4))) == 4
        assert len(draft_engine._call(lambda: p.propose(b, 4))) == 4  # a's KV made room
        assert p.evictions == evictions + 1
        draft_engine._call(lambda: p.observe_finished(b))
        assert p.free_slots == 160
    finally:
        runner.allocator = saved


def test_refusals():
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        Engine(speculative_algorithm="draft", max_total_tokens=64)
    eng = Engine(max_total_tokens=256)
    try:
        with pytest.raises(ValueError, match="needs an engine started with a draft model"):
            eng.generate("hi", {"max_new_tokens": 2, "speculative_algorithm": "draft"})
    finally:
        eng.shutdown()
