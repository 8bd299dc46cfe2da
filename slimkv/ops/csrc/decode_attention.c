/* Single-pass decode attention on the CPU (float32): slimkv's native kernel.
 *
 * One query row per query head attends to every cached key of its key/value head. The query heads
 * that share a key/value head (GQA/MQA) are the ``groups`` rows of one block, so each cached key
 * and value is read from memory once per step, whatever the number of query heads. Keys are
 * visited in blocks of BLOCK_KEYS with an online softmax (running max, running sum, rescaled
 * accumulator), so logits, probabilities and values never make a second trip through memory: the
 * block's keys and values stay in the L1 cache for every row of the group.
 *
 * ``segments`` (key/value buffers read one after the other under one softmax) let a cache made of
 * two parts, e.g. KVM's compressed rows and its exact window, be attended without concatenation;
 * each segment has its own query rows (the same pointer for plain attention; KVM folds a
 * per-region temperature into them). The logits are q . k * scale.
 *
 * Layout (what slimkv/ops/native.py passes): every query and out are contiguous
 * (batch, kv_heads, groups, dim) and (batch, kv_heads, groups, v_dim); each segment's keys and
 * values are rows of ``dim`` and ``v_dim`` contiguous floats, with a batch, a head and a row
 * stride in elements (a slice of a larger preallocated buffer is fine, and so are values that are
 * part of the key rows: MLA's absorbed decode reads its latent rows once, as keys and, from an
 * offset, as values). The plain reference is slimkv.ops.attention.reference_attention;
 * tests/ops/test_native.py compares the two.
 *
 * Paths, chosen at build time from the target's instruction set (slimkv_kernel_isa() says which):
 * - "avx512" (decode_avx512.h): head widths 32/64/128 (MHA, GQA, KVM) take register tiles holding
 *   whole rows (block_rows_avx512); any other widths and group counts (MLA's latent rows, LRKV's
 *   rows, 9 query heads per key head) and values shared by every head (the latent kind) take
 *   tiles over 16-float chunks (attend_item_wide: keys in lanes for a head of one query row).
 *   "avx512-bf16" is that path for bfloat16 rows with the logits by AVX512-BF16 dot products.
 *
 * Heads: a work item is one (batch, kv_head) pair, or, when every segment's values are shared by
 * all heads (value head stride 0), all heads of a batch row (or a share of them per thread), so
 * the shared value rows are read once per step.
 * - "avx2" (decode_avx2.h, AVX2 and FMA without AVX-512): tiles over 8-float chunks sized for 16
 *   vector registers, for every width, when several query rows share a key/value head (GQA, MQA,
 *   MLA, LRKV: attend_item_avx2), when every head shares the values (latent), and for bfloat16
 *   rows always (one query row per head: keys-in-lanes tiles); float32 heads of one query row
 *   (MHA) take attend_item, which measured faster there (nothing shares a key chunk).
 * - "portable": attend_item below, plain C written for the compiler to vectorize (any CPU).
 *
 * Threads: the (batch, kv_head) pairs are split over ``threads`` POSIX threads (1: the caller's).
 *
 * Quantized caches (int8 / int4 codes with per-group scales and minima, slimkv/ops/quantize.py)
 * have their own entry point, QUANTIZED_ENTRY (decode_quantized.h), which reads the codes in place;
 * LINEAR_ENTRY (decode_linear.h) is a decode step's projections: one row through a linear layer;
 * QUANTIZE_ENTRY (quantize_rows.h) turns the rows leaving a quantized cache's residual window into codes.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef BLOCK_KEYS
#define BLOCK_KEYS 64
#endif
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2 /* software prefetch of the keys and values at most this many blocks ahead (0: none) */
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES (64 << 10) /* ... and at most this many bytes of an item's rows ahead (wide rows: fewer keys ahead) */
#endif
#define MAX_SEGMENTS 4
#define FIELDS 10 /* integers per segment in the entry point's ``fields`` */

/* The element type of the cached keys and values: float32, or bfloat16 when built with
 * -DSLIMKV_BF16 (the same source, a second library: slimkv/ops/native.py builds both). A bfloat16
 * is the top half of a float32, so widening is a 16-bit shift; every product and sum is float32. */
#ifdef SLIMKV_BF16
typedef uint16_t elem_t;
#define ENTRY slimkv_decode_attention_bf16
#define QUANTIZED_ENTRY slimkv_decode_quantized_bf16
#define LINEAR_ENTRY slimkv_decode_linear_bf16
#define QUANTIZE_ENTRY slimkv_quantize_rows_bf16
static inline float to_float(elem_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#else
typedef float elem_t;
#define ENTRY slimkv_decode_attention_f32
#define QUANTIZED_ENTRY slimkv_decode_quantized_f32
#define LINEAR_ENTRY slimkv_decode_linear_f32
#define QUANTIZE_ENTRY slimkv_quantize_rows_f32
static inline float to_float(elem_t x) { return x; }
#endif

typedef struct {
    const float *q; /* this segment's query rows (a region may have its own temperatures) */
    const elem_t *k, *v;
    int64_t keys, k_stride_b, k_stride_h, k_stride_t, v_stride_b, v_stride_h, v_stride_t; /* strides in elements */
} Segment;

typedef struct {
    float *out;
    const Segment *segments;
    int n_segments;
    int64_t kv_heads, groups, dim, v_dim, first, last; /* work items [first, last) */
    int64_t parts; /* work items per batch row: kv_heads (one head each), or fewer when every head reads the same values */
    int shared; /* every segment's values are shared by all heads (value head stride 0: the latent kind) */
    float scale;
    int status;
} Job;

/* exp(x) for x <= 0, to a few ulp: Cody-Waite reduction to |r| <= ln2/2, then Cephes' degree-6
 * polynomial, then 2^n from the exponent bits. Written so the compiler vectorizes it. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float pow2n;
    memcpy(&pow2n, &bits, sizeof pow2n);
    return p * pow2n;
}

/* One (batch, kv_head) item: ``groups`` query rows against every segment. ``dim`` and ``v_dim``
 * are compile-time constants where the dispatcher below inlines this for common widths. */
static inline __attribute__((always_inline)) void attend_item(int64_t item, float *restrict out, const Segment *segments,
                                                               int n_segments, int64_t b, int64_t h, int64_t heads, int64_t groups,
                                                               int64_t dim, int64_t v_dim, float scale, float *restrict acc,
                                                               float *restrict run_max, float *restrict run_sum, float *restrict qs) {
    const int64_t rows_all = heads * groups;
    for (int64_t g = 0; g < rows_all; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
        for (int64_t e = 0; e < v_dim; e++) acc[g * v_dim + e] = 0.0f;
    }
    float logits[BLOCK_KEYS];
    for (int s = 0; s < n_segments; s++) {
        const Segment seg = segments[s];
        const float *restrict q = seg.q + item * groups * dim;
        for (int64_t i = 0; i < rows_all * dim; i++) qs[i] = q[i] * scale;
        const elem_t *restrict kh = seg.k + b * seg.k_stride_b + h * seg.k_stride_h;
        const elem_t *restrict vh = seg.v + b * seg.v_stride_b + h * seg.v_stride_h;
        const int64_t k_row = seg.k_stride_t, v_row = seg.v_stride_t;
        for (int64_t t0 = 0; t0 < seg.keys; t0 += BLOCK_KEYS) {
            const int64_t n = seg.keys - t0 < BLOCK_KEYS ? seg.keys - t0 : BLOCK_KEYS;
            const elem_t *restrict kb = kh + t0 * k_row;
            const elem_t *restrict vb = vh + t0 * v_row;
            for (int64_t g = 0; g < rows_all; g++) {
                const float *restrict qg = qs + g * dim;
                const elem_t *restrict kg = kb + (g / groups) * seg.k_stride_h; /* row g's key head (heads > 1: values shared) */
                float block_max = -INFINITY;
                for (int64_t t = 0; t < n; t++) {
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < dim; d++) dot += qg[d] * to_float(kg[t * k_row + d]);
                    logits[t] = dot;
                    block_max = dot > block_max ? dot : block_max;
                }
                float *restrict ag = acc + g * v_dim;
                if (block_max > run_max[g]) {
                    const float correction = exp_nonpositive(run_max[g] - block_max);
                    run_sum[g] *= correction;
#pragma omp simd
                    for (int64_t e = 0; e < v_dim; e++) ag[e] *= correction;
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
                for (int64_t t = 0; t < n; t++) {
                    const float p = logits[t];
#pragma omp simd
                    for (int64_t e = 0; e < v_dim; e++) ag[e] += p * to_float(vb[t * v_row + e]);
                }
            }
        }
    }
    for (int64_t g = 0; g < rows_all; g++) {
        const float inv = 1.0f / run_sum[g];
        for (int64_t e = 0; e < v_dim; e++) out[g * v_dim + e] = acc[g * v_dim + e] * inv;
    }
}

/* How many keys ahead the tiled paths prefetch an item's rows: PREFETCH_BLOCKS blocks, or fewer
 * when that would be more than PREFETCH_BYTES (``heads`` key rows of ``dim`` and one value row of
 * ``v_dim`` elements per key; v_dim 0 when the values lie in the key rows), at least 16 keys. */
static inline int64_t prefetch_keys(int64_t heads, int64_t dim, int64_t v_dim) {
    const int64_t per_key = (int64_t)sizeof(elem_t) * (heads * dim + v_dim), most = PREFETCH_BLOCKS * BLOCK_KEYS;
    const int64_t keys = PREFETCH_BYTES / per_key;
    return keys > most ? most : keys < 16 ? 16 : keys;
}

/* Whether each value row lies inside its key row (MLA's latent rows): prefetching the key rows fetches the values too. */
static inline int values_in_key_rows(const elem_t *k, const elem_t *v, int64_t dim, int64_t v_dim, int64_t k_row, int64_t v_row) {
    const uintptr_t kp = (uintptr_t)k, vp = (uintptr_t)v;
    return k_row == v_row && vp >= kp && vp + sizeof(elem_t) * (size_t)v_dim <= kp + sizeof(elem_t) * (size_t)dim;
}

/* The instruction-set path, chosen at build time from the target's flags (-march=native: this
 * CPU's; slimkv/ops/native.py can build a named one). SLIMKV_PORTABLE forces the portable path. */
#if !defined(SLIMKV_PORTABLE) && defined(__AVX512F__) && (!defined(SLIMKV_BF16) || defined(__AVX512BW__))
#if defined(SLIMKV_BF16) && defined(__AVX512BF16__)
#define SLIMKV_ISA "avx512-bf16" /* bfloat16 logits by vdpbf16ps (decode_avx512.h) */
#else
#define SLIMKV_ISA "avx512"
#endif
#define SLIMKV_PATH_AVX512 1
#include "decode_avx512.h"
#elif !defined(SLIMKV_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#define SLIMKV_ISA "avx2"
#define SLIMKV_PATH_AVX2 1
#include "decode_avx2.h"
#else
#define SLIMKV_ISA "portable"
#endif

/* Which path this build runs: "avx512-bf16" (bfloat16 caches, AVX512-BF16 dot products), "avx512", "avx2" or
 * "portable" (what was compiled, not a guess). */
const char *slimkv_kernel_isa(void) { return SLIMKV_ISA; }

/* Work item i of a job: batch row b, heads [h, h + heads) of it; its first query row's head index
 * (b * kv_heads + h) is the item index the attend functions take. */
#define ITEM_SPAN(job, i, b, h, heads)                                                        \
    const int64_t b = (i) / (job)->parts, part_ = (i) % (job)->parts;                         \
    const int64_t h = (job)->kv_heads * part_ / (job)->parts;                                 \
    const int64_t heads = (job)->kv_heads * (part_ + 1) / (job)->parts - h;
#define DISPATCH_AVX512(ND, NV)                                                                                                  \
    if (!job->shared && job->dim == 16 * (ND) && job->v_dim == 16 * (NV)) {                                                    \
        for (int64_t i = job->first; i < job->last; i++)                                                                       \
            attend_item_avx512(i, job->out + i * job->groups * job->v_dim, job->segments, job->n_segments, i / job->kv_heads,   \
                               i % job->kv_heads, job->groups, (ND), (NV), job->scale, acc, run_max, run_sum);                  \
        goto done;                                                                                                             \
    }
#define DISPATCH_TILED(ATTEND)                                                                                                 \
    for (int64_t i = job->first; i < job->last; i++) {                                                                         \
        ITEM_SPAN(job, i, b, h, heads)                                                                                         \
        ATTEND(b * job->kv_heads + h, job->out + (b * job->kv_heads + h) * job->groups * job->v_dim, job->segments,             \
               job->n_segments, b, h, heads, job->groups, job->dim, job->v_dim, job->scale, acc, qs, logits, run_max, run_sum); \
    }                                                                                                                          \
    goto done;
#define DISPATCH(D, DV)                                                                                                        \
    if (job->dim == (D) && job->v_dim == (DV)) {                                                                               \
        for (int64_t i = job->first; i < job->last; i++) {                                                                     \
            ITEM_SPAN(job, i, b, h, heads)                                                                                     \
            attend_item(b * job->kv_heads + h, job->out + (b * job->kv_heads + h) * job->groups * (DV), job->segments,          \
                        job->n_segments, b, h, heads, job->groups, (D), (DV), job->scale, acc, run_max, run_sum, qs);           \
        }                                                                                                                      \
        goto done;                                                                                                             \
    }

static void *run_job(void *arg) {
    Job *job = (Job *)arg;
    const int64_t d_pad = (job->dim + 15) / 16 * 16, v_pad = (job->v_dim + 15) / 16 * 16; /* widths rounded up to 16-float chunks */
    const int64_t rows = (job->kv_heads + job->parts - 1) / job->parts * job->groups; /* query rows of the largest item */
    float *acc = malloc(sizeof(float) * (size_t)(rows * (v_pad + d_pad + BLOCK_KEYS + 2)));
    if (!acc) {
        job->status = 1;
        return NULL;
    }
    float *qs = acc + rows * v_pad;
    float *logits = qs + rows * d_pad;
    float *run_max = logits + rows * BLOCK_KEYS;
    float *run_sum = run_max + rows;
    (void)logits;
#if defined(SLIMKV_PATH_AVX512)
    DISPATCH_AVX512(4, 4)
    DISPATCH_AVX512(2, 2)
    DISPATCH_AVX512(8, 8)
    DISPATCH_TILED(attend_item_wide)
#elif defined(SLIMKV_PATH_AVX2)
#ifndef SLIMKV_BF16
    if (job->groups > 1 || job->shared) /* float32 heads of one query row (MHA) measured faster in attend_item here */
#endif
    {
        DISPATCH_TILED(attend_item_avx2)
    }
#endif
    DISPATCH(64, 64)
    DISPATCH(32, 32)
    DISPATCH(128, 128)
    for (int64_t i = job->first; i < job->last; i++) {
        ITEM_SPAN(job, i, b, h, heads)
        attend_item(b * job->kv_heads + h, job->out + (b * job->kv_heads + h) * job->groups * job->v_dim, job->segments, job->n_segments,
                    b, h, heads, job->groups, job->dim, job->v_dim, job->scale, acc, run_max, run_sum, qs);
    }
done:
    free(acc);
    job->status = 0;
    return NULL;
}

#include "decode_quantized.h"
#include "decode_linear.h"
#include "quantize_rows.h"

/* ``fields`` holds FIELDS integers per segment: the query, key and value pointers, the key count,
 * the keys' batch, head and row strides and the values' batch, head and row strides (in elements).
 * Returns 0 on success, 1 when memory or a thread could not be had, 2 on bad arguments. */
int ENTRY(const int64_t *fields, int n_segments, float *out, int64_t batch, int64_t kv_heads, int64_t groups,
                                int64_t dim, int64_t v_dim, float scale, int threads) {
    if (n_segments < 1 || n_segments > MAX_SEGMENTS || batch < 1 || kv_heads < 1 || groups < 1 || dim < 1 || v_dim < 1) return 2;
    Segment segments[MAX_SEGMENTS];
    int64_t total_keys = 0;
    for (int s = 0; s < n_segments; s++) {
        const int64_t *f = fields + FIELDS * s;
        segments[s] = (Segment){(const float *)(intptr_t)f[0], (const elem_t *)(intptr_t)f[1], (const elem_t *)(intptr_t)f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9]};
        total_keys += f[3];
    }
    if (total_keys < 1) return 2;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    /* Values shared by every head (value head stride 0 in every segment: the latent kind) are read
     * once per work item for all its heads: one item per batch row, or per share of the heads
     * when there are more threads than batch rows. Otherwise one item per (batch row, head). */
    int shared = kv_heads > 1;
    for (int s = 0; s < n_segments; s++) shared = shared && segments[s].v_stride_h == 0;
    int64_t parts = kv_heads;
    if (shared) {
        parts = (threads + batch - 1) / batch;
        if (parts > kv_heads) parts = kv_heads;
    }
    const int64_t items = batch * parts;
    if (threads > items) threads = (int)items;
    Job jobs[64];
    pthread_t ids[64];
    for (int t = 0; t < threads; t++)
        jobs[t] = (Job){out, segments, n_segments, kv_heads, groups, dim, v_dim, items * t / threads, items * (t + 1) / threads, parts, shared, scale, 1};
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[t], NULL, run_job, &jobs[t]) != 0) break;
        started = t;
    }
    for (int t = started + 1; t < threads; t++) run_job(&jobs[t]); /* threads that could not start: run here */
    run_job(&jobs[0]);
    int status = jobs[0].status;
    for (int t = 1; t <= started; t++) {
        pthread_join(ids[t], NULL);
        status |= jobs[t].status;
    }
    for (int t = started + 1; t < threads; t++) status |= jobs[t].status;
    return status;
}
