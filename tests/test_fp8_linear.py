"""Fp8Linear (radixlm.backend.fp8_linear) and its kernels on the CPU: stored e4m3 weights and row
scales against an independent per-row computation, the forward against fp32 F.linear with the
dequantized weight (tight) and the original weight (loose), bias / 3-D input / zero rows, the
_scaled_mm call convention (torch's CPU _scaled_mm) against its fp32 reference, which of the
two _scaled_mm calls a shape takes, the model's linear() dispatch, and the Triton kernels
(fp8_quant with its GEMM epilogue, fp8_gemv) under TRITON_INTERPRET=1 against their torch references (one subprocess: the interpreter must be on before kernels are defined)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixlm.backend.fp8_linear import (
    Fp8Linear,
    fp8_linear_ref,
    quantize_weight,
    rowwise_fills,
    scaled_mm_rowwise,
    scaled_mm_unit,
)
from radixlm.backend.models.llama import linear, native
from radixlm.kernels.fp8_quant import quantize_rows_ref

E4M3 = torch.float8_e4m3fn


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _layer(n: int, k: int, bias: bool, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Linear:
    """A linear whose rows span six orders of magnitude, with one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        w = torch.randn(n, k, generator=g) * torch.logspace(-3, 3, n)[:, None]
        w[n // 2] = 0.0
        lin.weight.copy_(w)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin.to(dtype)


def _expected(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, written out: scale = max(amax, 1e-12) * (1 / 448) (in float32), q = cast(clamp(w / scale))."""
    qs, scales = [], []
    for row in w.float():
        amax = max(float(v) for v in row.abs())
        scale = torch.tensor(max(amax, 1e-12), dtype=torch.float32) * torch.tensor(1 / 448.0)
        qs.append(torch.clamp(row / scale, -448.0, 448.0).to(E4M3))
        scales.append(scale)
    return torch.stack(qs), torch.stack(scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_linear_stores_independent_quantization(dtype: torch.dtype) -> None:
    lin = _layer(48, 64, bias=True, dtype=dtype)
    fp8 = Fp8Linear.from_linear(lin)
    q, scale = _expected(lin.weight.detach())
    assert fp8.weight.dtype == E4M3 and fp8.weight.shape == (48, 64)
    assert fp8.weight_scale.dtype == torch.float32 and fp8.weight_scale.shape == (48,)
    assert torch.equal(fp8.weight_scale, scale)
    assert torch.equal(fp8.weight.view(torch.uint8), q.view(torch.uint8))
    # e4m3 keeps 3 mantissa bits: each weight within half a step (2**-4 relative, or half the
    # subnormal step 2**-9 * scale near zero) of its dequantized value
    w = lin.weight.detach().float()
    deq = fp8.weight.float() * fp8.weight_scale[:, None]
    bound = torch.maximum(w.abs() * 2**-4, fp8.weight_scale[:, None] * 2**-10)
    assert bool(((deq - w).abs() <= bound * (1 + 1e-6)).all())
    assert bool((fp8.weight.float().abs().amax(1)[w.abs().amax(1) > 0] == 448.0).all())  # amax maps to 448
    assert fp8.bias is not None and fp8.bias.dtype == dtype and torch.equal(fp8.bias, lin.bias)


def test_zero_rows_quantize_to_zero_with_finite_scale() -> None:
    fp8 = Fp8Linear.from_linear(_layer(8, 32, bias=True))
    assert bool((fp8.weight[4].float() == 0).all()) and torch.isfinite(fp8.weight_scale).all()
    x = torch.randn(3, 32)
    x[1] = 0.0
    y = fp8(x)
    assert torch.equal(y[:, 4], fp8.bias[4].expand(3))  # type: ignore[index]
    assert torch.equal(y[1], fp8.bias)  # an all-zero input row gives the bias alone


def test_forward_matches_dequantized_weight_and_original() -> None:
    g = torch.Generator().manual_seed(1)
    lin = _layer(96, 128, bias=False)
    with torch.no_grad():  # a realistic spread: every row at unit scale
        lin.weight.copy_(torch.randn(96, 128, generator=g) / 128**0.5)
    fp8 = Fp8Linear.from_linear(lin)
    x = torch.randn(7, 128, generator=g)
    y = fp8(x)
    deq = fp8.weight.double() * fp8.weight_scale.double()[:, None]
    assert y.dtype == torch.float32
    assert _rel(y, F.linear(x.double(), deq)) < 1e-6
    # against the original weight: e4m3 rounding alone (measured 2.5e-2 to 2.8e-2 over 5 seeds)
    err = _rel(y, F.linear(x.double(), lin.weight.detach().double()))
    assert 1e-3 < err < 4e-2, err


@pytest.mark.parametrize("bias", [False, True])
def test_three_dim_input_and_bias(bias: bool) -> None:
    lin = _layer(32, 48, bias=bias, dtype=torch.bfloat16)
    fp8 = Fp8Linear.from_linear(lin)
    assert (fp8.bias is None) == (not bias)
    x = torch.randn(2, 5, 48).to(torch.bfloat16)
    y = fp8(x)
    assert y.shape == (2, 5, 32) and y.dtype == torch.bfloat16
    deq = fp8.weight.float() * fp8.weight_scale[:, None]
    ref = F.linear(x.float(), deq, lin.bias.float() if bias else None)
    assert _rel(y, ref) < 1e-2  # bf16 output rounding
    assert torch.equal(y[1], fp8(x[1]))  # rows are independent of the leading shape
    with pytest.raises(ValueError, match="input features"):
        fp8(torch.randn(3, 47))


def test_activation_reference_quantizes_per_row() -> None:
    x = torch.randn(6, 40) * torch.logspace(-4, 4, 6)[:, None]
    x[2] = 0.0
    q, s = quantize_rows_ref(x)
    assert q.dtype == E4M3 and s.shape == (6, 1) and s.dtype == torch.float32
    assert torch.equal(
        s[:, 0], torch.stack([max(r.abs().max(), torch.tensor(1e-12)) * torch.tensor(1 / 448.0) for r in x])
    )
    assert bool((q[2].float() == 0).all())
    deq = q.float() * s
    assert bool(((deq - x).abs() <= torch.maximum(x.abs() * 2**-4, s * 2**-10) * (1 + 1e-6)).all())


def _cpu_scaled_mm_works() -> bool:
    try:
        a = torch.ones(16, 16).to(E4M3)
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@pytest.mark.skipif(not _cpu_scaled_mm_works(), reason="this torch has no CPU _scaled_mm for e4m3")
@pytest.mark.parametrize(
    "dtype,bias",
    [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True), (torch.float16, False)],
)
def test_scaled_mm_call_matches_reference(dtype: torch.dtype, bias: bool) -> None:
    """The CUDA paths' exact calls (row-wise scales [M, 1] and [1, N], the weight's transpose; or
    unit scales into float32 and the epilogue), run by torch's CPU _scaled_mm: equal to
    dequantize-then-F.linear up to bf16 output rounding."""
    lin = _layer(64, 96, bias=bias)
    with torch.no_grad():  # rows 1e-5..1e1: every output stays inside float16's range
        lin.weight.mul_(1e-2)
    fp8 = Fp8Linear.from_linear(lin.to(dtype))
    x = (torch.randn(5, 96) * torch.logspace(-2, 1, 5)[:, None]).to(dtype)
    xq, xs = quantize_rows_ref(x)
    ref = fp8_linear_ref(fp8, x)
    for call in (scaled_mm_rowwise, scaled_mm_unit):  # row-wise scales; unit scales + epilogue
        y = call(xq, xs, fp8.weight, fp8.weight_scale, fp8.bias, dtype)
        assert y.dtype == dtype
        assert _rel(y, ref) < 8e-3, call.__name__
        # per output row too: a swapped scale (x's per column, w's per row) would fail here
        assert max(_rel(y[i], ref[i]) for i in range(5)) < 8e-3, call.__name__


def test_rowwise_scaled_mm_only_where_its_tiles_fill_the_gpu() -> None:
    """The H200's 132 SMs at the 8B shapes: row-wise for gate_up (N = 28672) from one row on, and
    for qkv once two row tiles make 96 tiles; unit scales for o_proj and down (N = 4096) up to
    256 rows, and for everything at few rows."""
    assert rowwise_fills(1, 28672, 132) and rowwise_fills(128, 28672, 132)
    assert not rowwise_fills(128, 6144, 132) and rowwise_fills(256, 6144, 132)
    assert not rowwise_fills(256, 4096, 132) and rowwise_fills(384, 4096, 132)
    assert not rowwise_fills(8, 4096, 132) and not rowwise_fills(8, 6144, 132)
    assert rowwise_fills(8192, 4096, 132)  # prefill


def test_model_linear_dispatch_runs_the_fp8_layer() -> None:
    fp8 = Fp8Linear.from_linear(_layer(32, 64, bias=True))
    for x in (torch.randn(1, 64), torch.randn(9, 64)):
        assert torch.equal(linear(fp8, x), fp8(x))
        assert torch.equal(native(fp8, x), fp8(x))


def test_fp8_parameters_survive_module_moves() -> None:
    fp8 = Fp8Linear.from_linear(_layer(16, 32, bias=True))
    names = {n for n, _ in fp8.named_parameters()} | {n for n, _ in fp8.named_buffers()}
    assert names == {"weight", "bias", "weight_scale"}
    moved = fp8.to("cpu")
    assert moved.weight.dtype == E4M3 and moved.weight_scale.dtype == torch.float32


def test_quantize_weight_chunks_match_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    import radixlm.backend.fp8_linear as mod

    w = torch.randn(37, 24) * torch.logspace(-2, 2, 37)[:, None]
    whole = quantize_weight(w)
    monkeypatch.setattr(mod, "ROW_CHUNK", 5)
    parts = quantize_weight(w)
    assert torch.equal(whole[0].view(torch.uint8), parts[0].view(torch.uint8))
    assert torch.equal(whole[1], parts[1])


# ---- Triton kernels under the interpreter (run in a subprocess: this file as a script) ----


def _interp_records() -> list[tuple[str, float, float]]:
    from radixlm.kernels.fp8_gemv import fp8_gemv, fp8_gemv_ref
    from radixlm.kernels.fp8_quant import quantize_rows, scale_outer, scale_outer_ref
    from radixlm.kernels.gemv import GemvConfig

    recs: list[tuple[str, float, float]] = []
    every = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    every = every[~every.isnan()].unique()
    mids = (every[1:] + every[:-1]) / 2  # ties: round to even
    grid = torch.cat([every, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    cases = [
        ("grid f32 (every e4m3 value, ties, neighbours)", grid[None, :], None),
        ("f32 3x40", torch.randn(3, 40), None),
        ("bf16 5x130 two-pass (block 32)", torch.randn(5, 130).to(torch.bfloat16), 32),
        ("f16 4x64", torch.randn(4, 64).to(torch.float16), None),
        ("bf16 rows 1e-6..1e4, a zero row", torch.randn(6, 72) * torch.logspace(-6, 4, 6)[:, None], None),
    ]
    cases[-1] = (cases[-1][0], cases[-1][1].to(torch.bfloat16), None)
    cases[-1][1][3] = 0.0
    cases.append(("strided f32 rows", torch.randn(4, 96)[:, :48], None))
    for label, x, block in cases:
        q, s = quantize_rows(x, block)
        qr, sr = quantize_rows_ref(x)
        mismatched = int((q.view(torch.uint8) != qr.view(torch.uint8)).sum()) + int((s != sr).sum())
        recs.append((f"quant {label}: bytes/scales differing", float(mismatched), 0.0))
    for m, n, k, dtype, bias, cfg in [
        (1, 37, 96, torch.float32, False, None),
        (3, 64, 100, torch.float32, True, GemvConfig("fma", 8, 32, 4)),
        (8, 20, 64, torch.bfloat16, True, GemvConfig("fma", 2, 64, 4)),
        (2, 16, 48, torch.float16, False, GemvConfig("fma", 4, 16, 2)),
    ]:
        x = torch.randn(m, k).to(dtype)
        w = torch.randn(n, k).to(E4M3)
        s = torch.rand(n) + 0.1
        b = torch.randn(n).to(dtype) if bias else None
        err = _rel(fp8_gemv(x, w, s, b, cfg), fp8_gemv_ref(x, w, s, b))
        recs.append(
            (f"gemv M={m} N={n} K={k} {dtype} bias={bias}", err, 1e-5 if dtype == torch.float32 else 1e-2)
        )
    for m, n, dtype, bias in [(3, 40, torch.bfloat16, True), (1, 2100, torch.float32, False)]:
        acc = torch.randn(m, n) * 1e4
        rs, cs = torch.rand(m, 1) * 1e-3, torch.rand(n) * 1e-2
        b = torch.randn(n).to(dtype) if bias else None
        err = _rel(scale_outer(acc, rs, cs, b, dtype).float(), scale_outer_ref(acc, rs, cs, b, dtype).float())
        # float32 exact; bf16 within one ulp (the interpreter's float32 -> bf16 cast truncates)
        recs.append(
            (f"scale_outer M={m} N={n} {dtype} bias={bias}", err, 0.0 if dtype == torch.float32 else 8e-3)
        )
    return recs


@pytest.fixture(scope="module")
def interp_records() -> list:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert lines, f"checker crashed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULTS ") :])


def test_triton_kernels_match_references_in_interpreter(interp_records: list) -> None:
    assert len(interp_records) == 12
    bad = [(label, err, bound) for label, err, bound in interp_records if not err <= bound]
    assert not bad, bad


if __name__ == "__main__":
    torch.manual_seed(0)
    print("RESULTS " + json.dumps(_interp_records()))
