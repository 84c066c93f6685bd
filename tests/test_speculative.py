"""Speculative decoding on the default model (CPU): greedy outputs, finish reasons, logprobs and
JSON-schema outputs identical with n-gram speculation on and off (the speculation-off engine is the
reference; both dequantize the weights, since the GGUF-block kernels round differently for one row
and for several, which moves logprobs by a few 1e-2), a fork program identical, the default engine's
per-request switch, the KV pool whole again after a speculative run with aborts and retractions,
and the switches' errors."""

from __future__ import annotations

import pytest

import radixlm as sgl
from radixlm.backend.engine import Engine

DOC = (
    "Order #4471 was placed by Maria Gonzalez (maria.gonzalez@example.com) on 2024-03-14. Items: "
    "2x USB-C cable, 1x wireless mouse. Shipping address: 1200 Market Street, Apt 5B, San Francisco."
)
CODE = "def total(items):\n    s = 0\n    for it in items:\n        s += it.price * it.qty\n    return s\n"


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "email": {"type": "string"}, "order": {"type": "integer"}},
    "required": ["name", "email", "order"],
    "additionalProperties": False,
}

CASES: list[tuple[str, dict]] = [
    (chat(f"Repeat the following text exactly:\n{DOC}"), {"max_new_tokens": 64}),
    (chat(f"Rename the variable s to acc in this code and print it:\n{CODE}"), {"max_new_tokens": 60}),
    (
        chat(f"Extract name, email and order number as JSON.\n{DOC}"),
        {"max_new_tokens": 60, "json_schema": SCHEMA},
    ),
    (chat("Write a short poem about the sea."), {"max_new_tokens": 40}),
    (chat(f"Repeat exactly: {DOC}"), {"max_new_tokens": 50, "stop": ["Street"]}),
    (chat(f"Repeat exactly: {DOC}"), {"max_new_tokens": 50, "stop_regex": [r"Fr\w+co\b"]}),
    (chat(f"Repeat exactly: {DOC}"), {"max_new_tokens": 7}),
    (
        chat(f"Repeat exactly: {DOC}"),
        {"max_new_tokens": 40, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    ),
    (chat("Count from 1 to 30 separated by commas."), {"max_new_tokens": 48, "min_new_tokens": 20}),
    (chat(f"Copy the code:\n{CODE}"), {"max_new_tokens": 48, "regex": r"def [a-z]+\(items\):\n.*"}),
]


@pytest.fixture(scope="module")
def spec_engine():
    eng = Engine(
        quantization="dequantize",
        max_total_tokens=8192,
        speculative_algorithm="ngram",
        speculative_policy="always",
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def ref_engine():
    eng = Engine(quantization="dequantize", max_total_tokens=8192)
    yield eng
    eng.shutdown()


def _greedy(p: dict) -> dict:
    return {"temperature": 0, **p}


def test_greedy_identical_on_and_off(ref_engine, spec_engine):
    prompts = [c[0] for c in CASES]
    params = [_greedy(c[1]) for c in CASES]
    ref = ref_engine.generate(prompts, params, return_logprob=True, top_logprobs_num=2)
    before = spec_engine.get_stats()
    outs = spec_engine.generate(prompts, params, return_logprob=True, top_logprobs_num=2)
    for r, o in zip(ref, outs):
        assert o["output_ids"] == r["output_ids"]
        assert o["text"] == r["text"]
        assert o["meta_info"]["finish_reason"] == r["meta_info"]["finish_reason"]
        got = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]
        assert [t for _, t, _ in o["meta_info"]["output_token_logprobs"]] == o["output_ids"]
        assert got == pytest.approx(want, abs=2e-3)
    assert outs[2]["meta_info"]["json_schema_valid"] is True
    assert outs[5]["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"Fr\w+co\b"}
    after = spec_engine.get_stats()
    assert after["spec_accepted_tokens"] - before.get("spec_accepted_tokens", 0) > 40  # it did speculate
    # with logprobs as above: a request that asks for them decodes forced text token by token (no
    # jump-forward), so both sides tokenize the schema's forced keys the same way
    one_by_one = [
        spec_engine.generate(p, q, return_logprob=True)["output_ids"] for p, q in zip(prompts[:3], params[:3])
    ]
    assert one_by_one == [r["output_ids"] for r in ref[:3]]


def test_per_request_switch(engine, spec_engine, ref_engine):
    """The default engine (GGUF blocks, speculation off) speculates when a request asks."""
    prompt, p = CASES[0]
    ref = engine.generate(prompt, _greedy(p))
    before = engine.get_stats().get("spec_accepted_tokens", 0)
    on = engine.generate(
        prompt, {**_greedy(p), "speculative_algorithm": "ngram", "speculative_num_draft_tokens": 6}
    )
    assert on["output_ids"] == ref["output_ids"]
    assert engine.get_stats()["spec_accepted_tokens"] > before
    mid = spec_engine.get_stats().get("spec_verify_steps", 0)
    off = spec_engine.generate(prompt, {**_greedy(p), "speculative_algorithm": "none"})
    assert off["output_ids"] == ref_engine.generate(prompt, _greedy(p))["output_ids"]
    assert spec_engine.get_stats().get("spec_verify_steps", 0) == mid


def test_streaming_matches(ref_engine, spec_engine):
    prompt, p = CASES[4]
    ref = ref_engine.generate(prompt, _greedy(p))
    chunks = list(spec_engine.generate(prompt, _greedy(p), stream=True))
    assert "".join(c["text"] for c in chunks) == ref["text"]
    assert [t for c in chunks for t in c["output_ids"]] == ref["output_ids"]


@sgl.function
def branches(s, doc):
    s += sgl.user(f"Repeat the text exactly.\n{doc}")
    s += sgl.assistant_begin()
    forks = s.fork(3)
    forks += lambda i: ["Order", "The order", "Text:"][i]
    forks += sgl.gen("copy", max_tokens=32)
    forks.join()
    s += "Summary:" + sgl.gen("summary", max_tokens=24, stop="\n")


def test_fork_program_identical(ref_engine, spec_engine):
    ref = branches.run(DOC, temperature=0, backend=sgl.Runtime(engine=ref_engine))
    got = branches.run(DOC, temperature=0, backend=sgl.Runtime(engine=spec_engine))
    assert got["copy"] == ref["copy"]
    assert got["summary"] == ref["summary"]


@pytest.mark.slow
def test_pool_restored_after_aborts_and_retractions():
    prompts = [chat(f"Repeat exactly: {DOC} ({i})") for i in range(12)]
    params = [{"temperature": 0, "max_new_tokens": 48, "ignore_eos": True} for _ in prompts]
    ref_eng = Engine(quantization="dequantize", max_total_tokens=4096)
    try:
        ref = [o["output_ids"] for o in ref_eng.generate(prompts, params)]
    finally:
        ref_eng.shutdown()
    eng = Engine(
        quantization="dequantize",
        max_total_tokens=400,
        chunked_prefill_size=64,
        speculative_algorithm="ngram",
        speculative_policy="always",
    )
    try:
        streams = [eng.generate(prompts[i], {**params[i], "temperature": 0.8}, stream=True) for i in (0, 1)]
        for s in streams:
            next(s)  # started; dropping the iterator aborts it
            s.close()
        outs = eng.generate(prompts, params)
        st = eng.get_stats()
        assert st["num_retractions"] > 0 and st["spec_accepted_tokens"] > 0
        assert [o["output_ids"] for o in outs] == ref
        assert eng.flush_cache()
        st = eng.get_stats()
        assert st["kv_free_slots"] == st["kv_total_slots"]
        assert st["num_aborted"] >= 2
    finally:
        eng.shutdown()


def test_switch_errors():
    from radixlm.backend.sampling_params import SamplingParams

    assert SamplingParams.from_dict({"speculative_algorithm": "draft"}).speculative_algorithm == "draft"
    with pytest.raises(ValueError, match="speculative_algorithm must be one of"):
        SamplingParams.from_dict({"speculative_algorithm": "eagle"})
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        SamplingParams.from_dict({"speculative_num_draft_tokens": 0})
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        Engine(speculative_algorithm="draft", max_total_tokens=64)


@pytest.mark.slow
def test_overlap_scheduler_identical(ref_engine):
    """With overlap on, a step settles the in-flight one before drafting and verify steps are
    processed at once; outputs stay identical and the pool comes back whole."""
    prompts = [c[0] for c in CASES]
    params = [_greedy(c[1]) for c in CASES]
    ref = [o["output_ids"] for o in ref_engine.generate(prompts, params)]
    eng = Engine(
        quantization="dequantize",
        max_total_tokens=8192,
        overlap_schedule=True,
        speculative_algorithm="ngram",
        speculative_policy="always",
    )
    try:
        assert [o["output_ids"] for o in eng.generate(prompts, params)] == ref
        assert eng.get_stats()["spec_accepted_tokens"] > 0
        assert eng.flush_cache()
        st = eng.get_stats()
        assert st["kv_free_slots"] == st["kv_total_slots"]
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_sampled_tokens_follow_the_same_distribution(ref_engine, spec_engine):
    """T > 0 on the real model: the joint of output tokens 2 and 3 (drafted and verified with
    speculation) has the same distribution with speculation on and off (chi-squared homogeneity)."""
    stats = pytest.importorskip("scipy.stats")
    prompt = CASES[0][0]
    n = 400
    p = {"temperature": 1.0, "top_k": 3, "max_new_tokens": 4, "ignore_eos": True}

    def joint(eng: Engine) -> dict[tuple[int, int], int]:
        counts: dict[tuple[int, int], int] = {}
        for o in eng.generate([prompt] * n, [dict(p) for _ in range(n)]):
            key = (o["output_ids"][1], o["output_ids"][2])
            counts[key] = counts.get(key, 0) + 1
        return counts

    before = spec_engine.get_stats().get("spec_draft_tokens", 0)
    on, off = joint(spec_engine), joint(ref_engine)
    assert spec_engine.get_stats()["spec_draft_tokens"] - before >= n
    cells = [k for k in set(on) | set(off) if on.get(k, 0) + off.get(k, 0) >= 10]
    table = [[on.get(k, 0) for k in cells], [off.get(k, 0) for k in cells]]
    assert len(cells) >= 2
    assert stats.chi2_contingency(table)[1] > 1e-3
