"""GGUF loading against independent references: the header reader against gguf's GGUFReader on
the default model; a tiny Llama-3.1-style model written with gguf's GGUFWriter the way llama.cpp's
converter writes it (q/k rows permuted, llama3 rope scaling stored as the rope_freqs tensor)
against HF transformers with the same rope_scaling; the sliding window's context cap."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from engine_helpers import last_logits

from radixlm.backend.engine import Engine
from radixlm.backend.gguf_file import GGUFFile, LongArray
from radixlm.backend.loader import default_model_path
from radixlm.backend.model_config import ModelConfig

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}  # fmt: skip
THETA = 500000.0


def test_header_reader_matches_gguf_reader() -> None:
    path = default_model_path()
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = ours.fields[key]
        expected = field.contents()
        assert value.length == len(expected) if isinstance(value, LongArray) else value == expected, key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.type_name == b.tensor_type.name and list(a.shape) == [int(x) for x in b.shape]
        assert np.array_equal(a.data, np.asarray(b.data)), a.name


def llama_cpp_rope_factors(head_dim: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py stores as rope_freqs for llama3 rope scaling."""
    freqs = 1.0 / (THETA ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old_ctx, factor = ROPE["original_max_position_embeddings"], ROPE["factor"]
    low_wavelen, high_wavelen = old_ctx / ROPE["low_freq_factor"], old_ctx / ROPE["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - ROPE["low_freq_factor"]) / (
                ROPE["high_freq_factor"] - ROPE["low_freq_factor"]
            )
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row interleave (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama31_gguf(model, path: Path, with_rope_freqs: bool = True, window: int | None = None) -> None:
    cfg = model.config
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(THETA)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if window:
        w.add_sliding_window(window)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    if with_rope_freqs:
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(head_dim))
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        for ours, hf in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if ours == "attn_q":
                t = _permute(t, heads)
            elif ours == "attn_k":
                t = _permute(t, kv_heads)
            w.add_tensor(f"blk.{i}.{ours}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def llama31():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2, tie_word_embeddings=False, rope_scaling=dict(ROPE, rope_theta=THETA),
                         rope_theta=THETA)  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).eval()


def _engine(path: Path, default_model_dir: Path) -> Engine:
    return Engine(model_path=str(path), tokenizer_path=str(default_model_dir), max_total_tokens=2048)


def test_rope_freqs_gguf_matches_hf_llama3_scaling(llama31, tmp_path, default_model_dir) -> None:
    path = tmp_path / "llama31.gguf"
    write_llama31_gguf(llama31, path)
    prompt = torch.randint(3, 512, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = llama31(torch.tensor([prompt])).logits[0, -1]
    eng = _engine(path, default_model_dir)
    try:
        assert eng.model_config.rope_scaling["rope_type"] == "freq_factors"
        ours = last_logits(eng, prompt)
        assert ((ours - ref).norm() / ref.norm()) <= 1e-4
    finally:
        eng.shutdown()
    # the same file without rope_freqs (rope scaling ignored): positions past the original
    # 32-token context come out wrong, so the check above can fail
    bare = tmp_path / "bare.gguf"
    write_llama31_gguf(llama31, bare, with_rope_freqs=False)
    eng = _engine(bare, default_model_dir)
    try:
        assert ((last_logits(eng, prompt) - ref).norm() / ref.norm()) > 1e-2
    finally:
        eng.shutdown()


def test_sliding_window_caps_the_context(llama31, tmp_path, default_model_dir) -> None:
    path = tmp_path / "window.gguf"
    write_llama31_gguf(llama31, path, window=64)
    eng = _engine(path, default_model_dir)
    try:
        assert eng.model_config.context_len == 64
        with pytest.raises(ValueError):
            eng.generate(input_ids=list(range(3, 80)), sampling_params={"max_new_tokens": 1})
    finally:
        eng.shutdown()


def test_hf_sliding_window_fields() -> None:
    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 32768}  # fmt: skip
    mistral = ModelConfig.from_hf_dict({**base, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.context_len == 4096
    qwen_off = ModelConfig.from_hf_dict(
        {**base, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    )
    assert qwen_off.context_len == 32768
    assert (
        ModelConfig.from_hf_dict({**base, "model_type": "mistral", "sliding_window": None}).context_len
        == 32768
    )
