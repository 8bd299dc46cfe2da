/* One row through linear layers, y = W x (+ bias), for decode steps (included by
 * decode_attention.c, after elem_t, to_float and from_float): a decode step multiplies one token's row by
 * every projection's weights, a matrix-vector product whose time is reading the weights, and
 * torch's CPU matmul for one row was measured at about half the read bandwidth here (15 GB/s
 * against 30 for this loop, one thread, weights not in cache).
 *
 * One weight row at a time, in memory order, float32 sums (bfloat16 weights widened as they are
 * read). The order matters: reading the weights as one sequential stream ran at 0.9 of a plain
 * sum's read rate on the development machine (AMD EPYC, one thread, 538 MB of SmolLM2
 * projections), where interleaving four rows (four streams 2.3 KB apart, the earlier loop) ran at
 * 0.5. Rows are split over ``threads`` POSIX threads. The plain reference is
 * torch.nn.functional.linear; tests/ops/test_native_linear.py compares every path with it.
 *
 * The inner loop differs by build, each the fastest of three measured on the development machine
 * (interleaved runs, one thread, 212 MB of bfloat16 and 424 MB of float32 rows;
 * benchmarks/decode_linear.py times the paths against the read rate):
 * - AVX-512: float32 rows by row_dot_plain, the compiler's 512-bit loop. bfloat16 rows with
 *   AVX512-BF16 by row_dot_dpbf16 (vdpbf16ps: 32 products of weights and the bfloat16 row per
 *   instruction, no widening; the row of a bfloat16 model is bfloat16, so nothing is rounded;
 *   12-16% faster than row_dot_plain in three interleaved runs over 212 MB in one call, 0.90-0.98
 *   of the read rate against 0.78-0.85);
 *   without it by row_dot_plain (widened one element at a time by a zero-extending shuffle and a
 *   shift; row_dot_pairs ran 10-12% slower there).
 * - AVX2: bfloat16 rows by row_dot_pairs (4-23% faster than row_dot_plain in three runs), float32
 *   rows by row_dot_lanes (within the runs' noise of row_dot_plain: -6% to +6%).
 * - portable (the compiler's default target): float32 by row_dot_lanes (16-17% faster), bfloat16
 *   by row_dot_plain (row_dot_pairs ran 17% slower). */

#if !defined(__AVX512F__) && (defined(__AVX2__) || !defined(SLIMKV_BF16))
#define LINEAR_LANES 1 /* row_dot_lanes (float32) or row_dot_pairs (bfloat16, AVX2) */
#else
#define LINEAR_LANES 0 /* row_dot_plain, or row_dot_dpbf16 where LINEAR_DPBF16 */
#endif
#if defined(SLIMKV_BF16) && defined(__AVX512BF16__)
#define LINEAR_DPBF16 1 /* bfloat16 rows by row_dot_dpbf16 */
#else
#define LINEAR_DPBF16 0
#endif

/* w . x over one row, one running sum the compiler vectorizes. */
static inline float row_dot_plain(const elem_t *restrict w, const float *restrict x, int64_t in_f) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < in_f; i++) s += to_float(w[i]) * x[i];
    return s;
}

#if LINEAR_LANES
/* Eight float32 lanes (GCC/Clang vector extensions, lowered to the build's vectors: one AVX2
 * register, two SSE ones). Four of them hold a row's running sums: one would wait on each add's
 * latency (sums kept in an array were kept in memory). */
typedef float lanes8 __attribute__((vector_size(32)));
typedef uint32_t words8 __attribute__((vector_size(32)));

static inline lanes8 load_lanes(const float *p) {
    lanes8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum_lanes(lanes8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#ifndef SLIMKV_BF16
/* w . x over one float32 row: 32 elements a step in four sets of lanes, then one at a time. */
static inline float row_dot_lanes(const float *restrict w, const float *restrict x, int64_t in_f) {
    lanes8 a = {0}, b = {0}, c = {0}, d = {0};
    int64_t i = 0;
    for (; i + 32 <= in_f; i += 32) {
        a += load_lanes(w + i) * load_lanes(x + i);
        b += load_lanes(w + i + 8) * load_lanes(x + i + 8);
        c += load_lanes(w + i + 16) * load_lanes(x + i + 16);
        d += load_lanes(w + i + 24) * load_lanes(x + i + 24);
    }
    float s = sum_lanes((a + b) + (c + d));
    for (; i < in_f; i++) s += w[i] * x[i];
    return s;
}
#else
/* w . x over one bfloat16 row read as 32-bit pairs: a pair's high half masked is its odd element
 * as a float32, its bits shifted left 16 its even one, so widening costs one AND or one shift per
 * element and no shuffle. x_pairs holds x's even elements then its odd ones (in_f even). */
static inline float row_dot_pairs(const elem_t *restrict w, const float *restrict x_pairs, int64_t in_f) {
    const int64_t half = in_f / 2;
    const float *restrict x_even = x_pairs, *restrict x_odd = x_pairs + half;
    const words8 high = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};
    lanes8 a = {0}, b = {0}, c = {0}, d = {0};
    int64_t p = 0;
    for (; p + 16 <= half; p += 16) {
        words8 first, second;
        memcpy(&first, w + 2 * p, sizeof first);
        memcpy(&second, w + 2 * p + 16, sizeof second);
        a += (lanes8)(first << 16) * load_lanes(x_even + p);
        b += (lanes8)(first & high) * load_lanes(x_odd + p);
        c += (lanes8)(second << 16) * load_lanes(x_even + p + 8);
        d += (lanes8)(second & high) * load_lanes(x_odd + p + 8);
    }
    float s = sum_lanes((a + b) + (c + d));
    for (; p < half; p++) s += to_float(w[2 * p]) * x_even[p] + to_float(w[2 * p + 1]) * x_odd[p];
    return s;
}
#endif
#endif

#if LINEAR_DPBF16
/* w . x over one bfloat16 row and the row x_bf16 in bfloat16: vdpbf16ps adds 16 lanes' pairs of
 * products (each exact in float32) into float32 sums, 128 elements a step in four sums (one would
 * wait on each instruction's latency), then 32 at a time, then one at a time. */
static inline float row_dot_dpbf16(const elem_t *restrict w, const uint16_t *restrict x_bf16, int64_t in_f) {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps(), c = _mm512_setzero_ps(), d = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 128 <= in_f; i += 128) {
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x_bf16 + i));
        b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_loadu_si512(w + i + 32), (__m512bh)_mm512_loadu_si512(x_bf16 + i + 32));
        c = _mm512_dpbf16_ps(c, (__m512bh)_mm512_loadu_si512(w + i + 64), (__m512bh)_mm512_loadu_si512(x_bf16 + i + 64));
        d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_loadu_si512(w + i + 96), (__m512bh)_mm512_loadu_si512(x_bf16 + i + 96));
    }
    for (; i + 32 <= in_f; i += 32) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x_bf16 + i));
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
    for (; i < in_f; i++) s += to_float(w[i]) * to_float(x_bf16[i]);
    return s;
}
#endif

typedef struct {
    const elem_t *w, *bias;
    const float *x;
    const void *x_ready; /* x as the build's loop reads it (ready_row); NULL: row_dot_plain or row_dot_lanes on x */
    float *y;
    int64_t in_f, first, last; /* output rows [first, last) */
} LinearJob;

/* Software prefetch of the weights LINEAR_PREFETCH_BYTES ahead of the row being read (0: none),
 * chosen per CPU at build time like ROW_PREFETCH_ALWAYS. On an Intel Xeon (Emerald Rapids, one
 * thread, SmolLM2's 30 layers of projections as the model calls them, interleaved A/B) the
 * hardware prefetchers alone read the stream at 0.68 (bfloat16) and 0.75 (float32) of a plain
 * sum's rate; prefetching 2 KiB ahead, 0.82 and 0.91 (1.20-1.22x; two threads 1.06-1.24x; 1 KiB
 * and 4 KiB within a few per cent). AMD Zen builds keep 0: there the stream alone reached 0.9 of
 * the read rate and L1 prefetches slowed the attention tiles (ROW_PREFETCH_ALWAYS), and no run has
 * measured this one. slimkv_linear_prefetch_bytes() says which a build took; the outputs do not change. */
#ifndef LINEAR_PREFETCH_BYTES
#if defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
#define LINEAR_PREFETCH_BYTES 0
#else
#define LINEAR_PREFETCH_BYTES 2048
#endif
#endif

static void *run_linear_job(void *arg) {
    const LinearJob *job = (const LinearJob *)arg;
    const int64_t row_bytes = job->in_f * (int64_t)sizeof(elem_t);
    for (int64_t o = job->first; o < job->last; o++) {
        const elem_t *w = job->w + o * job->in_f;
        if (LINEAR_PREFETCH_BYTES > 0)
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch((const char *)w + LINEAR_PREFETCH_BYTES + b, 0, 3);
#if LINEAR_DPBF16
        job->y[o] = job->x_ready ? row_dot_dpbf16(w, (const uint16_t *)job->x_ready, job->in_f) : row_dot_plain(w, job->x, job->in_f);
#elif LINEAR_LANES && defined(SLIMKV_BF16)
        job->y[o] = job->x_ready ? row_dot_pairs(w, (const float *)job->x_ready, job->in_f) : row_dot_plain(w, job->x, job->in_f);
#elif LINEAR_LANES
        job->y[o] = row_dot_lanes(w, job->x, job->in_f);
#else
        job->y[o] = row_dot_plain(w, job->x, job->in_f);
#endif
    }
    if (job->bias)
        for (int64_t o = job->first; o < job->last; o++) job->y[o] += to_float(job->bias[o]);
    return NULL;
}

/* x (in_f floats) as the build's loop reads it, to free after the call: its bfloat16 rounding for
 * row_dot_dpbf16, its even elements then its odd ones for row_dot_pairs (in_f even). NULL where
 * the loop reads x itself (float32 rows, bfloat16 on AVX-512 without AVX512-BF16 or portable), for
 * odd in_f on AVX2, or without memory (row_dot_plain then runs). */
static void *ready_row(const float *x, int64_t in_f) {
#if LINEAR_DPBF16
    uint16_t *x_bf16 = (uint16_t *)malloc((size_t)in_f * sizeof(uint16_t));
    if (x_bf16)
        for (int64_t i = 0; i < in_f; i++) x_bf16[i] = from_float(x[i]);
    return x_bf16;
#elif LINEAR_LANES && defined(SLIMKV_BF16)
    float *x_pairs = NULL;
    if (in_f % 2 == 0 && (x_pairs = (float *)malloc((size_t)in_f * sizeof(float))))
        for (int64_t p = 0; p < in_f / 2; p++) x_pairs[p] = x[2 * p], x_pairs[in_f / 2 + p] = x[2 * p + 1];
    return x_pairs;
#else
    (void)x, (void)in_f;
    return NULL;
#endif
}

/* y (out_f floats) = w (out_f x in_f, rows contiguous) . x (in_f floats) + bias (out_f, or NULL),
 * with x already prepared (ready_row), so projections sharing one row prepare it once. */
static void linear_rows(const elem_t *w, const float *x, const void *x_ready, const elem_t *bias, float *y, int64_t out_f, int64_t in_f,
                        int threads) {
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (threads > out_f / 4) threads = out_f / 4 > 0 ? (int)(out_f / 4) : 1;
    LinearJob jobs[64];
    for (int t = 0; t < threads; t++) /* whole groups of four rows per thread */
        jobs[t] = (LinearJob){w, bias, x, x_ready, y, in_f, out_f / 4 * t / threads * 4, t + 1 == threads ? out_f : out_f / 4 * (t + 1) / threads * 4};
    run_on_threads(run_linear_job, jobs, sizeof *jobs, threads, threads);
}

/* A decode step's projections that share one input row, in one call, in the model's element type
 * (a decode step pays the Python and dispatch cost of every call; a layer's q, k and v, or its
 * MLP's gate and up, read one row): y[c] = w[c] . x + bias[c] for c < count, each by linear_rows
 * (float32 sums) and rounded once to the element type, written one after the other
 * into y (the sum of out_f elements). With ``gate`` (in_f elements), the input is silu(gate) * x,
 * rounded as torch rounds it in the element type: silu(gate) rounded, then the product rounded
 * (the plain reference is torch.nn.functional.silu(gate) * x in x's dtype). Returns 0, or 2 on bad
 * arguments, 1 without memory. */
int PROJECT_ENTRY(const elem_t *x, const elem_t *gate, int64_t in_f, int count, const elem_t *const *w, const elem_t *const *bias,
                  const int64_t *out_f, elem_t *y, int threads) {
    if (!x || !w || !out_f || !y || count < 1 || in_f < 1) return 2;
    int64_t total = 0;
    for (int c = 0; c < count; c++) {
        if (!w[c] || out_f[c] < 1) return 2; /* every call checked before any output is written */
        total += out_f[c];
    }
#ifdef SLIMKV_BF16
    float *row = (float *)malloc((size_t)(in_f + total) * sizeof(float)), *sums = row + in_f;
    if (!row) return 1;
    if (!gate) /* with a gate the SwiGLU row below is the input */
        for (int64_t i = 0; i < in_f; i++) row[i] = to_float(x[i]);
#else
    float *row = NULL, *sums = y;
    if (gate && !(row = (float *)malloc((size_t)in_f * sizeof(float)))) return 1;
#endif
    if (gate)
        for (int64_t i = 0; i < in_f; i++) {
            const float g = to_float(gate[i]), silu = to_float(from_float(g / (1.0f + expf(-g))));
            row[i] = to_float(from_float(silu * to_float(x[i])));
        }
    const float *input = row ? row : (const float *)x;
    void *x_ready = ready_row(input, in_f);
    float *out = sums;
    for (int c = 0; c < count; out += out_f[c], c++) linear_rows(w[c], input, x_ready, bias ? bias[c] : NULL, out, out_f[c], in_f, threads);
#ifdef SLIMKV_BF16
    for (int64_t i = 0; i < total; i++) y[i] = from_float(sums[i]);
#endif
    free(x_ready);
    free(row);
    return 0;
}

/* One token's rows each through its own small matrix, for the per-head products of a decode step
 * (MLA's queries absorbing W_UK and its context through W_UV; LRKV's latent queries and values):
 * row i of x (``rows`` rows of in_f elements, x_stride apart) goes through matrix k = (i /
 * rows_per_matrix) % matrices of ``w`` (matrices one after the other), y row i (out_f elements,
 * y_stride apart) = W_k x_i with W_k out_f x in_f (``transposed`` 0), or x_i W_k with W_k in_f x
 * out_f (``transposed`` 1). float32 sums, rounded once to the element type. torch's batched
 * bfloat16 product of SmolLM2's MLA shapes (9 heads of 64 x 160) took 34-38 us on the development
 * machine (Intel Xeon, one thread), this call 7 us; its plain reference is torch.matmul
 * (tests/ops/test_native_linear.py). Returns 0, 2 on bad arguments, 1 without memory. */
#define HEADS_CHUNK 32 /* outputs whose sums a transposed product keeps in registers over a matrix (two 512-bit, four 256-bit vectors) */
int HEADS_ENTRY(const elem_t *x, int64_t x_stride, int64_t rows, const elem_t *w, int64_t matrices, int64_t rows_per_matrix, int64_t in_f,
                int64_t out_f, int transposed, elem_t *y, int64_t y_stride) {
    if (!x || !w || !y || rows < 1 || matrices < 1 || rows_per_matrix < 1 || in_f < 1 || out_f < 1 || x_stride < in_f || y_stride < out_f) return 2;
    float *xf = (float *)malloc((size_t)(in_f + out_f) * sizeof(float)), *sums = xf + in_f;
    if (!xf) return 1;
    for (int64_t i = 0; i < rows; i++) {
        const elem_t *restrict wk = w + (i / rows_per_matrix) % matrices * in_f * out_f, *xi = x + i * x_stride;
        elem_t *restrict yi = y + i * y_stride;
        for (int64_t c = 0; c < in_f; c++) xf[c] = to_float(xi[c]);
        if (transposed) { /* x_i W_k: each input channel's row of W_k scaled into the sums, HEADS_CHUNK outputs at a time (sums in registers) */
            for (int64_t o0 = 0; o0 < out_f; o0 += HEADS_CHUNK) {
                const int64_t n = out_f - o0 < HEADS_CHUNK ? out_f - o0 : HEADS_CHUNK;
                float chunk[HEADS_CHUNK] = {0};
                if (n == HEADS_CHUNK)
                    for (int64_t c = 0; c < in_f; c++) {
                        const float xc = xf[c];
                        const elem_t *restrict row = wk + c * out_f + o0;
#pragma omp simd
                        for (int64_t o = 0; o < HEADS_CHUNK; o++) chunk[o] += xc * to_float(row[o]);
                    }
                else
                    for (int64_t c = 0; c < in_f; c++) {
                        const float xc = xf[c];
                        const elem_t *restrict row = wk + c * out_f + o0;
                        for (int64_t o = 0; o < n; o++) chunk[o] += xc * to_float(row[o]);
                    }
                for (int64_t o = 0; o < n; o++) yi[o0 + o] = from_float(chunk[o]);
            }
        } else { /* W_k x_i: the linear layers' rows (linear_rows, the build's dot product), one thread */
            void *ready = ready_row(xf, in_f);
            linear_rows(wk, xf, ready, NULL, sums, out_f, in_f, 1);
            free(ready);
            for (int64_t o = 0; o < out_f; o++) yi[o] = from_float(sums[o]);
        }
    }
    free(xf);
    return 0;
}

/* RMS norm of one row, y = x / sqrt(mean(x^2) + eps) * w, in float32 and rounded once to the
 * element type (the plain reference is torch.nn.functional.rms_norm on the float32 row, cast back).
 * Returns 0, or 2 on bad arguments. */
int NORM_ENTRY(const elem_t *x, const elem_t *w, elem_t *y, int64_t n, float eps) {
    if (!x || !w || !y || n < 1) return 2;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += to_float(x[i]) * to_float(x[i]);
    const float scale = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = from_float(to_float(x[i]) * scale * to_float(w[i]));
    return 0;
}

/* RoPE on one token's heads: ``rows`` rows of head_dim elements, contiguous; the first rot_dim
 * channels are adjacent pairs (even e, odd o) turned by rotation[p] = (cos, sin) (float32 pairs, a
 * complex64 row), the rest copied: e cos - o sin and e sin + o cos in float32, rounded once to the
 * element type (the plain reference is slimkv.ops.rope.Rotary's torch path: the complex product in
 * float32). Returns 0, or 2 on bad arguments. */
int ROTATE_ENTRY(const elem_t *x, int64_t rows, int64_t head_dim, int64_t rot_dim, const float *rotation, elem_t *y) {
    if (!x || !rotation || !y || rows < 1 || head_dim < 1 || rot_dim < 0 || rot_dim > head_dim || rot_dim % 2) return 2;
    for (int64_t r = 0; r < rows; r++) {
        const elem_t *xr = x + r * head_dim;
        elem_t *yr = y + r * head_dim;
        for (int64_t p = 0; p < rot_dim / 2; p++) {
            const float e = to_float(xr[2 * p]), o = to_float(xr[2 * p + 1]), c = rotation[2 * p], sn = rotation[2 * p + 1];
            yr[2 * p] = from_float(e * c - o * sn);
            yr[2 * p + 1] = from_float(e * sn + o * c);
        }
        for (int64_t i = rot_dim; i < head_dim; i++) yr[i] = xr[i];
    }
    return 0;
}

/* A pre-norm SwiGLU block's second half for one row, in one call: y = x + down(silu(gate(n)) *
 * up(n)) with n = rms_norm(x) * norm_w, each step as NORM_ENTRY and PROJECT_ENTRY compute it and
 * rounded to the element type where torch's path rounds (n, gate and up, silu, the product, down,
 * the sum). gate_w and up_w are d_ff x d_model, down_w d_model x d_ff, no biases; threads_in for
 * gate and up, threads_out for down. Returns 0, 2 on bad arguments, 1 without memory. */
int SWIGLU_ENTRY(const elem_t *x, const elem_t *norm_w, float eps, const elem_t *gate_w, const elem_t *up_w, const elem_t *down_w,
                 int64_t d_model, int64_t d_ff, elem_t *y, int threads_in, int threads_out) {
    if (!x || !norm_w || !gate_w || !up_w || !down_w || !y || d_model < 1 || d_ff < 1) return 2;
    elem_t *n = (elem_t *)malloc((size_t)(2 * d_model + 2 * d_ff) * sizeof(elem_t)), *gate_up = n + d_model, *m = gate_up + 2 * d_ff;
    if (!n) return 1;
    const elem_t *in_w[2] = {gate_w, up_w}, *out_w[1] = {down_w};
    const int64_t gate_up_f[2] = {d_ff, d_ff}, down_f[1] = {d_model};
    int status = NORM_ENTRY(x, norm_w, n, d_model, eps);
    if (!status) status = PROJECT_ENTRY(n, NULL, d_model, 2, in_w, NULL, gate_up_f, gate_up, threads_in);
    if (!status) status = PROJECT_ENTRY(gate_up + d_ff, gate_up, d_ff, 1, out_w, NULL, down_f, m, threads_out);
    if (!status)
        for (int64_t i = 0; i < d_model; i++) y[i] = from_float(to_float(x[i]) + to_float(m[i]));
    free(n);
    return status;
}
