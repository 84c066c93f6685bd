"""Decode-sized matmul y = x @ W^T (+ bias) for few rows (M <= 8) in one launch, no split-K: each
program owns BLOCK_N rows of W [N, K] (nn.Linear layout), streams them over K once and reuses
each W tile for all M rows; fp32 accumulation, y in x's dtype. Promises: `gemv` equals `gemv_ref`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._triton import dot_precision, mma, next_pow2, pdl_args, pdl_wait, tl, triton, use_triton

MAX_M = 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemvConfig:
    """kind "fma": CUDA-core multiply + row reduction, a static loop over the M rows; kind "dot":
    tensor-core tl.dot with M padded to 16 and a num_stages-deep cp.async pipeline over K."""

    kind: str = "fma"
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("fma", "dot"):
            raise ValueError(f"gemv kind must be 'fma' or 'dot', got {self.kind!r}")
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"gemv {name} must be a power of two, got {v}")
        if self.kind == "dot" and (self.block_n < 16 or self.block_k < 16):
            raise ValueError("gemv kind 'dot' needs block_n >= 16 and block_k >= 16")
        if self.num_stages < 1:
            raise ValueError(f"gemv num_stages must be >= 1, got {self.num_stages}")

    def label(self) -> str:
        return f"{self.kind} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}"


DEFAULT = GemvConfig()
# per row count M (the smallest key >= M applies): CUDA cores while the FMAs per weight byte are
# few, tensor cores above.
# M 1/2: fma n2 k4096 is the fastest config at every llama-3.1-8b shape for one row, and beats
# cuBLAS there; from M = 4 cuBLAS is faster at every shape, so the model calls gemv for one row
# only (`radixlm.backend.models.llama.linear`, through `use_gemv` below). Figures:
# benchmarks/results/gemv_h200.json.
DEFAULTS: dict[int, GemvConfig] = {
    1: GemvConfig("fma", 2, 4096, 4),
    2: GemvConfig("fma", 2, 4096, 4),
    4: GemvConfig("dot", 32, 256, 4, 4),
    8: GemvConfig("dot", 32, 256, 4, 4),
}


def default_config(m: int) -> GemvConfig:
    """The config `gemv` uses for m rows when none is given."""
    return next((DEFAULTS[k] for k in sorted(DEFAULTS) if k >= m), DEFAULT)


@triton.jit
def _gemv_fma_kernel(
    X,
    W,
    WS,
    B,
    Y,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N re-read row N-1 (loads stay unmasked); their outputs are never stored
    w_ptrs = W + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    offs_k = tl.arange(0, BLOCK_K)
    m_idx = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs).to(tl.float32)
        else:
            w = tl.load(w_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0).to(tl.float32)
        for m in tl.static_range(M):
            if EVEN_K:
                xm = tl.load(X + m * stride_xm + k0 + offs_k).to(tl.float32)
            else:
                xm = tl.load(X + m * stride_xm + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
            part = tl.sum(w * xm[None, :], axis=1)
            acc += tl.where(m_idx[:, None] == m, part[None, :], 0.0)
        w_ptrs += BLOCK_K
    if HAS_SCALE:  # a quantized weight's per-row scale, applied once per output
        acc *= tl.load(WS + rows, mask=rows < N, other=0.0)[None, :]
    _store(acc, B, Y, rows, m_idx, N, stride_ym, M, HAS_BIAS)


@triton.jit
def _gemv_dot_kernel(
    X,
    W,
    B,
    Y,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_idx = tl.arange(0, BLOCK_M)
    w_ptrs = W + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = X + tl.minimum(m_idx, M - 1)[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            kmask = (k0 + offs_k)[None, :] < K
            w = tl.load(w_ptrs, mask=kmask, other=0.0)
            x = tl.load(x_ptrs, mask=kmask, other=0.0)
        acc += mma(x, tl.trans(w), DOT_PREC)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    _store(acc, B, Y, rows, m_idx, N, stride_ym, M, HAS_BIAS)


@triton.jit
def _store(acc, B, Y, rows, m_idx, N, stride_ym, M: tl.constexpr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(B + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    mask = (m_idx[:, None] < M) & (rows[None, :] < N)
    tl.store(Y + m_idx[:, None] * stride_ym + rows[None, :], acc.to(Y.dtype.element_ty), mask=mask)


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a model should call `gemv` for F.linear(x, weight): a CUDA tensor of 1..8 rows
    (x [M, K]), W [N, K] with unit stride along K, same supported dtype. Host metadata only."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_M
        and weight.dim() == 2
        and weight.shape[1] == x.shape[1]
        and weight.stride(1) == 1
        and x.dtype == weight.dtype
        and x.dtype in DTYPES
        and weight.device == x.device
    )


def _validate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"gemv needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x has K={x.shape[1]} but weight has K={weight.shape[1]}")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"gemv serves 1..{MAX_M} rows, got M={x.shape[0]}")
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        raise ValueError(f"gemv: x {x.dtype} and weight {weight.dtype} must share one of {DTYPES}")
    if bias is not None and (bias.shape != (weight.shape[0],)):
        raise ValueError(f"gemv: bias shape {tuple(bias.shape)} != ({weight.shape[0]},)")


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight[N, K]^T (+ bias), fp32 accumulation, one kernel launch."""
    _validate(x, weight, bias)
    if not use_triton(x):
        return gemv_ref(x, weight, bias)
    return launch_gemv(x, weight, bias, config or default_config(x.shape[0]), out)


def launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: GemvConfig,
    out: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The launch behind `gemv`, for validated inputs; scale [N] fp32 (kind "fma" only) multiplies
    each output column: a quantized weight (e.g. e4m3) with one scale per row, read as it is."""
    if scale is not None and cfg.kind != "fma":
        raise ValueError("gemv: a per-row weight scale needs kind 'fma'")
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0 or k == 0:
        return y.zero_() if k == 0 else y
    block_k = min(cfg.block_k, max(16, next_pow2(k)))
    common = dict(
        M=m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_args(x, "gemv_" + cfg.kind),
    )
    grid = (triton.cdiv(n, cfg.block_n),)
    b = bias.contiguous() if bias is not None else y
    if cfg.kind == "dot":
        _gemv_dot_kernel[grid](
            x,
            weight,
            b,
            y,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            y.stride(0),
            BLOCK_M=16,
            DOT_PREC=dot_precision(x.dtype),
            **common,
            enable_fp_fusion=True,
        )
    else:
        _gemv_fma_kernel[grid](
            x,
            weight,
            scale.reshape(-1).contiguous() if scale is not None else y,
            b,
            y,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            y.stride(0),
            BLOCK_M=max(2, next_pow2(m)),
            HAS_SCALE=scale is not None,
            **common,
            enable_fp_fusion=True,
        )
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in fp32, cast to x's dtype."""
    b = bias.float() if bias is not None else None
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


__all__ = [
    "GemvConfig",
    "DEFAULT",
    "DEFAULTS",
    "default_config",
    "MAX_M",
    "gemv",
    "gemv_ref",
    "launch_gemv",
    "use_gemv",
]
