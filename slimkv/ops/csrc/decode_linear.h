/* One row through a linear layer, y = W x (+ bias), for decode steps (included by
 * decode_attention.c, after elem_t and to_float): a decode step multiplies one token's row by
 * every projection's weights, a matrix-vector product whose time is reading the weights, and
 * torch's CPU matmul for one row was measured at about half the read bandwidth here (15 GB/s
 * against 30 for this loop, one thread, weights not in cache).
 *
 * One weight row at a time, in memory order, in plain C written for the compiler to vectorize on
 * the build's target; float32 sums (bfloat16 weights widened as they are read). The order matters:
 * reading the weights as one sequential stream ran at 0.9 of a plain sum's read rate on the
 * development machine (AMD EPYC, one thread, 538 MB of SmolLM2 projections), where interleaving
 * four rows (four streams 2.3 KB apart, the earlier loop) ran at 0.5. Rows are split over
 * ``threads`` POSIX threads. The plain reference is torch.nn.functional.linear;
 * tests/ops/test_native_linear.py compares them. */

typedef struct {
    const elem_t *w, *bias;
    const float *x;
    float *y;
    int64_t in_f, first, last; /* output rows [first, last) */
} LinearJob;

static void *run_linear_job(void *arg) {
    const LinearJob *job = (const LinearJob *)arg;
    const float *restrict x = job->x;
    const int64_t in_f = job->in_f;
    for (int64_t o = job->first; o < job->last; o++) {
        const elem_t *restrict w = job->w + o * in_f;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < in_f; i++) s += to_float(w[i]) * x[i];
        job->y[o] = s;
    }
    if (job->bias)
        for (int64_t o = job->first; o < job->last; o++) job->y[o] += to_float(job->bias[o]);
    return NULL;
}

/* y (out_f floats) = w (out_f x in_f, rows contiguous) . x (in_f floats) + bias (out_f, or NULL).
 * Returns 0, or 2 on bad arguments. */
int LINEAR_ENTRY(const elem_t *w, const float *x, const elem_t *bias, float *y, int64_t out_f, int64_t in_f, int threads) {
    if (!w || !x || !y || out_f < 1 || in_f < 1) return 2;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (threads > out_f / 4) threads = out_f / 4 > 0 ? (int)(out_f / 4) : 1;
    LinearJob jobs[64];
    for (int t = 0; t < threads; t++) /* whole groups of four rows per thread */
        jobs[t] = (LinearJob){w, bias, x, y, in_f, out_f / 4 * t / threads * 4, t + 1 == threads ? out_f : out_f / 4 * (t + 1) / threads * 4};
    run_on_threads(run_linear_job, jobs, sizeof *jobs, threads, threads);
    return 0;
}

/* A decode step's projections that share one input row, in one call (a decode step pays the
 * Python and dispatch cost of every call; a layer's q, k and v, or its MLP's gate and up, read
 * one row): y[c] = w[c] . x + bias[c] for c < count, each as LINEAR_ENTRY computes it, written one
 * after the other into y (the sum of out_f floats). With
 * ``gate`` (in_f floats), the input is silu(gate) * x instead (SwiGLU's down projection; the plain
 * reference is torch.nn.functional.silu(gate) * x, float32). Returns 0, or 2 on bad arguments
 * (1: no memory for the SwiGLU row). */
int PROJECT_ENTRY(const float *x, const float *gate, int64_t in_f, int count, const elem_t *const *w, const elem_t *const *bias,
                  const int64_t *out_f, float *y, int threads) {
    if (!x || !w || !out_f || !y || count < 1 || in_f < 1) return 2;
    const float *input = x;
    float *glu = NULL;
    if (gate) {
        glu = (float *)malloc((size_t)in_f * sizeof(float));
        if (!glu) return 1;
        for (int64_t i = 0; i < in_f; i++) glu[i] = gate[i] / (1.0f + expf(-gate[i])) * x[i];
        input = glu;
    }
    int status = 0;
    for (int c = 0; c < count && status == 0; y += out_f[c], c++) status = LINEAR_ENTRY(w[c], input, bias ? bias[c] : NULL, y, out_f[c], in_f, threads);
    free(glu);
    return status;
}

/* RMS norm of one row, y = x / sqrt(mean(x^2) + eps) * w, in float32 (the plain reference is
 * torch.nn.functional.rms_norm on the float32 row). Returns 0, or 2 on bad arguments. */
int NORM_ENTRY(const float *x, const elem_t *w, float *y, int64_t n, float eps) {
    if (!x || !w || !y || n < 1) return 2;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float scale = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * scale * to_float(w[i]);
    return 0;
}
