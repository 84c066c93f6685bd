"""The per-layer pieces of CPU decode around the matmuls, each one C call in place of the 10-35
small torch ops it replaces (at batch 1 on the CPU a decode step is bound by the count of ops as
much as by the weights): residual add + RMSNorm of a few rows, and rope + KV store + attention
of one request's few new tokens (a decode token, or a verify step's token and drafts) over its
slots. Each row's arithmetic is the same however many rows come with it, so a verify step's
rows equal the decode steps they stand for. Built like radixlm.kernels.quant_gemv_cpu;
`available()` is False where that cannot build, and callers keep their torch ops."""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from .quant_gemv_cpu import GEMV_MAX_ROWS, build_c

# Steps of up to as many rows as the GEMV kernel takes are bound by op count, like decode, and run
# these calls; larger ones (prefill) keep torch's batched, multi-threaded attention and norms.
MAX_ROWS = GEMV_MAX_ROWS

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    float r = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* per row of m rows of n: sum = x + residual; h = sum * rsqrt(mean(sum^2) + eps) * w */
void add_rmsnorm(const float *x, const float *residual, const float *w, float eps, int64_t m, int64_t n,
                 float *sum, float *h) {
    for (int64_t row = 0; row < m; row++, x += n, residual += n, sum += n, h += n) {
        for (int64_t i = 0; i < n; i++) sum[i] = x[i] + residual[i];
        const float r = 1.f / sqrtf(dot(sum, sum, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) h[i] = w[i] * (sum[i] * r);
    }
}

/* x [d] rotated in HF's rotate-half layout: x * cos + [x2, x1] * sin_signed */
static inline void rope(const float *x, const float *c, const float *s, int64_t d, float *o) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) o[i] = x[i] * c[i] + x[i + half] * s[i];
    for (int64_t i = half; i < d; i++) o[i] = x[i] * c[i] + x[i - half] * s[i];
}

/* One token of one request: qkv [(hq + 2 hkv) d] -> q, k rotated at cos/sin (rows of the
   tables), k and v stored at slot new_slot of the pool [slots, hkv, d], then out [hq d] =
   softmax(q . K[slots] * scale) V[slots] with kv head h / (hq / hkv) for query head h; q and
   the scores live in work [hq d + len]. */
static void attend_one(const float *qkv, int64_t hq, int64_t hkv, int64_t d, const float *c, const float *s,
                       float *kbuf, float *vbuf, int64_t new_slot, const int64_t *slots, int64_t len,
                       float scale, float *work, float *out) {
    float *q = work, *p = work + hq * d;
    for (int64_t h = 0; h < hq; h++) rope(qkv + h * d, c, s, d, q + h * d);
    for (int64_t h = 0; h < hkv; h++) {
        rope(qkv + (hq + h) * d, c, s, d, kbuf + (new_slot * hkv + h) * d);
        for (int64_t i = 0; i < d; i++) vbuf[(new_slot * hkv + h) * d + i] = qkv[(hq + hkv + h) * d + i];
    }
    const int64_t group = hq / hkv;
    for (int64_t h = 0; h < hq; h++) {
        const int64_t g = h / group;
        float mx = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < len; t++) {
            p[t] = dot(q + h * d, kbuf + (slots[t] * hkv + g) * d, d) * scale;
            mx = p[t] > mx ? p[t] : mx;
        }
        for (int64_t t = 0; t < len; t++) { p[t] = expf(p[t] - mx); sum += p[t]; }
        float *o = out + h * d;
        for (int64_t i = 0; i < d; i++) o[i] = 0.f;
        for (int64_t t = 0; t < len; t++) {
            const float a = p[t] / sum, *v = vbuf + (slots[t] * hkv + g) * d;
            for (int64_t i = 0; i < d; i++) o[i] += a * v[i];
        }
    }
}

/* n new tokens of one request, in order: token i (qkv row i, cos/sin row i) is stored at
   new_slots[i], then attends causally: the first prefix + i + 1 of the request's slots, itself
   last (the ones before it already stored). */
void rope_store_attend(const float *qkv, int64_t n, int64_t hq, int64_t hkv, int64_t d, const float *c,
                       const float *s, float *kbuf, float *vbuf, const int64_t *new_slots,
                       const int64_t *slots, int64_t prefix, float scale, float *out) {
    float *work = (float *)malloc(sizeof(float) * (hq * d + prefix + n));
    for (int64_t i = 0; i < n; i++)
        attend_one(qkv + i * (hq + 2 * hkv) * d, hq, hkv, d, c + i * d, s + i * d, kbuf, vbuf, new_slots[i],
                   slots, prefix + i + 1, scale, work, out + i * hq * d);
    free(work);
}
"""

_lock = threading.Lock()
_lib: list[ctypes.CDLL | None] = []


def available() -> bool:
    if not _lib:
        with _lock:
            if not _lib:
                lib = None if os.environ.get("RADIXLM_NO_CPU_GEMV") else build_c(_SOURCE, "cpu_decode")
                if lib is not None:
                    p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
                    lib.add_rmsnorm.argtypes = [p, p, p, f, i, i, p, p]
                    lib.add_rmsnorm.restype = None
                    lib.rope_store_attend.argtypes = [p, i, i, i, i, p, p, p, p, p, p, i, f, p]
                    lib.rope_store_attend.restype = None
                _lib.append(lib)
    return _lib[0] is not None


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual) for float32 contiguous rows [m, n]."""
    lib = _lib[0]
    assert lib is not None
    total, h = torch.empty_like(residual), torch.empty_like(residual)
    m, n = residual.shape
    lib.add_rmsnorm(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, m, n, total.data_ptr(), h.data_ptr()
    )
    return h, total


def rope_store_attend(
    qkv: torch.Tensor,
    heads: tuple[int, int, int],
    cos_rows: torch.Tensor,
    sin_signed_rows: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    new_slots: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The attention output [n, hq * d] (float32) of one request's n new tokens (qkv [n, ...],
    cos/sin rows [n, d] at their positions), their k and v stored at new_slots (int64 [n]);
    slots (int64) are the request's KV slots, the n new ones last."""
    lib = _lib[0]
    assert lib is not None and new_slots.dtype == slots.dtype == torch.int64
    assert new_slots.is_contiguous() and slots.is_contiguous() and cos_rows.is_contiguous()
    hq, hkv, d = heads
    n = qkv.shape[0]
    out = torch.empty(n, hq * d)
    lib.rope_store_attend(
        qkv.data_ptr(), n, hq, hkv, d, cos_rows.data_ptr(), sin_signed_rows.data_ptr(),
        k_buf.data_ptr(), v_buf.data_ptr(), new_slots.data_ptr(), slots.data_ptr(), slots.numel() - n,
        d**-0.5, out.data_ptr(),
    )  # fmt: skip
    return out
