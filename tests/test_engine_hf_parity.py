"""Greedy tokens and logits of radixlm's engine against HF transformers on the same weights:
the default SmolLM2 model, and tiny random Llama / Mistral / Qwen2 / Qwen3 built with
transformers' own config classes."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_helpers import last_logits

from radixlm.backend.engine import Engine

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors: red,",
    "Once upon a time, in a small village,",
    "Question: What is 12 times 7?\nAnswer:",
    "The quick brown fox",
    "import numpy as np\n",
    "Water boils at a temperature of",
]
NEW_TOKENS = 64


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        min_new_tokens=n,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(ids) :].tolist()


# incremental decoding and one full forward round differently in fp32's last bits: a top-2 gap
# below this is a tie either path may break its own way
TIE = 1e-4


def hf_disagreements(model, ids: list[int], out: list[int]) -> list[int]:
    """Positions t where HF's greedy choice after ids + out[:t] is not out[t] (beyond a tie): one
    teacher-forced forward gives every step's logits, so the whole output is checked against HF
    in a single call instead of one generate step per token."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : len(ids) + len(out) - 1].float()
    best = logits.max(-1).values
    chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
    return [t for t in range(len(out)) if best[t] - chosen[t] > TIE]


@pytest.mark.slow
def test_smollm_greedy_matches_hf_one_by_one_and_batched(engine, tokenizer, hf_model):
    ids = [tokenizer.encode(p) for p in PROMPTS]
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    engine.flush_cache()
    singles = [engine.generate(input_ids=x, sampling_params=params)["output_ids"] for x in ids]
    engine.flush_cache()
    batched = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=params)]
    for i in range(len(PROMPTS)):
        assert len(singles[i]) == NEW_TOKENS
        assert hf_disagreements(hf_model, ids[i], singles[i]) == [], f"prompt {i}: HF chose otherwise"
        assert batched[i] == singles[i], f"prompt {i} batched differs from one-by-one"


def test_smollm_last_logits_match_hf(engine, tokenizer, hf_model):
    for prompt in PROMPTS[:3]:
        ids = tokenizer.encode(prompt)
        ours = last_logits(engine, ids)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0, -1].float()
        rel = (ours - ref).norm() / ref.norm()
        assert rel <= 1e-4, f"relative logits error {rel:.2e} for {prompt!r}"


def _tiny_model(kind: str, tmp_path, default_model_dir):
    import transformers as tf

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    if kind == "llama3":
        cfg = tf.LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 500000.0,
            },
            rope_theta=500000.0,
        )
        cls = tf.LlamaForCausalLM
    elif kind == "mistral":
        cfg, cls = tf.MistralConfig(**common), tf.MistralForCausalLM
    elif kind == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    else:
        cfg, cls = tf.Qwen3Config(**common, head_dim=16), tf.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    if kind == "qwen2":  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    out = tmp_path / kind
    model.save_pretrained(str(out))
    for f in default_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return model, out


@pytest.mark.parametrize("kind", ["llama3", "mistral", "qwen2", "qwen3"])
def test_tiny_random_configs_match_hf(kind, tmp_path, default_model_dir):
    model, path = _tiny_model(kind, tmp_path, default_model_dir)
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=rng).tolist() for n in (5, 17, 40)]
    eng = Engine(model_path=str(path), max_total_tokens=2048, chunked_prefill_size=16)
    try:
        params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        for ids, out in zip(prompts, outs):
            assert out["output_ids"] == hf_greedy(model, ids, 24)
        ours = last_logits(eng, prompts[2])
        with torch.no_grad():
            ref = model(torch.tensor([prompts[2]])).logits[0, -1]
        assert ((ours - ref).norm() / ref.norm()) <= 1e-4
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_gguf_conversion_matches_hf_gguf_loader(engine, tokenizer):
    """Independent check of our GGUF conversion (dequantize + q/k un-permute): HF's own GGUF
    loader must give the same logits as our engine."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from radixlm.backend.loader import default_model_path

    path = Path(default_model_path())
    ref_model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    ids = tokenizer.encode("The capital of France is")
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0, -1]
    ours = last_logits(engine, ids)
    assert ((ours - ref).norm() / ref.norm()) <= 1e-4
