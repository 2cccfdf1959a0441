/* CompactAdamW's update in one pass over each parameter: decode, AdamW, encode.
 *
 * The same arithmetic as the eager path of fused_optim_dist/_compact_update.py, op for op, in
 * float32 and integer operations that are correctly rounded (or exact), so the bits are the
 * same as eager's: that is what the tests check. It must be compiled without contracting
 * a * b + c into an FMA (-ffp-contract=off) and without -ffast-math; see _compact_kernel.py.
 *
 * One call steps a batch of parameters, each described by a row of int64 fields (PARAM_*)
 * and its gradient's address (in an array of their own: the one field that changes from step
 * to step), read from contiguous tensors on the CPU. Each parameter's step counter (a float32
 * scalar) is incremented here and its bias corrections computed from it in double, as Python
 * does.
 *
 * [Note: the kernel's loops]
 * The work goes one quantization group (32 elements) at a time, in loops of constant length
 * that the compiler unrolls and vectorises, each element decoded, updated and its weight
 * written back while in registers. A group's codes need the group's largest magnitude, known
 * only once all of its elements are updated, so the new momentum and root wait in a buffer of
 * SPAN groups; those groups' scales are then rounded and inverted together, in one loop across
 * groups (per group, the horizontal work and a scalar division cost as much as the group's
 * elements), and the buffered values encoded. A parameter's layout (weight and gradient
 * dtypes, weight error or not, companding or not, 8- or 4-bit roots) selects one of 24
 * specialised copies of the loops (`Layout`'s fields are constants where `step_param` is
 * inlined): no branch per element. IVDEP tells the compiler that the tensors do not overlap,
 * which it cannot prove: without it, it checks before every loop or does not vectorise.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum {
    PARAM_WEIGHT,       /* bfloat16 or float32 */
    PARAM_WEIGHT_ERROR, /* int8, or 0: no error (float32 weights, or no correction) */
    PARAM_A,            /* grouped: exp_avg_code (int8); flat: exp_avg (bfloat16) */
    PARAM_B,            /* grouped: exp_avg_scale (bfloat16); flat: exp_avg_error (int8) */
    PARAM_C,            /* grouped: exp_avg_sq_root_code (uint8; 4-bit: two to a byte, rows of
                           (length + 1) / 2 bytes); flat: exp_avg_sq (bfloat16) */
    PARAM_D,            /* grouped: exp_avg_sq_root_scale (bfloat16); flat: exp_avg_sq_error */
    PARAM_STEP,         /* float32 step counter */
    PARAM_ROWS,
    PARAM_ROW_LENGTH,
    PARAM_FLAGS,
    PARAM_FIELDS
};

enum { FLAG_WEIGHT_BF16 = 1, FLAG_GRAD_BF16 = 2, FLAG_GROUPED = 4, FLAG_ROOT4 = 8 };

#define GROUP_SIZE 32
#define SPAN 32 /* groups whose scales are rounded together */
#define PREFETCH_DISTANCE 3 /* parameters ahead; see [Note: prefetching the next parameters] */
#define MOMENTUM_LEVELS 127.0f
#define ROOT_LEVELS 255.0f
#define ROOT4_SQUARED_LEVELS 225.0f /* 4-bit codes: 15 levels of the root's square root */
#define SMALLEST_SCALE_BITS 0x0380 /* bfloat16 bits of 2**-120, the smallest scale kept */

#if defined(__clang__)
#define INLINE static inline __attribute__((always_inline))
#define NOINLINE __attribute__((noinline))
#define IVDEP _Pragma("clang loop vectorize(assume_safety)")
#define PREFETCH(address) __builtin_prefetch((address), 1)
#elif defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#define NOINLINE __attribute__((noinline))
#define IVDEP _Pragma("GCC ivdep")
#define PREFETCH(address) __builtin_prefetch((address), 1)
#else
#define INLINE static inline
#define NOINLINE
#define IVDEP
#define PREFETCH(address) ((void)(address))
#endif

typedef struct {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, ic2, step_size;
} Hyper;

/* What selects a specialised copy of the loops. */
typedef struct {
    int weight_bf16, weight_error, grad_bf16, compand, root4;
} Layout;

/* A parameter's tensors (the moments' meaning depends on the kind: see PARAM_A..PARAM_D). */
typedef struct {
    void *weight;
    int8_t *weight_error;
    const void *grad;
    void *a, *b, *c, *d;
} Tensors;

INLINE float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE uint32_t float_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

INLINE float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

/* Round to nearest even, as c10::BFloat16; a NaN as 0xFFFF, as torch's vectorised conversion
 * (eager's) writes it, where c10::BFloat16 writes 0x7FC0: see [Note: non-finite values] in
 * _compact_codes.py. */
INLINE uint16_t float_to_bf16(float f) {
    const uint32_t u = float_to_bits(f);
    return f != f ? 0xFFFF : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* [Note: 24-bit weights] of _compact_codes.py: bits(x) = bits(high) << 16 + error << 8; a zero
 * with a negative error (no split's, a value written since) is zero. */
INLINE float join24(uint16_t high, int8_t error) {
    const int32_t kept = (high & 0x7FFF) == 0 && error < 0 ? 0 : error;
    return bits_to_float(((uint32_t)high << 16) + ((uint32_t)kept << 8));
}

/* bits(x) rounded to nearest 2**8 (ties up), then split: the upper 16 bits rounded to nearest
 * and the rest, -128..127 units of 2**8. A NaN is not rounded (the carry of 0x7FFFFFFF would
 * reach the sign: -0.0): its upper half with the quiet bit set, and no error. */
INLINE void split24(float value, uint16_t *high, int8_t *error) {
    const uint32_t bits = float_to_bits(value);
    const uint32_t rounded = (bits + 0x80u) & ~0xFFu;
    const uint32_t h = (rounded + 0x8000u) >> 16;
    const int nan = value != value;
    *high = nan ? (uint16_t)((bits >> 16) | 0x40u) : (uint16_t)h;
    *error = nan ? 0 : (int8_t)((int32_t)(rounded - (h << 16)) >> 8);
}

/* A plain comparison: fmaxf is a library call, this a single instruction. */
INLINE float larger(float a, float b) { return a > b ? a : b; }

/* An integer-valued float (or an infinity, or NaN) as an integer clamped to [low, high]: eager's
 * clamp, then its conversion. Adding 1.5 * 2**23 puts an integer below 2**22 in magnitude in
 * the float's low bits, exactly; an infinity lands beyond the bound of its sign (a NaN beyond
 * one of them: the momentum's caller recodes it 0, as eager codes it). A float clamp before
 * the conversion gives the same values but GCC compiles it into mask-register code that made
 * the whole kernel a third slower (measured); this is integer arithmetic, with no undefined
 * conversion of an out-of-range float. */
INLINE int32_t clamp_level(float level, int32_t low, int32_t high) {
    const float shifted = level + 12582912.0f;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    const int32_t q = bits - 0x4B400000;
    return q < low ? low : q > high ? high : q;
}

/* A magnitude's bits: non-negative floats (NaN above everything) order as their bits do. */
INLINE uint32_t magnitude_bits(float f) { return float_to_bits(f) & 0x7FFFFFFFu; }

INLINE float load_weight(Tensors t, int64_t i, Layout l) {
    if (l.weight_error) return join24(((const uint16_t *)t.weight)[i], t.weight_error[i]);
    if (l.weight_bf16) return bf16_to_float(((const uint16_t *)t.weight)[i]);
    return ((const float *)t.weight)[i];
}

INLINE void store_weight(Tensors t, int64_t i, float x, Layout l) {
    if (l.weight_error) {
        split24(x, &((uint16_t *)t.weight)[i], &t.weight_error[i]);
    } else if (l.weight_bf16) {
        ((uint16_t *)t.weight)[i] = float_to_bf16(x);
    } else {
        ((float *)t.weight)[i] = x;
    }
}

INLINE float load_grad(Tensors t, int64_t i, Layout l) {
    return l.grad_bf16 ? bf16_to_float(((const uint16_t *)t.grad)[i])
                       : ((const float *)t.grad)[i];
}

/* AdamW on one element, in eager's order of single ops: updates m and v, sets root =
 * sqrt(v) (correctly rounded), returns the new weight. */
INLINE float adamw(float x, float g, float *m, float *v, float *root, Hyper h) {
    *m = *m * h.beta1 + g * h.one_minus_beta1;
    *v = *v * h.beta2 + (g * g) * h.one_minus_beta2;
    *root = sqrtf(*v);
    const float denom = *root * h.ic2 + h.eps;
    return x * h.decay - (*m / denom) * h.step_size;
}

/* [Note: 4-bit codes in the kernel]
 * Byte k of a group holds code k in its low nibble and code k + half in its high one (half =
 * ceil(size / 2); see [Note: 4-bit variance] in _compact_codes.py). A whole group's 16 bytes
 * are unpacked and packed eight at a time in 64-bit integers (a code is at most 15, so a
 * shift by 4 moves each into the high nibble of its byte), and the element loops stay 32
 * long, as with 8-bit codes: loops over each half of a group, 16 long, were compiled into
 * 128-bit vectors and took twice as long. */
INLINE void unpack4(const uint8_t *packed, int size, uint8_t *codes) {
    if (size == GROUP_SIZE) {
        for (int w = 0; w < 2; w++) {
            uint64_t bytes;
            memcpy(&bytes, packed + 8 * w, 8);
            const uint64_t low = bytes & 0x0F0F0F0F0F0F0F0Full;
            const uint64_t high = (bytes >> 4) & 0x0F0F0F0F0F0F0F0Full;
            memcpy(codes + 8 * w, &low, 8);
            memcpy(codes + 16 + 8 * w, &high, 8);
        }
        return;
    }
    const int half = (size + 1) / 2;
    for (int k = 0; k < half; k++) {
        codes[k] = packed[k] & 0xF;
        codes[half + k] = packed[k] >> 4; /* the padding nibble lands past the group */
    }
}

INLINE void pack4(const uint8_t *codes, int size, uint8_t *packed) {
    if (size == GROUP_SIZE) {
        for (int w = 0; w < 2; w++) {
            uint64_t low, high;
            memcpy(&low, codes + 8 * w, 8);
            memcpy(&high, codes + 16 + 8 * w, 8);
            const uint64_t bytes = low | high << 4;
            memcpy(packed + 8 * w, &bytes, 8);
        }
        return;
    }
    const int half = (size + 1) / 2;
    for (int k = 0; k < half; k++) {
        const int high = half + k < size ? codes[half + k] : 0;
        packed[k] = (uint8_t)(codes[k] | high << 4);
    }
}

/* Decode, update and write back the `size` weights of the group at element `at`, whose root
 * codes start at r_code; the new momentum and root go to m_out and root_out, their largest
 * magnitudes to *m_max, *r_max. */
INLINE void update_group(Tensors t, int64_t at, const uint8_t *r_code, int size,
                         uint16_t m_scale, uint16_t r_scale, Hyper h, Layout l, float *m_out,
                         float *root_out, float *m_max, float *r_max) {
    const int8_t *m_code = (const int8_t *)t.a;
    const float m_factor = bf16_to_float(m_scale);
    const float r_factor = bf16_to_float(r_scale) * (l.root4 ? (float)(1.0 / 225.0)
                                                              : (float)(1.0 / 255.0));
    uint8_t unpacked[GROUP_SIZE + 1];
    if (l.root4) {
        unpack4(r_code, size, unpacked);
        r_code = unpacked;
    }
    uint32_t m_most = 0, r_most = 0;
    IVDEP
    for (int j = 0; j < size; j++) {
        const float c = (float)m_code[at + j];
        float m = l.compand ? c / (-fabsf(c) + 2.0f * MOMENTUM_LEVELS) * m_factor
                            : c * (float)(1.0 / 127.0) * m_factor;
        const float level = (float)r_code[j];
        const float old_root = (l.root4 ? level * level : level) * r_factor;
        float v = old_root * old_root, root;
        const float x = load_weight(t, at + j, l), g = load_grad(t, at + j, l);
        store_weight(t, at + j, adamw(x, g, &m, &v, &root, h), l);
        m_out[j] = m;
        root_out[j] = root;
        const uint32_t m_bits = magnitude_bits(m), r_bits = magnitude_bits(root);
        m_most = m_bits > m_most ? m_bits : m_most;
        r_most = r_bits > r_most ? r_bits : r_most;
    }
    *m_max = bits_to_float(m_most);
    *r_max = bits_to_float(r_most);
}

/* The momentum's code level of y, its ratio to the group's scale, rounded. */
INLINE float momentum_level(float y, Layout l) {
    return l.compand ? rintf(y / (fabsf(y) + 1.0f) * (2.0f * MOMENTUM_LEVELS))
                     : rintf(y * MOMENTUM_LEVELS);
}

/* Encode a group's buffered momentum and root with its scales' factors; its root codes start
 * at r_code. */
INLINE void encode_group(Tensors t, int64_t at, uint8_t *r_code, int size, float m_factor,
                         float r_factor, Layout l, const float *m, const float *root) {
    int8_t *m_code = (int8_t *)t.a;
    IVDEP
    for (int j = 0; j < size; j++) {
        m_code[at + j] = (int8_t)clamp_level(momentum_level(m[j] * m_factor, l), -127, 127);
    }
    if (!(m_factor > 0.0f && m_factor <= FLT_MAX)) {
        /* A NaN or infinite scale (a NaN or infinite momentum): a NaN level is coded 0, as eager
         * codes it (see [Note: non-finite values] in _compact_codes.py), where clamp_level put
         * it beyond a bound. Per group: a test per element in the loop above made the kernel
         * about 10% slower (measured). */
        for (int j = 0; j < size; j++) {
            const float level = momentum_level(m[j] * m_factor, l);
            if (level != level) m_code[at + j] = 0;
        }
    }
    /* Nearest, but at least 1 for a positive root (see [Note: 8-bit moments]): eager's
     * ceil(min(level, 1)) of a non-negative level, written so that it vectorises. 4 bits: the
     * level is the square root of the ratio times 15**2 ([Note: 4-bit variance]). */
    uint8_t codes[GROUP_SIZE];
    uint8_t *out = l.root4 ? codes : r_code;
    IVDEP
    for (int j = 0; j < size; j++) {
        const float level = l.root4 ? sqrtf(root[j] * r_factor) : root[j] * r_factor;
        const float rounded = larger(rintf(level), level > 0.0f ? 1.0f : 0.0f);
        out[j] = (uint8_t)clamp_level(rounded, 0, l.root4 ? 15 : 255);
    }
    if (l.root4) pack4(codes, size, r_code);
}

/* A bfloat16 scale below 2**-120 (exponent field below 7) is stored as 0: its inverse times the
 * levels would overflow (see [Note: 8-bit moments] in _compact_codes.py). */
INLINE uint16_t kept_scale(uint16_t scale) { return scale < SMALLEST_SCALE_BITS ? 0 : scale; }

/* Round `count` groups' largest magnitudes into their bfloat16 scales, and the factors their
 * codes are computed with: against the rounded scale, 1 for an all-zero group. */
INLINE void round_scales(const float *m_max, const float *r_max, uint16_t *m_scale,
                         uint16_t *r_scale, float *m_factor, float *r_factor, int count,
                         Layout l) {
    const float r_levels = l.root4 ? ROOT4_SQUARED_LEVELS : ROOT_LEVELS;
    IVDEP
    for (int k = 0; k < count; k++) {
        const uint16_t ms = kept_scale(float_to_bf16(m_max[k]));
        const uint16_t rs = kept_scale(float_to_bf16(r_max[k]));
        m_scale[k] = ms;
        r_scale[k] = rs;
        m_factor[k] = 1.0f / (ms ? bf16_to_float(ms) : 1.0f);
        r_factor[k] = r_levels / (rs ? bf16_to_float(rs) : 1.0f);
    }
}

/* A parameter of two or more dims: rows of groups, SPAN groups of a row at a time (the last
 * group of a row is short where the row length is not a multiple of 32). */
INLINE void step_rows(Tensors t, int64_t rows, int64_t row_length, Hyper h, Layout l) {
    const int64_t groups_per_row = (row_length + GROUP_SIZE - 1) / GROUP_SIZE;
    const int64_t code_row = l.root4 ? (row_length + 1) / 2 : row_length; /* root code bytes */
    float m[SPAN * GROUP_SIZE], root[SPAN * GROUP_SIZE];
    float m_max[SPAN], r_max[SPAN], m_factor[SPAN], r_factor[SPAN];
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *m_scale = (uint16_t *)t.b + r * groups_per_row;
        uint16_t *r_scale = (uint16_t *)t.d + r * groups_per_row;
        uint8_t *r_code = (uint8_t *)t.c + r * code_row;
        for (int64_t first = 0; first < groups_per_row; first += SPAN) {
            const int64_t in_row = first * GROUP_SIZE, at = r * row_length + in_row;
            const int64_t left = row_length - in_row; /* elements */
            const int full = left >= SPAN * GROUP_SIZE ? SPAN : (int)(left / GROUP_SIZE);
            const int rest = full == SPAN ? 0 : (int)(left % GROUP_SIZE); /* a short group */
            /* Whole groups with a constant size, which the compiler unrolls, then a short one. */
#define GROUP_CODES(o) (r_code + (l.root4 ? (in_row + (o)) / 2 : in_row + (o)))
            for (int k = 0; k < full; k++) {
                const int o = k * GROUP_SIZE;
                update_group(t, at + o, GROUP_CODES(o), GROUP_SIZE, m_scale[first + k],
                             r_scale[first + k], h, l, m + o, root + o, &m_max[k], &r_max[k]);
            }
            if (rest) {
                const int o = full * GROUP_SIZE;
                update_group(t, at + o, GROUP_CODES(o), rest, m_scale[first + full],
                             r_scale[first + full], h, l, m + o, root + o, &m_max[full],
                             &r_max[full]);
            }
            round_scales(m_max, r_max, m_scale + first, r_scale + first, m_factor, r_factor,
                         full + (rest > 0), l);
            for (int k = 0; k < full; k++) {
                const int o = k * GROUP_SIZE;
                encode_group(t, at + o, GROUP_CODES(o), GROUP_SIZE, m_factor[k], r_factor[k], l,
                             m + o, root + o);
            }
            if (rest) {
                const int o = full * GROUP_SIZE;
                encode_group(t, at + o, GROUP_CODES(o), rest, m_factor[full], r_factor[full], l,
                             m + o, root + o);
            }
#undef GROUP_CODES
        }
    }
}

/* A parameter of at most one dim: each moment a 24-bit value (bfloat16 and an int8 error). */
INLINE void step_flat(Tensors t, int64_t numel, Hyper h, Layout l) {
    uint16_t *m_high = (uint16_t *)t.a, *v_high = (uint16_t *)t.c;
    int8_t *m_error = (int8_t *)t.b, *v_error = (int8_t *)t.d;
    IVDEP
    for (int64_t i = 0; i < numel; i++) {
        float m = join24(m_high[i], m_error[i]), v = join24(v_high[i], v_error[i]), root;
        const float x = load_weight(t, i, l), g = load_grad(t, i, l);
        store_weight(t, i, adamw(x, g, &m, &v, &root, h), l);
        split24(m, &m_high[i], &m_error[i]);
        split24(v, &v_high[i], &v_error[i]);
    }
}

INLINE void step_param(Tensors t, const int64_t *p, Hyper h, Layout l) {
    if (p[PARAM_FLAGS] & FLAG_GROUPED) {
        step_rows(t, p[PARAM_ROWS], p[PARAM_ROW_LENGTH], h, l);
    } else {
        step_flat(t, p[PARAM_ROWS] * p[PARAM_ROW_LENGTH], h, l);
    }
}

/* step_param with the layout's fields as constants: one specialised copy per layout (an
 * error is only read with bfloat16 weights), in one function per root width. Measured: with
 * all 24 copies in one function, GCC compiled the 8-bit ones 10% slower. */
#define LAYOUT(r, w, e, g, c)                                                                \
    case (w << 3 | e << 2 | g << 1 | c):                                                     \
        step_param(t, p, h, (Layout){w, e, g, c, r});                                        \
        break;
#define STEP_WIDTH(name, r)                                                                  \
    static NOINLINE void name(Tensors t, const int64_t *p, Hyper h, int key) {               \
        switch (key) {                                                                       \
            LAYOUT(r, 1, 1, 1, 1) LAYOUT(r, 1, 1, 1, 0) LAYOUT(r, 1, 1, 0, 1)                 \
            LAYOUT(r, 1, 1, 0, 0) LAYOUT(r, 1, 0, 1, 1) LAYOUT(r, 1, 0, 1, 0)                 \
            LAYOUT(r, 1, 0, 0, 1) LAYOUT(r, 1, 0, 0, 0) LAYOUT(r, 0, 0, 1, 1)                 \
            LAYOUT(r, 0, 0, 1, 0) LAYOUT(r, 0, 0, 0, 1) LAYOUT(r, 0, 0, 0, 0)                 \
        }                                                                                    \
    }
STEP_WIDTH(step_root8, 0)
STEP_WIDTH(step_root4, 1)
#undef STEP_WIDTH
#undef LAYOUT

static void step_specialised(Tensors t, const int64_t *p, Hyper h, int compand) {
    const int64_t flags = p[PARAM_FLAGS];
    const int weight_bf16 = (flags & FLAG_WEIGHT_BF16) != 0;
    const int weight_error = weight_bf16 && t.weight_error != 0;
    const int grad_bf16 = (flags & FLAG_GRAD_BF16) != 0;
    const int key = weight_bf16 << 3 | weight_error << 2 | grad_bf16 << 1 | (compand != 0);
    if (flags & FLAG_ROOT4) {
        step_root4(t, p, h, key);
    } else {
        step_root8(t, p, h, key);
    }
}

/* [Note: prefetching the next parameters]
 * In training a unit's state is cold when its step runs (a backward pass ran since its last
 * one), and each parameter starts seven streams of memory (weight, error, gradient, codes,
 * scales, step). On small tensors the kernel waits for those first cache lines more than it
 * computes: asking for them PREFETCH_DISTANCE parameters ahead made the many-tiny and
 * many-small units' steps about 10% faster with cold caches (measured against fused AdamW,
 * benchmarks/compact_adamw_cost.py). Prefetching within a large tensor made it slower: the
 * hardware follows the streams once started. A prefetch never faults, and changes no value. */
INLINE void prefetch_param(const int64_t *p, int64_t grad) {
    static const int fields[] = {PARAM_WEIGHT, PARAM_WEIGHT_ERROR, PARAM_A, PARAM_B,
                                 PARAM_C,      PARAM_D,            PARAM_STEP};
    for (unsigned i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        if (p[fields[i]]) PREFETCH((const void *)p[fields[i]]);
    }
    if (grad) PREFETCH((const void *)grad);
}

/* Steps `count` parameters: `params` holds PARAM_FIELDS int64 per parameter, `grads` the
 * address of each one's gradient. */
void compact_adamw_step(const int64_t *params, const int64_t *grads, int64_t count, double lr,
                        double beta1, double beta2, double eps, double weight_decay,
                        int compand) {
    Hyper h;
    h.beta1 = (float)beta1;
    h.one_minus_beta1 = (float)(1.0 - beta1);
    h.beta2 = (float)beta2;
    h.one_minus_beta2 = (float)(1.0 - beta2);
    h.eps = (float)eps;
    h.decay = (float)(1.0 - lr * weight_decay);
    float last_step = 0.0f;
    for (int64_t k = 1; k < PREFETCH_DISTANCE && k < count; k++) {
        prefetch_param(params + k * PARAM_FIELDS, grads[k]);
    }
    for (int64_t k = 0; k < count; k++) {
        const int64_t *p = params + k * PARAM_FIELDS;
        if (k + PREFETCH_DISTANCE < count) {
            prefetch_param(p + PREFETCH_DISTANCE * PARAM_FIELDS, grads[k + PREFETCH_DISTANCE]);
        }
        const Tensors t = {(void *)p[PARAM_WEIGHT], (int8_t *)p[PARAM_WEIGHT_ERROR],
                           (const void *)grads[k],  (void *)p[PARAM_A],
                           (void *)p[PARAM_B],      (void *)p[PARAM_C],
                           (void *)p[PARAM_D]};
        float *step = (float *)p[PARAM_STEP];
        *step = *step + 1.0f;
        if (k == 0 || *step != last_step) { /* a batch's counts are usually all the same */
            const double s = (double)*step;
            h.ic2 = (float)(1.0 / sqrt(1.0 - pow(beta2, s)));
            h.step_size = (float)(lr / (1.0 - pow(beta1, s)));
            last_step = *step;
        }
        step_specialised(t, p, h, compand);
    }
}
