"""The qkv projection with rope and the KV store in its epilogue (`quant_gemv_rope.qkv_rope_store`)
against the two launches it replaces (the "dp4a" matmul, then `rotary_and_store`) and against the
torch references of both (`qkv_rope_store_ref`); weights from gguf's own quantizer. Under
TRITON_INTERPRET=1 in a subprocess (the interpreter must be on before the kernels are defined),
and in-process on a GPU when there is one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

# (format, x dtype, Hq, Hkv, D, K, fp8 pool): K / 32 not a multiple of the block tile in some
CASES = [
    ("Q4_0", "bfloat16", 4, 2, 16, 96, False),
    ("Q4_1", "float16", 2, 1, 32, 64, False),
    ("Q8_0", "bfloat16", 4, 2, 8, 160, False),
    ("Q4_0", "bfloat16", 4, 2, 16, 64, True),
    ("Q4_K", "bfloat16", 2, 2, 16, 256, False),
]


def _raw(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    if qtype != "Q4_K":
        return gguf.quants.quantize(
            rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType[qtype]
        )
    raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)  # every sub-scale and quant
    raw[..., 0:4] = (rng.standard_normal((n, k // 256, 2)) * 0.02).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def _pool(size: int, hkv: int, d: int, fp8: bool, g: torch.Generator, device: str) -> torch.Tensor:
    buf = torch.randn(size, hkv, d, generator=g)
    return (buf.to(torch.float8_e4m3fn) if fp8 else buf.to(torch.bfloat16)).to(device)


def check(device: str, qtype: str, dtype: str, hq: int, hkv: int, d: int, k: int, fp8: bool) -> dict:
    """Rel. errors of q and of the pool rows written against the unfused launches ("two") and the
    torch references ("ref"), and whether any other pool row changed."""
    from radixlm.kernels.quant_gemv import DP4A, quant_matmul, repack
    from radixlm.kernels.quant_gemv_rope import qkv_rope_store, qkv_rope_store_ref
    from radixlm.kernels.rotary import build_cos_sin_cache, rotary_and_store

    rng = np.random.default_rng(hq * 100 + d * 10 + k)
    g = torch.Generator().manual_seed(k)
    w = repack(torch.from_numpy(_raw(qtype, (hq + 2 * hkv) * d, k, rng)).to(device), qtype)
    x = torch.randn(1, k, generator=g).to(device, getattr(torch, dtype))
    cache = build_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 512).to(device)
    pos, loc = torch.tensor([301], device=device), torch.tensor([5], device=device)
    scales = (torch.rand(hkv, generator=g) + 0.5).to(device), (torch.rand(hkv, generator=g) + 0.5).to(device)
    k_scale, v_scale = scales if fp8 else (None, None)
    pools = {
        name: [_pool(9, hkv, d, fp8, torch.Generator().manual_seed(3), device) for _ in "kv"]
        for name in ("fused", "two", "ref")
    }
    heads = (hq, hkv, d)
    q = {"fused": qkv_rope_store(x, w, heads, pos, cache, *pools["fused"], loc, k_scale, v_scale)}
    q["ref"] = qkv_rope_store_ref(x, w, heads, pos, cache, *pools["ref"], loc, k_scale, v_scale)
    qkv = quant_matmul(x, w, DP4A)
    parts = [t.view(1, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1)]
    q["two"] = rotary_and_store(*parts, pos, cache, *pools["two"], loc, k_scale, v_scale)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))

    out: dict = {}
    for name in ("two", "ref"):
        kb, vb = pools[name]
        out[name] = {
            "q": rel(q["fused"], q[name]),
            "k": rel(pools["fused"][0][loc], kb[loc]),
            "v": rel(pools["fused"][1][loc], vb[loc]),
        }
    rest = torch.ones(9, dtype=torch.bool, device=device)
    rest[loc] = False
    out["others_equal"] = all(
        torch.equal(a[rest].float(), b[rest].float()) for a, b in zip(pools["fused"], pools["ref"])
    )
    out["q_shape"] = list(q["fused"].shape)
    return out


def _run_all(device: str) -> list[dict]:
    return [check(device, *case) for case in CASES]


def _check(results: list[dict]) -> None:
    """Against the two launches: the same products, so equal but for a rounding the fused
    epilogue may take the other way (fp32 sums, then one bf16 or fp8 rounding); against the torch
    references: within x's dtype (and fp8's) rounding. A lost sign, a swapped half or a wrong head
    would be off by tens of percent."""
    assert len(results) == len(CASES)
    for (_, dtype, hq, _, d, _, fp8), r in zip(CASES, results):
        assert r["q_shape"] == [1, hq, d], r
        assert r["others_equal"], r
        for name, tol, kv_tol in (("two", 5e-3, 1e-2 if fp8 else 5e-3), ("ref", 2e-2, 5e-2 if fp8 else 2e-2)):
            assert r[name]["q"] <= tol, (name, dtype, r)
            assert r[name]["k"] <= kv_tol and r[name]["v"] <= kv_tol, (name, fp8, r)


@pytest.mark.parametrize("where", ["interpreter", "cuda"])
def test_qkv_rope_store_matches_two_launches_and_references(where):
    if where == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        _check(_run_all("cuda"))
        return
    if torch.cuda.is_available():  # the GPU image's older Triton interpreter fails; 'cuda' covers it
        pytest.skip("interpreter check is for CPU CI; the compiled kernel runs in the cuda case")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_qkv_rope_store_refuses_what_it_does_not_serve():
    from radixlm.kernels.quant_gemv import repack
    from radixlm.kernels.quant_gemv_rope import qkv_rope_store

    rng = np.random.default_rng(0)
    w = repack(torch.from_numpy(_raw("Q4_0", 8 * 16, 64, rng)), "Q4_0")
    cache = torch.zeros(4, 16)
    pool = torch.zeros(3, 2, 16, dtype=torch.bfloat16)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="need"):  # the weight's rows are not these heads'
        qkv_rope_store(torch.randn(1, 64).bfloat16(), w, (2, 2, 16), one, cache, pool, pool, one)
    with pytest.raises(ValueError, match="one bf16/fp16 row"):
        qkv_rope_store(torch.randn(2, 64).bfloat16(), w, (4, 2, 16), one, cache, pool, pool, one)
    with pytest.raises(ValueError, match="pool rows"):
        qkv_rope_store(torch.randn(1, 64).bfloat16(), w, (4, 2, 16), one, cache, pool[:, :1], pool, one)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_engine_decodes_alike_with_and_without_the_fused_projection(
    tmp_path, default_model_dir, monkeypatch: pytest.MonkeyPatch, kv_dtype: str
) -> None:
    """A tiny random Llama 3 with Q4_0 weights on the GPU, CUDA graphs and overlap on: decode with
    the qkv matmul rotating and storing (batch-1 steps) gives the greedy tokens of the two
    launches, and the fused kernel really ran."""
    from gpu_helpers import mem_fraction
    from test_engine_hf_parity import _tiny_model

    from radixlm.backend import quant_linear
    from radixlm.backend.engine import Engine
    from radixlm.kernels import quant_gemv_rope

    _, path = _tiny_model("llama3", tmp_path, default_model_dir)
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=rng).tolist() for n in (7, 33)]
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    outs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(quant_linear, "fuses_rope", lambda *a: False)
        eng = Engine(
            model_path=str(path),
            device="cuda",
            dtype="bfloat16",
            quantization="q4_0",
            kv_cache_dtype=kv_dtype,
            max_total_tokens=4096,
            mem_fraction_static=mem_fraction(0.2),
        )
        try:
            assert eng.runner.graph_runner is not None
            outs[fused] = [eng.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
        finally:
            eng.shutdown()
        if fused:
            kernel = quant_gemv_rope._qkv_rope_store_kernel
            assert any(cache[0] for cache in kernel.device_caches.values()), "the fused kernel never ran"
    assert outs[True] == outs[False]


if __name__ == "__main__":
    print(json.dumps(_run_all("cpu")))
