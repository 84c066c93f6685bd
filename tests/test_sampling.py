"""Sampling semantics: fixed seed → reproducible; top_k=1 = greedy; penalties equal a plain
per-element reference; top-k/top-p/min-p filtering; stop strings trimmed; EOS masked until
min_new_tokens; incremental detokenization never splits a UTF-8 character."""

from __future__ import annotations

import pytest
import torch

from radixlm.backend.sampler import apply_penalties_, filter_probs
from radixlm.backend.tokenizer import IncrementalDetokenizer


def naive_penalties(logits, counts, seen, freq, pres, rep):
    out = logits.clone()
    for i in range(out.shape[0]):
        for v in range(out.shape[1]):
            x = out[i, v].item()
            if seen[i, v]:
                x = x / rep[i].item() if x > 0 else x * rep[i].item()
            x -= freq[i].item() * counts[i, v].item()
            x -= pres[i].item() * (1.0 if counts[i, v] > 0 else 0.0)
            out[i, v] = x
    return out


def test_penalties_match_plain_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g)
    counts = torch.randint(0, 3, (3, 40), generator=g).float()
    seen = (counts > 0) | (torch.rand(3, 40, generator=g) > 0.7)
    freq, pres, rep = (
        torch.tensor([0.0, 0.5, -0.3]),
        torch.tensor([0.2, 0.0, 1.0]),
        torch.tensor([1.0, 1.3, 0.8]),
    )
    expected = naive_penalties(logits, counts, seen, freq, pres, rep)
    apply_penalties_(logits, counts, seen, freq, pres, rep)
    torch.testing.assert_close(logits, expected)


def test_filter_probs_top_k_top_p_min_p():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3)
    kept, ids = filter_probs(
        probs,
        top_k=torch.tensor([2, 5, 5]),
        top_p=torch.tensor([1.0, 0.8, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.25]),
    )
    nz = [(ids[i][kept[i] > 0]).tolist() for i in range(3)]
    assert nz[0] == [0, 1]  # top-k 2
    assert nz[1] == [0, 1, 2]  # 0.5 + 0.2 < 0.8, so the third is still needed
    assert nz[2] == [0, 1, 2]  # min_p: ≥ 0.25 × 0.5


def test_seed_reproducible_and_top_k_one_is_greedy(engine):
    p = "Write a short poem about the sea:"
    a = engine.generate(p, {"max_new_tokens": 12, "temperature": 1.0, "seed": 7})
    b = engine.generate(p, {"max_new_tokens": 12, "temperature": 1.0, "seed": 7})
    c = engine.generate(p, {"max_new_tokens": 12, "temperature": 1.0, "seed": 8})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]
    greedy = engine.generate(p, {"max_new_tokens": 12, "temperature": 0})
    top1 = engine.generate(p, {"max_new_tokens": 12, "temperature": 1.5, "top_k": 1})
    assert top1["output_ids"] == greedy["output_ids"]


def test_negative_seeds_are_seeds_of_their_own(engine):
    """OpenAI takes any int64 seed: -s reproduces itself and is not the seed s."""
    p = {"max_new_tokens": 12, "temperature": 1.0}
    runs = [engine.generate("Once upon a time", {**p, "seed": s})["output_ids"] for s in (-7, -7, 7)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_seeded_sample_does_not_depend_on_batch(engine):
    p = {"max_new_tokens": 10, "temperature": 0.9, "seed": 11}
    alone = engine.generate("Tell me about cats.", p)["output_ids"]
    mixed = engine.generate(
        ["Tell me about cats.", "Numbers: 1 2 3"], [p, {"max_new_tokens": 10, "temperature": 0.8}]
    )
    assert mixed[0]["output_ids"] == alone
    # a neighbour that filters (top-p) makes the batch sort its rows: the seeded row must not care
    filtering = engine.generate(
        ["Tell me about cats.", "Numbers: 1 2 3"],
        [p, {"max_new_tokens": 10, "temperature": 0.8, "top_p": 0.9}],
    )
    assert filtering[0]["output_ids"] == alone
    filtered = {**p, "top_p": 0.95}
    alone_filtered = engine.generate("Tell me about cats.", filtered)["output_ids"]
    mixed_filtered = engine.generate(
        ["Tell me about cats.", "Numbers: 1 2 3"], [filtered, {"max_new_tokens": 10, "temperature": 0.8}]
    )
    assert mixed_filtered[0]["output_ids"] == alone_filtered


def test_stop_string_trimmed_and_kept_with_no_stop_trim(engine):
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7,"
    free = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0})["text"]
    stop = free.strip()[:2].strip() or ","
    out = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and free.startswith(out["text"])
    kept = engine.generate(
        prompt, {"max_new_tokens": 16, "temperature": 0, "stop": stop, "no_stop_trim": True}
    )
    assert kept["text"].endswith(stop)


def test_eos_masked_until_min_new_tokens(engine, tokenizer):
    msgs = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
    prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    short = engine.generate(prompt, {"max_new_tokens": 40, "temperature": 0})
    assert short["meta_info"]["finish_reason"]["type"] == "stop"
    n = short["meta_info"]["completion_tokens"]
    longer = engine.generate(prompt, {"max_new_tokens": 40, "temperature": 0, "min_new_tokens": n + 5})
    assert longer["meta_info"]["completion_tokens"] >= n + 5
    assert tokenizer.eos_token_id not in longer["output_ids"][: n + 4]


def test_stop_strings_count_only_past_min_new_tokens(engine, tokenizer):
    """A stop string written within the first min_new_tokens tokens is not a stop: generation
    goes on to the first one that ends later, and the text keeps the earlier ones (streamed too)."""
    prompt = "List five fruits, one per line:\n1."
    sp = {"max_new_tokens": 40, "temperature": 0, "stop": "\n"}
    first = engine.generate(prompt, sp)
    assert first["meta_info"]["finish_reason"] == {"type": "stop", "matched": "\n"}
    least = first["meta_info"]["completion_tokens"] + 3
    out = engine.generate(prompt, {**sp, "min_new_tokens": least})
    n_out = out["meta_info"]["completion_tokens"]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "\n"} and n_out >= least
    whole = tokenizer.decode(out["output_ids"])
    assert out["text"] == whole[: whole.rindex("\n")] and out["text"].startswith(first["text"] + "\n")
    assert len(out["text"]) >= len(tokenizer.decode(out["output_ids"][: least - 1]))
    streamed = "".join(
        c["text"] for c in engine.generate(prompt, {**sp, "min_new_tokens": least}, stream=True)
    )
    assert streamed == out["text"]


def test_stop_token_ids_and_ignore_eos(engine):
    out = engine.generate("a b c d e f g", {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    first = out["output_ids"][2]
    cut = engine.generate("a b c d e f g", {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first]})
    assert cut["output_ids"] == out["output_ids"][: out["output_ids"].index(first) + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


def test_incremental_detokenizer_never_splits_utf8(tokenizer):
    text = "naïve café — 東京 🎉 ok"
    ids = tokenizer.encode(text)
    d = IncrementalDetokenizer(tokenizer)
    pieces = [d.add([i]) for i in ids]
    pieces.append(d.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("top_p", [1.0, 0.9999])  # vocabulary order, and the sorted (filter) path
def test_seeded_rows_follow_the_distribution(top_p):
    """Seeded rows are drawn by inverting each row's CDF with the request's own uniform: over many
    seeds the token frequencies must match softmax(logits / T) (chi-square, 10 tokens)."""
    import random
    from types import SimpleNamespace

    from radixlm.backend.sampler import Sampler

    n, temp = 4000, 0.8
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.2, 0.8, 1.2])
    params = SimpleNamespace(is_greedy=False, temperature=temp, top_k=0, top_p=top_p, min_p=0.0)
    reqs = [SimpleNamespace(params=params, rng=random.Random(s)) for s in range(n)]
    tokens = Sampler(10, torch.device("cpu"))._sample_random(logits.repeat(n, 1), reqs, [False] * n)
    counts = torch.bincount(tokens, minlength=10).double()
    expected = torch.softmax(logits.double() / temp, dim=0) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.9  # the 99.9% quantile of chi-square with 9 degrees of freedom
    again = Sampler(10, torch.device("cpu"))._sample_random(
        logits.repeat(n, 1),
        [SimpleNamespace(params=params, rng=random.Random(s)) for s in range(n)],
        [False] * n,
    )
    assert torch.equal(tokens, again)  # the same seeds draw the same tokens


def test_logit_bias_forces_and_bans_tokens(engine) -> None:
    """+100 on a token makes greedy pick it every step; -100 on the greedy choice bans it; an
    OpenAI-style body (ids as strings) works the same; the bias moves only its own request."""
    params = {"max_new_tokens": 4, "temperature": 0}
    free = engine.generate("The capital of France is", params)
    first = free["output_ids"][0]
    forced_id = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced, banned, plain = engine.generate(
        ["The capital of France is"] * 3,
        [
            {**params, "logit_bias": {str(forced_id): 100}},
            {**params, "logit_bias": {first: -100.0}},
            params,
        ],
    )
    assert forced["output_ids"] == [forced_id] * 4
    assert banned["output_ids"][0] != first
    assert plain["output_ids"] == free["output_ids"]
