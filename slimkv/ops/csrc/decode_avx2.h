/* slimkv's decode kernel, AVX2+FMA path (included by decode_attention.c when the build targets
 * AVX2 and FMA but not AVX-512): register tiles over 8-float chunks of the rows, sized for the 16
 * vector registers, for every width and number of query rows (attend_item_avx2).
 *
 * Per block of keys: the logits of every query row (a head with one query row: keys in lanes, 8
 * keys per vector from one transposing reduction of 8 per-key accumulators; rows sharing a head's
 * keys: tiles of ROWS_TILE rows x KEYS_TILE keys, each key chunk loaded once for the rows, each
 * query chunk once for the keys, one horizontal sum per logit paid once per row, not per chunk),
 * the online-softmax update on 8 lanes, then the values (tiles of ROWS_TILE rows x CHUNKS_TILE
 * chunks; an item of one query row ROW_CHUNKS chunks at a time), with the next block's rows
 * prefetched a share per tile step (Ahead in decode_attention.c). Vectors used by several products
 * (a key or value chunk for the tile's rows) are pinned in registers (IN_REGISTER8): otherwise the
 * compiler folds them back into each product as a memory operand and the tiles become load-bound.
 * bfloat16 rows are widened as they are read (a byte shuffle for the logits and one-row values,
 * load8_shuffled; a zero-extension to 32 bits and a 16-bit shift for the shared-row values; the
 * AVX-512 path's pair order, one instruction per 8, measured slower here with 16 registers); every
 * product and sum is float32 (AVX2 has no bfloat16 arithmetic). */
#include <immintrin.h>

#define ROWS_TILE 4
#define KEYS_TILE 3 /* logits tile: 4 x 3 accumulators + 3 key chunks + 1 query chunk = 16 registers */
#define CHUNKS_TILE 3 /* values tile: 4 x 3 accumulators + 3 value chunks + 1 probability = 16 registers */
#define ROW_CHUNKS 8 /* values_row8: 8 accumulators for one query row */

/* Keep x in a register (see decode_avx512.h): a vector used by several products stays loaded once. */
#define IN_REGISTER8(x) __asm__("" : "+x"(x))

/* 8 cached elements as float32 lanes. */
#ifdef SLIMKV_BF16
static inline __m256 load8(const elem_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
/* load8 by a byte shuffle: the 8 elements loaded into both 128-bit halves (a load alone) and each
 * moved to the high half of its 32-bit lane (one shuffle, off the FMA ports on Intel cores; load8's
 * shift takes an FMA port). Every logits tile and one-row values tile widens so (the shared-row
 * logits tiles measured 0.95-0.96x for MQA, LRKV and latent, MLA and GQA unchanged); the
 * shared-row values tiles keep load8. */
static inline __m256 load8_shuffled(const elem_t *p) {
    const __m256i to_high = _mm256_setr_epi8(-128, -128, 0, 1, -128, -128, 2, 3, -128, -128, 4, 5, -128, -128, 6, 7,
                                             -128, -128, 8, 9, -128, -128, 10, 11, -128, -128, 12, 13, -128, -128, 14, 15);
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)), to_high));
}
#else
static inline __m256 load8(const elem_t *p) { return _mm256_loadu_ps(p); }
#define load8_shuffled load8
#endif

/* The first ``left`` (1..8) elements at p as float32 lanes, zero past them; nothing read past them. */
static inline __m256 load8_partial(const elem_t *p, int64_t left) {
    elem_t lanes[8] = {0};
    memcpy(lanes, p, sizeof(elem_t) * (size_t)(left < 8 ? left : 8));
    return load8(lanes);
}

/* exp_nonpositive on 8 lanes. */
static inline __m256 exp_nonpositive8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Horizontal sums of K (1 to 4) vectors at once: sums[u] = sum of the lanes of v[u]. */
static inline __attribute__((always_inline)) void horizontal_sums8(const __m256 *v, const int K, float *sums) {
    if (K == 1) {
        sums[0] = sum8(v[0]);
        return;
    }
    const __m256 zero = _mm256_setzero_ps();
    const __m256 ab = _mm256_hadd_ps(v[0], v[1]);
    const __m256 cd = _mm256_hadd_ps(K > 2 ? v[2] : zero, K > 3 ? v[3] : zero);
    const __m256 abcd = _mm256_hadd_ps(ab, cd); /* per 128-bit half: the four partial sums */
    float lanes[4];
    _mm_storeu_ps(lanes, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
    for (int u = 0; u < K; u++) sums[u] = lanes[u];
}

/* Logits of R query rows against KT consecutive keys over the rows' 8-float chunks (R * KT
 * accumulators). qs: R scaled query rows, ``d_pad`` floats apart and zero past ``dim``. */
static inline __attribute__((always_inline)) void logits_tile8(const float *restrict qs, int64_t d_pad, const elem_t *restrict kt, int64_t k_row,
                                                               int64_t dim, const int R, const int KT, float *restrict logits, int t) {
    __m256 dots[ROWS_TILE][KEYS_TILE];
    for (int i = 0; i < R; i++)
        for (int u = 0; u < KT; u++) dots[i][u] = _mm256_setzero_ps();
    const int64_t full = dim / 8;
    for (int64_t j = 0; j < full; j++) {
        __m256 kv[KEYS_TILE];
        for (int u = 0; u < KT; u++) {
            kv[u] = load8_shuffled(kt + u * k_row + 8 * j);
            IN_REGISTER8(kv[u]); /* loaded once for the R rows: not folded into each product as a memory operand */
        }
        for (int i = 0; i < R; i++) {
            __m256 qv = _mm256_loadu_ps(qs + i * d_pad + 8 * j);
            IN_REGISTER8(qv);
            for (int u = 0; u < KT; u++) dots[i][u] = _mm256_fmadd_ps(qv, kv[u], dots[i][u]);
        }
    }
    if (8 * full < dim) { /* a partial last chunk: nothing read past the row */
        __m256 kv[KEYS_TILE];
        for (int u = 0; u < KT; u++) kv[u] = load8_partial(kt + u * k_row + 8 * full, dim - 8 * full);
        for (int i = 0; i < R; i++) {
            __m256 qv = _mm256_loadu_ps(qs + i * d_pad + 8 * full);
            for (int u = 0; u < KT; u++) dots[i][u] = _mm256_fmadd_ps(qv, kv[u], dots[i][u]);
        }
    }
    for (int i = 0; i < R; i++) {
        float sums[4];
        horizontal_sums8(dots[i], KT, sums);
        for (int u = 0; u < KT; u++) logits[i * BLOCK_KEYS + t + u] = sums[u];
    }
}

/* Lane i of the result: the sum of the lanes of v[i], for 8 vectors (a transposing reduction:
 * 21 shuffles and adds for 8 sums, no horizontal sum per vector). */
static inline __attribute__((always_inline)) __m256 transpose_sums8(const __m256 *v) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; i++) b[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) /* per 128-bit half H: the partial sums over H of vectors 4i .. 4i + 3 */
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}

/* Keys in lanes: the logits of one query row against 8 consecutive keys as one vector (lane u:
 * key u), for rows that share their keys with no other row (MHA, latent's per-head keys): one
 * accumulator per key over the row's 8-float chunks, 4 keys at a time (4 independent sums: one
 * key's 8 dependent products at a time took 1.1x MHA's step), then one transposing reduction for
 * the 8 (no horizontal sum per key). q: the scaled row, zero past ``dim``. Stored to logits[0 .. 7]. */
static inline __attribute__((always_inline)) void logits_lanes8(const float *restrict q, const elem_t *restrict kt, int64_t k_row, int64_t dim,
                                                                float *restrict logits) {
    __m256 acc[8];
    const int64_t full = dim / 8;
    for (int u0 = 0; u0 < 8; u0 += 4) { /* 4 keys at a time: 4 independent sums, each row read front to back */
        __m256 a[4];
        for (int u = 0; u < 4; u++) a[u] = _mm256_setzero_ps();
        for (int64_t j = 0; j < full; j++) {
            const __m256 qv = _mm256_loadu_ps(q + 8 * j);
            for (int u = 0; u < 4; u++) a[u] = _mm256_fmadd_ps(qv, load8_shuffled(kt + (u0 + u) * k_row + 8 * j), a[u]);
        }
        if (8 * full < dim) {
            const __m256 qv = _mm256_loadu_ps(q + 8 * full);
            for (int u = 0; u < 4; u++) a[u] = _mm256_fmadd_ps(qv, load8_partial(kt + (u0 + u) * k_row + 8 * full, dim - 8 * full), a[u]);
        }
        for (int u = 0; u < 4; u++) acc[u0 + u] = a[u];
    }
    _mm256_storeu_ps(logits, transpose_sums8(acc));
}

/* acc[R rows][chunks c0 .. c0 + CV - 1] += p . values of a block's n keys. p: the rows'
 * probabilities, BLOCK_KEYS apart; acc rows ``v_pad`` apart. */
static inline __attribute__((always_inline)) void values_tile8(const float *restrict p, int n, const elem_t *restrict vb, int64_t v_row,
                                                               int64_t v_dim, int64_t c0, const int R, const int CV, float *restrict acc,
                                                               int64_t v_pad, Ahead *ah) {
    const int64_t step = R * CV * ah->per_unit;
    __m256 av[ROWS_TILE][CHUNKS_TILE];
    for (int i = 0; i < R; i++)
        for (int c = 0; c < CV; c++) av[i][c] = _mm256_loadu_ps(acc + i * v_pad + 8 * (c0 + c));
    const int64_t left = v_dim - 8 * (c0 + CV - 1); /* values in the tile's last chunk: fewer than 8 at the row's end */
    for (int t = 0; t < n; t++) {
        const elem_t *vt = vb + t * v_row + 8 * c0;
        ahead_step(ah, step);
        __m256 vv[CHUNKS_TILE];
        for (int c = 0; c < CV - 1; c++) vv[c] = load8(vt + 8 * c);
        vv[CV - 1] = left >= 8 ? load8(vt + 8 * (CV - 1)) : load8_partial(vt + 8 * (CV - 1), left);
        for (int c = 0; c < CV; c++) IN_REGISTER8(vv[c]); /* loaded once for the R rows */
        for (int i = 0; i < R; i++) {
            __m256 pi = _mm256_broadcast_ss(p + i * BLOCK_KEYS + t);
            IN_REGISTER8(pi);
            for (int c = 0; c < CV; c++) av[i][c] = _mm256_fmadd_ps(pi, vv[c], av[i][c]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int c = 0; c < CV; c++) _mm256_storeu_ps(acc + i * v_pad + 8 * (c0 + c), av[i][c]);
}

/* values_tile8 for an item of one query row (MHA, the latent kind's heads): up to ROW_CHUNKS
 * chunks at a time, so as many independent sums as keep both FMA ports busy (one row's 3 chunks
 * at a time took 1.1x MHA's step), each chunk widened by load8_shuffled (no value is shared). */
static inline __attribute__((always_inline)) void values_row8(const float *restrict p, int n, const elem_t *restrict vb, int64_t v_row,
                                                              int64_t v_dim, int64_t c0, const int CV, float *restrict acc, Ahead *ah) {
    const int64_t step = CV * ah->per_unit;
    __m256 av[ROW_CHUNKS];
    for (int c = 0; c < CV; c++) av[c] = _mm256_loadu_ps(acc + 8 * (c0 + c));
    const int64_t left = v_dim - 8 * (c0 + CV - 1);
    for (int t = 0; t < n; t++) {
        const elem_t *vt = vb + t * v_row + 8 * c0;
        ahead_step(ah, step);
        const __m256 pt = _mm256_broadcast_ss(p + t);
        for (int c = 0; c < CV - 1; c++) av[c] = _mm256_fmadd_ps(pt, load8_shuffled(vt + 8 * c), av[c]);
        av[CV - 1] = _mm256_fmadd_ps(pt, left >= 8 ? load8_shuffled(vt + 8 * (CV - 1)) : load8_partial(vt + 8 * (CV - 1), left), av[CV - 1]);
    }
    for (int c = 0; c < CV; c++) _mm256_storeu_ps(acc + 8 * (c0 + c), av[c]);
}

#define ROWS_SWITCH8(R, CALL_R) \
    switch (R) {                \
    case 4: CALL_R(4); break;   \
    case 3: CALL_R(3); break;   \
    case 2: CALL_R(2); break;   \
    default: CALL_R(1); break;  \
    }

/* Every chunk of a one-row item's block (values_row8, ROW_CHUNKS at a time). Not inlined into
 * the item's loop (there its tiles cost the tiles of rows sharing a head 1.1-1.15x: LRKV's and
 * MLA's layers); one call per block, the prefetch state passed and returned by value. */
static __attribute__((noinline)) Ahead values_row_block8(const float *restrict p, int n, const elem_t *restrict vb, int64_t v_row, int64_t v_dim,
                                                         int64_t v_chunks, float *restrict acc, Ahead ah) {
    for (int64_t c0 = 0; c0 < v_chunks; c0 += ROW_CHUNKS) {
        switch (v_chunks - c0 < ROW_CHUNKS ? (int)(v_chunks - c0) : ROW_CHUNKS) {
#define ROW_CASE(CV) case CV: values_row8(p, n, vb, v_row, v_dim, c0, CV, acc, &ah); break;
        ROW_CASE(8) ROW_CASE(7) ROW_CASE(6) ROW_CASE(5) ROW_CASE(4) ROW_CASE(3) ROW_CASE(2)
        default: values_row8(p, n, vb, v_row, v_dim, c0, 1, acc, &ah); break;
#undef ROW_CASE
        }
    }
    return ah;
}

/* acc[every row] += p . values of a block's n keys, for ``rows`` (> 1) query rows (probabilities
 * in p, BLOCK_KEYS apart; accumulators v_pad apart): tiles of up to ROWS_TILE rows x CHUNKS_TILE
 * chunks, each value chunk read once per row tile. Like values_row_block8, a function of its own
 * called once per block, the prefetch state passed and returned by value. */
static __attribute__((noinline)) Ahead values_rows_block8(const float *restrict p, int n, const elem_t *restrict vb, int64_t v_row, int64_t v_dim,
                                                          int64_t v_chunks, int64_t rows, float *restrict acc, int64_t v_pad, Ahead ah) {
    for (int64_t c0 = 0; c0 < v_chunks; c0 += CHUNKS_TILE) {
        const int chunks = v_chunks - c0 < CHUNKS_TILE ? (int)(v_chunks - c0) : CHUNKS_TILE;
        for (int64_t g = 0; g < rows; g += ROWS_TILE) {
            const int tile_rows = rows - g < ROWS_TILE ? (int)(rows - g) : ROWS_TILE;
            const float *pg = p + g * BLOCK_KEYS;
            float *ag = acc + g * v_pad;
#define VALUES8(R)                                                                   \
    switch (chunks) {                                                                \
    case 3: values_tile8(pg, n, vb, v_row, v_dim, c0, R, 3, ag, v_pad, &ah); break; \
    case 2: values_tile8(pg, n, vb, v_row, v_dim, c0, R, 2, ag, v_pad, &ah); break; \
    default: values_tile8(pg, n, vb, v_row, v_dim, c0, R, 1, ag, v_pad, &ah); break;\
    }
            ROWS_SWITCH8(tile_rows, VALUES8)
#undef VALUES8
        }
    }
    return ah;
}

/* acc[every row] += p . values of a block's n keys: values_row_block8 for one query row, else values_rows_block8. */
static inline void values_block8(const float *restrict p, int n, const elem_t *restrict vb, int64_t v_row, int64_t v_dim, int64_t rows,
                                 float *restrict acc, int64_t v_pad, Ahead *ah) {
    *ah = rows == 1 ? values_row_block8(p, n, vb, v_row, v_dim, v_pad / 8, acc, *ah)
                    : values_rows_block8(p, n, vb, v_row, v_dim, v_pad / 8, rows, acc, v_pad, *ah);
}

/* The online-softmax update of one row for a block of n keys (logits in lg[0 .. width), width a
 * multiple of 8 and at least n): logits -> probabilities (in place), the running max and sum, and
 * the accumulator rescaled when the max grows. */
static inline void softmax_block8(float *restrict lg, int n, int width, float *restrict acc, int64_t v_pad, float *restrict run_max, float *restrict run_sum) {
    for (int t = n; t < width; t++) lg[t] = -INFINITY;
    __m256 m8 = _mm256_loadu_ps(lg);
    for (int t = 8; t < width; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(lg + t));
    const float block_max = max8(m8);
    if (block_max > *run_max) {
        const float correction = _mm_cvtss_f32(_mm256_castps256_ps128(exp_nonpositive8(_mm256_set1_ps(*run_max - block_max))));
        *run_sum *= correction;
        const __m256 c8 = _mm256_set1_ps(correction);
        for (int64_t e = 0; e < v_pad; e += 8) _mm256_storeu_ps(acc + e, _mm256_mul_ps(_mm256_loadu_ps(acc + e), c8));
        *run_max = block_max;
    }
    const __m256 m = _mm256_set1_ps(*run_max);
    __m256 sum = _mm256_setzero_ps();
    for (int t = 0; t < width; t += 8) {
        const __m256 p = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(lg + t), m));
        _mm256_storeu_ps(lg + t, p);
        sum = _mm256_add_ps(sum, p);
    }
    *run_sum += sum8(sum);
}

/* Software prefetch of the n rows of a block ``row`` elements apart, ``width`` elements each: the
 * narrow rows' fixed-distance prefetch (segments Ahead leaves alone). */
static inline void prefetch_rows(const elem_t *rows, int n, int64_t row, int64_t width) {
    for (int t = 0; t < n; t++)
        for (int64_t e = 0; e < width; e += 64 / (int64_t)sizeof(elem_t)) _mm_prefetch((const char *)(rows + t * row + e), _MM_HINT_T0);
}

/* One work item, any widths, any number of query rows: ``heads`` key heads from head h (a
 * segment's key head stride apart) with ``groups`` query rows each, all reading the same values
 * (heads > 1 only when every head shares the values: the latent kind's rows). Per block: logits
 * (keys in lanes, 8 per vector, for a head with one row; 4 rows x 3 keys tiles for rows sharing a
 * head's keys), the online softmax, then the values (4 rows x 3 chunks, each chunk read once for 4
 * rows; one row: 8 chunks at a time). Same arithmetic as attend_item, in another order of sums. Scratch: acc (rows x v_pad), qs
 * (rows x d_pad), logits (rows x BLOCK_KEYS), widths padded to 8 floats. */
static void attend_item_avx2(int64_t item, float *restrict out, const Segment *segments, int n_segments, int64_t b, int64_t h, int64_t heads,
                             int64_t groups, int64_t dim, int64_t v_dim, float scale, float *restrict acc, float *restrict qs, float *restrict logits,
                             float *restrict run_max, float *restrict run_sum) {
    const int64_t d_pad = (dim + 7) / 8 * 8, v_pad = (v_dim + 7) / 8 * 8, v_chunks = v_pad / 8, rows_all = heads * groups;
    for (int64_t g = 0; g < rows_all; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(rows_all * v_pad));
    memset(qs, 0, sizeof(float) * (size_t)(rows_all * d_pad));
    for (int s = 0; s < n_segments; s++) {
        const Segment seg = segments[s];
        const float *restrict q = seg.q + item * groups * dim;
        for (int64_t g = 0; g < rows_all; g++)
            for (int64_t d = 0; d < dim; d++) qs[g * d_pad + d] = q[g * dim + d] * scale;
        const elem_t *restrict kh = seg.k + b * seg.k_stride_b + h * seg.k_stride_h;
        const elem_t *restrict vh = seg.v + b * seg.v_stride_b + h * seg.v_stride_h;
        const int64_t k_row = seg.k_stride_t, v_row = seg.v_stride_t;
        const int v_in_k = heads == 1 && values_in_key_rows(kh, vh, dim, v_dim, k_row, v_row);
        const int64_t units = rows_all * (d_pad / 8 + v_chunks); /* a block's work per key, in tile units (see Ahead) */
        const int fetch = ahead_pays(seg.keys, heads, dim, v_in_k ? 0 : v_dim);
        const int64_t near = !fetch && PREFETCH_BLOCKS > 0 && NEAR_PREFETCH ? PREFETCH_BLOCKS * BLOCK_KEYS : 0; /* narrow rows: this many keys ahead */
        for (int64_t t0 = 0; t0 < seg.keys; t0 += BLOCK_KEYS) {
            const int n = (int)(seg.keys - t0 < BLOCK_KEYS ? seg.keys - t0 : BLOCK_KEYS);
            const elem_t *restrict vb = vh + t0 * v_row;
            const int64_t next = seg.keys - t0 - AHEAD_BLOCKS * BLOCK_KEYS; /* keys of the block AHEAD_BLOCKS on (<= 0: none) */
            Ahead ah = ahead_rows(kh + (t0 + AHEAD_BLOCKS * BLOCK_KEYS) * k_row, vh + (t0 + AHEAD_BLOCKS * BLOCK_KEYS) * v_row,
                                  fetch && next > 0 ? (next < BLOCK_KEYS ? next : BLOCK_KEYS) : 0, k_row, v_row, seg.k_stride_h, heads,
                                  dim, v_dim, units, n);
            for (int64_t hh = 0; hh < heads; hh++) {
                const elem_t *restrict kb = kh + hh * seg.k_stride_h + t0 * k_row;
                if (groups == 1) {
                    const float *qr = qs + hh * d_pad;
                    float *lg = logits + hh * BLOCK_KEYS;
                    const int64_t step = d_pad / 8 * ah.per_unit;
                    int t = 0;
                    for (; t + 8 <= n; t += 8) {
                        ahead_step(&ah, 8 * step);
                        if (near && t0 + t + near + 8 <= seg.keys) {
                            prefetch_rows(kb + (t + near) * k_row, 8, k_row, dim);
                            if (hh == 0 && !v_in_k) prefetch_rows(vb + (t + near) * v_row, 8, v_row, v_dim);
                        }
                        logits_lanes8(qr, kb + t * k_row, k_row, dim, lg + t);
                    }
                    for (; t < n; t++) {
                        ahead_step(&ah, step);
                        logits_tile8(qr, d_pad, kb + t * k_row, k_row, dim, 1, 1, lg, t);
                    }
                    continue;
                }
                for (int64_t g = 0; g < groups; g += ROWS_TILE) {
                    const int rows = groups - g < ROWS_TILE ? (int)(groups - g) : ROWS_TILE;
                    const float *qg = qs + (hh * groups + g) * d_pad;
                    float *lg = logits + (hh * groups + g) * BLOCK_KEYS;
                    const int64_t step = rows * (d_pad / 8) * ah.per_unit;
                    int t = 0;
#define LOGITS_WIDE(R)                                                                                  \
    for (; t + KEYS_TILE <= n; t += KEYS_TILE) {                                                      \
        ahead_step(&ah, KEYS_TILE * step);                                                            \
        if (near && g == 0 && t0 + t + near + KEYS_TILE <= seg.keys) {                                \
            prefetch_rows(kb + (t + near) * k_row, KEYS_TILE, k_row, dim);                            \
            if (hh == 0 && !v_in_k) prefetch_rows(vb + (t + near) * v_row, KEYS_TILE, v_row, v_dim);  \
        }                                                                                             \
        logits_tile8(qg, d_pad, kb + t * k_row, k_row, dim, R, KEYS_TILE, lg, t);                     \
    }
#define LOGITS_ONE(R)                                                                                   \
    for (; t < n; t++) {                                                                              \
        ahead_step(&ah, step);                                                                        \
        logits_tile8(qg, d_pad, kb + t * k_row, k_row, dim, R, 1, lg, t);                             \
    }
                    ROWS_SWITCH8(rows, LOGITS_WIDE)
                    ROWS_SWITCH8(rows, LOGITS_ONE)
#undef LOGITS_WIDE
#undef LOGITS_ONE
                }
            }
            for (int64_t g = 0; g < rows_all; g++) softmax_block8(logits + g * BLOCK_KEYS, n, BLOCK_KEYS, acc + g * v_pad, v_pad, run_max + g, run_sum + g);
            values_block8(logits, n, vb, v_row, v_dim, rows_all, acc, v_pad, &ah);
        }
    }
    for (int64_t g = 0; g < rows_all; g++) {
        const float inv = 1.0f / run_sum[g];
        for (int64_t e = 0; e < v_dim; e++) out[g * v_dim + e] = acc[g * v_pad + e] * inv;
    }
}
