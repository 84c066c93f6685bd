/* Dequantization of the rows quant_gemv.c's repack layout holds (built after it, into the same
   library): to fp32 unrounded, or to bf16 rounded once, for the many-row path's dense matmul. */

static inline uint16_t to_bf16(float f) {  /* round to nearest even (weights are finite) */
    uint32_t u; memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

#if USE512
#define DEQ_ROWS 4  /* rows whose quants one 4 x 4 dword transpose takes out of a group */
#else
#define DEQ_ROWS 1
#endif

/* rows r0 .. r0 + DEQ_ROWS - 1's block b quant bytes (16, Q8_0 32) in order, one row per q[i]
   (rows past the last are a group's zero padding, never stored) */
static inline void row_quants(const uint8_t *w, int64_t r0, int64_t b, int64_t nb, int fmt, __m256i *q) {
    const uint8_t *p = w + quant_at(r0, b, 0, nb, fmt);
#if USE512  /* chunk c holds 4 bytes of every row of the group, 64 bytes apart: transpose 4 x 4 */
    for (int half = 0; half < (fmt == 2 ? 2 : 1); half++) {
        const uint8_t *h = p + half * 256;
        const __m128i c0 = _mm_loadu_si128((const __m128i *)h);
        const __m128i c1 = _mm_loadu_si128((const __m128i *)(h + 64));
        const __m128i c2 = _mm_loadu_si128((const __m128i *)(h + 128));
        const __m128i c3 = _mm_loadu_si128((const __m128i *)(h + 192));
        const __m128i t0 = _mm_unpacklo_epi32(c0, c1), t1 = _mm_unpackhi_epi32(c0, c1);
        const __m128i t2 = _mm_unpacklo_epi32(c2, c3), t3 = _mm_unpackhi_epi32(c2, c3);
        const __m128i rows[4] = {_mm_unpacklo_epi64(t0, t2), _mm_unpackhi_epi64(t0, t2), _mm_unpacklo_epi64(t1, t3),
                                 _mm_unpackhi_epi64(t1, t3)};
        for (int i = 0; i < 4; i++)
            q[i] = half ? _mm256_inserti128_si256(q[i], rows[i], 1) : _mm256_castsi128_si256(rows[i]);
    }
#else
    q[0] = fmt == 2 ? _mm256_loadu_si256((const __m256i *)p)
                    : _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p));
#endif
}

/* the block's 32 values as the format defines them (d * q + m, d * (q - 8), Q8_0 d * q), one
   rounding each (d * (q - 8) = d * q - 8 d exactly before it) */
static inline void block_values(__m256i qv, float dv, float mv, int fmt, float *o) {
#if defined(__AVX512F__)
    __m512 v0, v1;
    if (fmt == 2) {
        v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(qv)));
        v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(qv, 1)));
        v0 = _mm512_mul_ps(v0, _mm512_set1_ps(dv));
        v1 = _mm512_mul_ps(v1, _mm512_set1_ps(dv));
    } else {
        const __m128i q = _mm256_castsi256_si128(qv), m = _mm_set1_epi8(0x0F);
        const __m512 dd = _mm512_set1_ps(dv), off = _mm512_set1_ps(fmt == 1 ? mv : -8.f * dv);
        v0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, m))), dd, off);
        v1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m))), dd, off);
    }
    _mm512_storeu_ps(o, v0);
    _mm512_storeu_ps(o + 16, v1);
#else
    uint8_t qs[32];
    _mm256_storeu_si256((__m256i *)qs, qv);
    if (fmt == 2) {
        for (int j = 0; j < 32; j++) o[j] = dv * (int8_t)qs[j];
        return;
    }
    for (int j = 0; j < 16; j++) {
        o[j] = fmaf(dv, (float)(qs[j] & 15), fmt == 1 ? mv : -8.f * dv);
        o[j + 16] = fmaf(dv, (float)(qs[j] >> 4), fmt == 1 ? mv : -8.f * dv);
    }
#endif
}

/* rows r0 .. r0 + DEQ_ROWS - 1 (those below n) of block b -> o + i * row stride, as floats */
static inline void blocks_of(const uint8_t *w, int64_t r0, int64_t n, int64_t b, int64_t nb, int fmt, float *o,
                             int64_t stride) {
    __m256i q[DEQ_ROWS];
    row_quants(w, r0, b, nb, fmt, q);
    for (int i = 0; i < DEQ_ROWS && r0 + i < n; i++) {
        const int64_t r = r0 + i;
        const float dv = f16(w + scale_at(r, b, nb, fmt)), mv = fmt == 1 ? f16(w + offset_at(r, b, nb, fmt)) : 0.f;
        block_values(q[i], dv, mv, fmt, o + i * stride);
    }
}

/* n repacked rows -> fp32 [n, nb * 32] */
void dequant_f32(const uint8_t *w, int64_t n, int64_t nb, int fmt, float *out) {
    for (int64_t r0 = 0; r0 < n; r0 += DEQ_ROWS)
        for (int64_t b = 0; b < nb; b++) blocks_of(w, r0, n, b, nb, fmt, out + (r0 * nb + b) * 32, nb * 32);
}

/* n repacked rows -> bf16 [n, nb * 32] */
void dequant_bf16(const uint8_t *w, int64_t n, int64_t nb, int fmt, uint16_t *out) {
    float v[DEQ_ROWS][32];
    for (int64_t r0 = 0; r0 < n; r0 += DEQ_ROWS)
        for (int64_t b = 0; b < nb; b++) {
            blocks_of(w, r0, n, b, nb, fmt, v[0], 32);
            for (int i = 0; i < DEQ_ROWS && r0 + i < n; i++) {
                uint16_t *o = out + ((r0 + i) * nb + b) * 32;
#if defined(__AVX512BF16__)
                _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(v[i])));
                _mm256_storeu_si256((__m256i *)(o + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(v[i] + 16)));
#else
                for (int j = 0; j < 32; j++) o[j] = to_bf16(v[i][j]);
#endif
            }
        }
}
