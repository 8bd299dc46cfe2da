/* A pre-norm GQA decoder block's decode step for one token in one call, or in two around an
 * attention that keeps its own kind of cache (included by decode_attention.c after
 * decode_linear.h): a decode step of a small model pays Python and dispatch costs per call (some
 * ten calls and tens of torch operations a layer: about 300 us a SmolLM2 layer on the development
 * machine, the --parts pages' "rest"), and these entries make them one or two.
 *
 *   n = rms_norm(x) * attn_norm;  q, k, v = Wq n, Wk n, Wv n;  q, k = RoPE(q), RoPE(k)
 *   the cache's rows at ``row`` = k, v;  a = attention(q, the rows first .. row)
 *   h = x + Wo a;  y = h + down(silu(gate(m)) * up(m)), m = rms_norm(h) * mlp_norm
 *
 * Each step is the entry the module path calls for it (NORM_ENTRY, PROJECT_ENTRY, ROTATE_ENTRY,
 * ENTRY, SWIGLU_ENTRY) and every value is rounded to the element type where the module path
 * rounds it (the attention's output once, the residual sum once), so the result is the module
 * path's to the bit: tests/model/test_block_step.py compares them, and the module path, whose
 * every kernel has its own plain reference, is these entries' reference. BLOCK_INPUT_ENTRY is the
 * first line, BLOCK_OUTPUT_ENTRY the last, BLOCK_ENTRY all three with the attention between (one
 * batch row, no biases, no query/key norms, full-precision cache rows; slimkv/model/block_step.py
 * checks, and takes the module path otherwise). */

#define BLOCK_FIELDS 30 /* integers in the block entry's ``fields`` */

int ENTRY(const int64_t *fields, int n_segments, float *out, int64_t batch, int64_t kv_heads, int64_t groups, int64_t dim, int64_t v_dim,
          float scale, int threads); /* decode_attention.c, below */

/* The block's first half up to the attention: qkv (n_heads + 2 * kv_heads rows of head_dim) = the
 * rotated queries, the rotated keys and the values of x's row (NORM_ENTRY, PROJECT_ENTRY,
 * ROTATE_ENTRY, as the module path calls them). Returns 0, 2 on bad arguments, 1 without memory. */
int BLOCK_INPUT_ENTRY(const elem_t *x, const elem_t *attn_norm, float eps, const elem_t *wq, const elem_t *wk, const elem_t *wv, int64_t d_model,
                      int64_t n_heads, int64_t kv_heads, int64_t head_dim, int64_t rot_dim, const float *rotation, elem_t *qkv, int threads) {
    if (!x || !attn_norm || !wq || !wk || !wv || !qkv || !rotation || d_model < 1 || n_heads < 1 || kv_heads < 1 || head_dim < 1) return 2;
    const int64_t q_f = n_heads * head_dim, kv_f = kv_heads * head_dim;
    elem_t *normed = (elem_t *)malloc((size_t)d_model * sizeof(elem_t));
    if (!normed) return 1;
    const elem_t *in_w[3] = {wq, wk, wv};
    const int64_t qkv_f[3] = {q_f, kv_f, kv_f};
    int status = NORM_ENTRY(x, attn_norm, normed, d_model, eps);
    if (!status) status = PROJECT_ENTRY(normed, NULL, d_model, 3, in_w, NULL, qkv_f, qkv, threads);
    if (!status) status = ROTATE_ENTRY(qkv, n_heads + kv_heads, head_dim, rot_dim, rotation, qkv); /* queries and keys, in place: each pair is read before it is written */
    free(normed);
    return status;
}

/* The block's second half from the attention's output ``attended`` (n_heads * head_dim, in the
 * element type): y = h + down(silu(gate(m)) * up(m)) with h = x + Wo attended rounded once and m =
 * rms_norm(h) * mlp_norm (PROJECT_ENTRY, then SWIGLU_ENTRY). y may be x. Returns 0, 2 on bad
 * arguments, 1 without memory. */
int BLOCK_OUTPUT_ENTRY(const elem_t *x, const elem_t *attended, const elem_t *wo, const elem_t *mlp_norm, float eps, const elem_t *gate,
                       const elem_t *up, const elem_t *down, int64_t d_model, int64_t q_f, int64_t d_ff, elem_t *y, int threads_o, int threads_gate_up,
                       int threads_down) {
    if (!x || !attended || !wo || !mlp_norm || !gate || !up || !down || !y || d_model < 1 || q_f < 1 || d_ff < 1) return 2;
    elem_t *projected = (elem_t *)malloc((size_t)(2 * d_model) * sizeof(elem_t)), *h = projected + d_model;
    if (!projected) return 1;
    const elem_t *o_w[1] = {wo};
    const int64_t o_f[1] = {d_model};
    int status = PROJECT_ENTRY(attended, NULL, q_f, 1, o_w, NULL, o_f, projected, threads_o);
    if (!status) {
        for (int64_t i = 0; i < d_model; i++) h[i] = from_float(to_float(x[i]) + to_float(projected[i]));
        status = SWIGLU_ENTRY(h, mlp_norm, eps, gate, up, down, d_model, d_ff, y, threads_gate_up, threads_down);
    }
    free(projected);
    return status;
}

/* The whole block: BLOCK_INPUT_ENTRY, the new key and value rows written into the cache, the
 * attention over the live rows (ENTRY), BLOCK_OUTPUT_ENTRY. ``fields``, first what a block keeps
 * from step to step: the addresses of attn_norm, wq, wk, wv, wo, mlp_norm, gate, up, down, then
 * d_model, n_heads, kv_heads, head_dim, rot_dim, d_ff; then the step's: the addresses of x, y (may
 * be x), the key rows and the value rows (the cache's storage at row 0 of head 0), their head and
 * row strides (elements: keys, then values), the first live row, the new row, and threads for
 * q/k/v, the attention, Wo, gate/up and down. ``rotation``: the token's (cos, sin) pairs, rot_dim / 2
 * of them. Returns 0, 2 on bad arguments, 1 without memory or threads. */
int BLOCK_ENTRY(const int64_t *fields, const float *rotation, float attn_eps, float mlp_eps, float scale) {
#define ADDRESS(i) ((elem_t *)(intptr_t)fields[i])
    const elem_t *attn_norm = ADDRESS(0), *wq = ADDRESS(1), *wk = ADDRESS(2), *wv = ADDRESS(3), *wo = ADDRESS(4), *mlp_norm = ADDRESS(5);
    const elem_t *gate = ADDRESS(6), *up = ADDRESS(7), *down = ADDRESS(8), *x = ADDRESS(15);
    elem_t *y = ADDRESS(16), *k_rows = ADDRESS(17), *v_rows = ADDRESS(18);
#undef ADDRESS
    const int64_t d_model = fields[9], n_heads = fields[10], kv_heads = fields[11], head_dim = fields[12], rot_dim = fields[13], d_ff = fields[14];
    const int64_t k_head = fields[19], k_row = fields[20], v_head = fields[21], v_row = fields[22], first = fields[23], row = fields[24];
    const int threads_qkv = (int)fields[25], threads_attention = (int)fields[26], threads_o = (int)fields[27];
    const int threads_gate_up = (int)fields[28], threads_down = (int)fields[29];
    if (!k_rows || !v_rows || kv_heads < 1 || n_heads % kv_heads || head_dim < 1 || first < 0 || row < first) return 2;
    const int64_t q_f = n_heads * head_dim, kv_f = kv_heads * head_dim;
    float *q_float = (float *)malloc((size_t)(2 * q_f) * sizeof(float)), *out = q_float + q_f;
    elem_t *qkv = (elem_t *)malloc((size_t)(2 * q_f + 2 * kv_f) * sizeof(elem_t)), *attended = qkv + q_f + 2 * kv_f;
    if (!q_float || !qkv) {
        free(q_float);
        free(qkv);
        return 1;
    }
    int status = BLOCK_INPUT_ENTRY(x, attn_norm, attn_eps, wq, wk, wv, d_model, n_heads, kv_heads, head_dim, rot_dim, rotation, qkv, threads_qkv);
    if (!status) {
        for (int64_t g = 0; g < kv_heads; g++) { /* the new key and value rows, written into the cache */
            memcpy(k_rows + g * k_head + row * k_row, qkv + q_f + g * head_dim, (size_t)head_dim * sizeof(elem_t));
            memcpy(v_rows + g * v_head + row * v_row, qkv + q_f + kv_f + g * head_dim, (size_t)head_dim * sizeof(elem_t));
        }
        for (int64_t i = 0; i < q_f; i++) q_float[i] = to_float(qkv[i]);
        const int64_t segment[FIELDS] = {(int64_t)(intptr_t)q_float, (int64_t)(intptr_t)(k_rows + first * k_row),
                                         (int64_t)(intptr_t)(v_rows + first * v_row), row - first + 1, kv_heads * k_head, k_head, k_row,
                                         kv_heads * v_head, v_head, v_row};
        status = ENTRY(segment, 1, out, 1, kv_heads, n_heads / kv_heads, head_dim, head_dim, scale, threads_attention);
    }
    if (!status) {
        for (int64_t i = 0; i < q_f; i++) attended[i] = from_float(out[i]); /* the attention's output in the element type, as the module path has it */
        status = BLOCK_OUTPUT_ENTRY(x, attended, wo, mlp_norm, mlp_eps, gate, up, down, d_model, q_f, d_ff, y, threads_o, threads_gate_up, threads_down);
    }
    free(q_float);
    free(qkv);
    return status;
}
