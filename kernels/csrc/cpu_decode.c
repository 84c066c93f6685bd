/* The CPU decode pieces of radixlm.kernels.cpu_decode (built there with the system compiler):
   add + RMSNorm, SiLU-and-mul, and rope + KV store + attention for a few rows; cpu_layers.c runs
   them layer after layer. */
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

/* per row of m rows of n: sum = x + residual; h = sum * rsqrt(mean(sum^2) + eps) * w. Without a
   residual (NULL) the plain norm: sum = x. */
void add_rmsnorm(const float *x, const float *residual, const float *w, float eps, int64_t m, int64_t n,
                 float *sum, float *h) {
    for (int64_t row = 0; row < m; row++, x += n, sum += n, h += n) {
        for (int64_t i = 0; i < n; i++) sum[i] = residual ? x[i] + residual[row * n + i] : x[i];
        const float r = 1.f / sqrtf(dot(sum, sum, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) h[i] = w[i] * (sum[i] * r);
    }
}

/* m rows, columns c0 .. c1: out [m, inter] = silu(gate) * up of gate_up [m, 2 inter] (gate first) */
static void silu_mul_cols(const float *gate_up, int64_t m, int64_t inter, int64_t c0, int64_t c1, float *out) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = c0; i < c1; i++) {
            const float g = gate_up[r * 2 * inter + i];
            out[r * inter + i] = g / (1.f + expf(-g)) * gate_up[r * 2 * inter + inter + i];
        }
}

void silu_mul(const float *gate_up, int64_t m, int64_t inter, float *out) {
    silu_mul_cols(gate_up, m, inter, 0, inter, out);
}

/* x [d] rotated in HF's rotate-half layout: x * cos + [x2, x1] * sin_signed */
static inline void rope(const float *x, const float *c, const float *s, int64_t d, float *o) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) o[i] = x[i] * c[i] + x[i + half] * s[i];
    for (int64_t i = half; i < d; i++) o[i] = x[i] * c[i] + x[i - half] * s[i];
}

/* One token of one request, qkv [(hq + 2 hkv) d]: k rotated at cos/sin (rows of the tables) and
   stored with v at slot new_slot of the pool [slots, hkv, d]. */
static void store_kv(const float *qkv, int64_t hq, int64_t hkv, int64_t d, const float *c, const float *s,
                     float *kbuf, float *vbuf, int64_t new_slot) {
    for (int64_t h = 0; h < hkv; h++) {
        rope(qkv + (hq + h) * d, c, s, d, kbuf + (new_slot * hkv + h) * d);
        for (int64_t i = 0; i < d; i++) vbuf[(new_slot * hkv + h) * d + i] = qkv[(hq + hkv + h) * d + i];
    }
}

/* Query heads h0 .. h1 of that token: q rotated, then out [hq d] = softmax(q . K[slots] * scale)
   V[slots] with kv head h / (hq / hkv) for query head h; q and the scores live in work [d + len]. */
static void attend_heads(const float *qkv, int64_t hq, int64_t hkv, int64_t d, const float *c, const float *s,
                         const float *kbuf, const float *vbuf, const int64_t *slots, int64_t len, float scale,
                         int64_t h0, int64_t h1, float *work, float *out) {
    float *q = work, *p = work + d;
    const int64_t group = hq / hkv;
    for (int64_t h = h0; h < h1; h++) {
        const int64_t g = h / group;
        float mx = -INFINITY, sum = 0.f;
        rope(qkv + h * d, c, s, d, q);
        for (int64_t t = 0; t < len; t++) {
            p[t] = dot(q, kbuf + (slots[t] * hkv + g) * d, d) * scale;
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
    float *work = (float *)malloc(sizeof(float) * (d + prefix + n));
    for (int64_t i = 0; i < n; i++) {
        const float *row = qkv + i * (hq + 2 * hkv) * d;
        store_kv(row, hq, hkv, d, c + i * d, s + i * d, kbuf, vbuf, new_slots[i]);
        attend_heads(row, hq, hkv, d, c + i * d, s + i * d, kbuf, vbuf, slots, prefix + i + 1, scale, 0, hq, work,
                     out + i * hq * d);
    }
    free(work);
}
