/* Quantization of cache rows into int8 / int4 codes (included by decode_attention.c, after elem_t
 * and to_float): the fast path of slimkv.ops.quantize.quantize_groups, which a quantized cache
 * calls every decode step for the row that leaves its residual window (a dozen torch calls for
 * one row, per buffer and layer). The same arithmetic in the same float32 operations: each group
 * of ``group`` channels (the last padded by repeating the row's last channel) stores its minimum
 * rounded down and its step (max - stored minimum) / levels rounded up to the cache's element type,
 * and codes round((x - minimum) / step) to nearest even, clamped to the levels; int4 packs channel
 * 2j in the low nibble of byte j. tests/ops/test_native_quantized.py checks that the codes equal
 * quantize_groups' exactly and the scales and minima in value (a zero minimum may differ in sign). */
#include <float.h>

#ifdef SLIMKV_BF16
/* x in the element type, rounded down (direction < 0) or up where the cast is inexact, as quantize._round_toward. */
static inline elem_t stored_toward(float x, int direction) {
    uint16_t y = from_float(x);
    const float yf = to_float(y);
    if (direction < 0 && yf > x) y = (y & 0x7FFFu) == 0 ? 0x8001u : (y & 0x8000u) ? (uint16_t)(y + 1) : (uint16_t)(y - 1);
    if (direction > 0 && yf < x) y = (y & 0x7FFFu) == 0 ? 0x0001u : (y & 0x8000u) ? (uint16_t)(y - 1) : (uint16_t)(y + 1);
    return y;
}
#else
static inline elem_t stored_toward(float x, int direction) { (void)direction; return x; }
#endif

/* ``rows`` rows of ``dim`` elements, ``x_row`` apart -> codes (rows x padded dim * bits / 8 bytes),
 * scales and minima (rows x groups each), all contiguous. Returns 0, or 2 on bad arguments. */
int QUANTIZE_ENTRY(const elem_t *x, int64_t rows, int64_t dim, int64_t x_row, int bits, int64_t group, uint8_t *codes, elem_t *scale, elem_t *low) {
    if (rows < 0 || dim < 1 || group < 2 || (bits != 4 && bits != 8) || (bits == 4 && group % 2)) return 2;
    const int64_t groups = (dim + group - 1) / group, row_bytes = groups * group * bits / 8;
    const float levels = (float)((1 << bits) - 1);
    for (int64_t r = 0; r < rows; r++) {
        const elem_t *xr = x + r * x_row;
        uint8_t *cr = codes + r * row_bytes;
        for (int64_t g = 0; g < groups; g++) {
            float lo = INFINITY, hi = -INFINITY;
            for (int64_t j = 0; j < group; j++) {
                const int64_t c = g * group + j < dim ? g * group + j : dim - 1;
                const float v = to_float(xr[c]);
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
            const elem_t stored_low = stored_toward(lo, -1);
            const float low_f = to_float(stored_low);
            const elem_t stored_scale = stored_toward((hi - low_f) / levels, 1);
            float step = to_float(stored_scale);
            step = step > FLT_MIN ? step : FLT_MIN;
            scale[r * groups + g] = stored_scale;
            low[r * groups + g] = stored_low;
            for (int64_t j = 0; j < group; j++) {
                const int64_t c = g * group + j < dim ? g * group + j : dim - 1;
                float q = __builtin_rintf((to_float(xr[c]) - low_f) / step);
                q = q < 0.0f ? 0.0f : q > levels ? levels : q;
                const uint8_t code = (uint8_t)q;
                const int64_t at = g * group + j;
                if (bits == 8) cr[at] = code;
                else if (at % 2 == 0) cr[at / 2] = code;
                else cr[at / 2] |= (uint8_t)(code << 4);
            }
        }
    }
    return 0;
}
