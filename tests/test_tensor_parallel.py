"""Tensor parallelism on the CPU: the split plan (whole KV-head groups, uneven where heads do not
divide; MLP columns on the 32-value grid), shards that cover every weight exactly once (float and
GGUF blocks), and TP=2 over gloo (two spawned ranks) against TP=1 on tiny Llama / Qwen2 / Qwen3
models and on the default model: the same greedy tokens, logits within fp32 tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from server_helpers import free_port
from test_engine_hf_parity import _tiny_model
from tp_helpers import greedy_run, make_runner, tp_rank

from radixlm.backend.loader import load_config, resolve_model_dir
from radixlm.backend.model_config import ModelConfig
from radixlm.backend.quant_formats import QuantTensor
from radixlm.backend.tensor_parallel import TPShard, local_config, plan_shards, shard_weights

TINY = {
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}


def test_plan_splits_whole_kv_groups_unevenly_and_columns_on_the_grid():
    cfg = ModelConfig.from_hf_dict({**TINY, "hidden_size": 576, "intermediate_size": 1536})  # default model
    a, b = plan_shards(cfg, 2)
    assert (a.kv0, a.kv1, a.q0, a.q1, a.i0, a.i1) == (0, 2, 0, 6, 0, 768)
    assert (b.kv0, b.kv1, b.q0, b.q1, b.i0, b.i1) == (2, 3, 6, 9, 768, 1536)
    three = plan_shards(cfg, 3)
    assert [(s.q0, s.q1) for s in three] == [(0, 3), (3, 6), (6, 9)]
    assert [s.i1 - s.i0 for s in three] == [512, 512, 512]
    local = local_config(cfg, b)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.hidden_size) == (
        3,
        1,
        768,
        576,
    )
    assert plan_shards(cfg, 1)[0] == TPShard(0, 1, 0, 3, 0, 9, 0, 1536, 0, 97, (97,))
    assert [(s.v0, s.v1) for s in three] == [(0, 33), (33, 65), (65, 97)]  # the vocabulary too
    assert three[0].vocab_sizes == (33, 32, 32) and local_config(cfg, three[2]).vocab_size == 32


@pytest.mark.parametrize(
    "change,size,reason",
    [
        ({}, 4, "cannot split 3 KV heads"),
        ({"intermediate_size": 100}, 2, "grid of 32"),
        ({}, 0, "at least 1"),
    ],
)
def test_plan_refuses_what_cannot_split(change, size, reason):
    with pytest.raises(ValueError, match=reason):
        plan_shards(ModelConfig.from_hf_dict({**TINY, **change}), size)


def test_shards_cover_each_weight_once():
    cfg = ModelConfig.from_hf_dict(TINY)
    d = cfg.head_dim
    gen = torch.Generator().manual_seed(0)
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(9 * d, 64, generator=gen),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(3 * d, 64, generator=gen),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 9 * d, generator=gen),
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 64, generator=gen),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 96, generator=gen),
        "model.layers.0.mlp.down_proj.bias": torch.randn(64, generator=gen),
        "model.embed_tokens.weight": torch.randn(97, 64, generator=gen),
    }
    parts = [dict(shard_weights(full.items(), cfg, s)) for s in plan_shards(cfg, 2)]
    for name, w in full.items():
        got = [p[name] for p in parts]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(got, dim=1), w)
        elif name.endswith("down_proj.bias"):  # added once, after the all-reduce
            assert torch.equal(got[0], w) and not got[1].any()
        else:  # rows: heads, columns of the MLP, vocabulary
            assert torch.equal(torch.cat(got), w)


def test_gguf_blocks_split_on_block_boundaries_only():
    raw = torch.arange(4 * 3 * 20, dtype=torch.uint8).reshape(4, 60)  # Q4_1: 20 bytes per 32 values
    w = QuantTensor("Q4_1", raw, 96)
    cfg = ModelConfig.from_hf_dict(TINY)
    a, b = plan_shards(cfg, 2)  # intermediate 96 = 3 blocks: 64 + 32 columns
    name = "model.layers.0.mlp.down_proj.weight"
    left, right = (dict(shard_weights([(name, w)], cfg, s))[name] for s in (a, b))
    assert isinstance(left, QuantTensor) and isinstance(right, QuantTensor)
    assert (left.cols, right.cols) == (64, 32)
    assert torch.equal(torch.cat([left.raw, right.raw], dim=1), raw)
    assert torch.equal(left.dequantize(), w.dequantize()[:, :64])
    assert torch.equal(right.dequantize(), w.dequantize()[:, 64:])
    k = QuantTensor("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="256-value blocks"):
        list(shard_weights([(name, k)], ModelConfig.from_hf_dict({**TINY, "intermediate_size": 256}), a))


def _tp2(
    model_dir: Path,
    quantization: str,
    prompt: list[int],
    steps: int,
    tmp_path: Path,
    forced: list[int] | None = None,
) -> dict:
    out = tmp_path / "tp2.pt"
    args = (2, free_port(), str(model_dir), quantization, prompt, steps, str(out), forced)
    mp.start_processes(tp_rank, args=args, nprocs=2, start_method="spawn", join=True)
    return torch.load(out)


def _compare(model_dir: Path, quantization: str, prompt: list[int], steps: int, tmp_path: Path) -> float:
    """TP=2's greedy tokens must equal TP=1's; returns the worst row's relative logits error."""
    ref_tokens, ref_logits = greedy_run(make_runner(model_dir, quantization, None), prompt, steps)
    tp = _tp2(model_dir, quantization, prompt, steps, tmp_path)
    assert tp["tokens"] == ref_tokens
    return _rel(tp["logits"], ref_logits).max().item()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each row's relative logits error."""
    return (a - ref).norm(dim=-1) / ref.norm(dim=-1)


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3"])
def test_tp2_equals_tp1_on_tiny_models(kind, tmp_path, default_model_dir):
    _, path = _tiny_model(kind, tmp_path, default_model_dir)
    prompt = torch.randint(3, 512, (23,), generator=torch.Generator().manual_seed(2)).tolist()
    assert _compare(path, "auto", prompt, 12, tmp_path) <= 1e-5


def test_tp2_equals_tp1_on_the_default_model(tmp_path, tokenizer):
    """Uneven shards: 6 query heads / 2 KV heads on rank 0, 3 / 1 on rank 1. Float32 weights:
    fp32 agreement, the same greedy tokens. Kept as GGUF blocks, decode rows round each rank's
    activations to int8 per block of 32, and a last-bit difference upstream (the all-reduce adds
    in another order) flips some roundings; after a few layers TP=2's decode logits differ from
    TP=1's by about as much as TP=1's differ from the dequantized weights (two independent
    roundings: about sqrt(2) times), so near-ties may go either way. Both are teacher forced on
    TP=1's greedy tokens, and TP=2 must stay within three times that kernel error on average
    (a lost shard or a wrong reduction is off by the whole signal)."""
    model_dir = resolve_model_dir(None)
    assert [s.q1 - s.q0 for s in plan_shards(load_config(model_dir), 2)] == [6, 3]
    prompt = tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    assert _compare(model_dir, "dequantize", prompt, 10, tmp_path) <= 1e-5
    tokens, tp1 = greedy_run(make_runner(model_dir, "gguf", None), prompt, 10)
    _, dense = greedy_run(make_runner(model_dir, "dequantize", None), prompt, 10, tokens)
    tp2 = _tp2(model_dir, "gguf", prompt, 10, tmp_path, forced=tokens)["logits"]
    gap, kernel_err = _rel(tp2, tp1), _rel(tp1, dense)
    # the prompt's 12 rows take the many-row path: no activations rounded before the LM head
    assert gap[0] <= 2 * kernel_err[0] + 1e-5
    assert gap[1:].mean() <= 3 * kernel_err[1:].mean(), (gap, kernel_err)


def test_engine_tp2_generates_what_tp1_does(tmp_path, default_model_dir):
    """The whole engine: batched prefill, decode, the radix cache (the second call reuses the
    first's prefix), streaming and embeddings, on two ranks, give TP=1's results."""
    from radixlm.backend.engine import Engine

    _, path = _tiny_model("qwen2", tmp_path, default_model_dir)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 30, 17)]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}

    def run(**kw) -> list[list[int]]:
        with Engine(model_path=str(path), max_total_tokens=2048, **kw) as eng:
            outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
            again = eng.generate(input_ids=prompts[1] + outs[1][:4], sampling_params=params)
            streamed = list(eng.generate(input_ids=prompts[2], sampling_params=params, stream=True))
            assert eng.get_stats()["cached_prompt_tokens"] >= len(prompts[1])
            vectors.append(torch.tensor(eng.encode(input_ids=prompts[0])["embedding"]))
            return [*outs, again["output_ids"], streamed[-1]["output_ids"]]

    vectors: list[torch.Tensor] = []
    assert run(tp_size=2) == run()
    torch.testing.assert_close(vectors[0], vectors[1], rtol=1e-5, atol=1e-6)  # embeddings too


def test_engine_tp2_on_the_default_model(tokenizer):
    from radixlm.backend.engine import Engine

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
    params = {"max_new_tokens": 16, "temperature": 0}
    outs = {}
    for tp in (1, 2):
        with Engine(quantization="dequantize", max_total_tokens=4096, tp_size=tp) as eng:
            outs[tp] = [o["output_ids"] for o in eng.generate(prompts, params)]
    assert outs[2] == outs[1]


@pytest.mark.parametrize("size,reason", [(4, "cannot split 3 KV heads"), (0, "at least 1")])
def test_engine_refuses_a_split_the_model_cannot_take(size, reason):
    from radixlm.backend.engine import Engine

    with pytest.raises(ValueError, match=reason):
        Engine(max_total_tokens=1024, tp_size=size)


def test_a_dead_worker_fails_requests_with_its_reason(tmp_path, default_model_dir):
    from radixlm.backend.engine import Engine

    _, path = _tiny_model("llama3", tmp_path, default_model_dir)
    with Engine(model_path=str(path), max_total_tokens=1024, tp_size=2) as eng:
        params = {"max_new_tokens": 4, "temperature": 0}
        assert eng.generate(input_ids=[5, 6, 7], sampling_params=params)["meta_info"]["finish_reason"]
        worker = eng._tp.procs[0]  # type: ignore[union-attr]
        worker.kill()
        worker.join(timeout=10)
        out = eng.generate(input_ids=[8, 9, 10], sampling_params=params)
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "tensor-parallel worker" in reason["message"], reason


def test_serve_tp_flag_reaches_an_engine_process():
    """`radixlm serve --tp 2`: the flag becomes Engine(tp_size=2), which runs in the server's
    engine process (its ranks are that process's children)."""
    import argparse

    from radixlm.backend.engine_process import EngineProcess
    from radixlm.backend.server.launch import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(
        p.parse_args(["--tp", "2", "--quantization", "dequantize", "--max-total-tokens", "4096"])
    )
    assert kw["tp_size"] == 2
    params = {"max_new_tokens": 8, "temperature": 0}
    proc = EngineProcess(**kw)
    try:
        two = proc.generate("The capital of France is", params)["output_ids"]
    finally:
        proc.shutdown()
    kw["tp_size"] = 1
    proc = EngineProcess(**kw)
    try:
        assert proc.generate("The capital of France is", params)["output_ids"] == two
    finally:
        proc.shutdown()
