/* slimkv's decode kernel, AMX logits for bfloat16 caches (included by decode_avx512.h when the
 * build targets AMX-TILE and AMX-BF16: Intel Sapphire Rapids and later).
 *
 * Why: where several query rows share a wide key row (MLA's latent rows, LRKV's rows), the
 * AVX-512 wide tiles pay, for every key, one fused multiply-add per 16 channels per row and a
 * horizontal sum per row: the logits alone cost more than the key rows' read. One AMX tile product
 * takes 16 keys x 16 rows x 32 channels. The same holds for the 32/64/128-wide rows of GQA and MQA
 * heads with more query rows than one AVX-512 row tile holds (5 or more of 64; block_rows_avx512
 * then passes over each block once per tile, each pass with its own products and horizontal sums):
 * there attend_item_avx512 takes every row's logits here and the row tiles do the softmax and the
 * values alone (softmax_values_avx512), in tiles of up to 6 rows. Heads of up to 4 rows (one row
 * tile) keep the row tiles' own logits: AMX logits measured slower there (one layer of SmolLM2's
 * 3 x 3 rows: 0.8-0.9x).
 *
 * How, per block of keys (attend_item_wide and attend_item_avx512, decode_avx512.h, call
 * amx_logits in place of their logits tiles; the online softmax and the values stay the AVX-512
 * tiles'):
 *   logits^T (16 keys x 16 rows) = K (16 cached rows x 32 channels, loaded straight from the cache)
 *                                  x Q^T (the queries' channel pairs interleaved: AMX's B layout),
 * accumulated over the 32-channel chunks in float32, stored, transposed to rows x keys and scaled.
 * The queries are float32; each is split into three bfloat16 parts (high, middle, low, each
 * rounded from what the ones before leave: their sum is the float32 to about 2^-26 of it) and a
 * part is multiplied only when some query has it not zero (the queries of a bfloat16 model are
 * bfloat16: one part). The keys are used as stored (exact). So the logits are the float32 dot
 * products to float32's precision, summed in another order. A 16-key tile that would read past
 * the block's n keys, and a last chunk of an odd number (below 32) of channels, are copied into
 * zeroed scratch first; a last chunk of an even number is read straight from the rows by a tile
 * configured to its width (amx_configure).
 *
 * Which items (amx_takes): bfloat16 rows, query rows of one head only (not the latent kind's
 * shared values), at least AMX_MIN_GROUPS rows per head (one row fills a sixteenth of a tile; the
 * keys-in-lanes tiles read at the memory's rate there), key widths up to AMX_MAX_DIM; of those, the
 * 32/64/128-wide rows only past one row tile (run_job). Linux hands
 * AMX's state to a process only when asked (arch_prctl ARCH_REQ_XCOMP_PERM): asked once; refused,
 * every item takes the AVX-512 tiles and slimkv_kernel_isa() says "avx512-bf16". */
#include <pthread.h>
#include <sys/syscall.h>

long syscall(long number, ...); /* unistd.h declares it only under _GNU_SOURCE / _DEFAULT_SOURCE, which -std=c11 leaves off */

#ifndef AMX_MIN_GROUPS
#define AMX_MIN_GROUPS 2
#endif
#define AMX_ROWS 16      /* query rows per tile */
#define AMX_MAX_DIM 1024 /* key widths up to this (the queries' tiles: 3 parts x dim / 32 KiB per 16 rows) */

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static int amx_permitted;

static void amx_request(void) { amx_permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0; }

/* Whether this process may use AMX's tiles (asked of the OS once). */
static int amx_ready(void) {
    pthread_once(&amx_once, amx_request);
    return amx_permitted;
}

/* Whether an item of ``groups`` query rows per head over keys ``dim`` wide may take amx_logits (the
 * row tiles' widths also need more rows than a row tile: run_job). */
static inline int amx_takes(int shared, int64_t groups, int64_t dim) {
    return !shared && groups >= AMX_MIN_GROUPS && groups <= 64 * AMX_ROWS && dim <= AMX_MAX_DIM && amx_ready();
}

/* The tiles for keys ``dim`` wide: 16 rows x 64 bytes each (amx_logits: 0 logits^T (keys x rows,
 * float32), 1 keys (16 x 32 bfloat16), 2 a part of the queries (B layout); amx_logits_block: its
 * own), except where dim % 32 is even and not zero: then 3 is the keys' last chunk (16 rows of its
 * dim % 32 channels, read straight from the rows) and 4 the queries' (dim % 32 / 2 channel pairs). Such widths never take amx_logits_block (32 or 64 wide only). Loaded by
 * each thread before its items. */
static inline int amx_direct_last(int64_t dim) { return dim % 32 != 0 && dim % 2 == 0; }

static void amx_configure(int64_t dim) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) {
        config.colsb[i] = 64;
        config.rows[i] = 16;
    }
    if (amx_direct_last(dim)) {
        config.colsb[3] = (uint16_t)(2 * (dim % 32));
        config.rows[4] = (uint8_t)(dim % 32 / 2);
    }
    _tile_loadconfig(&config);
}

/* The queries of one item as B tiles: for each group of AMX_ROWS rows, each part, each 32-channel
 * chunk, 16 channel pairs x 16 rows (1 KiB; rows past the item's are zero). */
typedef struct {
    uint16_t *tiles;
    int parts[64]; /* per row group: how many parts to multiply (1 to 3) */
    int64_t chunks;          /* 32-channel chunks, the last one partial where dim is not a multiple of 32 */
    elem_t *tail;            /* 16 key rows of dim, for a tile past the block's keys */
    elem_t *last;            /* 16 rows x 32: a partial last chunk's channels, zero past dim */
} AmxQueries;

/* Scratch for items of ``groups`` rows per head over keys ``dim`` wide, and the tile configuration
 * loaded on this thread. 0 when out of memory. */
static int amx_open(AmxQueries *a, int64_t groups, int64_t dim) {
    const int64_t row_groups = (groups + AMX_ROWS - 1) / AMX_ROWS, chunks = (dim + 31) / 32;
    a->tiles = malloc(sizeof(uint16_t) * (size_t)(row_groups * 3 * chunks * 512) + sizeof(elem_t) * (size_t)(16 * dim + 16 * 32));
    if (!a->tiles) return 0;
    a->tail = (elem_t *)(a->tiles + row_groups * 3 * chunks * 512);
    a->last = a->tail + 16 * dim;
    amx_configure(dim);
    return 1;
}

/* Gives back what amx_open took (the tiles' state and the scratch). */
static void amx_close(AmxQueries *a) {
    _tile_release();
    free(a->tiles);
}

static inline uint16_t *amx_query_tile(const AmxQueries *a, int64_t group, int part, int64_t chunk) {
    return a->tiles + ((group * 3 + part) * a->chunks + chunk) * 512;
}

/* 16 floats as three bfloat16 parts, each rounded to nearest even from what the ones before leave
 * (every subtraction exact): part[0] + part[1] + part[2] = x to about 2^-26 of x. */
static inline void split_bf16(__m512 x, __m256i part[3]) {
    for (int i = 0; i < 3; i++) {
        const __m256bh h = _mm512_cvtneps_pbh(x);
        part[i] = (__m256i)h;
        x = _mm512_sub_ps(x, _mm512_cvtpbh_ps(h));
    }
}

/* The B tiles of ``rows`` query rows of ``dim`` floats (unscaled: the scale goes on the logits). */
static void amx_queries(const float *q, int64_t rows, int64_t dim, AmxQueries *a) {
    a->chunks = (dim + 31) / 32;
    const int64_t groups = (rows + AMX_ROWS - 1) / AMX_ROWS;
    memset(a->tiles, 0, sizeof(uint16_t) * (size_t)(groups * 3 * a->chunks * 512));
    for (int64_t g = 0; g < groups; g++) {
        a->parts[g] = 1;
        for (int64_t c = 0; c < AMX_ROWS && g * AMX_ROWS + c < rows; c++)
            for (int64_t d = 0; d < dim; d += 16) {
                const int64_t width = dim - d < 16 ? dim - d : 16;
                __m256i parts[3];
                split_bf16(_mm512_maskz_loadu_ps((__mmask16)((1u << width) - 1u), q + (g * AMX_ROWS + c) * dim + d), parts);
                for (int i = 0; i < 3; i++) {
                    uint16_t lanes[16];
                    _mm256_storeu_si256((__m256i *)lanes, parts[i]);
                    for (int e = 0; e < width; e++) {
                        const int64_t channel = d + e;
                        amx_query_tile(a, g, i, channel / 32)[channel % 32 / 2 * 32 + c * 2 + channel % 2] = lanes[e]; /* pair row, column c */
                        if (lanes[e] && i + 1 > a->parts[g]) a->parts[g] = i + 1;
                    }
                }
            }
    }
}

/* Rows [0, R) of dst (``dst_stride`` floats apart, 16 floats each) = post x the transpose of src
 * (16 x 16, contiguous): dst[i][t] = post * src[t][i]. */
static inline void transpose16_rows(const float *restrict src, float *restrict dst, int64_t dst_stride, int R, __m512 post) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + 16 * i);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    /* r[4b + j], 128-bit lane L: column 4L + j of src rows 4b .. 4b + 3; gather each column's four lanes */
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], _MM_SHUFFLE(2, 0, 2, 0));
        t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], _MM_SHUFFLE(3, 1, 3, 1));
        t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(2, 0, 2, 0));
        t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(3, 1, 3, 1));
    }
    for (int j = 0; j < 4; j++) {
        if (j < R) _mm512_storeu_ps(dst + j * dst_stride, _mm512_mul_ps(post, _mm512_shuffle_f32x4(t[j], t[8 + j], _MM_SHUFFLE(2, 0, 2, 0))));
        if (4 + j < R) _mm512_storeu_ps(dst + (4 + j) * dst_stride, _mm512_mul_ps(post, _mm512_shuffle_f32x4(t[4 + j], t[12 + j], _MM_SHUFFLE(2, 0, 2, 0))));
        if (8 + j < R) _mm512_storeu_ps(dst + (8 + j) * dst_stride, _mm512_mul_ps(post, _mm512_shuffle_f32x4(t[j], t[8 + j], _MM_SHUFFLE(3, 1, 3, 1))));
        if (12 + j < R) _mm512_storeu_ps(dst + (12 + j) * dst_stride, _mm512_mul_ps(post, _mm512_shuffle_f32x4(t[4 + j], t[12 + j], _MM_SHUFFLE(3, 1, 3, 1))));
    }
}

/* logits[i * BLOCK_KEYS + t] = post * (query row i . key t) for the ``rows`` rows of amx_queries
 * and the block's n keys (kb, k_row apart; a tile of 16 keys reaching past n is read from zeroed
 * scratch, and so is a last chunk of an odd number of channels (an even one is read straight from
 * the rows by tiles 3 and 4): no tile reads past a row's dim channels);
 * the logits of keys n .. the tile's end are written too (the caller overwrites them). */
static inline void amx_logits(const elem_t *kb, int64_t k_row, int n, int64_t dim, int64_t rows, const AmxQueries *a, float post,
                              float *restrict logits) {
    float out[256] __attribute__((aligned(64)));
    const __m512 post16 = _mm512_set1_ps(post);
    for (int t0 = 0; t0 < n; t0 += 16) {
        const elem_t *keys = kb + t0 * k_row;
        int64_t stride = k_row;
        if (n - t0 < 16) {
            memset(a->tail, 0, sizeof(elem_t) * (size_t)(16 * dim));
            for (int t = 0; t < n - t0; t++) memcpy(a->tail + t * dim, keys + t * k_row, sizeof(elem_t) * (size_t)dim);
            keys = a->tail;
            stride = dim;
        }
        const int64_t full = dim / 32;
        if (full < a->chunks && !amx_direct_last(dim)) { /* an odd last chunk's dim % 32 channels of each of the 16 rows, zero past them */
            memset(a->last, 0, sizeof(elem_t) * 16 * 32);
            for (int t = 0; t < 16; t++) memcpy(a->last + 32 * t, keys + t * stride + 32 * full, sizeof(elem_t) * (size_t)(dim - 32 * full));
        }
        for (int64_t g = 0; g * AMX_ROWS < rows; g++) {
            _tile_zero(0);
            for (int64_t j = 0; j < a->chunks; j++) {
                if (j == full && amx_direct_last(dim)) { /* tiles 3 and 4 (amx_configure): the last chunk's channels only */
                    _tile_loadd(3, keys + 32 * j, stride * (int64_t)sizeof(elem_t));
                    for (int part = 0; part < a->parts[g]; part++) {
                        _tile_loadd(4, amx_query_tile(a, g, part, j), 64);
                        _tile_dpbf16ps(0, 3, 4);
                    }
                    continue;
                }
                if (j < full)
                    _tile_loadd(1, keys + 32 * j, stride * (int64_t)sizeof(elem_t));
                else
                    _tile_loadd(1, a->last, 64);
                for (int part = 0; part < a->parts[g]; part++) {
                    _tile_loadd(2, amx_query_tile(a, g, part, j), 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
            }
            _tile_stored(0, out, 64);
            const int R = (int)(rows - g * AMX_ROWS < AMX_ROWS ? rows - g * AMX_ROWS : AMX_ROWS);
            transpose16_rows(out, logits + g * AMX_ROWS * BLOCK_KEYS + t0, BLOCK_KEYS, R, post16);
        }
    }
}

/* amx_logits for a whole block (BLOCK_KEYS = 64 keys) of keys 32 or 64 wide and at most 16 rows whose
 * queries are one bfloat16 part (the row tiles' GQA and MQA heads): the query tiles stay in tile
 * registers for the block and four logits^T tiles (one per 16 keys) accumulate side by side, so
 * the tile products do not wait on each other. Tiles: 0-3 logits^T, 4-5 the queries' chunks, 6-7
 * the keys' chunks. */
static inline void amx_logits_block(const elem_t *kb, int64_t k_row, int64_t dim, int64_t rows, const AmxQueries *a, float post,
                                    float *restrict logits) {
    float out[4][256] __attribute__((aligned(64)));
    const int64_t stride = k_row * (int64_t)sizeof(elem_t);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, amx_query_tile(a, 0, 0, 0), 64);
#define AMX_KEYS_LO(T)                                \
    _tile_loadd(6, kb + 16 * (T) * k_row, stride);    \
    _tile_dpbf16ps(T, 6, 4);
#define AMX_KEYS_HI(T)                                  \
    _tile_loadd(7, kb + 16 * (T) * k_row + 32, stride); \
    _tile_dpbf16ps(T, 7, 5);
    if (dim == 64) {
        _tile_loadd(5, amx_query_tile(a, 0, 0, 1), 64);
        AMX_KEYS_LO(0) AMX_KEYS_HI(0) AMX_KEYS_LO(1) AMX_KEYS_HI(1) AMX_KEYS_LO(2) AMX_KEYS_HI(2) AMX_KEYS_LO(3) AMX_KEYS_HI(3)
    } else {
        AMX_KEYS_LO(0) AMX_KEYS_LO(1) AMX_KEYS_LO(2) AMX_KEYS_LO(3)
    }
#undef AMX_KEYS_LO
#undef AMX_KEYS_HI
    _tile_stored(0, out[0], 64);
    _tile_stored(1, out[1], 64);
    _tile_stored(2, out[2], 64);
    _tile_stored(3, out[3], 64);
    const __m512 post16 = _mm512_set1_ps(post);
    for (int t = 0; t < 4; t++) transpose16_rows(out[t], logits + 16 * t, BLOCK_KEYS, (int)rows, post16);
}
