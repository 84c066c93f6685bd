/* The CPU block kernels of radixlm.kernels.quant_gemv_cpu (built there with the system compiler):
   int8 dot products over GGUF Q4_0/Q4_1/Q8_0 rows, and their dequantization to bf16. */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

static inline float f16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

static inline __m256i q4_values(const uint8_t *qs) {  /* low lane values 0-15, high lane 16-31 */
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

static inline __m256 dot_u8_s8(__m256i u, __m256i s) {  /* 8 partial int sums, as float */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s));
#elif defined(__AVXVNNI__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s));
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define USE512 1 /* two blocks per 512-bit dot product */
#else
#define USE512 0
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define MASKED_TAIL 1 /* masked 256-bit loads and stores */
#else
#define MASKED_TAIL 0
#endif

/* x [m, nb * 32] -> int8 qx, per-block scale dx (qx * dx ~ x), sum of qx, and sx = dx * sum(qx):
   the block's sum as quantized, so that the offset term of Q4_0/Q4_1 (-8 d sum(x), m sum(x)) sees
   the same x as the dot product and the error is sum(w * (x - qx * dx)), llama.cpp's Q8_1 choice.
   The exact sum would leave only d * q (all of one sign, twice w's spread) against the error.
   With USE512 and 4-bit weights a row's block pairs (b, b+1) are stored as b's values 0-15,
   b+1's 0-15, b's 16-31, b+1's 16-31: the order their nibbles unpack in. */
static void quantize_x(const float *x, int64_t m, int64_t nb, int fmt, int8_t *qx, float *dx, float *sx,
                       float *qsum) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + (i * nb + b) * 32;
            float amax = 0.f;
            for (int j = 0; j < 32; j++) { float a = fabsf(v[j]); amax = a > amax ? a : amax; }
            const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            int8_t *o = qx + (i * nb + b) * 32;
            int lo = 0, hi = 16, qs = 0;
            if (USE512 && fmt != 2 && (b | 1) < nb) {  /* paired block */
                o = qx + (i * nb + (b & ~1)) * 32;
                lo = (b & 1) ? 16 : 0;
                hi = lo + 32;
            }
            for (int j = 0; j < 16; j++) {
                const int a = (int)lrintf(v[j] * id), c = (int)lrintf(v[j + 16] * id);
                o[lo + j] = (int8_t)a; o[hi + j] = (int8_t)c; qs += a + c;
            }
            dx[i * nb + b] = d; sx[i * nb + b] = d * (float)qs; qsum[i * nb + b] = (float)qs;
        }
}

/* Rows come repacked (repack() below): per row the nb block scales d as halves, for Q4_1 the nb
   offsets m too, then the quants, nb * 16 bytes (Q4: low nibbles values 0-15 of a block, high
   16-31) or nb * 32 (Q8_0). Scales in a run vectorise the per-block float work, leaving one
   broadcast and one FMA per block in the inner loop. fmt: 0 Q4_0, 1 Q4_1, 2 Q8_0. */
#define ROWS 4        /* rows walked side by side: four memory streams, x loaded once per block */
#define AHEAD 2       /* groups of rows prefetched ahead of the one computed */
#define MAXNB 512     /* blocks per row the scale buffer holds (K <= 16384) */

static inline int64_t header_bytes(int fmt, int64_t nb) { return (fmt == 1 ? 4 : 2) * nb; }
static inline int64_t quant_bytes(int fmt) { return fmt == 2 ? 32 : 16; }

/* sc[b] = d[b] * dx[b]; returns the row's term in sum(x) (sum m * sx for Q4_1, -8 sum d * sx for
   Q4_0) as 8 partial sums: the dot products accumulate onto them, and one reduction ends all */
static inline __m256 prologue(const uint8_t *row, int64_t nb, int fmt, const float *dx, const float *sx,
                              const float *qsum, float *sc) {
    const uint16_t *d = (const uint16_t *)row;
    __m256 e = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b)));
        const __m256 s = _mm256_mul_ps(dv, _mm256_loadu_ps(dx + b));
        _mm256_storeu_ps(sc + b, s);
        if (fmt == 1)
            e = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + nb + b))),
                                _mm256_loadu_ps(sx + b), e);
        else if (fmt == 0)
            e = _mm256_fnmadd_ps(_mm256_mul_ps(dv, _mm256_set1_ps(8.f)), _mm256_loadu_ps(sx + b), e);
        else if (USE512)  /* Q8_0 dotted as q + 128: take 128 * sum(qx) back out */
            e = _mm256_fnmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(128.f)), _mm256_loadu_ps(qsum + b), e);
    }
    if (b == nb) return e;
#if MASKED_TAIL  /* the last < 8 blocks as one masked step (masked-off lanes load 0, add 0) */
    const __mmask8 k = (__mmask8)((1u << (nb - b)) - 1);
    const __m256 dv = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(k, d + b));
    const __m256 s = _mm256_mul_ps(dv, _mm256_maskz_loadu_ps(k, dx + b));
    _mm256_mask_storeu_ps(sc + b, k, s);
    if (fmt == 1)
        e = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_maskz_loadu_epi16(k, d + nb + b)), _mm256_maskz_loadu_ps(k, sx + b), e);
    else if (fmt == 0)
        e = _mm256_fnmadd_ps(_mm256_mul_ps(dv, _mm256_set1_ps(8.f)), _mm256_maskz_loadu_ps(k, sx + b), e);
    else if (USE512)
        e = _mm256_fnmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(128.f)), _mm256_maskz_loadu_ps(k, qsum + b), e);
    return e;
#else
    float extra = 0.f;
    for (; b < nb; b++) {
        const float dv = _cvtsh_ss(d[b]);
        sc[b] = dv * dx[b];
        if (fmt == 1) extra += _cvtsh_ss(d[nb + b]) * sx[b];
        else if (fmt == 0) extra -= 8.f * dv * sx[b];
        else if (USE512) extra -= 128.f * sc[b] * qsum[b];
    }
    return _mm256_add_ps(e, _mm256_set_ps(0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, extra));
#endif
}

static inline __m256 block_dot(const uint8_t *qs, __m256i xv, int fmt) {
    if (fmt == 2) {  /* signed times signed: (q + 128) . qx, or |q| . (qx * sign(q)) */
        const __m256i q = _mm256_loadu_si256((const __m256i *)qs);
        if (USE512) return dot_u8_s8(_mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)), xv);
        return dot_u8_s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q));
    }
    return dot_u8_s8(q4_values(qs), xv);
}

#if USE512
static inline __m512i pair_quants(const uint8_t *qs, int fmt) {  /* blocks b, b+1 as dpbusd's u8 side */
    if (fmt == 2) return _mm512_xor_si512(_mm512_loadu_si512(qs), _mm512_set1_epi8((char)0x80));
    const __m256i v = _mm256_loadu_si256((const __m256i *)qs), m = _mm256_set1_epi8(0x0F);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m)),
                              _mm256_and_si256(_mm256_srli_epi16(v, 4), m), 1);
}

static inline __m512 pair_dot(__m512i q, __m512i xv, const float *sc, int fmt, __m512 acc) {
    const __m512i idx = fmt == 2 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                 : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512 s2 = _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)sc)));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv)),
                           _mm512_permutexvar_ps(idx, s2), acc);
}
#endif

/* y [im, n] (rows r .. r + rows of it) = im rows of x, given quantized, @ w^T. Each block pair
   of the weight is unpacked once for all im rows of x. Per (x row, weight row) the operations
   and their order do not depend on im or on the other rows: a row's result is the same alone
   (decode) as among others (a verify step). Inlined with constant rows and im, so the
   accumulators stay in registers. */
#define MAXIM 4  /* x rows per pass: 4 x 4 accumulators, 4 unpacked pairs and x fit 32 registers */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, int64_t r, const int rows,
                                                       const int im, int64_t n, int64_t nb, const int8_t *qx,
                                                       const float *dx, const float *sx, const float *qsum,
                                                       float *y, const int fmt) {
    const int64_t hdr = header_bytes(fmt, nb), qb = quant_bytes(fmt), stride = hdr + qb * nb;
    float sc[MAXIM][ROWS][MAXNB];  /* d * dx per (x row, weight row, block) */
    __m256 e[MAXIM][ROWS];  /* the prologue's terms, where the dot products start */
    for (int i = 0; i < im; i++)
        for (int j = 0; j < rows; j++)
            e[i][j] = prologue(w + (r + j) * stride, nb, fmt, dx + i * nb, sx + i * nb, qsum + i * nb, sc[i][j]);
    const uint8_t *q0 = w + r * stride + hdr;
    int64_t b0 = 0;
#if USE512
    __m512 acc2[MAXIM][ROWS];
    for (int i = 0; i < im; i++)
        for (int j = 0; j < rows; j++) acc2[i][j] = _mm512_zextps256_ps512(e[i][j]);
    for (; b0 + 2 <= nb; b0 += 2) {
        __m512i q[ROWS];
        for (int j = 0; j < rows; j++) q[j] = pair_quants(q0 + j * stride + b0 * qb, fmt);
        for (int i = 0; i < im; i++) {
            const __m512i xv = _mm512_loadu_si512(qx + (i * nb + b0) * 32);
            for (int j = 0; j < rows; j++) acc2[i][j] = pair_dot(q[j], xv, &sc[i][j][b0], fmt, acc2[i][j]);
        }
    }
    if (b0 == nb) {
        for (int i = 0; i < im; i++)
            for (int j = 0; j < rows; j++) y[i * n + r + j] = _mm512_reduce_add_ps(acc2[i][j]);
        return;
    }
#endif
    for (int i = 0; i < im; i++) {  /* blocks left: all without USE512, else the odd last one */
        const int8_t *xq = qx + i * nb * 32;
        __m256 acc[ROWS];
        for (int j = 0; j < rows; j++) acc[j] = USE512 ? _mm256_setzero_ps() : e[i][j];
        for (int64_t b = b0; b < nb; b++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
            for (int j = 0; j < rows; j++)
                acc[j] = _mm256_fmadd_ps(block_dot(q0 + j * stride + b * qb, xv, fmt),
                                         _mm256_broadcast_ss(&sc[i][j][b]), acc[j]);
        }
#if USE512
        for (int j = 0; j < rows; j++)
            y[i * n + r + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc2[i][j], _mm512_zextps256_ps512(acc[j])));
#else
        for (int j = 0; j < rows; j++) y[i * n + r + j] = hsum(acc[j]);
#endif
    }
}

#define TILE(ROWS_, IM_) tile(w, r, ROWS_, IM_, n, nb, qx + i0 * nb * 32, dx + i0 * nb, sx + i0 * nb, \
                              qsum + i0 * nb, y + i0 * n, fmt)

/* columns r0 .. r1 of y [m, n] = x [m, k] @ w^T, w n repacked rows of nb blocks, x given quantized */
static __attribute__((noinline)) void gemm(const uint8_t *w, int64_t n, int64_t nb, const int8_t *qx, const float *dx,
                        const float *sx, const float *qsum, int64_t m, float *y, const int fmt, int64_t r0,
                        int64_t r1) {
    const int64_t stride = header_bytes(fmt, nb) + quant_bytes(fmt) * nb;
    for (int64_t r = r0; r < r1; r += ROWS) {
        const int rows = r1 - r < ROWS ? (int)(r1 - r) : ROWS;
        /* the whole group AHEAD on, line by line; past the last row this runs into the weight the
           arena (arena() below) placed next, the one the next call reads (prefetches never fault) */
        for (int64_t off = 0; off < ROWS * stride; off += 64)
                _mm_prefetch((const char *)(w + (r + AHEAD * ROWS) * stride + off), _MM_HINT_T0);
        /* x rows in passes of at most MAXIM, as even as possible (5 rows: 3 + 2, not 4 + 1) */
        for (int64_t i0 = 0, left = (m + MAXIM - 1) / MAXIM; i0 < m; left--) {
            const int im = (int)((m - i0 + left - 1) / left);
            if (rows == ROWS) {
                switch (im) {
                    case 1: TILE(ROWS, 1); break;
                    case 2: TILE(ROWS, 2); break;
                    case 3: TILE(ROWS, 3); break;
                    default: TILE(ROWS, 4); break;
                }
            } else {
                switch (im) {
                    case 1: TILE(rows, 1); break;
                    case 2: TILE(rows, 2); break;
                    case 3: TILE(rows, 3); break;
                    default: TILE(rows, 4); break;
                }
            }
            i0 += im;
        }
    }
}

/* Columns r0 .. r1 of y [m, n] = x [m, k] (float) @ w^T: x quantized into per-thread scratch, then
   gemm. matmul() is all columns, one call from Python per matmul (a ctypes call and its argument
   conversion cost microseconds); threads that share a matmul each take a range of columns. */
#define MAXM 8
static __thread int8_t scratch_q[MAXM * MAXNB * 32];
static __thread float scratch_d[MAXM * MAXNB], scratch_s[MAXM * MAXNB], scratch_qs[MAXM * MAXNB];

static void matmul_cols(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int fmt, float *y,
                        int64_t r0, int64_t r1) {
    const int64_t nb = k / 32;
    int8_t *qx = scratch_q;
    float *dx = scratch_d, *sx = scratch_s, *qsum = scratch_qs;
    /* opaque to the optimizer: else it folds the thread-local addresses into gemm and looks them
       up again (a libc call each) at every use inside its loops */
    __asm__("" : "+r"(qx), "+r"(dx), "+r"(sx), "+r"(qsum));
    quantize_x(x, m, nb, fmt, qx, dx, sx, qsum);
    gemm(w, n, nb, qx, dx, sx, qsum, m, y, fmt, r0, r1);
}

void matmul(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int fmt, float *y) {
    matmul_cols(x, m, k, w, n, fmt, y, 0, n);
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even (weights are finite) */
    uint32_t u; memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* n repacked rows -> fp32 [n, nb * 32]: the block values as the format defines them, unrounded */
void dequant_f32(const uint8_t *w, int64_t n, int64_t nb, int fmt, float *out) {
    const int64_t hdr = header_bytes(fmt, nb), qb = quant_bytes(fmt), stride = hdr + qb * nb;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = w + r * stride;
        const uint16_t *d = (const uint16_t *)row;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *qs = row + hdr + b * qb;
            float *o = out + (r * nb + b) * 32;
            const float dv = _cvtsh_ss(d[b]), mv = fmt == 1 ? _cvtsh_ss(d[nb + b]) : 0.f;
            if (fmt == 2) {
                for (int j = 0; j < 32; j++) o[j] = dv * (int8_t)qs[j];
            } else {
                const int z = fmt == 0 ? 8 : 0;
                for (int j = 0; j < 16; j++) {
                    o[j] = dv * ((qs[j] & 15) - z) + mv;
                    o[j + 16] = dv * ((qs[j] >> 4) - z) + mv;
                }
            }
        }
    }
}

/* n repacked rows -> bf16 [n, nb * 32] */
void dequant_bf16(const uint8_t *w, int64_t n, int64_t nb, int fmt, uint16_t *out) {
    const int64_t hdr = header_bytes(fmt, nb), qb = quant_bytes(fmt), stride = hdr + qb * nb;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = w + r * stride;
        const uint16_t *d = (const uint16_t *)row;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *qs = row + hdr + b * qb;
            uint16_t *o = out + (r * nb + b) * 32;
            const float dv = _cvtsh_ss(d[b]), mv = fmt == 1 ? _cvtsh_ss(d[nb + b]) : 0.f;
#if USE512 && defined(__AVX512BF16__)
            __m512 v0, v1;  /* values 0-15 and 16-31 */
            if (fmt == 2) {
                v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
                v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
                v0 = _mm512_mul_ps(v0, _mm512_set1_ps(dv));
                v1 = _mm512_mul_ps(v1, _mm512_set1_ps(dv));
            } else {  /* d * q + m, or d * q - 8 d (= d * (q - 8), 8 d exact) */
                const __m128i q = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0F);
                const __m512 dd = _mm512_set1_ps(dv), off = _mm512_set1_ps(fmt == 1 ? mv : -8.f * dv);
                v0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, m))), dd, off);
                v1 = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m))), dd, off);
            }
            _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(v0));
            _mm256_storeu_si256((__m256i *)(o + 16), (__m256i)_mm512_cvtneps_pbh(v1));
            continue;
#endif
            if (fmt == 2) {
                for (int j = 0; j < 32; j++) o[j] = to_bf16(dv * (int8_t)qs[j]);
            } else {
                const int z = fmt == 0 ? 8 : 0;
                for (int j = 0; j < 16; j++) {
                    o[j] = to_bf16(dv * ((qs[j] & 15) - z) + mv);
                    o[j + 16] = to_bf16(dv * ((qs[j] >> 4) - z) + mv);
                }
            }
        }
    }
}
