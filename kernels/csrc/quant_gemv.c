/* The CPU block kernels of radixlm.kernels.quant_gemv_cpu (built there with the system compiler):
   int8 dot products over GGUF Q4_0/Q4_1/Q8_0 rows, and their dequantization to bf16 or fp32.
   With AVX-512 VNNI the rows are interleaved in groups of GROUP_ROWS (group_rows() tells
   repack()): one dpbusd meets four x values with sixteen rows, the block's int32 sums stay in
   their lanes, and one scale vector per block applies to all sixteen; else rows stay whole and
   AVX2 dots run four rows side by side. */
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
#define USE512 1 /* rows interleaved by 16: one dpbusd serves 16 rows */
#define GROUP_ROWS 16
#else
#define USE512 0
#define GROUP_ROWS 1
#endif
int group_rows(void) { return GROUP_ROWS; }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define MASKED_TAIL 1 /* masked 256-bit loads and stores */
#else
#define MASKED_TAIL 0
#endif

/* x [m, nb * 32] -> int8 qx, per-block scale dx (qx * dx ~ x), sum of qx, and sx = dx * sum(qx):
   the block's sum as quantized, so that the offset term of Q4_0/Q4_1 (-8 d sum(x), m sum(x)) sees
   the same x as the dot product and the error is sum(w * (x - qx * dx)), llama.cpp's Q8_1 choice.
   The exact sum would leave only d * q (all of one sign, twice w's spread) against the error. */
static void quantize_x(const float *x, int64_t m, int64_t nb, int8_t *qx, float *dx, float *sx, float *qsum) {
    for (int64_t i = 0; i < m * nb; i++) {
        const float *v = x + i * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; j++) { float a = fabsf(v[j]); amax = a > amax ? a : amax; }
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int qs = 0;
        for (int j = 0; j < 32; j++) {
            const int a = (int)lrintf(v[j] * id);
            qx[i * 32 + j] = (int8_t)a;
            qs += a;
        }
        dx[i] = d; sx[i] = d * (float)qs; qsum[i] = (float)qs;
    }
}

#define MAXM 8      /* x rows per call (the per-thread scratch) */
#define MAXNB 512   /* blocks per row the scratch holds (K <= 16384) */

#if USE512
/* Rows come repacked (quant_gemv_cpu.repack()) in groups of 16, padded with zero rows: per block
   of the group the 16 rows' scales d as halves, for Q4_1 their 16 offsets m, then their quants
   interleaved by dwords: chunk c of 64 bytes holds, for row r, bytes 4c .. 4c + 3 of its block
   (Q4: 4 chunks, low nibbles values 4c .. 4c + 3, high 16 + 4c ..; Q8_0: 8 chunks, values 4c ..).
   One dpbusd then multiplies four x values into sixteen rows' int32 sums, and the block's scale
   and offset terms are one vector each. fmt: 0 Q4_0, 1 Q4_1, 2 Q8_0. */
#define AHEAD_GROUPS 2  /* a block is prefetched in the group this many groups on */

static inline int64_t quant_bytes(int fmt) { return fmt == 2 ? 32 : 16; }
static inline int64_t scale_bytes(int fmt) { return fmt == 1 ? 64 : 32; }
static inline int64_t block_bytes(int fmt) { return scale_bytes(fmt) + GROUP_ROWS * quant_bytes(fmt); }

/* y[i][r .. r + 16) (rows past n not stored) for the im rows of x, given quantized. Per (x row,
   weight row) the operations and their order do not depend on im or on the other rows: a row's
   result is the same alone (decode) as among others (a verify step). Inlined with constant im. */
static inline __attribute__((always_inline)) void group_tile(const uint8_t *g, int64_t gstride, int64_t nb,
                                                             const int8_t *qx, const float *dx, const float *sx,
                                                             const float *qsum, const int im, float *y, int64_t n,
                                                             int64_t r, const int fmt) {
    const int64_t bs = block_bytes(fmt), hdr = scale_bytes(fmt);
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[MAXM];
    for (int i = 0; i < im; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + b * bs;
        /* past the last group this runs into the weight the arena placed next (prefetches never
           fault), the one the next call reads */
        for (int64_t off = 0; off < bs; off += 64)
            _mm_prefetch((const char *)(p + AHEAD_GROUPS * gstride + off), _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        __m512i u[8];  /* the u8 side of dpbusd: quad c meets x values 4c .. 4c + 3 */
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(p + hdr + 64 * c);
            if (fmt == 2) {  /* signed times signed as (q + 128) . qx: 128 * sum(qx) comes back out */
                u[c] = _mm512_xor_si512(v, flip);
                u[c + 4] = _mm512_xor_si512(_mm512_loadu_si512(p + hdr + 64 * (c + 4)), flip);
            } else {
                u[c] = _mm512_and_si512(v, low);
                u[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        }
        for (int i = 0; i < im; i++) {
            const int64_t ib = i * nb + b;
            const int8_t *xb = qx + ib * 32;
            __m512i s = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) {
                int32_t xw;
                memcpy(&xw, xb + 4 * c, 4);
                s = _mm512_dpbusd_epi32(s, u[c], _mm512_set1_epi32(xw));
            }
            const __m512 sc = _mm512_mul_ps(d, _mm512_set1_ps(dx[ib]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[i]);
            if (fmt == 1)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32))),
                                         _mm512_set1_ps(sx[ib]), acc[i]);
            else if (fmt == 0)
                acc[i] = _mm512_fmadd_ps(d, _mm512_set1_ps(-8.f * sx[ib]), acc[i]);
            else
                acc[i] = _mm512_fmadd_ps(sc, _mm512_set1_ps(-128.f * qsum[ib]), acc[i]);
        }
    }
    const __mmask16 k = n - r >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - r)) - 1);
    for (int i = 0; i < im; i++) _mm512_mask_storeu_ps(y + i * n + r, k, acc[i]);
}

#define GROUP(IM_) group_tile(g, gstride, nb, qx, dx, sx, qsum, IM_, y, n, r, fmt)

/* columns r0 .. r1 (multiples of 16, or n) of y [m, n] = x [m, k] @ w^T, w n repacked rows of nb
   blocks, x given quantized, m <= MAXM */
static __attribute__((noinline)) void gemm(const uint8_t *w, int64_t n, int64_t nb, const int8_t *qx, const float *dx,
                                           const float *sx, const float *qsum, int64_t m, float *y, const int fmt,
                                           int64_t r0, int64_t r1) {
    const int64_t gstride = nb * block_bytes(fmt);
    for (int64_t r = r0; r < r1; r += GROUP_ROWS) {
        const uint8_t *g = w + (r / GROUP_ROWS) * gstride;
        switch (m) {
            case 1: GROUP(1); break;
            case 2: GROUP(2); break;
            case 3: GROUP(3); break;
            case 4: GROUP(4); break;
            case 5: GROUP(5); break;
            case 6: GROUP(6); break;
            case 7: GROUP(7); break;
            default: GROUP(8); break;
        }
    }
}

/* the byte offset of row r's block b (its scale, its offset at +32 for Q4_1) and of its quant
   byte j, in the group layout */
static inline int64_t scale_at(int64_t r, int64_t b, int64_t nb, int fmt) {
    return (r / 16) * nb * block_bytes(fmt) + b * block_bytes(fmt) + (r % 16) * 2;
}
static inline int64_t offset_at(int64_t r, int64_t b, int64_t nb, int fmt) {
    return scale_at(r, b, nb, fmt) + 32;
}
static inline int64_t quant_at(int64_t r, int64_t b, int j, int64_t nb, int fmt) {
    return (r / 16) * nb * block_bytes(fmt) + b * block_bytes(fmt) + scale_bytes(fmt) + (j / 4) * 64 + (r % 16) * 4 +
           j % 4;
}
#define COL_ALIGN GROUP_ROWS
#else
/* Rows come repacked (quant_gemv_cpu.repack()): per row the nb block scales d as halves, for Q4_1
   the nb offsets m too, then the quants, nb * 16 bytes (Q4: low nibbles values 0-15 of a block, high
   16-31) or nb * 32 (Q8_0). Scales in a run vectorise the per-block float work, leaving one
   broadcast and one FMA per block in the inner loop. fmt: 0 Q4_0, 1 Q4_1, 2 Q8_0. */
#define ROWS 4        /* rows walked side by side: four memory streams, x loaded once per block */
#define AHEAD 2       /* groups of rows prefetched ahead of the one computed */

static inline int64_t header_bytes(int fmt, int64_t nb) { return (fmt == 1 ? 4 : 2) * nb; }
static inline int64_t quant_bytes(int fmt) { return fmt == 2 ? 32 : 16; }

/* sc[b] = d[b] * dx[b]; returns the row's term in sum(x) (sum m * sx for Q4_1, -8 sum d * sx for
   Q4_0) as 8 partial sums: the dot products accumulate onto them, and one reduction ends all */
static inline __m256 prologue(const uint8_t *row, int64_t nb, int fmt, const float *dx, const float *sx,
                              float *sc) {
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
    return e;
#else
    float extra = 0.f;
    for (; b < nb; b++) {
        const float dv = _cvtsh_ss(d[b]);
        sc[b] = dv * dx[b];
        if (fmt == 1) extra += _cvtsh_ss(d[nb + b]) * sx[b];
        else if (fmt == 0) extra -= 8.f * dv * sx[b];
    }
    return _mm256_add_ps(e, _mm256_set_ps(0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, extra));
#endif
}

static inline __m256 block_dot(const uint8_t *qs, __m256i xv, int fmt) {
    if (fmt == 2) {  /* signed times signed: (q + 128) . qx, or |q| . (qx * sign(q)) */
        const __m256i q = _mm256_loadu_si256((const __m256i *)qs);
        return dot_u8_s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q));
    }
    return dot_u8_s8(q4_values(qs), xv);
}


/* y [im, n] (rows r .. r + rows of it) = im rows of x, given quantized, @ w^T. Each block pair
   of the weight is unpacked once for all im rows of x. Per (x row, weight row) the operations
   and their order do not depend on im or on the other rows: a row's result is the same alone
   (decode) as among others (a verify step). Inlined with constant rows and im, so the
   accumulators stay in registers. */
#define MAXIM 4  /* x rows per pass: the prologue's scales of 4 x 4 (x row, weight row) stay in L1 */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, int64_t r, const int rows,
                                                       const int im, int64_t n, int64_t nb, const int8_t *qx,
                                                       const float *dx, const float *sx, float *y,
                                                       const int fmt) {
    const int64_t hdr = header_bytes(fmt, nb), qb = quant_bytes(fmt), stride = hdr + qb * nb;
    float sc[MAXIM][ROWS][MAXNB];  /* d * dx per (x row, weight row, block) */
    __m256 e[MAXIM][ROWS];  /* the prologue's terms, where the dot products start */
    for (int i = 0; i < im; i++)
        for (int j = 0; j < rows; j++)
            e[i][j] = prologue(w + (r + j) * stride, nb, fmt, dx + i * nb, sx + i * nb, sc[i][j]);
    const uint8_t *q0 = w + r * stride + hdr;
    for (int i = 0; i < im; i++) {
        const int8_t *xq = qx + i * nb * 32;
        __m256 acc[ROWS];
        for (int j = 0; j < rows; j++) acc[j] = e[i][j];
        for (int64_t b = 0; b < nb; b++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
            for (int j = 0; j < rows; j++)
                acc[j] = _mm256_fmadd_ps(block_dot(q0 + j * stride + b * qb, xv, fmt),
                                         _mm256_broadcast_ss(&sc[i][j][b]), acc[j]);
        }
        for (int j = 0; j < rows; j++) y[i * n + r + j] = hsum(acc[j]);
    }
}

#define TILE(ROWS_, IM_) tile(w, r, ROWS_, IM_, n, nb, qx + i0 * nb * 32, dx + i0 * nb, sx + i0 * nb, y + i0 * n, fmt)

/* columns r0 .. r1 of y [m, n] = x [m, k] @ w^T, w n repacked rows of nb blocks, x given quantized
   (qsum: the group kernel's Q8_0 correction; whole rows dot Q8_0 by signs and need none) */
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


/* the byte offset of row r's block b scale (its offset m at offset_at for Q4_1) and of its quant
   byte j, in the row layout */
static inline int64_t row_stride(int64_t nb, int fmt) { return header_bytes(fmt, nb) + quant_bytes(fmt) * nb; }
static inline int64_t scale_at(int64_t r, int64_t b, int64_t nb, int fmt) { return r * row_stride(nb, fmt) + b * 2; }
static inline int64_t offset_at(int64_t r, int64_t b, int64_t nb, int fmt) {
    return scale_at(r, b, nb, fmt) + nb * 2;
}
static inline int64_t quant_at(int64_t r, int64_t b, int j, int64_t nb, int fmt) {
    return r * row_stride(nb, fmt) + header_bytes(fmt, nb) + b * quant_bytes(fmt) + j;
}
#define COL_ALIGN ROWS
#endif

/* Columns r0 .. r1 of y [m, n] = x [m, k] (float) @ w^T: x quantized into per-thread scratch, then
   gemm. matmul() is all columns, one call from Python per matmul (a ctypes call and its argument
   conversion cost microseconds); threads that share a matmul each take a range of columns. */
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
    quantize_x(x, m, nb, qx, dx, sx, qsum);
    gemm(w, n, nb, qx, dx, sx, qsum, m, y, fmt, r0, r1);
}

void matmul(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int fmt, float *y) {
    matmul_cols(x, m, k, w, n, fmt, y, 0, n);
}
