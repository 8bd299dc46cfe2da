/* Decode attention that reads int8 / int4 cache codes in place (included by decode_attention.c,
 * after elem_t, to_float and exp_nonpositive): the fast path of a quantized cache
 * (slimkv/ops/quantize.py), which otherwise dequantizes its whole history every step.
 *
 * Storage (slimkv.ops.quantize.quantize_groups): each cached row of ``dim`` channels is cut into
 * groups of ``group`` channels (the last padded); a group holds unsigned codes, int8 one per byte,
 * int4 two per byte (channel 2j in the low nibble of byte j, 2j + 1 in the high one), and a scale
 * and a minimum in the cache's element type: value = code * scale + minimum. A call's segments are
 * read one after the other under one softmax; each is either codes (``bits`` 4 or 8, with scales
 * and minima) or plain rows (``bits`` 0: the full-precision residual window), so the history and
 * the newest rows need no concatenation. Every quantized segment of a call has the same bits and
 * group.
 *
 * Per work item (a batch row's key/value head) and block of QBLOCK keys, the block's keys and
 * values are dequantized once into scratch rows of the cache's element type that stay in the L1
 * cache, and every query row of the head (GQA: the query heads sharing it) is served from them
 * with an online softmax, so each code is read from memory once per step. int4 rows are unpacked
 * in "split" order (a group's low nibbles, then its high nibbles: contiguous loads and stores,
 * which the compiler vectorizes); the query rows are permuted into that order once per segment and
 * the output back once per item, which changes no sum's terms, only their order. The portable
 * path reads the scratch with plain C loops written for the compiler to vectorize; the AVX2 path
 * reads it with the plain rows' register tiles (decode_avx2.h: logits_tile8 / logits_lanes8,
 * softmax_block8, values_tile8), as if the scratch were a segment of rows; the AVX-512 path
 * dequantizes in registers instead (attend_item_quantized_avx512, below).
 *
 * Dequantized values are what the cache's own dequantization gives (in bfloat16 builds, rounded
 * to bfloat16: the scratch rows hold them as bfloat16, and the AVX-512 path rounds in registers), so the plain reference is
 * slimkv.ops.attention.reference_attention over the buffer's rows
 * (slimkv.ops.quantize.dequantize_groups); tests/ops/test_native_quantized.py compares them on
 * every instruction-set path. */

#define QBLOCK 32 /* keys per block: 32 rows of keys and values of 64 float32 channels are 16 KB of scratch */
#define QFIELDS 28 /* integers per segment in the quantized entry point's ``fields`` */

typedef struct {
    const float *q;
    int64_t bits, group, keys;
    const void *k, *v;                   /* codes (uint8) when bits > 0, else rows of elem_t */
    const elem_t *ks, *kl, *vs, *vl;     /* per-group scales and minima of the key and value rows (bits > 0) */
    int64_t k_st[3], v_st[3];            /* batch, head, row strides: bytes for codes, elements for rows */
    int64_t ks_st[3], kl_st[3], vs_st[3], vl_st[3]; /* batch, head, row strides of the scales and minima, in elements */
} QSegment;

typedef struct {
    float *out;
    const QSegment *segments;
    int n_segments;
    int64_t kv_heads, groups, dim, v_dim, bits, group, first, last;
    float scale;
    int status;
    float *stats_max, *stats_sum; /* a key split's job (one item): its rows' softmax maxima and sums, for the merge */
} QJob;

/* A key split's job keeps its item's softmax statistics (run_max, run_sum of its ``groups`` rows). */
static inline void keep_split_stats(const QJob *job, int64_t item, const float *run_max, const float *run_sum) {
    if (!job->stats_max) return;
    memcpy(job->stats_max + item * job->groups, run_max, sizeof(float) * (size_t)job->groups);
    memcpy(job->stats_sum + item * job->groups, run_sum, sizeof(float) * (size_t)job->groups);
}

/* Row (b, h, t) of a strided array of ``size``-byte elements (strides in elements). */
static inline const void *row_at(const void *p, const int64_t *st, int64_t b, int64_t h, int64_t t, size_t size) {
    return (const char *)p + (size_t)(b * st[0] + h * st[1] + t * st[2]) * size;
}

#if defined(SLIMKV_PATH_AVX2)
/* 8 dequantized values stored as the cache's element type holds them (bfloat16 builds: rounded to
 * the nearest bfloat16, ties to even, as from_float and the cache's own dequantization do). */
static inline void store8_elems(elem_t *d, __m256 x) {
#ifdef SLIMKV_BF16
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    _mm_storeu_si128((__m128i *)d, _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
#else
    _mm256_storeu_ps(d, x);
#endif
}
#endif

/* Position of channel c in split order (int4: within a group, the even channels then the odd ones). */
static inline int64_t split_position(int64_t c, int64_t bits, int64_t group) {
    if (bits != 4) return c;
    const int64_t base = c / group * group, j = c - base;
    return base + (j & 1 ? group / 2 + j / 2 : j / 2);
}

/* Rows t0 .. t0 + n of one side (keys or values) of a segment in split order as the cache's element
 * type holds them, ``pad`` elements apart (``width`` real channels; quantized rows fill every
 * padded channel, plain rows leave the padding zero). */
static inline __attribute__((always_inline)) void load_rows(const QSegment *seg, int side, int64_t b, int64_t h, int64_t t0, int64_t n,
                                                             int64_t width, int64_t pad, int64_t bits, int64_t group, const int32_t *position,
                                                             elem_t *restrict dst) {
    const int64_t *st = side ? seg->v_st : seg->k_st;
    if (seg->bits == 0) {
        const elem_t *rows = (const elem_t *)(side ? seg->v : seg->k) + b * st[0] + h * st[1] + t0 * st[2];
        for (int64_t t = 0; t < n; t++) {
            const elem_t *row = rows + t * st[2];
            elem_t *restrict d = dst + t * pad;
            if (pad > width) /* the padding's places in split order are not the row's tail */
                for (int64_t p = 0; p < pad; p++) d[p] = from_float(0.0f);
            for (int64_t c = 0; c < width; c++) d[position[c]] = row[c];
        }
        return;
    }
    const int64_t *sst = side ? seg->vs_st : seg->ks_st, *lst = side ? seg->vl_st : seg->kl_st;
    const uint8_t *codes = (const uint8_t *)(side ? seg->v : seg->k) + b * st[0] + h * st[1] + t0 * st[2];
    const elem_t *scales = (side ? seg->vs : seg->ks) + b * sst[0] + h * sst[1] + t0 * sst[2];
    const elem_t *lows = (side ? seg->vl : seg->kl) + b * lst[0] + h * lst[1] + t0 * lst[2];
    const int64_t n_groups = pad / group, half = group / 2;
    for (int64_t t = 0; t < n; t++) {
        const uint8_t *restrict c = codes + t * st[2];
        elem_t *restrict d = dst + t * pad;
        for (int64_t g = 0; g < n_groups; g++) {
            const float s = to_float(scales[t * sst[2] + g]), m = to_float(lows[t * lst[2] + g]);
            elem_t *restrict dg = d + g * group;
            if (bits == 4) {
                const uint8_t *restrict cg = c + g * half;
                int64_t j0 = 0;
#if defined(SLIMKV_PATH_AVX2)
                for (; j0 + 8 <= half; j0 += 8) { /* 8 bytes: their low nibbles and their high ones as 8 floats each (the compiler took 4 at a time) */
                    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cg + j0)));
                    const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
                    store8_elems(dg + j0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15))), sv, mv));
                    store8_elems(dg + half + j0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4)), sv, mv));
                }
#endif
#pragma omp simd
                for (int64_t j = j0; j < half; j++) {
                    dg[j] = from_float((float)(cg[j] & 15) * s + m);
                    dg[half + j] = from_float((float)(cg[j] >> 4) * s + m);
                }
            } else {
                const uint8_t *restrict cg = c + g * group;
                int64_t j0 = 0;
#if defined(SLIMKV_PATH_AVX2)
                for (; j0 + 8 <= group; j0 += 8) /* 8 codes as 8 floats */
                    store8_elems(dg + j0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cg + j0)))),
                                                          _mm256_set1_ps(s), _mm256_set1_ps(m)));
#endif
#pragma omp simd
                for (int64_t j = j0; j < group; j++) dg[j] = from_float((float)cg[j] * s + m);
            }
        }
    }
}

/* One (batch, kv_head) item: ``groups`` query rows against every segment. The widths are
 * compile-time constants where the dispatcher below inlines this for common shapes. */
static inline __attribute__((always_inline)) void attend_item_quantized(const QJob *job, int64_t item, int64_t dim, int64_t v_dim,
                                                                         int64_t bits, int64_t group, const int32_t *position,
                                                                         float *restrict scratch) {
    const int64_t groups = job->groups, b = item / job->kv_heads, h = item % job->kv_heads;
    const int64_t d_pad = (dim + group - 1) / group * group, v_pad = (v_dim + group - 1) / group * group;
    float *restrict acc = scratch, *restrict qs = acc + groups * v_pad, *restrict run_max = qs + groups * d_pad, *restrict run_sum = run_max + groups;
    elem_t *restrict kbuf = (elem_t *)(run_sum + groups), *restrict vbuf = kbuf + QBLOCK * d_pad;
    float logits[QBLOCK];
    for (int64_t g = 0; g < groups; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
        for (int64_t p = 0; p < v_pad; p++) acc[g * v_pad + p] = 0.0f;
    }
    for (int s = 0; s < job->n_segments; s++) {
        const QSegment *seg = job->segments + s;
        const float *q = seg->q + item * groups * dim;
        for (int64_t g = 0; g < groups; g++) {
            for (int64_t p = 0; p < d_pad; p++) qs[g * d_pad + p] = 0.0f;
            for (int64_t c = 0; c < dim; c++) qs[g * d_pad + position[c]] = q[g * dim + c] * job->scale;
        }
        for (int64_t t0 = 0; t0 < seg->keys; t0 += QBLOCK) {
            const int64_t n = seg->keys - t0 < QBLOCK ? seg->keys - t0 : QBLOCK;
            load_rows(seg, 0, b, h, t0, n, dim, d_pad, bits, group, position, kbuf);
            load_rows(seg, 1, b, h, t0, n, v_dim, v_pad, bits, group, position, vbuf);
            for (int64_t g = 0; g < groups; g++) {
                const float *restrict qg = qs + g * d_pad;
                float block_max = -INFINITY;
                for (int64_t t = 0; t < n; t++) {
                    const elem_t *restrict kt = kbuf + t * d_pad;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t p = 0; p < d_pad; p++) dot += qg[p] * to_float(kt[p]);
                    logits[t] = dot;
                    block_max = dot > block_max ? dot : block_max;
                }
                float *restrict ag = acc + g * v_pad;
                if (block_max > run_max[g]) {
                    const float correction = exp_nonpositive(run_max[g] - block_max);
                    run_sum[g] *= correction;
#pragma omp simd
                    for (int64_t p = 0; p < v_pad; p++) ag[p] *= correction;
                    run_max[g] = block_max;
                }
                const float m = run_max[g];
                float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
                for (int64_t t = 0; t < n; t++) {
                    logits[t] = exp_nonpositive(logits[t] - m);
                    block_sum += logits[t];
                }
                run_sum[g] += block_sum;
                for (int64_t t = 0; t < n; t++) { /* key by key, all channels at once: the vectors of channels accumulate side by
                                                      side (channel-vector by channel-vector, each add waited on the last's latency) */
                    const float w = logits[t];
                    const elem_t *restrict vt = vbuf + t * v_pad;
#pragma omp simd
                    for (int64_t p = 0; p < v_pad; p++) ag[p] += w * to_float(vt[p]);
                }
            }
        }
    }
    keep_split_stats(job, item, run_max, run_sum);
    float *out = job->out + item * groups * v_dim;
    for (int64_t g = 0; g < groups; g++) {
        const float inv = 1.0f / run_sum[g];
        for (int64_t c = 0; c < v_dim; c++) out[g * v_dim + c] = acc[g * v_pad + position[c]] * inv;
    }
}


#if defined(SLIMKV_PATH_AVX2)
/* One (batch, kv_head) item on the AVX2 path: each block's keys and values dequantized into
 * scratch rows (load_rows, as attend_item_quantized does), then read by the plain rows' register
 * tiles as a segment of d_pad- and v_pad-wide rows: logits in tiles of ROWS_TILE rows x KEYS_TILE
 * keys (keys in lanes for a head with one query row), softmax_block8, values in tiles of
 * ROWS_TILE rows x CHUNKS_TILE chunks (values_block8), so the accumulators stay in registers over the block where
 * the portable loops load and store them per key. Queries and accumulators are kept 8-float
 * aligned (q_row, acc_row) so every chunk the tiles read lies inside its row. The scratch is fresh
 * in the L1 cache: no software prefetch (an empty Ahead). */
static inline __attribute__((always_inline)) void attend_item_quantized_avx2(const QJob *job, int64_t item, int64_t dim, int64_t v_dim,
                                                                              int64_t bits, int64_t group, const int32_t *position,
                                                                              float *restrict scratch) {
    const int64_t groups = job->groups, b = item / job->kv_heads, h = item % job->kv_heads;
    const int64_t d_pad = (dim + group - 1) / group * group, v_pad = (v_dim + group - 1) / group * group;
    const int64_t q_row = (d_pad + 7) / 8 * 8, acc_row = (v_pad + 7) / 8 * 8;
    float *restrict acc = scratch, *restrict qs = acc + groups * acc_row, *restrict logits = qs + groups * q_row;
    float *restrict run_max = logits + groups * BLOCK_KEYS, *restrict run_sum = run_max + groups;
    elem_t *restrict kbuf = (elem_t *)(run_sum + groups), *restrict vbuf = kbuf + QBLOCK * d_pad;
    Ahead none = ahead_rows(NULL, NULL, 0, 0, 0, 0, 1, dim, v_dim, 1, 1);
    for (int64_t g = 0; g < groups; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(groups * acc_row));
    for (int s = 0; s < job->n_segments; s++) {
        const QSegment *seg = job->segments + s;
        const float *q = seg->q + item * groups * dim;
        memset(qs, 0, sizeof(float) * (size_t)(groups * q_row));
        for (int64_t g = 0; g < groups; g++)
            for (int64_t c = 0; c < dim; c++) qs[g * q_row + position[c]] = q[g * dim + c] * job->scale;
        for (int64_t t0 = 0; t0 < seg->keys; t0 += QBLOCK) {
            const int n = (int)(seg->keys - t0 < QBLOCK ? seg->keys - t0 : QBLOCK);
            load_rows(seg, 0, b, h, t0, n, dim, d_pad, bits, group, position, kbuf);
            load_rows(seg, 1, b, h, t0, n, v_dim, v_pad, bits, group, position, vbuf);
            if (groups == 1) {
                int t = 0;
                for (; t + 8 <= n; t += 8) logits_lanes8(qs, kbuf + t * d_pad, d_pad, d_pad, logits + t);
                for (; t < n; t++) logits_tile8(qs, q_row, kbuf + t * d_pad, d_pad, d_pad, 1, 1, logits, t);
            } else {
                for (int64_t g = 0; g < groups; g += ROWS_TILE) {
                    const int rows = groups - g < ROWS_TILE ? (int)(groups - g) : ROWS_TILE;
                    const float *qg = qs + g * q_row;
                    float *lg = logits + g * BLOCK_KEYS;
                    int t = 0;
#define QLOGITS_WIDE(R) \
    for (; t + KEYS_TILE <= n; t += KEYS_TILE) logits_tile8(qg, q_row, kbuf + t * d_pad, d_pad, d_pad, R, KEYS_TILE, lg, t);
#define QLOGITS_ONE(R) \
    for (; t < n; t++) logits_tile8(qg, q_row, kbuf + t * d_pad, d_pad, d_pad, R, 1, lg, t);
                    ROWS_SWITCH8(rows, QLOGITS_WIDE)
                    ROWS_SWITCH8(rows, QLOGITS_ONE)
#undef QLOGITS_WIDE
#undef QLOGITS_ONE
                }
            }
            for (int64_t g = 0; g < groups; g++) softmax_block8(logits + g * BLOCK_KEYS, n, (n + 7) / 8 * 8, acc + g * acc_row, acc_row, run_max + g, run_sum + g);
            values_block8(logits, n, vbuf, v_pad, v_pad, groups, acc, acc_row, &none);
        }
    }
    keep_split_stats(job, item, run_max, run_sum);
    float *out = job->out + item * groups * v_dim;
    for (int64_t g = 0; g < groups; g++) {
        const float inv = 1.0f / run_sum[g];
        for (int64_t c = 0; c < v_dim; c++) out[g * v_dim + c] = acc[g * acc_row + position[c]] * inv;
    }
}

#endif

#if defined(SLIMKV_PATH_AVX512)
/* The AVX-512 path for rows of 32, 64 or 128 channels in groups of 32 or 64: the plain kernel's
 * register tiles (block_rows_avx512) read each block's codes in place, dequantizing every row in
 * registers (code_row_avx512) where the plain rows would be loaded, so the arithmetic after
 * dequantization is the plain kernel's; residual rows are read as rows. */
static inline __attribute__((always_inline)) void attend_item_quantized_avx512(const QJob *job, int64_t item, const int ND, const int bits,
                                                                                const int group, float *restrict acc, float *restrict run_max,
                                                                                float *restrict run_sum) {
    const int64_t groups = job->groups, b = item / job->kv_heads, h = item % job->kv_heads, dim = 16 * ND;
    const int fetch = ROW_PREFETCH_ALWAYS || groups > row_tile_avx512(ND); /* the exact window's rows (ROW_PREFETCH_ALWAYS) */
    for (int64_t g = 0; g < groups; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
        for (int64_t e = 0; e < dim; e++) acc[g * dim + e] = 0.0f;
    }
    const __m512 scale16 = _mm512_set1_ps(job->scale);
    float wide[4][BLOCK_KEYS * 4]; /* a bfloat16 block's scales and minima of keys and values as float32 (dim / group <= 4 per row) */
    for (int s = 0; s < job->n_segments; s++) {
        const QSegment *seg = job->segments + s;
        const float *restrict q = seg->q + item * groups * dim;
        const int64_t *kst = seg->k_st, *vst = seg->v_st;
        for (int64_t t0 = 0; t0 < seg->keys; t0 += BLOCK_KEYS) {
            const int n = (int)(seg->keys - t0 < BLOCK_KEYS ? seg->keys - t0 : BLOCK_KEYS);
            if (seg->bits) {
                const int per_row = dim / group;
                CodeBlock block = {.k = row_at(seg->k, kst, b, h, t0, 1), .v = row_at(seg->v, vst, b, h, t0, 1), .k_row = kst[2], .v_row = vst[2]};
                block.ks = block_scales(row_at(seg->ks, seg->ks_st, b, h, t0, sizeof(elem_t)), seg->ks_st[2], n, per_row, wide[0], &block.ks_row);
                block.kl = block_scales(row_at(seg->kl, seg->kl_st, b, h, t0, sizeof(elem_t)), seg->kl_st[2], n, per_row, wide[1], &block.kl_row);
                block.vs = block_scales(row_at(seg->vs, seg->vs_st, b, h, t0, sizeof(elem_t)), seg->vs_st[2], n, per_row, wide[2], &block.vs_row);
                block.vl = block_scales(row_at(seg->vl, seg->vl_st, b, h, t0, sizeof(elem_t)), seg->vl_st[2], n, per_row, wide[3], &block.vl_row);
                rows_in_tiles_avx512(q, NULL, NULL, 0, 0, n, groups, ND, ND, scale16, 0, &block, bits, group, NULL, acc, run_max, run_sum);
            } else {
                const elem_t *kb = (const elem_t *)seg->k + b * kst[0] + h * kst[1] + t0 * kst[2];
                const elem_t *vb = (const elem_t *)seg->v + b * vst[0] + h * vst[1] + t0 * vst[2];
                rows_in_tiles_avx512(q, kb, vb, kst[2], vst[2], n, groups, ND, ND, scale16, fetch, NULL, 0, 0, NULL, acc, run_max, run_sum);
            }
        }
    }
    keep_split_stats(job, item, run_max, run_sum);
    float *out = job->out + item * groups * dim;
    for (int64_t g = 0; g < groups; g++) {
        const float inv = 1.0f / run_sum[g];
#ifdef SLIMKV_BF16
        unpair_row(acc + g * dim, out + g * dim, dim, inv); /* block_rows_avx512 keeps bfloat16 rows' sums in pair order */
#else
        for (int64_t e = 0; e < dim; e++) out[g * dim + e] = acc[g * dim + e] * inv;
#endif
    }
}

#define DISPATCH_QUANTIZED_AVX512(ND, BITS, G)                                                                            \
    if (job->dim == 16 * (ND) && job->v_dim == 16 * (ND) && job->bits == (BITS) && job->group == (G)) {                  \
        for (int64_t i = job->first; i < job->last; i++)                                                                  \
            attend_item_quantized_avx512(job, i, (ND), (BITS), (G), scratch, scratch + job->groups * job->v_dim,            \
                                         scratch + job->groups * job->v_dim + job->groups);                              \
        goto done;                                                                                                        \
    }
#endif

/* The item function of this build (the AVX2 tiles over the dequantized rows, or the portable loops), inlined with
 * the widths as constants for common shapes. */
#if defined(SLIMKV_PATH_AVX2)
#define QUANTIZED_ITEM attend_item_quantized_avx2
#else
#define QUANTIZED_ITEM attend_item_quantized
#endif
#define DISPATCH_QUANTIZED(D, DV, BITS, G)                                                                            \
    if (job->dim == (D) && job->v_dim == (DV) && job->bits == (BITS) && job->group == (G)) {                          \
        for (int64_t i = job->first; i < job->last; i++) QUANTIZED_ITEM(job, i, (D), (DV), (BITS), (G), position, scratch); \
        goto done;                                                                                                    \
    }

static void *run_quantized_job(void *arg) {
    QJob *job = (QJob *)arg;
    const int64_t d_pad = (job->dim + job->group - 1) / job->group * job->group, v_pad = (job->v_dim + job->group - 1) / job->group * job->group;
    const int64_t width = job->dim > job->v_dim ? job->dim : job->v_dim;
    /* per query row: accumulators, query, logits (the AVX2 tiles' BLOCK_KEYS), max and sum, rows 8-float aligned; then the block's rows */
    const int64_t floats = job->groups * (v_pad + d_pad + 16 + BLOCK_KEYS + 2), elems = QBLOCK * (d_pad + v_pad);
    const size_t position_at = (sizeof(float) * (size_t)floats + sizeof(elem_t) * (size_t)elems + 3) / 4 * 4;
    float *scratch = malloc(position_at + sizeof(int32_t) * (size_t)width);
    if (!scratch) {
        job->status = 1;
        return NULL;
    }
    int32_t *position = (int32_t *)((char *)scratch + position_at); /* channel -> its place in split order */
    for (int64_t c = 0; c < width; c++) position[c] = (int32_t)split_position(c, job->bits, job->group);
#if defined(SLIMKV_PATH_AVX512)
    DISPATCH_QUANTIZED_AVX512(4, 4, 32)
    DISPATCH_QUANTIZED_AVX512(4, 8, 32)
    DISPATCH_QUANTIZED_AVX512(8, 4, 32)
    DISPATCH_QUANTIZED_AVX512(8, 8, 32)
    DISPATCH_QUANTIZED_AVX512(2, 4, 32)
    DISPATCH_QUANTIZED_AVX512(2, 8, 32)
    DISPATCH_QUANTIZED_AVX512(4, 4, 64)
    DISPATCH_QUANTIZED_AVX512(8, 4, 64)
#endif
    DISPATCH_QUANTIZED(64, 64, 4, 32)
    DISPATCH_QUANTIZED(64, 64, 8, 32)
    DISPATCH_QUANTIZED(128, 128, 4, 32)
    DISPATCH_QUANTIZED(128, 128, 8, 32)
    DISPATCH_QUANTIZED(64, 64, 4, 64)
    DISPATCH_QUANTIZED(128, 128, 4, 64)
    for (int64_t i = job->first; i < job->last; i++) QUANTIZED_ITEM(job, i, job->dim, job->v_dim, job->bits, job->group, position, scratch);
done:
    free(scratch);
    job->status = 0;
    return NULL;
}

/* Runs ``jobs[0..count)`` on at most ``threads`` threads (``run_on_threads``); returns their statuses or-ed. */
static int run_quantized_jobs(QJob *jobs, int count, int threads) {
    run_on_threads(run_quantized_job, jobs, sizeof *jobs, count, threads);
    int status = 0;
    for (int t = 0; t < count; t++) status |= jobs[t].status;
    return status;
}

/* The rows from key ``from`` of one side of a segment: codes and their scales and minima, or plain rows. */
static inline void skip_rows(const QSegment *seg, int side, int64_t from, QSegment *range) {
    const int64_t *st = side ? seg->v_st : seg->k_st, *sst = side ? seg->vs_st : seg->ks_st, *lst = side ? seg->vl_st : seg->kl_st;
    const void *rows = side ? seg->v : seg->k;
    const void *moved = seg->bits ? (const void *)((const uint8_t *)rows + from * st[2]) : (const void *)((const elem_t *)rows + from * st[2]);
    if (side) {
        range->v = moved;
        if (seg->bits) range->vs = seg->vs + from * sst[2], range->vl = seg->vl + from * lst[2];
    } else {
        range->k = moved;
        if (seg->bits) range->ks = seg->ks + from * sst[2], range->kl = seg->kl + from * lst[2];
    }
}

/* Key splits of the quantized entry (as split_keys does for plain rows): ``splits`` ranges of every
 * item's keys, one job per (range, item), on ``threads`` threads, merged by merge_key_splits. */
static int split_quantized_keys(const QSegment *segments, int n_segments, int64_t total_keys, float *out, int64_t batch, int64_t kv_heads,
                                int64_t groups, int64_t dim, int64_t v_dim, int64_t bits, int64_t group, float scale, int64_t splits, int threads) {
    const int64_t rows = batch * kv_heads * groups, items = batch * kv_heads;
    float *scratch = malloc(sizeof(float) * (size_t)((splits - 1) * rows * v_dim + 2 * splits * rows));
    if (!scratch) return 1;
    float *stats = scratch + (splits - 1) * rows * v_dim;
    QSegment ranges[64][MAX_SEGMENTS];
    QJob jobs[64];
    int n_jobs = 0;
    for (int64_t j = 0; j < splits; j++) {
        int64_t lo, hi, start = 0;
        split_range(total_keys, splits, j, &lo, &hi);
        int n = 0;
        for (int s = 0; s < n_segments; start += segments[s].keys, s++) {
            const int64_t from = lo > start ? lo - start : 0, to = hi < start + segments[s].keys ? hi - start : segments[s].keys;
            if (to <= from) continue;
            QSegment range = segments[s];
            skip_rows(&segments[s], 0, from, &range);
            skip_rows(&segments[s], 1, from, &range);
            range.keys = to - from;
            ranges[j][n++] = range;
        }
        float *range_out = j == 0 ? out : scratch + (j - 1) * rows * v_dim;
        for (int64_t i = 0; i < items; i++)
            jobs[n_jobs++] = (QJob){range_out, ranges[j], n, kv_heads, groups, dim, v_dim, bits, group, i, i + 1, scale, 1,
                                    stats + 2 * j * rows, stats + (2 * j + 1) * rows};
    }
    const int status = run_quantized_jobs(jobs, n_jobs, threads);
    if (status == 0) merge_key_splits(out, scratch, stats, rows, v_dim, splits);
    free(scratch);
    return status;
}

/* ``fields`` holds QFIELDS integers per segment: the query pointer, bits (0, 4 or 8), group, key
 * count, the key and value pointers (codes or rows), the key scale, key minimum, value scale and
 * value minimum pointers, then batch/head/row strides of keys, values, key scales, key minima,
 * value scales and value minima. Returns 0 on success, 1 when memory or a thread could not be
 * had, 2 on bad arguments. */
int QUANTIZED_ENTRY(const int64_t *fields, int n_segments, float *out, int64_t batch, int64_t kv_heads, int64_t groups, int64_t dim,
                    int64_t v_dim, float scale, int threads) {
    if (n_segments < 1 || n_segments > MAX_SEGMENTS || batch < 1 || kv_heads < 1 || groups < 1 || dim < 1 || v_dim < 1) return 2;
    QSegment segments[MAX_SEGMENTS];
    int64_t total_keys = 0, bits = 0, group = 0;
    for (int s = 0; s < n_segments; s++) {
        const int64_t *f = fields + QFIELDS * s;
        QSegment *seg = segments + s;
        *seg = (QSegment){(const float *)(intptr_t)f[0], f[1], f[2], f[3], (const void *)(intptr_t)f[4], (const void *)(intptr_t)f[5],
                          (const elem_t *)(intptr_t)f[6], (const elem_t *)(intptr_t)f[7], (const elem_t *)(intptr_t)f[8],
                          (const elem_t *)(intptr_t)f[9], {f[10], f[11], f[12]}, {f[13], f[14], f[15]}, {f[16], f[17], f[18]},
                          {f[19], f[20], f[21]}, {f[22], f[23], f[24]}, {f[25], f[26], f[27]}};
        if (seg->keys < 0 || (seg->bits != 0 && seg->bits != 4 && seg->bits != 8)) return 2;
        if (seg->bits) {
            if (seg->group < 2 || (seg->bits == 4 && seg->group % 2) || (bits && (seg->bits != bits || seg->group != group))) return 2;
            bits = seg->bits;
            group = seg->group;
        }
        total_keys += seg->keys;
    }
    if (total_keys < 1) return 2;
    if (!bits) { /* plain rows only: one group as wide as the rows, so nothing is padded or permuted */
        bits = 8;
        group = dim > v_dim ? dim : v_dim;
    }
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    const int64_t items = batch * kv_heads;
    const int64_t splits = key_splits(threads, items, total_keys);
    if (splits > 1) return split_quantized_keys(segments, n_segments, total_keys, out, batch, kv_heads, groups, dim, v_dim, bits, group, scale, splits, threads);
    if (threads > items) threads = (int)items;
    QJob jobs[64];
    for (int t = 0; t < threads; t++)
        jobs[t] = (QJob){out, segments, n_segments, kv_heads, groups, dim, v_dim, bits, group, items * t / threads, items * (t + 1) / threads, scale, 1, NULL, NULL};
    return run_quantized_jobs(jobs, threads, threads);
}
