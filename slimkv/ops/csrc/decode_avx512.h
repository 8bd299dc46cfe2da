/* slimkv's decode kernel, AVX-512 path (included by decode_attention.c when the build targets
 * AVX-512F, and AVX-512BW for bfloat16): register tiles holding whole rows of width 32/64/128
 * (block_rows_avx512: MHA, GQA, MQA, KVM regions), and tiles over 16-float chunks for any other
 * width and any number of query rows (attend_item_wide: MLA's latent rows, LRKV's rows). */
#include <immintrin.h>

/* 16 cached elements as float32 lanes (masked: lanes off the mask are zero, nothing read there). */
#ifdef SLIMKV_BF16
static inline __m512 load16(const elem_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 load16_masked(__mmask16 mask, const elem_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
#else
static inline __m512 load16(const elem_t *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_masked(__mmask16 mask, const elem_t *p) { return _mm512_maskz_loadu_ps(mask, p); }
#endif

/* exp_nonpositive on 16 lanes. */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* Horizontal sums of R (1, 2 or 4) vectors: sums[i] = sum of the lanes of v[i]. */
static inline __attribute__((always_inline)) void horizontal_sums(const __m512 *v, const int R, float *sums) {
    if (R == 1) {
        sums[0] = _mm512_reduce_add_ps(v[0]);
        return;
    }
    const __m512 zero = _mm512_setzero_ps();
    const __m512 a = v[0], b = v[1], c = R == 4 ? v[2] : zero, d = R == 4 ? v[3] : zero;
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* per 128-bit lane: a02 b02 a13 b13 */
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 halves = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512 total = _mm512_add_ps(halves, _mm512_shuffle_f32x4(halves, halves, _MM_SHUFFLE(2, 3, 0, 1)));
    float lanes[16] __attribute__((aligned(64)));
    _mm512_store_ps(lanes, total);
    for (int i = 0; i < R; i++) sums[i] = lanes[i];
}

/* R query rows (g0 .. g0 + R - 1 of one item) against one block of n keys, with AVX-512, for
 * dim = 16 * ND and v_dim = 16 * NV: each key and value vector is loaded once for the R rows, the
 * R accumulators stay in registers. Same arithmetic as attend_item. */
static inline __attribute__((always_inline)) void block_rows_avx512(const float *restrict q, const elem_t *restrict kb, const elem_t *restrict vb,
                                                                     int64_t k_row, int64_t v_row, int n, const int R, const int ND, const int NV, __m512 scale16,
                                                                     float *restrict acc, float *restrict run_max, float *restrict run_sum) {
    float logits[4][BLOCK_KEYS] __attribute__((aligned(64)));
    __m512 qv[4][8];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < ND; j++) qv[i][j] = _mm512_mul_ps(_mm512_loadu_ps(q + i * 16 * ND + 16 * j), scale16);
    for (int t = 0; t < n; t++) {
        const elem_t *kt = kb + t * k_row;
        if (PREFETCH_BLOCKS > 0)
            for (int j = 0; j < ND; j++) _mm_prefetch((const char *)(kt + PREFETCH_BLOCKS * BLOCK_KEYS * k_row + 16 * j), _MM_HINT_T0);
        __m512 kv[8], dots[4];
        for (int j = 0; j < ND; j++) kv[j] = load16(kt + 16 * j);
        for (int i = 0; i < R; i++) {
            dots[i] = _mm512_mul_ps(qv[i][0], kv[0]);
            for (int j = 1; j < ND; j++) dots[i] = _mm512_fmadd_ps(qv[i][j], kv[j], dots[i]);
        }
        float sums[4];
        horizontal_sums(dots, R, sums);
        for (int i = 0; i < R; i++) logits[i][t] = sums[i];
    }
    __m512 av[4][8];
    for (int i = 0; i < R; i++) {
        for (int t = n; t < BLOCK_KEYS; t++) logits[i][t] = -INFINITY;
        __m512 m16 = _mm512_load_ps(logits[i]);
        for (int t = 16; t < BLOCK_KEYS; t += 16) m16 = _mm512_max_ps(m16, _mm512_load_ps(logits[i] + t));
        const float block_max = _mm512_reduce_max_ps(m16);
        for (int j = 0; j < NV; j++) av[i][j] = _mm512_loadu_ps(acc + i * 16 * NV + 16 * j);
        if (block_max > run_max[i]) {
            const __m512 correction = exp_nonpositive16(_mm512_set1_ps(run_max[i] - block_max));
            run_sum[i] *= _mm512_cvtss_f32(correction);
            for (int j = 0; j < NV; j++) av[i][j] = _mm512_mul_ps(av[i][j], correction);
            run_max[i] = block_max;
        }
        const __m512 m = _mm512_set1_ps(run_max[i]);
        __m512 sum16 = _mm512_setzero_ps();
        for (int t = 0; t < BLOCK_KEYS; t += 16) {
            const __m512 p = exp_nonpositive16(_mm512_sub_ps(_mm512_load_ps(logits[i] + t), m));
            _mm512_store_ps(logits[i] + t, p);
            sum16 = _mm512_add_ps(sum16, p);
        }
        run_sum[i] += _mm512_reduce_add_ps(sum16);
    }
    for (int t = 0; t < n; t++) {
        const elem_t *vt = vb + t * v_row;
        if (PREFETCH_BLOCKS > 0)
            for (int j = 0; j < NV; j++) _mm_prefetch((const char *)(vt + PREFETCH_BLOCKS * BLOCK_KEYS * v_row + 16 * j), _MM_HINT_T0);
        __m512 vv[8];
        for (int j = 0; j < NV; j++) vv[j] = load16(vt + 16 * j);
        for (int i = 0; i < R; i++) {
            const __m512 p = _mm512_set1_ps(logits[i][t]);
            for (int j = 0; j < NV; j++) av[i][j] = _mm512_fmadd_ps(p, vv[j], av[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(acc + i * 16 * NV + 16 * j, av[i][j]);
}

/* attend_item with AVX-512 (see block_rows_avx512): the rows of a group go in tiles of 4 (2 for
 * v_dim 128, so the accumulators fit the 32 vector registers), then 2, then 1. */
static inline __attribute__((always_inline)) void attend_item_avx512(int64_t item, float *restrict out, const Segment *segments,
                                                                      int n_segments, int64_t b, int64_t h, int64_t groups, const int ND,
                                                                      const int NV, float scale, float *restrict acc, float *restrict run_max,
                                                                      float *restrict run_sum) {
    const int64_t dim = 16 * ND, v_dim = 16 * NV;
    const int tile = NV > 4 ? 2 : 4;
    for (int64_t g = 0; g < groups; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
        for (int64_t e = 0; e < v_dim; e++) acc[g * v_dim + e] = 0.0f;
    }
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int s = 0; s < n_segments; s++) {
        const Segment seg = segments[s];
        const float *restrict q = seg.q + item * groups * dim;
        const elem_t *restrict kh = seg.k + b * seg.k_stride_b + h * seg.k_stride_h;
        const elem_t *restrict vh = seg.v + b * seg.v_stride_b + h * seg.v_stride_h;
        const int64_t k_row = seg.k_stride_t, v_row = seg.v_stride_t;
        for (int64_t t0 = 0; t0 < seg.keys; t0 += BLOCK_KEYS) {
            const int n = (int)(seg.keys - t0 < BLOCK_KEYS ? seg.keys - t0 : BLOCK_KEYS);
            const elem_t *restrict kb = kh + t0 * k_row;
            const elem_t *restrict vb = vh + t0 * v_row;
            int64_t g = 0;
            for (; tile == 4 && g + 4 <= groups; g += 4)
                block_rows_avx512(q + g * dim, kb, vb, k_row, v_row, n, 4, ND, NV, scale16, acc + g * v_dim, run_max + g, run_sum + g);
            for (; g + 2 <= groups; g += 2)
                block_rows_avx512(q + g * dim, kb, vb, k_row, v_row, n, 2, ND, NV, scale16, acc + g * v_dim, run_max + g, run_sum + g);
            for (; g < groups; g++)
                block_rows_avx512(q + g * dim, kb, vb, k_row, v_row, n, 1, ND, NV, scale16, acc + g * v_dim, run_max + g, run_sum + g);
        }
    }
    for (int64_t g = 0; g < groups; g++) {
        const float inv = 1.0f / run_sum[g];
        for (int64_t e = 0; e < v_dim; e++) out[g * v_dim + e] = acc[g * v_dim + e] * inv;
    }
}

/* Keep x in a register: without this the compiler folds a vector that is used several times back
 * into each use as a memory operand, one load per use, and the tiles below become load-bound. */
#define IN_REGISTER(x) __asm__("" : "+v"(x))

/* The lanes of chunk j (16 floats) of a row of ``width`` floats: all but in the last chunk. */
static inline __mmask16 chunk_mask(int64_t width, int64_t j) {
    const int64_t left = width - 16 * j;
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* Logits of R query rows against KT consecutive keys, over the rows' 16-float chunks: each key
 * chunk is loaded once for the R rows, each query chunk once for the KT keys (R * KT accumulators).
 * qs: R scaled query rows, ``d_pad`` floats apart and zero past ``dim``; kt: the first key's row. */
static inline __attribute__((always_inline)) void logits_tile(const float *restrict qs, int64_t d_pad, const elem_t *restrict kt, int64_t k_row,
                                                              int64_t dim, const int R, const int KT, float *restrict logits, int t) {
    __m512 dots[4][4];
    for (int i = 0; i < R; i++)
        for (int u = 0; u < KT; u++) dots[i][u] = _mm512_setzero_ps();
    const int64_t full = dim / 16; /* whole chunks; a partial last one is loaded under a mask */
    for (int64_t j = 0; j < d_pad / 16; j++) {
        __m512 kv[4];
        if (j < full)
            for (int u = 0; u < KT; u++) kv[u] = load16(kt + u * k_row + 16 * j);
        else
            for (int u = 0; u < KT; u++) kv[u] = load16_masked(chunk_mask(dim, j), kt + u * k_row + 16 * j);
        for (int i = 0; i < R; i++) {
            __m512 qv = _mm512_loadu_ps(qs + i * d_pad + 16 * j);
            IN_REGISTER(qv);
            for (int u = 0; u < KT; u++) dots[i][u] = _mm512_fmadd_ps(qv, kv[u], dots[i][u]);
        }
    }
    for (int i = 0; i < R; i++) {
        float sums[4];
        horizontal_sums(dots[i], KT, sums);
        for (int u = 0; u < KT; u++) logits[i * BLOCK_KEYS + t + u] = sums[u];
    }
}

/* acc[R rows][chunks c0 .. c0 + CV - 1] += p . values of a block's n keys (each value chunk loaded
 * once for the R rows). p: the rows' probabilities, BLOCK_KEYS apart; acc rows ``v_pad`` apart. */
static inline __attribute__((always_inline)) void values_tile(const float *restrict p, int n, const elem_t *restrict vb, int64_t v_row,
                                                              int64_t v_dim, int64_t c0, const int R, const int CV, float *restrict acc,
                                                              int64_t v_pad) {
    __m512 av[4][4];
    __mmask16 mask[4];
    for (int c = 0; c < CV; c++) mask[c] = chunk_mask(v_dim, c0 + c);
    for (int i = 0; i < R; i++)
        for (int c = 0; c < CV; c++) av[i][c] = _mm512_loadu_ps(acc + i * v_pad + 16 * (c0 + c));
    for (int t = 0; t < n; t++) {
        const elem_t *vt = vb + t * v_row + 16 * c0;
        __m512 vv[4];
        for (int c = 0; c < CV; c++) vv[c] = mask[c] == (__mmask16)0xFFFF ? load16(vt + 16 * c) : load16_masked(mask[c], vt + 16 * c);
        for (int i = 0; i < R; i++) {
            __m512 pi = _mm512_set1_ps(p[i * BLOCK_KEYS + t]);
            IN_REGISTER(pi);
            for (int c = 0; c < CV; c++) av[i][c] = _mm512_fmadd_ps(pi, vv[c], av[i][c]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int c = 0; c < CV; c++) _mm512_storeu_ps(acc + i * v_pad + 16 * (c0 + c), av[i][c]);
}

#define ROWS_SWITCH(R, CALL_R) \
    switch (R) {               \
    case 4: CALL_R(4); break;  \
    case 3: CALL_R(3); break;  \
    case 2: CALL_R(2); break;  \
    default: CALL_R(1); break; \
    }

/* Software prefetch of the n rows of a block ``row`` elements apart, ``width`` elements each. */
static inline void prefetch_rows16(const elem_t *rows, int n, int64_t row, int64_t width) {
    for (int t = 0; t < n; t++)
        for (int64_t e = 0; e < width; e += 64 / (int64_t)sizeof(elem_t)) _mm_prefetch((const char *)(rows + t * row + e), _MM_HINT_T0);
}

/* One (batch, kv_head) item for any widths and any number of query rows: per block of keys, the
 * logits of every row (tiles of 4 rows x 4 keys), the online-softmax update of every row, then the
 * values (tiles of 4 rows x 4 chunks). Same arithmetic as attend_item, in another order of sums.
 * Scratch: acc (groups x v_pad), qs (groups x d_pad), logits (groups x BLOCK_KEYS). */
static void attend_item_wide(int64_t item, float *restrict out, const Segment *segments, int n_segments, int64_t b, int64_t h, int64_t groups,
                             int64_t dim, int64_t v_dim, float scale, float *restrict acc, float *restrict qs, float *restrict logits,
                             float *restrict run_max, float *restrict run_sum) {
    const int64_t d_pad = (dim + 15) / 16 * 16, v_pad = (v_dim + 15) / 16 * 16;
    for (int64_t g = 0; g < groups; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(groups * v_pad));
    memset(qs, 0, sizeof(float) * (size_t)(groups * d_pad));
    for (int s = 0; s < n_segments; s++) {
        const Segment seg = segments[s];
        const float *restrict q = seg.q + item * groups * dim;
        for (int64_t g = 0; g < groups; g++)
            for (int64_t d = 0; d < dim; d++) qs[g * d_pad + d] = q[g * dim + d] * scale;
        const elem_t *restrict kh = seg.k + b * seg.k_stride_b + h * seg.k_stride_h;
        const elem_t *restrict vh = seg.v + b * seg.v_stride_b + h * seg.v_stride_h;
        const int64_t k_row = seg.k_stride_t, v_row = seg.v_stride_t;
        const int v_in_k = values_in_key_rows(kh, vh, dim, v_dim, k_row, v_row);
        for (int64_t t0 = 0; t0 < seg.keys; t0 += BLOCK_KEYS) {
            const int n = (int)(seg.keys - t0 < BLOCK_KEYS ? seg.keys - t0 : BLOCK_KEYS);
            const elem_t *restrict kb = kh + t0 * k_row;
            const elem_t *restrict vb = vh + t0 * v_row;
            const int64_t ahead = PREFETCH_BLOCKS * BLOCK_KEYS; /* rows: prefetched this far ahead, with the first row tile's logits */
            for (int64_t g = 0; g < groups; g += 4) {
                const int rows = groups - g < 4 ? (int)(groups - g) : 4;
                const int fetch = PREFETCH_BLOCKS > 0 && g == 0;
                int t = 0;
#define LOGITS4(R)                                                                                                \
    for (; t + 4 <= n; t += 4) {                                                                                  \
        if (fetch && t0 + t + ahead + 4 <= seg.keys) {                                                            \
            prefetch_rows16(kb + (t + ahead) * k_row, 4, k_row, dim);                                             \
            if (!v_in_k) prefetch_rows16(vb + (t + ahead) * v_row, 4, v_row, v_dim);                                           \
        }                                                                                                         \
        logits_tile(qs + g * d_pad, d_pad, kb + t * k_row, k_row, dim, R, 4, logits + g * BLOCK_KEYS, t);         \
    }
#define LOGITS1(R) for (; t < n; t++) logits_tile(qs + g * d_pad, d_pad, kb + t * k_row, k_row, dim, R, 1, logits + g * BLOCK_KEYS, t)
                ROWS_SWITCH(rows, LOGITS4)
                ROWS_SWITCH(rows, LOGITS1)
#undef LOGITS4
#undef LOGITS1
            }
            for (int64_t g = 0; g < groups; g++) {
                float *restrict lg = logits + g * BLOCK_KEYS;
                for (int t = n; t < BLOCK_KEYS; t++) lg[t] = -INFINITY;
                __m512 m16 = _mm512_loadu_ps(lg);
                for (int t = 16; t < BLOCK_KEYS; t += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(lg + t));
                const float block_max = _mm512_reduce_max_ps(m16);
                if (block_max > run_max[g]) {
                    const float correction = _mm512_cvtss_f32(exp_nonpositive16(_mm512_set1_ps(run_max[g] - block_max)));
                    run_sum[g] *= correction;
                    const __m512 c16 = _mm512_set1_ps(correction);
                    for (int64_t e = 0; e < v_pad; e += 16) _mm512_storeu_ps(acc + g * v_pad + e, _mm512_mul_ps(_mm512_loadu_ps(acc + g * v_pad + e), c16));
                    run_max[g] = block_max;
                }
                const __m512 m = _mm512_set1_ps(run_max[g]);
                __m512 sum16 = _mm512_setzero_ps();
                for (int t = 0; t < BLOCK_KEYS; t += 16) {
                    const __m512 p = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(lg + t), m));
                    _mm512_storeu_ps(lg + t, p);
                    sum16 = _mm512_add_ps(sum16, p);
                }
                run_sum[g] += _mm512_reduce_add_ps(sum16);
            }
            for (int64_t c0 = 0; c0 < v_pad / 16; c0 += 4) {
                const int chunks = v_pad / 16 - c0 < 4 ? (int)(v_pad / 16 - c0) : 4;
                for (int64_t g = 0; g < groups; g += 4) {
                    const int rows = groups - g < 4 ? (int)(groups - g) : 4;
                    const float *pg = logits + g * BLOCK_KEYS;
                    float *ag = acc + g * v_pad;
#define VALUES(R)                                                                 \
    switch (chunks) {                                                             \
    case 4: values_tile(pg, n, vb, v_row, v_dim, c0, R, 4, ag, v_pad); break;  \
    case 3: values_tile(pg, n, vb, v_row, v_dim, c0, R, 3, ag, v_pad); break;  \
    case 2: values_tile(pg, n, vb, v_row, v_dim, c0, R, 2, ag, v_pad); break;  \
    default: values_tile(pg, n, vb, v_row, v_dim, c0, R, 1, ag, v_pad); break; \
    }
                    ROWS_SWITCH(rows, VALUES)
#undef VALUES
                }
            }
        }
    }
    for (int64_t g = 0; g < groups; g++) {
        const float inv = 1.0f / run_sum[g];
        for (int64_t e = 0; e < v_dim; e++) out[g * v_dim + e] = acc[g * v_pad + e] * inv;
    }
}

