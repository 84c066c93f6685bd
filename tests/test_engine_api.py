"""The Engine API surface: bad input raises ValueError with a reason (and the engine keeps
serving), list in/list out, n samples, streaming and async, logprobs checked against HF."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

BAD_INPUTS = [
    (dict(prompt=""), "empty prompt"),
    (dict(input_ids=[]), "input_ids"),
    (dict(prompt="hi", sampling_params={"max_new_tokens": 9000}), "context length"),
    (dict(prompt="hi", sampling_params={"max_tokens": 5}), "unknown sampling parameter"),
    (dict(prompt="hi", sampling_params={"temperature": -0.5}), "temperature"),
    (dict(prompt="hi", sampling_params={"top_p": 0.0}), "top_p"),
    (dict(prompt="hi", sampling_params={"top_p": 1.5}), "top_p"),
    (dict(prompt="hi", sampling_params={"top_k": 0}), "top_k"),
    (dict(prompt="hi", sampling_params={"min_new_tokens": 5, "max_new_tokens": 2}), "min_new_tokens"),
    (dict(prompt="hi", sampling_params={"n": 0}), "n must be"),
    (dict(input_ids=[1, 2, 10**9]), "outside the vocabulary"),
    (dict(prompt=["a", "b"], sampling_params=[{}]), "sampling_params"),
    (dict(prompt="hi", input_ids=[1]), "exactly one"),
]


@pytest.mark.parametrize("kwargs,reason", BAD_INPUTS)
def test_bad_input_raises_value_error_and_engine_keeps_serving(engine, kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        engine.generate(**kwargs)
    out = engine.generate("Hello", {"max_new_tokens": 2, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 2


def test_list_in_list_out_and_n(engine):
    outs = engine.generate(["One", "Two"], {"max_new_tokens": 3, "temperature": 0})
    assert isinstance(outs, list) and len(outs) == 2
    samples = engine.generate("Pick a fruit:", {"max_new_tokens": 6, "temperature": 1.0, "n": 3, "seed": 5})
    assert isinstance(samples, list) and len(samples) == 3
    assert len({tuple(s["output_ids"]) for s in samples}) > 1
    both = engine.generate(["A", "B"], {"max_new_tokens": 2, "n": 2})
    assert len(both) == 4


def test_stream_concatenates_to_full_text(engine):
    params = {"max_new_tokens": 20, "temperature": 0}
    full = engine.generate("The history of Rome", params)
    chunks = list(engine.generate("The history of Rome", params, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum(len(c["output_ids"]) for c in chunks) == len(full["output_ids"])
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_stream_chunks_carry_their_own_logprobs(engine):
    """Like its text and ids, a chunk's output logprobs are its own entries (SGLang's incremental
    stream shape), with the running count; they join to the unstreamed result's list."""
    params = {"max_new_tokens": 12, "temperature": 0}
    full = engine.generate("The history of Rome", params, return_logprob=True, top_logprobs_num=2)
    chunks = list(
        engine.generate("The history of Rome", params, stream=True, return_logprob=True, top_logprobs_num=2)
    )
    joined, top = [], []
    for c in chunks:
        meta = c["meta_info"]
        assert [e[1] for e in meta["output_token_logprobs"]] == c["output_ids"]
        joined += meta["output_token_logprobs"]
        top += meta["output_top_logprobs"]
        assert meta["output_token_logprobs_length"] == len(joined)
    assert joined == full["meta_info"]["output_token_logprobs"]
    assert top == full["meta_info"]["output_top_logprobs"]


def test_async_generate_and_async_stream(engine):
    params = {"max_new_tokens": 8, "temperature": 0}
    ref = engine.generate(["x y z", "1 2 3"], params)

    async def main():
        many = await asyncio.gather(*(engine.async_generate(p, params) for p in ["x y z", "1 2 3"]))
        agen = await engine.async_generate("x y z", params, stream=True)
        text = "".join([c["text"] async for c in agen])
        return many, text

    many, text = asyncio.run(main())
    assert [m["output_ids"] for m in many] == [r["output_ids"] for r in ref]
    assert text == ref[0]["text"]


def test_abort_ends_request_with_abort_reason(engine):
    it = engine.generate(
        "Tell me a long story", {"max_new_tokens": 500, "ignore_eos": True}, stream=True, rid="abort-me"
    )
    first = next(it)
    assert first["meta_info"]["finish_reason"] is None
    engine.abort_request("abort-me")
    last = list(it)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 500


def test_logprobs_match_hf(engine, tokenizer, hf_model):
    engine.flush_cache()
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(prompt)
    out = engine.generate(
        prompt,
        {"max_new_tokens": 4, "temperature": 0},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
    )
    m = out["meta_info"]
    full = ids + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), -1)
    assert m["input_token_logprobs"][0][0] is None and len(m["input_token_logprobs"]) == len(ids)
    for p in range(1, len(ids)):
        lp, tok, _ = m["input_token_logprobs"][p]
        assert tok == ids[p] and abs(lp - ref[p - 1, tok].item()) < 1e-3
    for k, (lp, tok, _) in enumerate(m["output_token_logprobs"]):
        assert tok == out["output_ids"][k] and abs(lp - ref[len(ids) - 1 + k, tok].item()) < 1e-3
        top = m["output_top_logprobs"][k]
        assert len(top) == 3 and top[0][1] == tok  # greedy picks the top-1
    # a later start skips the cache only as far as it must
    part = engine.generate(
        prompt, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True, logprob_start_len=5
    )
    assert len(part["meta_info"]["input_token_logprobs"]) == len(ids) - 5


def test_max_new_tokens_zero_scores_prompt(engine):
    out = engine.generate("Score me please", {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["meta_info"]["input_token_logprobs"]) == out["meta_info"]["prompt_tokens"]


def test_tiny_temperature_is_greedy_and_tiny_penalty_rejected(engine):
    greedy = engine.generate("Hello there", {"max_new_tokens": 6, "temperature": 0})
    tiny = engine.generate("Hello there", {"max_new_tokens": 6, "temperature": 1e-300})
    assert tiny["output_ids"] == greedy["output_ids"]
    with pytest.raises(ValueError, match="repetition_penalty"):
        engine.generate("Hello there", {"repetition_penalty": 1e-300})


def test_failed_step_aborts_its_requests_frees_kv_and_engine_goes_on(engine):
    runner = engine.runner
    real_forward = runner.forward
    calls = {"n": 0}

    def flaky(fb):
        calls["n"] += 1
        if calls["n"] == 2:  # fail mid-generation, after the prompt's KV exists
            raise RuntimeError("injected fault")
        return real_forward(fb)

    assert engine.flush_cache()
    free0 = engine.get_stats()["kv_free_slots"]
    runner.forward = flaky
    try:
        out = engine.generate("Count to ten:", {"max_new_tokens": 8, "temperature": 0})
    finally:
        runner.forward = real_forward
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "injected fault" in out["meta_info"]["finish_reason"]["message"]
    assert engine.flush_cache()
    assert engine.get_stats()["kv_free_slots"] == free0
    ok = engine.generate("Count to ten:", {"max_new_tokens": 3, "temperature": 0})
    assert ok["meta_info"]["completion_tokens"] == 3


def test_shutdown_answers_every_waiting_caller():
    from radixlm.backend.engine import Engine

    eng = Engine(max_total_tokens=1024)
    stream = eng.generate("A long tale:", {"max_new_tokens": 400, "ignore_eos": True}, stream=True)
    next(stream)
    eng.shutdown()
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate("again", {"max_new_tokens": 2})
    with pytest.raises(RuntimeError, match="shut down"):
        eng.flush_cache()


def test_shutdown_names_what_still_holds_the_model(caplog):
    """Shutdown frees the weights even when something outside the engine holds the model (their
    tensors are emptied in place), and the log names the holder."""
    from radixlm.backend.engine import Engine

    eng = Engine(max_total_tokens=256)
    holder = type("Holder", (), {})()
    holder.model, holder.kv_pool = eng.runner.model, eng.runner.kv_pool
    with caplog.at_level("WARNING", logger="radixlm"):
        eng.shutdown()
    assert "still referenced (by Holder" in caplog.text
    assert all(t.numel() == 0 for t in holder.model.parameters())  # its memory is released anyway
    assert holder.kv_pool.k_buffers == [] and holder.kv_pool.v_buffers == []
    del holder
    caplog.clear()
    other = Engine(max_total_tokens=256)
    with caplog.at_level("WARNING", logger="radixlm"):
        other.shutdown()
    assert "still referenced" not in caplog.text


def test_request_path_warm_up_runs_and_leaves_no_counts(engine):
    """The start-up warm batch (run by CUDA engines) is valid on any engine; what it did is then
    flushed and its counters reset, as Engine does after it."""
    from radixlm.backend.warmup import warm_request_path

    before = engine.get_stats()["generated_tokens"]
    warm_request_path(engine.generate, engine.model_config.vocab_size, engine.model_config.context_len)
    assert engine.get_stats()["generated_tokens"] > before
    assert engine.flush_cache()
    engine._call(engine.scheduler.stats.reset)
    stats = engine.get_stats()
    assert stats["generated_tokens"] == stats["forward_passes"] == 0
    assert stats["kv_cached_slots"] == 0 and stats["kv_free_slots"] == stats["kv_total_slots"]


def test_start_freezes_the_heap_and_shutdown_collects_the_engine():
    """After start-up the engine's objects sit in the collector's permanent generation (full passes
    skip them) and the thresholds are raised; shutdown thaws and collects, so the engine's cycles
    are freed, re-freezes what the engines still running hold, and the last engine to stop gives
    the process its own thresholds back."""
    import gc
    import weakref

    from radixlm.backend import collector
    from radixlm.backend import engine as engine_mod
    from radixlm.backend.engine import Engine

    before = gc.get_threshold()  # raised already if another test's engine still runs
    first = Engine(max_total_tokens=256)
    second = Engine(max_total_tokens=256)
    assert gc.get_threshold() == collector.RAISED_THRESHOLDS
    models = [weakref.ref(first.runner.model), weakref.ref(second.runner.model)]
    frozen = gc.get_freeze_count()
    assert frozen > 10_000
    first.shutdown()
    assert models[0]() is None  # collected, though it was frozen
    assert 0 < gc.get_freeze_count() < frozen  # the second engine's objects are frozen again
    assert gc.get_threshold() == collector.RAISED_THRESHOLDS  # one engine still runs
    second.shutdown()
    assert models[1]() is None
    assert (gc.get_freeze_count() == 0) == (not engine_mod._live_engines)
    assert gc.get_threshold() == before


def test_a_matched_stop_token_is_trimmed_from_the_text(engine):
    """As SGLang: the stop token's text is left out unless no_stop_trim; output_ids keep it, and a
    stream's chunks join to the same text. An EOS shown by skip_special_tokens=False too."""
    params = {"max_new_tokens": 16, "temperature": 0}
    free = engine.generate("The capital of France is", params)
    stop = free["output_ids"][2]  # a token the greedy output reaches
    cut = engine.generate("The capital of France is", {**params, "stop_token_ids": [stop]})
    kept = engine.generate(
        "The capital of France is", {**params, "stop_token_ids": [stop], "no_stop_trim": True}
    )
    assert cut["output_ids"] == kept["output_ids"] == free["output_ids"][:3]
    assert kept["text"] == cut["text"] + engine.tokenizer.decode([stop])
    chunks = engine.generate("The capital of France is", {**params, "stop_token_ids": [stop]}, stream=True)
    assert "".join(c["text"] for c in chunks) == cut["text"]
    chat = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi"}], tokenize=False, add_generation_prompt=True
    )
    shown = engine.generate(chat, {"max_new_tokens": 64, "temperature": 0, "skip_special_tokens": False})
    assert shown["meta_info"]["finish_reason"] == {"type": "stop", "matched": shown["output_ids"][-1]}
    assert "<|im_end|>" not in shown["text"] and shown["text"]


def test_a_stop_string_in_the_text_that_completes_a_grammar_still_cuts(engine):
    """The grammar's last forced text ", because" holds the stop string: the stop wins."""
    params = {"max_new_tokens": 10, "temperature": 0, "regex": " (yes|no), because"}
    whole = engine.generate("Is the sky blue? Answer:", params)
    cut = engine.generate("Is the sky blue? Answer:", {**params, "stop": ","})
    assert whole["text"].endswith(", because")
    assert cut["text"] == whole["text"][: whole["text"].index(",")]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": ","}


def test_a_batch_streams_with_each_chunk_indexed(engine):
    """As SGLang's Engine: a batch (or n > 1) streams, each chunk tagged with its request's index;
    each index's chunks join to that request's unstreamed result."""
    params = {"max_new_tokens": 6, "temperature": 0}
    prompts = ["The history of Rome", "Once upon a time"]
    ref = engine.generate(prompts, params)
    texts = {0: "", 1: ""}
    finished = []
    for c in engine.generate(prompts, params, stream=True):
        texts[c["index"]] += c["text"]
        if c["meta_info"]["finish_reason"] is not None:
            finished.append(c["index"])
    assert sorted(finished) == [0, 1] and [texts[0], texts[1]] == [r["text"] for r in ref]

    async def main():
        agen = await engine.async_generate(prompts[0], {**params, "n": 2}, stream=True)
        seen = {}
        async for c in agen:
            seen[c["index"]] = seen.get(c["index"], "") + c["text"]
        return seen

    seen = asyncio.run(main())
    assert seen == {0: ref[0]["text"], 1: ref[0]["text"]}  # greedy: both samples alike


def test_closing_a_batch_stream_aborts_the_unfinished_requests(engine):
    long = {"max_new_tokens": 400, "ignore_eos": True}
    aborted_before = engine.get_stats()["num_aborted"]
    stream = engine.generate(["a", "b"], [long, {"max_new_tokens": 1}], stream=True, rid="closing")
    ends = {}
    for c in stream:
        if c["meta_info"]["finish_reason"] is not None:
            ends[c["index"]] = c["meta_info"]["finish_reason"]["type"]
        if 1 in ends:
            break
    stream.close()

    def settled(stats: dict[str, int]) -> bool:  # read off the scheduler thread: poll for both
        return stats["num_running"] == 0 and stats["num_aborted"] == aborted_before + 1

    deadline = time.monotonic() + 30
    while not settled(engine.get_stats()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ends[1] == "length" and 0 not in ends
    assert settled(engine.get_stats())
