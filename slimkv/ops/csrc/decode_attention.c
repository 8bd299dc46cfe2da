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
 *   bfloat16 rows are widened 32 at a time into "pair order" (even and odd elements, one
 *   instruction per 16 floats; queries and accumulators kept in that order, outputs put back).
 *   "avx512-bf16" is that path for bfloat16 rows on a CPU with AVX512-BF16: quantized values
 *   rounded by its conversion, and, where TILE_DOT_BF16 (decode_avx512.h: AMD Zen, where it
 *   measured faster), the logits by its dot products in both tile kinds (slimkv_tile_logits says).
 *   "amx-bf16" is that path on a CPU with AMX-TILE and AMX-BF16 whose OS hands AMX out: the logits
 *   of query rows sharing a head (MLA, LRKV, and GQA / MQA heads of more rows than a row tile
 *   holds; decode_amx.h) by AMX tile products.
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
 * Prefetch: the chunk tiles (attend_item_wide, attend_item_avx2) read a block's rows several times
 * (once per row tile and chunk tile, in strips), which the hardware prefetcher does not follow
 * well; they prefetch the next block's rows in memory order, a share with every tile step, so the
 * memory is read evenly while the current block is computed (Ahead, below; segments of rows over
 * 256 bytes per key and over 1 MiB). The 32/64/128-wide row tiles read each row once, front to
 * back, and prefetch a fixed distance ahead (PREFETCH_BLOCKS; on AMD Zen only items of several
 * tiles, ROW_PREFETCH_ALWAYS in decode_avx512.h), and so do the AVX2 tiles for
 * narrower rows (NEAR_PREFETCH: without it an Intel Xeon's one-core read rate dropped 30% there).
 *
 * Threads: the (batch, kv_head) pairs are split over ``threads`` threads (1: the caller's; more:
 * torch's OpenMP team, threads.h).
 * When there are fewer pairs than threads (MQA, MLA, LRKV at batch 1) and enough keys, each pair's
 * keys are cut into ranges (key splits, as flash decoding does): each thread attends one range, and
 * the ranges' normalised outputs are merged by their softmax statistics (running max and sum).
 *
 * Quantized caches (int8 / int4 codes with per-group scales and minima, slimkv/ops/quantize.py)
 * have their own entry point, QUANTIZED_ENTRY (decode_quantized.h), which reads the codes in place;
 * PROJECT_ENTRY (decode_linear.h) is a decode step's projections: one row through the linear layers
 * that share it (NORM_ENTRY: the row's RMS norm; ROTATE_ENTRY: RoPE on its heads; SWIGLU_ENTRY: a
 * pre-norm SwiGLU block's second half);
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
#define PREFETCH_BLOCKS 2 /* software prefetch of the keys and values this many blocks ahead in the 32/64/128-wide row tiles (0: no software prefetch anywhere) */
#endif
#ifndef AHEAD_BLOCKS
#define AHEAD_BLOCKS 1 /* the chunk tiles (attend_item_wide, attend_item_avx2) prefetch the block this many blocks on (Ahead) */
#endif
#ifndef AHEAD_HINT
#define AHEAD_HINT 2 /* ... with this locality hint (__builtin_prefetch: 2 is prefetcht1, which measured better here than t0 for rows 2 KiB apart) */
#endif
#ifndef NEAR_PREFETCH
#define NEAR_PREFETCH 1 /* the AVX2 tiles prefetch rows Ahead leaves alone (narrow rows) PREFETCH_BLOCKS blocks ahead, key by key (0: not) */
#endif
#define MAX_SEGMENTS 4
#ifndef MIN_SPLIT_KEYS
#define MIN_SPLIT_KEYS 1024 /* a key split is at least this many keys (a shorter one costs more to start and merge than it saves) */
#endif
#define FIELDS 10 /* integers per segment in the entry point's ``fields`` */

/* The element type of the cached keys and values: float32, or bfloat16 when built with
 * -DSLIMKV_BF16 (the same source, a second library: slimkv/ops/native.py builds both). A bfloat16
 * is the top half of a float32, so widening is a 16-bit shift; every product and sum is float32. */
#ifdef SLIMKV_BF16
typedef uint16_t elem_t;
#define ENTRY slimkv_decode_attention_bf16
#define QUANTIZED_ENTRY slimkv_decode_quantized_bf16
#define PROJECT_ENTRY slimkv_decode_project_bf16
#define NORM_ENTRY slimkv_rms_norm_row_bf16
#define ROTATE_ENTRY slimkv_rotate_row_bf16
#define SWIGLU_ENTRY slimkv_swiglu_residual_bf16
#define BLOCK_ENTRY slimkv_decode_block_bf16
#define BLOCK_INPUT_ENTRY slimkv_block_input_bf16
#define BLOCK_OUTPUT_ENTRY slimkv_block_output_bf16
#define LATENT_INPUT_ENTRY slimkv_latent_input_bf16
#define QUANTIZE_ENTRY slimkv_quantize_rows_bf16
#define HEADS_ENTRY slimkv_heads_product_bf16
static inline float to_float(elem_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
/* x rounded to the nearest bfloat16, ties to even, a NaN kept a NaN (torch's float -> bfloat16 cast). */
static inline elem_t from_float(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (x != x) return (elem_t)0x7FC0u;
    return (elem_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
#else
typedef float elem_t;
#define ENTRY slimkv_decode_attention_f32
#define QUANTIZED_ENTRY slimkv_decode_quantized_f32
#define PROJECT_ENTRY slimkv_decode_project_f32
#define NORM_ENTRY slimkv_rms_norm_row_f32
#define ROTATE_ENTRY slimkv_rotate_row_f32
#define SWIGLU_ENTRY slimkv_swiglu_residual_f32
#define BLOCK_ENTRY slimkv_decode_block_f32
#define BLOCK_INPUT_ENTRY slimkv_block_input_f32
#define BLOCK_OUTPUT_ENTRY slimkv_block_output_f32
#define LATENT_INPUT_ENTRY slimkv_latent_input_f32
#define QUANTIZE_ENTRY slimkv_quantize_rows_f32
#define HEADS_ENTRY slimkv_heads_product_f32
static inline float to_float(elem_t x) { return x; }
static inline elem_t from_float(float x) { return x; }
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
    float *stats_max, *stats_sum; /* key splits: the item's softmax statistics per query row, kept for the merge (NULL: not split) */
} Job;

#include "threads.h"

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

/* The next block's rows, prefetched over the current block's work so that memory is read while the
 * current block is computed, not in bursts, and in the order it lies in memory: the block's key
 * rows as one range of bytes (every key head an item reads, ``k_head`` elements apart, and the
 * values too when they lie in the key rows, as MLA's and LRKV's [k | v] rows), then its value rows
 * as another. A tile doing w units of work per key calls ahead_step(a, w * a->per_unit) per key;
 * per_unit spreads the block's lines over its work (``units`` per key, ``keys`` keys), in 1/65536
 * of a line (integers: no vector register is taken from the tiles). Layouts whose rows hold much
 * that is not read take no prefetch (n 0). */
typedef struct {
    const char *k, *v;
    int64_t k_lines, total, pos; /* lines of the key range, of both, prefetched so far */
    int64_t per_unit, credit;
} Ahead;

static inline Ahead ahead_rows(const elem_t *k, const elem_t *v, int64_t n, int64_t k_row, int64_t v_row, int64_t k_head, int64_t heads,
                               int64_t dim, int64_t v_dim, int64_t units, int64_t keys) {
    Ahead a = {(const char *)k, (const char *)v, 0, 0, 0, 0, 0};
    if (n <= 0) return a;
    const int64_t e = (int64_t)sizeof(elem_t);
    const uintptr_t kp = (uintptr_t)k, vp = (uintptr_t)v;
    const int v_in_rows = v_row == k_row && vp >= kp && vp + (uintptr_t)(e * v_dim) <= kp + (uintptr_t)(e * k_row); /* values in the key rows' stride */
    const int64_t k_read = heads * dim + (v_in_rows ? v_dim : 0), k_span = (heads - 1) * k_head + dim;
    if (k_read * 4 < k_row * 3 || k_span > k_row || (!v_in_rows && v_dim * 4 < v_row * 3)) return a; /* rows mostly not read: no prefetch */
    a.k_lines = (e * ((n - 1) * k_row + (v_in_rows ? k_row : k_span)) + 63) / 64;
    a.total = a.k_lines + (v_in_rows ? 0 : (e * ((n - 1) * v_row + v_dim) + 63) / 64);
    a.per_unit = (a.total << 16) / (units * keys) + 1;
    return a;
}

/* Whether the tiled paths prefetch a segment's rows (Ahead): rows of more than AHEAD_MIN_ROW bytes
 * per key (narrower rows, e.g. 64-wide heads, are two plain streams the hardware prefetcher keeps
 * up with, and there the prefetch instructions only cost time: measured here), in segments of at
 * least AHEAD_MIN_BYTES (fewer stay in the caches from one step to the next). */
#ifndef AHEAD_MIN_ROW
#define AHEAD_MIN_ROW 256
#endif
#ifndef AHEAD_MIN_BYTES
#define AHEAD_MIN_BYTES (1 << 20)
#endif
static inline int ahead_pays(int64_t keys, int64_t heads, int64_t dim, int64_t v_dim) {
    const int64_t row = (int64_t)sizeof(elem_t) * (heads * dim + v_dim);
    return PREFETCH_BLOCKS > 0 && row > AHEAD_MIN_ROW && keys * row >= AHEAD_MIN_BYTES;
}

static inline __attribute__((always_inline)) void ahead_step(Ahead *a, int64_t lines) {
    if (a->pos >= a->total) return;
    a->credit += lines;
    while (a->credit >= 65536 && a->pos < a->total) {
        const char *p = a->pos < a->k_lines ? a->k + 64 * a->pos : a->v + 64 * (a->pos - a->k_lines);
        __builtin_prefetch(p, 0, AHEAD_HINT);
        a->credit -= 65536;
        a->pos++;
    }
}

/* Whether each value row lies inside its key row (MLA's latent rows): prefetching the key rows fetches the values too. */
static inline int values_in_key_rows(const elem_t *k, const elem_t *v, int64_t dim, int64_t v_dim, int64_t k_row, int64_t v_row) {
    const uintptr_t kp = (uintptr_t)k, vp = (uintptr_t)v;
    return k_row == v_row && vp >= kp && vp + sizeof(elem_t) * (size_t)v_dim <= kp + sizeof(elem_t) * (size_t)dim;
}

/* The instruction-set path, chosen at build time from the target's flags (-march=native: this
 * CPU's; slimkv/ops/native.py can build a named one). SLIMKV_PORTABLE forces the portable path. */
#if !defined(SLIMKV_PORTABLE) && defined(__AVX512F__) && (!defined(SLIMKV_BF16) || defined(__AVX512BW__))
#if defined(SLIMKV_BF16) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(SLIMKV_NO_AMX)
#define SLIMKV_ISA "amx-bf16" /* AMX logits for query rows sharing a head (decode_amx.h), the avx512-bf16 tiles for the rest */
#define SLIMKV_PATH_AMX 1
#elif defined(SLIMKV_BF16) && defined(__AVX512BF16__)
#define SLIMKV_ISA "avx512-bf16" /* AVX512-BF16 conversions and dot products (decode_avx512.h, decode_linear.h) */
#else
#define SLIMKV_ISA "avx512"
#endif
#define SLIMKV_PATH_AVX512 1
#include "decode_avx512.h" /* and decode_amx.h, where SLIMKV_PATH_AMX */
#elif !defined(SLIMKV_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#define SLIMKV_ISA "avx2"
#define SLIMKV_PATH_AVX2 1
#include "decode_avx2.h"
#else
#define SLIMKV_ISA "portable"
#endif

/* Which path this build runs: "amx-bf16" (bfloat16 caches, AMX logits; "avx512-bf16" where the OS refuses AMX),
 * "avx512-bf16" (bfloat16 caches, AVX512-BF16 instructions), "avx512", "avx2" or "portable" (what was compiled, not a guess). */
const char *slimkv_kernel_isa(void) {
#ifdef SLIMKV_PATH_AMX
    if (!amx_ready()) return "avx512-bf16"; /* built with AMX, refused it by the OS: every item takes the AVX-512 tiles */
#endif
    return SLIMKV_ISA;
}

/* How the attention tiles compute a bfloat16 cache's logits (TILE_DOT_BF16 in decode_avx512.h):
 * "vdpbf16ps" (AVX512-BF16 dot products on the stored keys) or "widened fma" (keys widened to
 * float32, fused multiply-adds); "" in float32 builds and on paths without such tiles' choice. */
const char *slimkv_tile_logits(void) {
#if defined(SLIMKV_PATH_AVX512) && defined(SLIMKV_BF16)
    return TILE_DOT_BF16 ? "vdpbf16ps" : "widened fma";
#else
    return "";
#endif
}

/* The AVX-512 row tiles' prefetch rule this build took (ROW_PREFETCH_ALWAYS in decode_avx512.h):
 * "always", "several-tiles", or "" where the path has no such tiles. */
const char *slimkv_row_prefetch_rule(void) {
#if defined(SLIMKV_PATH_AVX512)
    return PREFETCH_BLOCKS == 0 ? "none" : ROW_PREFETCH_ALWAYS ? "always" : "several-tiles";
#else
    return "";
#endif
}

/* Work item i of a job: batch row b, heads [h, h + heads) of it; its first query row's head index
 * (b * kv_heads + h) is the item index the attend functions take. */
#define ITEM_SPAN(job, i, b, h, heads)                                                        \
    const int64_t b = (i) / (job)->parts, part_ = (i) % (job)->parts;                         \
    const int64_t h = (job)->kv_heads * part_ / (job)->parts;                                 \
    const int64_t heads = (job)->kv_heads * (part_ + 1) / (job)->parts - h;
/* Whether a job's items take the row tiles (DISPATCH_AVX512's widths: 32, 64 or 128, keys and values alike). */
static inline int row_tiles_take(const Job *job) {
    return !job->shared && job->dim == job->v_dim && (job->dim == 32 || job->dim == 64 || job->dim == 128);
}
#define DISPATCH_AVX512(ND, NV)                                                                                                  \
    if (!job->shared && job->dim == 16 * (ND) && job->v_dim == 16 * (NV)) {                                                    \
        for (int64_t i = job->first; i < job->last; i++)                                                                       \
            attend_item_avx512(i, job->out + i * job->groups * job->v_dim, job->segments, job->n_segments, i / job->kv_heads,   \
                               i % job->kv_heads, job->groups, (ND), (NV), job->scale, acc, run_max, run_sum, logits, amx);      \
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
    const int64_t d_pad = (job->dim + 31) / 32 * 32, v_pad = (job->v_dim + 31) / 32 * 32; /* widths rounded up to 32-element chunks */
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
#if defined(SLIMKV_PATH_AMX)
    AmxQueries amx_scratch, *amx = NULL; /* AMX logits for this job's items (decode_amx.h); the row tiles' widths only past one tile of rows */
    if (amx_takes(job->shared, job->groups, job->dim) && (!row_tiles_take(job) || job->groups > row_tile_avx512((int)(job->v_dim / 16)))) {
        if (!amx_open(&amx_scratch, job->groups, job->dim)) {
            free(acc);
            job->status = 1;
            return NULL;
        }
        amx = &amx_scratch;
    }
#else
    AmxQueries *amx = NULL;
#endif
    DISPATCH_AVX512(4, 4)
    DISPATCH_AVX512(2, 2)
    DISPATCH_AVX512(8, 8)
#define ATTEND_WIDE(...) attend_item_wide(__VA_ARGS__, amx) /* the wide tiles, their logits by AMX where amx is set */
    DISPATCH_TILED(ATTEND_WIDE)
#undef ATTEND_WIDE
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
#if defined(SLIMKV_PATH_AMX)
    if (amx) amx_close(amx);
#endif
    if (job->stats_max) { /* a key split runs one item: keep its rows' statistics */
        ITEM_SPAN(job, job->first, b, h, heads)
        const int64_t base = (b * job->kv_heads + h) * job->groups;
        memcpy(job->stats_max + base, run_max, sizeof(float) * (size_t)(heads * job->groups));
        memcpy(job->stats_sum + base, run_sum, sizeof(float) * (size_t)(heads * job->groups));
    }
    free(acc);
    job->status = 0;
    return NULL;
}

/* Key splits' merge: ``out`` holds range 0's normalised rows, ``ranges`` the other ranges' (``rows``
 * rows of ``v_dim`` each, range j at (j - 1) * rows * v_dim), ``stats`` each range's softmax maximum
 * (at 2j * rows) and sum (at (2j + 1) * rows) per row. Each output row becomes the ranges' rows
 * weighted by their share of the whole softmax: s_j exp(m_j - M) over the same summed over j. */
static void merge_key_splits(float *out, const float *ranges, const float *stats, int64_t rows, int64_t v_dim, int64_t splits) {
    for (int64_t r = 0; r < rows; r++) {
        float top = -INFINITY, weights[64], total = 0.0f;
        for (int64_t j = 0; j < splits; j++) top = stats[2 * j * rows + r] > top ? stats[2 * j * rows + r] : top;
        for (int64_t j = 0; j < splits; j++) {
            weights[j] = stats[(2 * j + 1) * rows + r] * exp_nonpositive(stats[2 * j * rows + r] - top);
            total += weights[j];
        }
        float *row = out + r * v_dim;
        for (int64_t e = 0; e < v_dim; e++) row[e] *= weights[0] / total;
        for (int64_t j = 1; j < splits; j++) {
            const float w = weights[j] / total, *from = ranges + (j - 1) * rows * v_dim + r * v_dim;
            for (int64_t e = 0; e < v_dim; e++) row[e] += w * from[e];
        }
    }
}

/* How many ranges to cut each item's keys into: the count s whose (range, item) jobs, shared out over
 * the threads in equal numbers where they can be, finish first (ceil(items * s / threads) / s items'
 * work per thread), the smallest such s; each range at least MIN_SPLIT_KEYS keys, at most 64 jobs.
 * One per idle thread per item when the items divide the threads; 2 for 3 heads on 2 threads (one
 * thread would otherwise take two heads, the other one); 1 (no split) when cutting gains nothing. */
static inline int64_t key_splits(int threads, int64_t items, int64_t total_keys) {
    int64_t most = total_keys / MIN_SPLIT_KEYS;
    if (most > 64 / items) most = 64 / items;
    int64_t best = 1, best_per_thread = (items + threads - 1) / threads; /* jobs per thread (s = 1) */
    for (int64_t s = 2; s <= most; s++) {
        const int64_t per_thread = (items * s + threads - 1) / threads;
        if (per_thread * best < best_per_thread * s) best = s, best_per_thread = per_thread;
    }
    return best;
}

/* Range j of ``splits`` over ``total_keys`` keys read as one: keys [lo, hi), cut on BLOCK_KEYS. */
static inline void split_range(int64_t total_keys, int64_t splits, int64_t j, int64_t *lo, int64_t *hi) {
    *lo = total_keys * j / splits / BLOCK_KEYS * BLOCK_KEYS;
    *hi = j + 1 == splits ? total_keys : total_keys * (j + 1) / splits / BLOCK_KEYS * BLOCK_KEYS;
}

#include "decode_quantized.h"
#include "decode_linear.h"

/* How far ahead the linear rows prefetch their weights, in bytes (LINEAR_PREFETCH_BYTES in
 * decode_linear.h; 0: the hardware prefetchers alone). */
int slimkv_linear_prefetch_bytes(void) { return LINEAR_PREFETCH_BYTES; }

#include "decode_block.h"
#include "quantize_rows.h"

/* Runs ``jobs[0..count)`` on at most ``threads`` threads (``run_on_threads``); returns their statuses or-ed. */
static int run_jobs(Job *jobs, int count, int threads) {
    run_on_threads(run_job, jobs, sizeof *jobs, count, threads);
    int status = 0;
    for (int t = 0; t < count; t++) status |= jobs[t].status;
    return status;
}

/* Key splits: ``splits`` ranges of every item's keys (the segments read as one), one job per (range,
 * item), on ``threads`` threads; range 0 writes ``out``, the others scratch copies of it, merged by merge_key_splits. */
static int split_keys(const Segment *segments, int n_segments, int64_t total_keys, float *out, int64_t batch, int64_t kv_heads,
                      int64_t groups, int64_t dim, int64_t v_dim, float scale, int64_t items, int64_t parts, int shared, int64_t splits,
                      int threads) {
    const int64_t rows = batch * kv_heads * groups;
    float *scratch = malloc(sizeof(float) * (size_t)((splits - 1) * rows * v_dim + 2 * splits * rows));
    if (!scratch) return 1;
    float *stats = scratch + (splits - 1) * rows * v_dim; /* range j: its rows' maxima at 2j * rows, their sums at (2j + 1) * rows */
    Segment ranges[64][MAX_SEGMENTS];
    Job jobs[64];
    int n_jobs = 0;
    for (int64_t j = 0; j < splits; j++) {
        int64_t lo, hi;
        split_range(total_keys, splits, j, &lo, &hi);
        int n = 0;
        int64_t start = 0; /* segment s's first key among the keys read as one */
        for (int s = 0; s < n_segments; start += segments[s].keys, s++) {
            const int64_t from = lo > start ? lo - start : 0, to = hi < start + segments[s].keys ? hi - start : segments[s].keys;
            if (to <= from) continue;
            Segment seg = segments[s];
            seg.k += from * seg.k_stride_t;
            seg.v += from * seg.v_stride_t;
            seg.keys = to - from;
            ranges[j][n++] = seg;
        }
        float *range_out = j == 0 ? out : scratch + (j - 1) * rows * v_dim;
        for (int64_t i = 0; i < items; i++)
            jobs[n_jobs++] = (Job){range_out, ranges[j], n, kv_heads, groups, dim, v_dim, i, i + 1, parts, shared, scale, 1,
                                   stats + 2 * j * rows, stats + (2 * j + 1) * rows};
    }
    const int status = run_jobs(jobs, n_jobs, threads);
    if (status == 0) merge_key_splits(out, scratch, stats, rows, v_dim, splits);
    free(scratch);
    return status;
}

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
    const int64_t splits = key_splits(threads, items, total_keys);
    if (splits > 1) return split_keys(segments, n_segments, total_keys, out, batch, kv_heads, groups, dim, v_dim, scale, items, parts, shared, splits, threads);
    if (threads > items) threads = (int)items;
    Job jobs[64];
    for (int t = 0; t < threads; t++)
        jobs[t] = (Job){out, segments, n_segments, kv_heads, groups, dim, v_dim, items * t / threads, items * (t + 1) / threads, parts, shared, scale, 1, NULL, NULL};
    return run_jobs(jobs, threads, threads);
}
