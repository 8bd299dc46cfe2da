/* slimkv's decode kernel, AVX-512 path (included by decode_attention.c when the build targets
 * AVX-512F, and AVX-512BW for bfloat16): register tiles holding whole rows of width 32/64/128
 * (block_rows_avx512: MHA, GQA, MQA, KVM regions), and tiles over 16-float chunks for any other
 * width and any number of query rows (attend_item_wide: MLA's latent rows, LRKV's rows), which
 * prefetch the next block's rows a share per tile step (Ahead in decode_attention.c).
 *
 * bfloat16 rows: widened 32 elements at a time into pair order (load32_pair: the even elements by
 * a shift, the odd by a mask, one instruction per 16 floats where widening in row order takes
 * two); the tiles' queries and accumulators are kept in that order and the output is put back in
 * row order at the end (unpair_row). With AVX512-BF16 on CPUs where it is faster (TILE_DOT_BF16,
 * below) the logits are vdpbf16ps dot products of the bfloat16 queries and the keys as stored, in
 * every tile; the values keep float32 products (the dot instruction would round the probabilities
 * to bfloat16). */
#include <immintrin.h>

/* Software prefetch in the 32/64/128-wide row tiles (block_rows_avx512), PREFETCH_BLOCKS blocks ahead.
 * ROW_PREFETCH_ALWAYS 1: every tile prefetches into L1 (measured on an Intel Xeon, where these tiles
 * then read at 0.96 of its read rate for MHA). 0: only items whose rows take several tiles per block
 * (MQA's 8 rows: two passes over each block, which the hardware prefetcher does not follow), into
 * L2; the tiles of an item that takes one pass leave it to the hardware prefetcher. Measured on an
 * AMD Zen 4 (its AVX-512 on 256-bit units), one thread, 32K keys, float32 / bfloat16: prefetching
 * into L1 in every tile cost MHA, GQA and SmolLM2's 3 x 3 layout 1.3-1.5x of their step time, and
 * leaving MQA's to the hardware cost it 1.2-1.4x (benchmarks/decode_prefetch.py). AMD Zen builds
 * (-march=native says so) take 0. */
#ifndef ROW_PREFETCH_ALWAYS
#if defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
#define ROW_PREFETCH_ALWAYS 0
#else
#define ROW_PREFETCH_ALWAYS 1
#endif
#endif
#define ROW_HINT (ROW_PREFETCH_ALWAYS ? _MM_HINT_T0 : _MM_HINT_T1)

/* The attention tiles' logits over a bfloat16 cache on a CPU with AVX512-BF16. TILE_DOT_BF16 1:
 * vdpbf16ps dot products of the bfloat16 queries and the keys as stored; 0: the keys widened into
 * float32 pair order (load32_pair) and fused multiply-adds, as on AVX-512 without BF16. Both give
 * float32 products and sums. Measured on one layer of 8 x 64 heads at 32K, one thread
 * (benchmarks/decode_native.py --layers, the avx512-bf16 column against avx512): on an AMD Zen 4
 * the dot products took 0.78-0.87x the widened tiles' time for GQA, MQA, hybrid, MLA and LRKV
 * (decode_roofline_layer.md), on an Intel Xeon (Emerald Rapids) 1.09-1.19x
 * (decode_roofline_layer_xeon_bfloat16_1thread.md; 1.06-1.23x in the session A/B of 2026-12-06,
 * SmolLM2's layer, MHA, MLA's and odd-width rows). AMD Zen builds with AVX512-BF16 take 1, others 0.
 * The rounding of quantized values (code_row_avx512) and the linear rows (decode_linear.h, 1.3x
 * faster by vdpbf16ps on that Xeon) use AVX512-BF16 wherever it is. */
#ifndef TILE_DOT_BF16
#if defined(__AVX512BF16__) && (defined(__znver4__) || defined(__znver5__))
#define TILE_DOT_BF16 1
#else
#define TILE_DOT_BF16 0
#endif
#endif
#if TILE_DOT_BF16 && !defined(__AVX512BF16__)
#error "TILE_DOT_BF16 1 needs AVX512-BF16"
#endif

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

/* Horizontal sums of R (1 to 4) vectors: sums[i] = sum of the lanes of v[i]. */
static inline __attribute__((always_inline)) void horizontal_sums(const __m512 *v, const int R, float *sums) {
    if (R == 1) {
        sums[0] = _mm512_reduce_add_ps(v[0]);
        return;
    }
    const __m512 zero = _mm512_setzero_ps();
    const __m512 a = v[0], b = v[1], c = R >= 3 ? v[2] : zero, d = R == 4 ? v[3] : zero;
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* per 128-bit lane: a02 b02 a13 b13 */
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 halves = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512 total = _mm512_add_ps(halves, _mm512_shuffle_f32x4(halves, halves, _MM_SHUFFLE(2, 3, 0, 1)));
    float lanes[16] __attribute__((aligned(64)));
    _mm512_store_ps(lanes, total);
    for (int i = 0; i < R; i++) sums[i] = lanes[i];
}

#ifdef SLIMKV_BF16
/* 32 bfloat16 as two float32 vectors, one instruction each: the even elements (0, 2, .., 30: the
 * low halves of the 32-bit lanes, shifted up) and the odd ones (the high halves, masked). Tiles
 * keep rows in this order, chunk by chunk of 32 (``pair order``); rows are put back at the end. */
static inline void load32_pair(const elem_t *p, __m512 *even, __m512 *odd) {
    const __m512i x = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
}
/* The first ``left`` (1..32) of 32 bfloat16 at p in pair order, zero past them; nothing read past them. */
static inline void load32_pair_partial(const elem_t *p, int64_t left, __m512 *even, __m512 *odd) {
    const __m512i x = _mm512_maskz_loadu_epi16((__mmask32)(left >= 32 ? 0xFFFFFFFFu : (1u << left) - 1u), p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
}
/* 32 floats (a: 0..15, b: 16..31) in pair order: the even ones, the odd ones. */
static inline void pair_order(__m512 a, __m512 b, __m512 *even, __m512 *odd) {
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    *even = _mm512_permutex2var_ps(a, ie, b);
    *odd = _mm512_permutex2var_ps(a, io, b);
}
/* A row of ``width`` floats kept in pair order (chunks of 32, the last one padded), back in row order. */
static inline void unpair_row(const float *restrict pairs, float *restrict row, int64_t width, float factor) {
    for (int64_t e = 0; e < width; e++) {
        const int64_t c = e / 32, m = e % 32;
        row[e] = pairs[32 * c + (m % 2) * 16 + m / 2] * factor;
    }
}
#endif

/* A block of int4 / int8 cache codes (csrc/decode_quantized.h's storage) that the row tiles read in
 * place: each key's and value's codes, one scale and one minimum per group as float32 (a bfloat16
 * cache's widened once per block: block_scales), strides per row. */
typedef struct {
    const uint8_t *k, *v;           /* the block's first key's and first value's codes */
    const float *ks, *kl, *vs, *vl; /* their groups' scales and minima */
    int64_t k_row, v_row;           /* bytes from one row's codes to the next */
    int64_t ks_row, kl_row, vs_row, vl_row; /* floats from one row's scales (minima) to the next */
} CodeBlock;

/* The scales (or minima) of a block's n rows, ``per_row`` each, ``row`` elements apart, as
 * float32 for CodeBlock: a float32 cache's own (``*stride`` = row), a bfloat16 cache's widened
 * into ``dst`` (``*stride`` = per_row; exact), so a row reads its scale as one broadcast. */
static inline const float *block_scales(const elem_t *src, int64_t row, int n, int per_row, float *restrict dst, int64_t *stride) {
#ifdef SLIMKV_BF16
    if (row == per_row) {
        for (int i = 0; i < n * per_row; i++) dst[i] = to_float(src[i]);
    } else {
        for (int t = 0; t < n; t++)
            for (int g = 0; g < per_row; g++) dst[t * per_row + g] = to_float(src[t * row + g]);
    }
    *stride = per_row;
    return dst;
#else
    (void)n, (void)per_row, (void)dst;
    *stride = row;
    return src;
#endif
}

/* 16 floats rounded to the nearest bfloat16 (ties to even), still as floats: the dequantized
 * value as a bfloat16 cache holds it (quantize.dequantize_groups rounds it so), by AVX512-BF16's
 * conversion where there is one, else by integer arithmetic. */
#ifdef SLIMKV_BF16
static inline __m512 round_to_bf16(__m512 x) {
#ifdef __AVX512BF16__
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
#else
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))),
                                                _mm512_set1_epi32((int)0xFFFF0000u)));
#endif
}
#endif

/* One side's row of int4 codes as N 16-float chunks, in pair order (``pairs`` 1) or row order (0),
 * by table: a group's 16 possible values c * s + m (c = 0 .. 15, one fused multiply-add each, as
 * a code-by-code dequantization computes them; rounded to bfloat16 when ``round`` is set, as a
 * bfloat16 cache holds them) are made once per 32 channels, and each code picks its value by a
 * permute that reads only the low 4 bits of its lane: no conversion or multiply-add per channel.
 * Pair order's even channels are the bytes' low nibbles as they come, its odd ones the bytes
 * shifted by 4; row order interleaves the bytes with themselves shifted by 4 first. */
static inline __attribute__((always_inline)) void int4_row_avx512(const uint8_t *restrict codes, const float *restrict scales,
                                                                   const float *restrict lows, const int N, const int group, const int pairs,
                                                                   const int round, __m512 *out) {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int j = 0; j < N; j += 2) {
        __m512 table = _mm512_fmadd_ps(levels, _mm512_set1_ps(scales[16 * j / group]), _mm512_set1_ps(lows[16 * j / group]));
#ifdef SLIMKV_BF16
        if (round) table = round_to_bf16(table);
#else
        (void)round;
#endif
        const __m128i x = _mm_loadu_si128((const __m128i *)(codes + 8 * j));
        __m512i a, b; /* each lane's code in its low 4 bits */
        if (pairs) {
            a = _mm512_cvtepu8_epi32(x);
            b = _mm512_srli_epi32(a, 4);
        } else {
            const __m128i shifted = _mm_srli_epi16(x, 4);
            a = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(x, shifted));
            b = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(x, shifted));
        }
        out[j] = _mm512_permutexvar_ps(a, table);
        out[j + 1] = _mm512_permutexvar_ps(b, table);
    }
}

/* One side's row of a code block as N 16-float chunks, in pair order (``pairs`` 1) or row order
 * (0): code * scale + minimum in float32, one fused multiply-add (code_row_avx512 rounds it as the
 * cache's element type holds it). ``group`` is 32 or 64, so each 32 channels share one scale.
 * int4 by table (int4_row_avx512); int8's even and odd bytes come apart by a mask and a shift of
 * 16-bit lanes. */
static inline __attribute__((always_inline)) void code_row_float_avx512(const uint8_t *restrict codes, const float *restrict scales,
                                                                         const float *restrict lows, const int N, const int bits, const int group,
                                                                         const int pairs, __m512 *out) {
    if (bits == 4) {
        int4_row_avx512(codes, scales, lows, N, group, pairs, 0, out);
        return;
    }
    for (int j = 0; j < N; j += 2) {
        const __m512 s = _mm512_set1_ps(scales[16 * j / group]), m = _mm512_set1_ps(lows[16 * j / group]);
        __m512i a, b; /* the 32 channels' codes as 32-bit integers, in the order asked for */
        if (pairs) {
            const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(codes + 16 * j)));
            a = _mm512_and_si512(w, _mm512_set1_epi32(255));
            b = _mm512_srli_epi32(w, 8);
        } else {
            a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16 * j)));
            b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16 * j + 16)));
        }
        out[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), s, m);
        out[j + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), s, m);
    }
}

/* code_row_float_avx512 in the tiles' order (pair order in bfloat16 builds, row order in float32
 * ones), each value as the cache's element type holds it: bfloat16 builds round to the nearest
 * bfloat16, int4 rows their tables (int4_row_avx512), int8 rows every value: with AVX512-BF16
 * dequantized in row order and rounded 32 values at a time by one conversion, then widened into
 * pair order as load32_pair widens a stored row. */
static inline __attribute__((always_inline)) void code_row_avx512(const uint8_t *restrict codes, const float *restrict scales,
                                                                   const float *restrict lows, const int N, const int bits, const int group,
                                                                   __m512 *out) {
#if defined(SLIMKV_BF16)
    if (bits == 4) {
        int4_row_avx512(codes, scales, lows, N, group, 1, 1, out);
        return;
    }
#endif
#if defined(SLIMKV_BF16) && defined(__AVX512BF16__)
    code_row_float_avx512(codes, scales, lows, N, bits, group, 0, out);
    for (int j = 0; j < N; j += 2) {
        const __m512i x = (__m512i)_mm512_cvtne2ps_pbh(out[j + 1], out[j]);
        out[j] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        out[j + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
    }
#elif defined(SLIMKV_BF16)
    code_row_float_avx512(codes, scales, lows, N, bits, group, 1, out);
    for (int j = 0; j < N; j++) out[j] = round_to_bf16(out[j]);
#else
    code_row_float_avx512(codes, scales, lows, N, bits, group, 0, out);
#endif
}

#ifdef SLIMKV_PATH_AMX
#include "decode_amx.h"
#else
typedef struct AmxQueries AmxQueries; /* no AMX in this build: the tiles always get NULL */
#endif

/* The online-softmax update of R query rows for one block of n keys and their values: ``logits``
 * holds the rows' scaled logits (BLOCK_KEYS apart; overwritten by the
 * probabilities), acc / run_max / run_sum the rows' running state (v_dim = 16 * NV floats a row).
 * Each value vector is loaded once for the R rows, whose accumulators stay in registers. ``fetch``,
 * ``codes``: as block_rows_avx512. */
#define VALUE_ROWS_MAX 6
static inline __attribute__((always_inline)) void softmax_values_avx512(float *restrict logits, const elem_t *restrict vb, int64_t v_row, int n,
                                                                         const int R, const int NV, int fetch, const CodeBlock *codes, const int bits,
                                                                         const int group, float *restrict acc, float *restrict run_max,
                                                                         float *restrict run_sum) {
    __m512 av[VALUE_ROWS_MAX][8];
    for (int i = 0; i < R; i++) {
        for (int t = n; t < BLOCK_KEYS; t++) logits[i * BLOCK_KEYS + t] = -INFINITY;
        __m512 m16 = _mm512_loadu_ps(logits + i * BLOCK_KEYS);
        for (int t = 16; t < BLOCK_KEYS; t += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(logits + i * BLOCK_KEYS + t));
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
            const __m512 p = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(logits + i * BLOCK_KEYS + t), m));
            _mm512_storeu_ps(logits + i * BLOCK_KEYS + t, p);
            sum16 = _mm512_add_ps(sum16, p);
        }
        run_sum[i] += _mm512_reduce_add_ps(sum16);
    }
    for (int t = 0; t < n; t++) {
        const elem_t *vt = vb + t * v_row;
        __m512 vv[8];
        if (codes) {
            if (PREFETCH_BLOCKS > 0) _mm_prefetch((const char *)(codes->v + (t + PREFETCH_BLOCKS * BLOCK_KEYS) * codes->v_row), _MM_HINT_T0);
            code_row_avx512(codes->v + t * codes->v_row, codes->vs + t * codes->vs_row, codes->vl + t * codes->vl_row, NV, bits, group, vv);
        } else {
            if (PREFETCH_BLOCKS > 0 && fetch)
                for (int j = 0; j < NV * (int)sizeof(elem_t) / 4; j++) _mm_prefetch((const char *)(vt + PREFETCH_BLOCKS * BLOCK_KEYS * v_row) + 64 * j, ROW_HINT);
#ifdef SLIMKV_BF16
            for (int j = 0; j < NV; j += 2) load32_pair(vt + 16 * j, &vv[j], &vv[j + 1]);
#else
            for (int j = 0; j < NV; j++) vv[j] = load16(vt + 16 * j);
#endif
        }
        for (int i = 0; i < R; i++) {
            const __m512 p = _mm512_set1_ps(logits[i * BLOCK_KEYS + t]);
            for (int j = 0; j < NV; j++) av[i][j] = _mm512_fmadd_ps(p, vv[j], av[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(acc + i * 16 * NV + 16 * j, av[i][j]);
}

/* R query rows (g0 .. g0 + R - 1 of one item) against one block of n keys, with AVX-512, for
 * dim = 16 * ND and v_dim = 16 * NV: each key and value vector is loaded once for the R rows, the
 * R accumulators stay in registers. Same arithmetic as attend_item. bfloat16 rows are widened 32
 * at a time into pair order (load32_pair; the accumulators hold their values in that order), and
 * with TILE_DOT_BF16 the logits are dot products of the bfloat16 query (exact: the queries of a
 * bfloat16 cache come from bfloat16 tensors) and the keys as stored, the scale applied to the sums.
 * ``fetch``: prefetch the rows PREFETCH_BLOCKS blocks ahead (ROW_PREFETCH_ALWAYS). ``codes`` (NULL
 * for rows): read the block from int4 / int8 codes of ``bits`` and ``group`` instead of kb and vb,
 * dequantized in registers to the values the cache's own dequantization gives
 * (code_row_avx512), each code row prefetched PREFETCH_BLOCKS blocks ahead. The softmax and the
 * values: softmax_values_avx512. */
static inline __attribute__((always_inline)) void block_rows_avx512(const float *restrict q, const elem_t *restrict kb, const elem_t *restrict vb,
                                                                     int64_t k_row, int64_t v_row, int n, const int R, const int ND, const int NV, __m512 scale16, int fetch,
                                                                     const CodeBlock *codes, const int bits, const int group,
                                                                     float *restrict acc, float *restrict run_max, float *restrict run_sum) {
    float logits[4][BLOCK_KEYS] __attribute__((aligned(64)));
#if defined(SLIMKV_BF16) && TILE_DOT_BF16
    __m512i qv[4][4]; /* bfloat16 pairs: 32 channels per vector (in pair order for codes, as code_row_avx512 gives the keys) */
    for (int i = 0; i < R; i++)
        for (int j = 0; j < ND / 2; j++) {
            __m512 lo = _mm512_loadu_ps(q + i * 16 * ND + 32 * j), hi = _mm512_loadu_ps(q + i * 16 * ND + 32 * j + 16);
            if (codes) pair_order(lo, hi, &lo, &hi);
            qv[i][j] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        }
#else
    __m512 qv[4][8];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < ND; j++) qv[i][j] = _mm512_mul_ps(_mm512_loadu_ps(q + i * 16 * ND + 16 * j), scale16);
#ifdef SLIMKV_BF16
    for (int i = 0; i < R; i++) /* pair order, as the keys are widened */
        for (int j = 0; j < ND; j += 2) pair_order(qv[i][j], qv[i][j + 1], &qv[i][j], &qv[i][j + 1]);
#endif
#endif
    for (int t = 0; t < n; t++) {
        const elem_t *kt = kb + t * k_row;
        if (codes) {
            if (PREFETCH_BLOCKS > 0) _mm_prefetch((const char *)(codes->k + (t + PREFETCH_BLOCKS * BLOCK_KEYS) * codes->k_row), _MM_HINT_T0);
        } else if (PREFETCH_BLOCKS > 0 && fetch) {
            for (int j = 0; j < ND * (int)sizeof(elem_t) / 4; j++) _mm_prefetch((const char *)(kt + PREFETCH_BLOCKS * BLOCK_KEYS * k_row) + 64 * j, ROW_HINT);
        }
        __m512 dots[4];
#if defined(SLIMKV_BF16) && TILE_DOT_BF16
        __m512i kr[4];
        if (codes) {
            __m512 kf[8]; /* rounded to bfloat16 by the conversion, as code_row_avx512 would */
            code_row_float_avx512(codes->k + t * codes->k_row, codes->ks + t * codes->ks_row, codes->kl + t * codes->kl_row, ND, bits, group, 1, kf);
            for (int j = 0; j < ND / 2; j++) kr[j] = (__m512i)_mm512_cvtne2ps_pbh(kf[2 * j + 1], kf[2 * j]);
        } else {
            for (int j = 0; j < ND / 2; j++) kr[j] = _mm512_loadu_si512(kt + 32 * j);
        }
        for (int i = 0; i < R; i++) {
            dots[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qv[i][0], (__m512bh)kr[0]);
            for (int j = 1; j < ND / 2; j++) dots[i] = _mm512_dpbf16_ps(dots[i], (__m512bh)qv[i][j], (__m512bh)kr[j]);
        }
#else
        __m512 kv[8];
        if (codes) {
            code_row_avx512(codes->k + t * codes->k_row, codes->ks + t * codes->ks_row, codes->kl + t * codes->kl_row, ND, bits, group, kv);
        } else {
#ifdef SLIMKV_BF16
            for (int j = 0; j < ND; j += 2) load32_pair(kt + 16 * j, &kv[j], &kv[j + 1]);
#else
            for (int j = 0; j < ND; j++) kv[j] = load16(kt + 16 * j);
#endif
        }
        for (int i = 0; i < R; i++) {
            dots[i] = _mm512_mul_ps(qv[i][0], kv[0]);
            for (int j = 1; j < ND; j++) dots[i] = _mm512_fmadd_ps(qv[i][j], kv[j], dots[i]);
        }
#endif
        float sums[4];
        horizontal_sums(dots, R, sums);
        for (int i = 0; i < R; i++) logits[i][t] = sums[i];
    }
#if defined(SLIMKV_BF16) && TILE_DOT_BF16
    const float post = _mm512_cvtss_f32(scale16); /* the scale, on the sums */
    for (int i = 0; i < R; i++)
        for (int t = 0; t < n; t++) logits[i][t] *= post;
#endif
    softmax_values_avx512(logits[0], vb, v_row, n, R, NV, fetch, codes, bits, group, acc, run_max, run_sum);
}

/* The most rows a tile of block_rows_avx512 holds for v_dim 16 * NV, and of softmax_values_avx512
 * alone (the logits given: no query or key registers). */
static inline int row_tile_avx512(const int NV) { return NV > 4 ? 2 : 4; }
static inline int value_tile_avx512(const int NV) { return NV > 4 ? 3 : VALUE_ROWS_MAX; }

/* Every one of an item's ``groups`` query rows against one block of n keys (block_rows_avx512), in the
 * fewest tiles of at most row_tile_avx512 rows, evenly filled: 3 rows are one tile of 3 (each
 * block's keys read once), 6 two of 3. ``codes``: the block is int4 / int8 codes (block_rows_avx512).
 * ``given`` (NULL: none): every row's scaled logits of the block, BLOCK_KEYS apart (amx_logits took
 * them; overwritten): the tiles are softmax_values_avx512's alone, of at most value_tile_avx512 rows. */
static inline __attribute__((always_inline)) void rows_in_tiles_avx512(const float *restrict q, const elem_t *restrict kb, const elem_t *restrict vb,
                                                                        int64_t k_row, int64_t v_row, int n, int64_t groups, const int ND,
                                                                        const int NV, __m512 scale16, int fetch, const CodeBlock *codes,
                                                                        const int bits, const int group, float *restrict given,
                                                                        float *restrict acc, float *restrict run_max, float *restrict run_sum) {
    const int64_t dim = 16 * ND, v_dim = 16 * NV;
    const int tile = given ? value_tile_avx512(NV) : row_tile_avx512(NV);
    for (int64_t g = 0; g < groups;) {
        const int64_t left = groups - g, tiles = (left + tile - 1) / tile;
        const int rows = (int)((left + tiles - 1) / tiles);
#define ROWS_AVX512(R)                                                                                                                            \
    if (given)                                                                                                                                    \
        softmax_values_avx512(given + g * BLOCK_KEYS, vb, v_row, n, (R), NV, fetch, codes, bits, group, acc + g * v_dim, run_max + g, run_sum + g); \
    else if ((R) <= 4)                                                                                                                            \
        block_rows_avx512(q + g * dim, kb, vb, k_row, v_row, n, (R) <= 4 ? (R) : 4, ND, NV, scale16, fetch, codes, bits, group, acc + g * v_dim, \
                          run_max + g, run_sum + g);
        switch (rows) {
        case 6: ROWS_AVX512(6); break;
        case 5: ROWS_AVX512(5); break;
        case 4: ROWS_AVX512(4); break;
        case 3: ROWS_AVX512(3); break;
        case 2: ROWS_AVX512(2); break;
        default: ROWS_AVX512(1); break;
        }
#undef ROWS_AVX512
        g += rows;
    }
}

/* attend_item with AVX-512: every block of keys through rows_in_tiles_avx512. ``amx`` (NULL: none): every
 * row's logits of a block by AMX tiles first (amx_logits into ``logits``, groups x BLOCK_KEYS), the
 * tiles then taking them as given. */
static inline __attribute__((always_inline)) void attend_item_avx512(int64_t item, float *restrict out, const Segment *segments,
                                                                      int n_segments, int64_t b, int64_t h, int64_t groups, const int ND,
                                                                      const int NV, float scale, float *restrict acc, float *restrict run_max,
                                                                      float *restrict run_sum, float *restrict logits, AmxQueries *amx) {
    const int64_t dim = 16 * ND, v_dim = 16 * NV;
    const int fetch = ROW_PREFETCH_ALWAYS || groups > row_tile_avx512(NV); /* see ROW_PREFETCH_ALWAYS */
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
#ifdef SLIMKV_PATH_AMX
        if (amx) amx_queries(q, groups, dim, amx);
#endif
        for (int64_t t0 = 0; t0 < seg.keys; t0 += BLOCK_KEYS) {
            const int n = (int)(seg.keys - t0 < BLOCK_KEYS ? seg.keys - t0 : BLOCK_KEYS);
            const elem_t *restrict kb = kh + t0 * k_row;
            const elem_t *restrict vb = vh + t0 * v_row;
#ifdef SLIMKV_PATH_AMX
            if (amx) { /* the keys' prefetch (the row tiles' own, who now read only the values), then the logits */
                if (PREFETCH_BLOCKS > 0 && fetch)
                    for (int t = 0; t < n; t++)
                        for (int j = 0; j < ND * (int)sizeof(elem_t) / 4; j++) _mm_prefetch((const char *)(kb + (t + PREFETCH_BLOCKS * BLOCK_KEYS) * k_row) + 64 * j, ROW_HINT);
                if (n == BLOCK_KEYS && BLOCK_KEYS == 64 && dim <= 64 && groups <= AMX_ROWS && amx->parts[0] == 1)
                    amx_logits_block(kb, k_row, dim, groups, amx, scale, logits);
                else
                    amx_logits(kb, k_row, n, dim, groups, amx, scale, logits);
            }
#endif
            rows_in_tiles_avx512(q, kb, vb, k_row, v_row, n, groups, ND, NV, scale16, fetch, NULL, 0, 0, amx ? logits : NULL, acc, run_max, run_sum);
        }
    }
    for (int64_t g = 0; g < groups; g++) {
        const float inv = 1.0f / run_sum[g];
#ifdef SLIMKV_BF16
        unpair_row(acc + g * v_dim, out + g * v_dim, v_dim, inv); /* the accumulators hold pair order */
#else
        for (int64_t e = 0; e < v_dim; e++) out[g * v_dim + e] = acc[g * v_dim + e] * inv;
#endif
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

/* The logits' dot products over chunks of DOT_WIDTH channels. bfloat16 rows with TILE_DOT_BF16
 * take vdpbf16ps (32 bfloat16 pairs of query and key per instruction, products and
 * sums in float32; the keys are used as stored, the queries, which come from bfloat16 tensors,
 * as bfloat16 too, and the scale is applied to the sum). Other bfloat16 rows are widened 32 at a
 * time into pair order (load32_pair: one instruction per 16) and multiplied with the scaled
 * float32 queries kept in the same order; float32 rows 16 at a time. */
#if defined(SLIMKV_BF16) && TILE_DOT_BF16
#define SLIMKV_BF16_DOT 1
#define DOT_WIDTH 32
typedef uint16_t qelem_t;
typedef __m512i qvec_t;
typedef __m512i kvec_t;
static inline qvec_t q_load(const qelem_t *p) { return _mm512_loadu_si512(p); }
static inline kvec_t k_load(const elem_t *p) { return _mm512_loadu_si512(p); }
static inline kvec_t k_load_partial(const elem_t *p, int64_t left) { return _mm512_maskz_loadu_epi16((__mmask32)((1ull << left) - 1ull), p); }
static inline __m512 k_dot(__m512 acc, qvec_t q, kvec_t k) { return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)k); }
#define IN_REGISTER_Q(x) __asm__("" : "+v"(x))
#elif defined(SLIMKV_BF16)
#define SLIMKV_BF16_PAIRS 1
#define DOT_WIDTH 32
typedef float qelem_t;
typedef struct {
    __m512 even, odd;
} qvec_t;
typedef qvec_t kvec_t;
static inline qvec_t q_load(const qelem_t *p) { return (qvec_t){_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)}; }
static inline kvec_t k_load(const elem_t *p) {
    kvec_t k;
    load32_pair(p, &k.even, &k.odd);
    return k;
}
static inline kvec_t k_load_partial(const elem_t *p, int64_t left) {
    kvec_t k;
    load32_pair_partial(p, left, &k.even, &k.odd);
    return k;
}
static inline __m512 k_dot(__m512 acc, qvec_t q, kvec_t k) { return _mm512_fmadd_ps(q.odd, k.odd, _mm512_fmadd_ps(q.even, k.even, acc)); }
#define IN_REGISTER_Q(x) __asm__("" : "+v"((x).even), "+v"((x).odd))
#else
#define DOT_WIDTH 16
typedef float qelem_t;
typedef __m512 qvec_t;
typedef __m512 kvec_t;
static inline qvec_t q_load(const qelem_t *p) { return _mm512_loadu_ps(p); }
static inline kvec_t k_load(const elem_t *p) { return load16(p); }
static inline kvec_t k_load_partial(const elem_t *p, int64_t left) { return load16_masked((__mmask16)((1u << left) - 1u), p); }
static inline __m512 k_dot(__m512 acc, qvec_t q, kvec_t k) { return _mm512_fmadd_ps(q, k, acc); }
#define IN_REGISTER_Q(x) IN_REGISTER(x)
#endif

/* Logits of R query rows against KT consecutive keys, over the rows' DOT_WIDTH chunks: each key
 * chunk is loaded once for the R rows, each query chunk once for the KT keys (R * KT accumulators).
 * qs: R query rows, ``d_pad`` elements apart and zero past ``dim``; kt: the first key's row;
 * ``post``: the factor applied to each sum (the scale when the queries are not scaled, else 1). */
static inline __attribute__((always_inline)) void logits_tile(const qelem_t *restrict qs, int64_t d_pad, const elem_t *restrict kt, int64_t k_row,
                                                              int64_t dim, const int R, const int KT, float *restrict logits, int t, float post) {
    __m512 dots[4][4];
    for (int i = 0; i < R; i++)
        for (int u = 0; u < KT; u++) dots[i][u] = _mm512_setzero_ps();
    const int64_t full = dim / DOT_WIDTH; /* whole chunks; a partial last one is loaded under a mask */
    for (int64_t j = 0; j < full; j++) {
        kvec_t kv[4];
        for (int u = 0; u < KT; u++) {
            kv[u] = k_load(kt + u * k_row + DOT_WIDTH * j);
            IN_REGISTER_Q(kv[u]);
        }
        for (int i = 0; i < R; i++) {
            qvec_t qv = q_load(qs + i * d_pad + DOT_WIDTH * j);
            IN_REGISTER_Q(qv);
            for (int u = 0; u < KT; u++) dots[i][u] = k_dot(dots[i][u], qv, kv[u]);
        }
    }
    if (DOT_WIDTH * full < dim) {
        kvec_t kv[4];
        for (int u = 0; u < KT; u++) kv[u] = k_load_partial(kt + u * k_row + DOT_WIDTH * full, dim - DOT_WIDTH * full);
        for (int i = 0; i < R; i++) {
            qvec_t qv = q_load(qs + i * d_pad + DOT_WIDTH * full);
            for (int u = 0; u < KT; u++) dots[i][u] = k_dot(dots[i][u], qv, kv[u]);
        }
    }
    for (int i = 0; i < R; i++) {
        float sums[4];
        horizontal_sums(dots[i], KT, sums);
        for (int u = 0; u < KT; u++) logits[i * BLOCK_KEYS + t + u] = sums[u] * post;
    }
}

/* Lane i of the result: the sum of the lanes of v[i], for 16 vectors (a transposing reduction:
 * 45 shuffles and adds for 16 sums, no horizontal sum per vector). */
static inline __attribute__((always_inline)) __m512 transpose_sums16(const __m512 *v) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) b[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane L: the partial sums over L of vectors 4i .. 4i + 3 */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Keys in lanes: the logits of one query row against 16 consecutive keys as one vector (lane u:
 * key u), for rows that share their keys with no other row (MHA, latent's per-head keys). Each
 * key has its own accumulator over the row's chunks; one transposing reduction turns the 16 into
 * the 16 logits, so no key pays a horizontal sum of its own. Stored to logits[0 .. 15]. */
static inline __attribute__((always_inline)) void logits_lanes16(const qelem_t *restrict q, const elem_t *restrict kt, int64_t k_row, int64_t dim,
                                                                 float *restrict logits, float post) {
    __m512 acc[16];
    for (int u = 0; u < 16; u++) acc[u] = _mm512_setzero_ps();
    const int64_t full = dim / DOT_WIDTH, chunks = (dim + DOT_WIDTH - 1) / DOT_WIDTH;
    for (int64_t j = 0; j < chunks; j++) { /* chunk by chunk: 16 independent accumulators (measured faster here than key by key) */
        qvec_t qv = q_load(q + DOT_WIDTH * j);
        IN_REGISTER_Q(qv);
        if (j < full)
            for (int u = 0; u < 16; u++) acc[u] = k_dot(acc[u], qv, k_load(kt + u * k_row + DOT_WIDTH * j));
        else
            for (int u = 0; u < 16; u++) acc[u] = k_dot(acc[u], qv, k_load_partial(kt + u * k_row + DOT_WIDTH * j, dim - DOT_WIDTH * j));
    }
    _mm512_storeu_ps(logits, _mm512_mul_ps(transpose_sums16(acc), _mm512_set1_ps(post)));
}

/* acc[R rows][chunks c0 .. c0 + CV - 1] += p . values of a block's n keys (each value chunk loaded
 * once for the R rows; R * CV <= 16). p: the rows' probabilities, BLOCK_KEYS apart; acc rows
 * ``v_pad`` apart. bfloat16 values are widened 32 at a time into pair order (c0 and CV even; the
 * accumulators hold that order). */
static inline __attribute__((always_inline)) void values_tile(const float *restrict p, int n, const elem_t *restrict vb, int64_t v_row,
                                                              int64_t v_dim, int64_t c0, const int R, const int CV, float *restrict acc,
                                                              int64_t v_pad, Ahead *ah) {
    const int64_t step = R * CV * ah->per_unit;
    __m512 av[8][4];
#ifdef SLIMKV_BF16
    int64_t left[2]; /* values in each pair of chunks: fewer than 32 at the row's end */
    for (int c = 0; c < CV; c += 2) left[c / 2] = v_dim - 16 * (c0 + c);
#else
    __mmask16 mask[4];
    for (int c = 0; c < CV; c++) mask[c] = chunk_mask(v_dim, c0 + c);
#endif
    for (int i = 0; i < R; i++)
        for (int c = 0; c < CV; c++) av[i][c] = _mm512_loadu_ps(acc + i * v_pad + 16 * (c0 + c));
    for (int t = 0; t < n; t++) {
        const elem_t *vt = vb + t * v_row + 16 * c0;
        ahead_step(ah, step);
        __m512 vv[4];
#ifdef SLIMKV_BF16
        for (int c = 0; c < CV; c += 2) {
            if (left[c / 2] >= 32)
                load32_pair(vt + 16 * c, &vv[c], &vv[c + 1]);
            else
                load32_pair_partial(vt + 16 * c, left[c / 2], &vv[c], &vv[c + 1]);
        }
#else
        for (int c = 0; c < CV; c++) vv[c] = mask[c] == (__mmask16)0xFFFF ? load16(vt + 16 * c) : load16_masked(mask[c], vt + 16 * c);
#endif
        for (int c = 0; c < CV; c++) IN_REGISTER(vv[c]);
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

/* One work item for any widths and any number of query rows: ``heads`` key heads from head h
 * (a segment's key head stride apart) with ``groups`` query rows each, all reading the same values
 * (heads > 1 only when the values are shared by every head: the latent kind's rows). Per block of
 * keys: the logits of every row (keys in lanes, 16 per vector, for a head with one row; tiles of
 * 4 rows x 4 keys for rows that share a head's keys), the online-softmax update of every row, then
 * the values (tiles of 8 rows x 2 chunks while 8 rows are left, then 4 rows x 4 chunks: each
 * value chunk read once for the tile's rows). Same arithmetic
 * as attend_item, in another order of sums. Scratch: acc (rows x v_pad), qs (rows x d_pad),
 * logits (rows x BLOCK_KEYS). ``amx`` (NULL: none; decode_amx.h): every row's logits by AMX tiles
 * (amx_logits) in place of the logits tiles. */
static inline __attribute__((always_inline)) void attend_item_wide(int64_t item, float *restrict out, const Segment *segments, int n_segments,
                                                                         int64_t b, int64_t h, int64_t heads, int64_t groups, int64_t dim, int64_t v_dim,
                                                                         float scale, float *restrict acc, float *restrict q_scratch, float *restrict logits,
                                                                         float *restrict run_max, float *restrict run_sum, AmxQueries *amx) {
    const int64_t d_pad = (dim + DOT_WIDTH - 1) / DOT_WIDTH * DOT_WIDTH, rows_all = heads * groups;
#ifdef SLIMKV_BF16
    const int64_t v_pad = (v_dim + 31) / 32 * 32; /* whole pairs of chunks (pair order) */
#else
    const int64_t v_pad = (v_dim + 15) / 16 * 16;
#endif
    qelem_t *restrict qs = (qelem_t *)q_scratch;
    for (int64_t g = 0; g < rows_all; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(rows_all * v_pad));
    memset(qs, 0, sizeof(qelem_t) * (size_t)(rows_all * d_pad));
#ifdef SLIMKV_BF16_DOT
    const float post = scale; /* bfloat16 queries as they are; the scale goes on the sums */
#else
    const float post = 1.0f;
#endif
    for (int s = 0; s < n_segments; s++) {
        const Segment seg = segments[s];
        const float *restrict q = seg.q + item * groups * dim;
        for (int64_t g = 0; g < (amx ? 0 : rows_all); g++) /* the logits tiles' queries (AMX takes its own, below) */
            for (int64_t d = 0; d < dim; d++) {
#ifdef SLIMKV_BF16_DOT
                float x = q[g * dim + d];
                uint32_t bits;
                memcpy(&bits, &x, sizeof bits);
                qs[g * d_pad + d] = (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16); /* round to nearest even (exact for bfloat16 queries) */
#elif defined(SLIMKV_BF16_PAIRS)
                qs[g * d_pad + d / 32 * 32 + (d % 2) * 16 + d % 32 / 2] = q[g * dim + d] * scale; /* pair order, as the keys are widened */
#else
                qs[g * d_pad + d] = q[g * dim + d] * scale;
#endif
            }
#ifdef SLIMKV_PATH_AMX
        if (amx) amx_queries(q, rows_all, dim, amx);
#endif
        const elem_t *restrict kh = seg.k + b * seg.k_stride_b + h * seg.k_stride_h;
        const elem_t *restrict vh = seg.v + b * seg.v_stride_b + h * seg.v_stride_h;
        const int64_t k_row = seg.k_stride_t, v_row = seg.v_stride_t;
        const int v_in_k = heads == 1 && values_in_key_rows(kh, vh, dim, v_dim, k_row, v_row);
        const int64_t d_chunks = d_pad / DOT_WIDTH, v_chunks = v_pad / 16;
        const int64_t units = rows_all * (d_chunks + v_chunks); /* a block's work per key, in tile units (see Ahead) */
        const int fetch = ahead_pays(seg.keys, heads, dim, v_in_k ? 0 : v_dim);
        for (int64_t t0 = 0; t0 < seg.keys; t0 += BLOCK_KEYS) {
            const int n = (int)(seg.keys - t0 < BLOCK_KEYS ? seg.keys - t0 : BLOCK_KEYS);
            const elem_t *restrict vb = vh + t0 * v_row;
            const int64_t next = seg.keys - t0 - AHEAD_BLOCKS * BLOCK_KEYS; /* keys of the block AHEAD_BLOCKS on (<= 0: none) */
            Ahead ah = ahead_rows(kh + (t0 + AHEAD_BLOCKS * BLOCK_KEYS) * k_row, vh + (t0 + AHEAD_BLOCKS * BLOCK_KEYS) * v_row, fetch && next > 0 ? (next < BLOCK_KEYS ? next : BLOCK_KEYS) : 0,
                                  k_row, v_row, seg.k_stride_h, heads, dim, v_dim, units, n);
#ifdef SLIMKV_PATH_AMX
            if (amx) { /* every row's logits by AMX tiles (heads is 1: amx_takes), the prefetch stepped by their share */
                ahead_step(&ah, n * rows_all * d_chunks * ah.per_unit);
                amx_logits(kh + t0 * k_row, k_row, n, dim, rows_all, amx, scale, logits);
            }
#endif
            for (int64_t hh = 0; hh < heads && !amx; hh++) {
                const elem_t *restrict kb = kh + hh * seg.k_stride_h + t0 * k_row;
                if (groups == 1) {
                    const qelem_t *qr = qs + hh * d_pad;
                    float *lg = logits + hh * BLOCK_KEYS;
                    const int64_t step = d_chunks * ah.per_unit;
                    int t = 0;
                    for (; t + 16 <= n; t += 16) {
                        ahead_step(&ah, 16 * step);
                        logits_lanes16(qr, kb + t * k_row, k_row, dim, lg + t, post);
                    }
                    for (; t < n; t++) {
                        ahead_step(&ah, step);
                        logits_tile(qr, d_pad, kb + t * k_row, k_row, dim, 1, 1, lg, t, post);
                    }
                    continue;
                }
                for (int64_t g = 0; g < groups; g += 4) {
                    const int rows = groups - g < 4 ? (int)(groups - g) : 4;
                    const qelem_t *qg = qs + (hh * groups + g) * d_pad;
                    float *lg = logits + (hh * groups + g) * BLOCK_KEYS;
                    const int64_t step = rows * d_chunks * ah.per_unit;
                    int t = 0;
#define LOGITS4(R)                                                                                                \
    for (; t + 4 <= n; t += 4) {                                                                                  \
        ahead_step(&ah, 4 * step);                                                                                \
        logits_tile(qg, d_pad, kb + t * k_row, k_row, dim, R, 4, lg, t, post);                                    \
    }
#define LOGITS1(R)                                                                                                \
    for (; t < n; t++) {                                                                                          \
        ahead_step(&ah, step);                                                                                    \
        logits_tile(qg, d_pad, kb + t * k_row, k_row, dim, R, 1, lg, t, post);                                    \
    }
                    ROWS_SWITCH(rows, LOGITS4)
                    ROWS_SWITCH(rows, LOGITS1)
#undef LOGITS4
#undef LOGITS1
                }
            }
            for (int64_t g = 0; g < rows_all; g++) {
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
            int64_t g8 = 0; /* 8 rows at a time (8 x 2 chunks): each value chunk is read once for the 8, not once per 4 rows */
            for (; g8 + 8 <= rows_all; g8 += 8)
                for (int64_t c0 = 0; c0 < v_pad / 16; c0 += 2) {
                    if (v_pad / 16 - c0 >= 2)
                        values_tile(logits + g8 * BLOCK_KEYS, n, vb, v_row, v_dim, c0, 8, 2, acc + g8 * v_pad, v_pad, &ah);
                    else
                        values_tile(logits + g8 * BLOCK_KEYS, n, vb, v_row, v_dim, c0, 8, 1, acc + g8 * v_pad, v_pad, &ah);
                }
            for (int64_t c0 = 0; c0 < v_pad / 16 && g8 < rows_all; c0 += 4) {
                const int chunks = v_pad / 16 - c0 < 4 ? (int)(v_pad / 16 - c0) : 4;
                for (int64_t g = g8; g < rows_all; g += 4) {
                    const int rows = rows_all - g < 4 ? (int)(rows_all - g) : 4;
                    const float *pg = logits + g * BLOCK_KEYS;
                    float *ag = acc + g * v_pad;
#define VALUES(R)                                                                                 \
    switch (chunks) {                                                                             \
    case 4: values_tile(pg, n, vb, v_row, v_dim, c0, R, 4, ag, v_pad, &ah); break;  \
    case 3: values_tile(pg, n, vb, v_row, v_dim, c0, R, 3, ag, v_pad, &ah); break;  \
    case 2: values_tile(pg, n, vb, v_row, v_dim, c0, R, 2, ag, v_pad, &ah); break;  \
    default: values_tile(pg, n, vb, v_row, v_dim, c0, R, 1, ag, v_pad, &ah); break; \
    }
                    ROWS_SWITCH(rows, VALUES)
#undef VALUES
                }
            }
        }
    }
    for (int64_t g = 0; g < rows_all; g++) {
        const float inv = 1.0f / run_sum[g];
#ifdef SLIMKV_BF16
        unpair_row(acc + g * v_pad, out + g * v_dim, v_dim, inv);
#else
        for (int64_t e = 0; e < v_dim; e++) out[g * v_dim + e] = acc[g * v_pad + e] * inv;
#endif
    }
}
