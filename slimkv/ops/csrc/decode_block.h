/* A pre-norm decoder block's decode step for one token in one call, or in two around an
 * attention that keeps its own kind of cache (included by decode_attention.c after
 * decode_linear.h): a decode step of a small model pays Python and dispatch costs per call (some
 * ten calls and tens of torch operations a layer: about 300 us a SmolLM2 layer on the development
 * machine, the --parts pages' "rest"), and these entries make them one or two.
 *
 *   n = rms_norm(x) * attn_norm;  q, k, v = Wq n, Wk n, Wv n;  q, k = RoPE(q), RoPE(k)
 *   each KV head's cache gets its new rows k, v;  a = attention(q, each head's cached rows)
 *   h = x + Wo a;  y = h + down(silu(gate(m)) * up(m)), m = rms_norm(h) * mlp_norm
 *
 * Each step is the entry the module path calls for it (NORM_ENTRY, PROJECT_ENTRY, ROTATE_ENTRY,
 * ENTRY, SWIGLU_ENTRY) and every value is rounded to the element type where the module path
 * rounds it (the attention's output once, the residual sum once), so the result is the module
 * path's to the bit: tests/model/test_block_step.py compares them, and the module path, whose
 * every kernel has its own plain reference, is these entries' reference. BLOCK_INPUT_ENTRY is the
 * first line, BLOCK_OUTPUT_ENTRY the last (LATENT_INPUT_ENTRY the first line of an MLA block, whose
 * absorbed attention runs in Python between the two), BLOCK_ENTRY all three with the attention between (one
 * batch row, no biases, no query/key norms, each KV head's cache a few segments: a GQA cache's
 * rows (or int8 / int4 codes and a full-precision window), or per-head roles' exact rows and
 * sinks + window; slimkv/model/block_step.py checks, and takes the module path otherwise). */

#define BLOCK_FIELDS 21 /* integers in the block entry's ``fields`` */

int ENTRY(const int64_t *fields, int n_segments, float *out, int64_t batch, int64_t kv_heads, int64_t groups, int64_t dim, int64_t v_dim,
          float scale, int threads); /* decode_attention.c, below */
int QUANTIZED_ENTRY(const int64_t *fields, int n_segments, float *out, int64_t batch, int64_t kv_heads, int64_t groups, int64_t dim,
                    int64_t v_dim, float scale, int threads); /* decode_quantized.h, below */

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

/* An MLA block's first half up to its attention (slimkv.attention.mla, as a conversion from a GQA
 * model makes it: no query latent, no latent norm, no query/key norms, no biases): out =
 * [q (n_heads rows of qk_dim) | the cache row (row_width)] of x's row: the norm (NORM_ENTRY), q and
 * the row [k_pe | c] projected in one PROJECT_ENTRY call, the first rot_dim channels of each query
 * head and of the row rotated (ROTATE_ENTRY), as the module path's queries() and latent_rows()
 * call them. Returns 0, 2 on bad arguments, 1 without memory. */
int LATENT_INPUT_ENTRY(const elem_t *x, const elem_t *attn_norm, float eps, const elem_t *wq, const elem_t *wkv, int64_t d_model, int64_t n_heads,
                       int64_t qk_dim, int64_t row_width, int64_t rot_dim, const float *rotation, elem_t *out, int threads) {
    if (!x || !attn_norm || !wq || !wkv || !out || !rotation || d_model < 1 || n_heads < 1 || qk_dim < rot_dim || row_width < rot_dim) return 2;
    elem_t *normed = (elem_t *)malloc((size_t)d_model * sizeof(elem_t));
    if (!normed) return 1;
    const elem_t *in_w[2] = {wq, wkv};
    const int64_t widths[2] = {n_heads * qk_dim, row_width};
    int status = NORM_ENTRY(x, attn_norm, normed, d_model, eps);
    if (!status) status = PROJECT_ENTRY(normed, NULL, d_model, 2, in_w, NULL, widths, out, threads);
    if (!status) status = ROTATE_ENTRY(out, n_heads, qk_dim, rot_dim, rotation, out); /* in place: each pair is read before it is written */
    if (!status) status = ROTATE_ENTRY(out + widths[0], 1, row_width, rot_dim, rotation, out + widths[0]);
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

/* The whole block: BLOCK_INPUT_ENTRY, each KV head's new key and value rows written into its
 * cache, the attention of each cache role over its segments (ENTRY, or QUANTIZED_ENTRY over
 * codes), BLOCK_OUTPUT_ENTRY.
 *
 * ``fields``, first what a block keeps from step to step: the addresses of attn_norm, wq, wk, wv,
 * wo, mlp_norm, gate, up, down, then d_model, n_heads, kv_heads, head_dim, rot_dim, d_ff; then the
 * step's: the addresses of x and y (may be x), and threads for q/k/v, Wo, gate/up and down.
 *
 * ``roles``: ``n_roles`` cache roles one after the other, each a set of KV heads whose cache has
 * the same segments (a GQA block: one role, every head; per-head roles: the exact heads, and the
 * heads keeping sinks and a window). A role is ROLE_FIELDS integers, then its ``heads`` KV head
 * indices (head i of the role is KV head heads[i]), then its segments:
 *   heads, segments, threads for its attention, the address where head 0's new key row goes and
 *   the elements from one head's to the next, the same for the value row, and whether the
 *   segments are QUANTIZED_ENTRY's (1: some hold int8 / int4 codes, QFIELDS each) or ENTRY's (0:
 *   FIELDS each), read one after the other under one softmax as that entry reads them (head 0 of
 *   each at the role's head 0; each segment's first field, the queries' address, is filled in here).
 * The new rows are written before any segment is read, so a segment may hold them.
 * The role's query rows (the ``n_heads / kv_heads`` queries of each of its heads) are gathered as
 * float32, attended, and their outputs rounded to the element type into the attention's output
 * at their heads' places: what the module path's per-role calls and their concatenation give.
 * ``rotation``: the token's (cos, sin) pairs, rot_dim / 2 of them. Returns 0, 2 on bad arguments,
 * 1 without memory or threads. */
#define ROLE_FIELDS 8
/* Integers in a role of ``roles`` (its fields, its heads, its segments). */
static inline int64_t role_length(const int64_t *role) { return ROLE_FIELDS + role[0] + role[1] * (role[7] ? QFIELDS : FIELDS); }
int BLOCK_ENTRY(const int64_t *fields, const int64_t *roles, int n_roles, const float *rotation, float attn_eps, float mlp_eps, float scale) {
#define ADDRESS(i) ((elem_t *)(intptr_t)fields[i])
    const elem_t *attn_norm = ADDRESS(0), *wq = ADDRESS(1), *wk = ADDRESS(2), *wv = ADDRESS(3), *wo = ADDRESS(4), *mlp_norm = ADDRESS(5);
    const elem_t *gate = ADDRESS(6), *up = ADDRESS(7), *down = ADDRESS(8), *x = ADDRESS(15);
    elem_t *y = ADDRESS(16);
#undef ADDRESS
    const int64_t d_model = fields[9], n_heads = fields[10], kv_heads = fields[11], head_dim = fields[12], rot_dim = fields[13], d_ff = fields[14];
    const int threads_qkv = (int)fields[17], threads_o = (int)fields[18], threads_gate_up = (int)fields[19], threads_down = (int)fields[20];
    if (!roles || n_roles < 1 || kv_heads < 1 || n_heads % kv_heads || head_dim < 1) return 2;
    const int64_t q_f = n_heads * head_dim, kv_f = kv_heads * head_dim, group = n_heads / kv_heads;
    float *q_float = (float *)malloc((size_t)(2 * q_f) * sizeof(float)), *out = q_float + q_f;
    elem_t *qkv = (elem_t *)malloc((size_t)(2 * q_f + 2 * kv_f) * sizeof(elem_t)), *attended = qkv + q_f + 2 * kv_f;
    if (!q_float || !qkv) {
        free(q_float);
        free(qkv);
        return 1;
    }
    int status = BLOCK_INPUT_ENTRY(x, attn_norm, attn_eps, wq, wk, wv, d_model, n_heads, kv_heads, head_dim, rot_dim, rotation, qkv, threads_qkv);
    const int64_t *role = roles;
    for (int r = 0; r < n_roles && !status; r++) { /* the new key and value rows, written into each role's cache */
        const int64_t heads = role[0], n_segments = role[1];
        elem_t *k_new = (elem_t *)(intptr_t)role[3], *v_new = (elem_t *)(intptr_t)role[5];
        if (heads < 1 || n_segments < 1 || n_segments > MAX_SEGMENTS || !k_new || !v_new) {
            status = 2;
            break;
        }
        for (int64_t i = 0; i < heads; i++) {
            const int64_t g = role[ROLE_FIELDS + i];
            if (g < 0 || g >= kv_heads) {
                status = 2;
                break;
            }
            memcpy(k_new + i * role[4], qkv + q_f + g * head_dim, (size_t)head_dim * sizeof(elem_t));
            memcpy(v_new + i * role[6], qkv + q_f + kv_f + g * head_dim, (size_t)head_dim * sizeof(elem_t));
        }
        role += role_length(role);
    }
    role = roles;
    for (int r = 0; r < n_roles && !status; r++) { /* each role's attention over its segments */
        const int64_t heads = role[0], n_segments = role[1], *head = role + ROLE_FIELDS, *seg = head + heads;
        for (int64_t i = 0; i < heads; i++)
            for (int64_t j = 0; j < group; j++)
                for (int64_t c = 0; c < head_dim; c++) q_float[(i * group + j) * head_dim + c] = to_float(qkv[(head[i] * group + j) * head_dim + c]);
        const int64_t width = role[7] ? QFIELDS : FIELDS;
        int64_t segments[MAX_SEGMENTS * QFIELDS];
        memcpy(segments, seg, (size_t)(n_segments * width) * sizeof(int64_t));
        for (int64_t s = 0; s < n_segments; s++) segments[s * width] = (int64_t)(intptr_t)q_float;
        status = (role[7] ? QUANTIZED_ENTRY : ENTRY)(segments, (int)n_segments, out, 1, heads, group, head_dim, head_dim, scale, (int)role[2]);
        for (int64_t i = 0; i < heads && !status; i++) /* the role's outputs at their heads' places, in the element type as the module path has them */
            for (int64_t j = 0; j < group; j++)
                for (int64_t c = 0; c < head_dim; c++) attended[(head[i] * group + j) * head_dim + c] = from_float(out[(i * group + j) * head_dim + c]);
        role += role_length(role);
    }
    if (!status)
        status = BLOCK_OUTPUT_ENTRY(x, attended, wo, mlp_norm, mlp_eps, gate, up, down, d_model, q_f, d_ff, y, threads_o, threads_gate_up, threads_down);
    free(q_float);
    free(qkv);
    return status;
}
