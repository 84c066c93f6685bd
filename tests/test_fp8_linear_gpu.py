"""Fp8Linear's CUDA paths (sm_89+) at the Llama-3.1-8B linear shapes: the per-row quantization
kernel bit-equal to its torch reference, the "scaled_mm" paths (torch._scaled_mm with row-wise
scales, or unit scales and the epilogue; each shape takes the one its SM fill picks) and the
weight-only fp8 GEMV against fp32 references over the same fp8 operands, both against the
original bf16 weight (loosely: e4m3 rounding), bias handling, and CUDA-graph capture and replay.
Skips without such a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixlm.backend.fp8_linear import (
    GEMV_MAX_M,
    Fp8Linear,
    fp8_linear_ref,
    rowwise_fills,
    scaled_mm_rowwise,
    scaled_mm_unit,
)
from radixlm.kernels.fp8_gemv import MAX_M as GEMV_ROWS
from radixlm.kernels.fp8_gemv import fp8_gemv, fp8_gemv_ref
from radixlm.kernels.fp8_quant import quantize_rows, quantize_rows_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with e4m3 tensor cores (sm_89+)",
    ),
]

K = 4096
SHAPES = [(6144, K), (4096, K), (28672, K), (4096, 14336)]  # qkv, o_proj, gate_up, down (N, K)
ROWS = [1, 7, 64, 128]
BF16 = torch.bfloat16
# bf16 output rounding plus fast accumulation, over identical fp8 operands
SAME_OPERANDS = 1e-2
# e4m3 rounding of the weight (and for scaled_mm of the activations too): ~2.5e-2 each on the
# CPU test's data (tests/test_fp8_linear.py), about sqrt(2) times that with both
VS_BF16 = 6e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"N{s[0]}_K{s[1]}")
def layers(request: pytest.FixtureRequest) -> tuple[nn.Linear, Fp8Linear]:
    n, k = request.param
    torch.manual_seed(n + k)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=BF16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, device="cuda") / k**0.5)
    return lin, Fp8Linear.from_linear(lin)


def _x(m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k, device="cuda").to(BF16)


@pytest.mark.parametrize("m", ROWS)
def test_forward_at_8b_shapes(layers: tuple[nn.Linear, Fp8Linear], m: int) -> None:
    lin, fp8 = layers
    x = _x(m, fp8.in_features)
    y = fp8(x)
    torch.cuda.synchronize()
    assert y.shape == (m, fp8.out_features) and y.dtype == BF16 and bool(torch.isfinite(y).all())
    path = fp8.path(x)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mm = "scaled_mm" if rowwise_fills(m, fp8.out_features, sms) else "scaled_mm_unit"
    assert path == ("gemv" if m <= GEMV_MAX_M else mm)
    deq = fp8.weight.float() * fp8.weight_scale[:, None]
    ref = fp8_linear_ref(fp8, x) if path.startswith("scaled_mm") else F.linear(x.float(), deq)
    assert _rel(y, ref) < SAME_OPERANDS, path
    assert _rel(y, F.linear(x.float(), lin.weight.float())) < VS_BF16, path


@pytest.mark.parametrize("m", ROWS)
def test_scaled_mm_path_at_every_row_count(layers: tuple[nn.Linear, Fp8Linear], m: int) -> None:
    """Both scaled_mm calls at every row count, whichever forward() would take."""
    _, fp8 = layers
    x = _x(m, fp8.in_features)
    xq, xs = quantize_rows(x)
    for call in (scaled_mm_rowwise, scaled_mm_unit):
        y = call(xq, xs, fp8.weight, fp8.weight_scale, None, BF16)
        assert _rel(y, fp8_linear_ref(fp8, x)) < SAME_OPERANDS, call.__name__


@pytest.mark.parametrize("m", [1, 2, 4, 7, 8])
def test_fp8_gemv_at_decode_rows(layers: tuple[nn.Linear, Fp8Linear], m: int) -> None:
    _, fp8 = layers
    assert m <= GEMV_ROWS
    x = _x(m, fp8.in_features)
    y = fp8_gemv(x, fp8.weight, fp8.weight_scale)
    assert _rel(y, fp8_gemv_ref(x.float(), fp8.weight, fp8.weight_scale)) < SAME_OPERANDS


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("block_k", [None, 1024])  # one read per row, and the two-pass loop
def test_quant_kernel_bit_equal_to_reference(m: int, block_k: int | None) -> None:
    for k in (4096, 14336):
        x = _x(m, k) * torch.logspace(-3, 3, m, device="cuda")[:, None].to(BF16)
        x[m // 2] = 0.0
        q, s = quantize_rows(x, block_k)
        qr, sr = quantize_rows_ref(x)
        assert s.shape == (m, 1) and s.dtype == torch.float32 and s.is_contiguous()
        assert torch.equal(s, sr)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_bias_and_input_dtypes(m: int, dtype: torch.dtype) -> None:
    torch.manual_seed(m)
    lin = nn.Linear(1024, 512, bias=True, device="cuda", dtype=dtype)
    fp8 = Fp8Linear.from_linear(lin)
    x = torch.randn(2, m, 1024, device="cuda", dtype=dtype)
    y = fp8(x)
    assert y.shape == (2, m, 512) and y.dtype == dtype
    ref = (
        fp8_linear_ref(fp8, x) if fp8.path(x).startswith("scaled_mm") else fp8.dequantized_forward(x.float())
    )
    assert _rel(y, ref) < SAME_OPERANDS


@pytest.mark.parametrize("m", [1, 64])
def test_cuda_graph_capture_and_replay(layers: tuple[nn.Linear, Fp8Linear], m: int) -> None:
    _, fp8 = layers
    static_x = _x(m, fp8.in_features)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (Triton compiles) outside the capture
        fp8(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fp8(static_x)
    for _ in range(2):
        static_x.copy_(_x(m, fp8.in_features))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, fp8(static_x))


@pytest.mark.parametrize("m", [1, 64])
def test_model_linear_dispatch(layers: tuple[nn.Linear, Fp8Linear], m: int) -> None:
    """llama.linear() hands an Fp8Linear its own paths (the bf16 one-row GEMV is for nn.Linear)."""
    from radixlm.backend.models.llama import linear

    _, fp8 = layers
    x = _x(m, fp8.in_features)
    assert torch.equal(linear(fp8, x), fp8(x))
