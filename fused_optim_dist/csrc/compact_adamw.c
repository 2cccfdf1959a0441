/* CompactAdamW's update in one pass over each parameter: decode, AdamW, encode.
 *
 * The same arithmetic as the eager path of fused_optim_dist/compact_adamw.py, op for op, in
 * float32 and integer operations that are correctly rounded (or exact), so the bits are the
 * same as eager's: that is what the tests check. It must be compiled without contracting
 * a * b + c into an FMA (-ffp-contract=off) and without -ffast-math; see _compact_kernel.py.
 *
 * One call steps a batch of parameters, each described by a row of int64 fields (PARAM_*),
 * read from contiguous tensors on the CPU. Each parameter's step counter (a float32 scalar)
 * is incremented here and its bias corrections computed from it in double, as Python does.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum {
    PARAM_WEIGHT,      /* bfloat16 or float32 */
    PARAM_GRAD,        /* bfloat16 or float32 */
    PARAM_WEIGHT_ERROR, /* int8, or 0: no error (float32 weights, or no correction) */
    PARAM_A,           /* grouped: exp_avg_code (int8); flat: exp_avg (bfloat16) */
    PARAM_B,           /* grouped: exp_avg_scale (bfloat16); flat: exp_avg_error (int8) */
    PARAM_C,           /* grouped: exp_avg_sq_root_code (uint8); flat: exp_avg_sq (bfloat16) */
    PARAM_D,           /* grouped: exp_avg_sq_root_scale (bfloat16); flat: exp_avg_sq_error */
    PARAM_STEP,        /* float32 step counter */
    PARAM_ROWS,
    PARAM_ROW_LENGTH,
    PARAM_FLAGS,
    PARAM_FIELDS
};

enum { FLAG_WEIGHT_BF16 = 1, FLAG_GRAD_BF16 = 2, FLAG_GROUPED = 4 };

#define GROUP_SIZE 32
#define BLOCK 1024 /* elements decoded, updated and encoded together: a multiple of GROUP_SIZE */
#define MOMENTUM_LEVELS 127.0f
#define ROOT_LEVELS 255.0f

typedef struct {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay;
    int compand;
} Hyper;

static inline float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t float_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

/* Round to nearest even, as c10::BFloat16. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u = float_to_bits(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* [Note: 24-bit weights] of compact_adamw.py: bits(x) = bits(high) << 16 + error << 8. */
static inline float join24(uint16_t high, int8_t error) {
    return bits_to_float(((uint32_t)high << 16) + ((uint32_t)(int32_t)error << 8));
}

static inline void split24(float value, uint16_t *high, int8_t *error) {
    uint32_t u = float_to_bits(value);
    uint32_t h = (u + 0x8000u) >> 16;
    int32_t e = ((int32_t)(u - (h << 16)) + 0x80) >> 8; /* -128..128 */
    int32_t carry = e == 128;                            /* +128: -128 on the next high */
    *high = (uint16_t)(h + (uint32_t)carry);
    *error = (int8_t)(e - (carry << 8));
}

/* The elements of a block as float32: weights, gradients, moments. */
typedef struct {
    float x[BLOCK], g[BLOCK], m[BLOCK], v[BLOCK], root[BLOCK];
} Block;

static void load_weights(Block *b, const void *weight, const int8_t *error, int bf16,
                         int64_t at, int n) {
    if (error) {
        const uint16_t *w = (const uint16_t *)weight + at;
        for (int j = 0; j < n; j++) b->x[j] = join24(w[j], error[at + j]);
    } else if (bf16) {
        const uint16_t *w = (const uint16_t *)weight + at;
        for (int j = 0; j < n; j++) b->x[j] = bf16_to_float(w[j]);
    } else {
        memcpy(b->x, (const float *)weight + at, n * sizeof(float));
    }
}

static void store_weights(const Block *b, void *weight, int8_t *error, int bf16, int64_t at,
                          int n) {
    if (error) {
        uint16_t *w = (uint16_t *)weight + at;
        for (int j = 0; j < n; j++) split24(b->x[j], &w[j], &error[at + j]);
    } else if (bf16) {
        uint16_t *w = (uint16_t *)weight + at;
        for (int j = 0; j < n; j++) w[j] = float_to_bf16(b->x[j]);
    } else {
        memcpy((float *)weight + at, b->x, n * sizeof(float));
    }
}

static void load_grads(Block *b, const void *grad, int bf16, int64_t at, int n) {
    if (bf16) {
        const uint16_t *g = (const uint16_t *)grad + at;
        for (int j = 0; j < n; j++) b->g[j] = bf16_to_float(g[j]);
    } else {
        memcpy(b->g, (const float *)grad + at, n * sizeof(float));
    }
}

/* AdamW on a block, in eager's order of single ops; root = sqrt(v), correctly rounded. */
static void adamw(Block *b, int n, const Hyper *h, float ic2, float step_size) {
    for (int j = 0; j < n; j++) {
        const float g = b->g[j];
        const float m = b->m[j] * h->beta1 + g * h->one_minus_beta1;
        const float v = b->v[j] * h->beta2 + (g * g) * h->one_minus_beta2;
        const float root = sqrtf(v);
        const float denom = root * ic2 + h->eps;
        const float x = b->x[j] * h->decay;
        b->x[j] = x - (m / denom) * step_size;
        b->m[j] = m;
        b->v[j] = v;
        b->root[j] = root;
    }
}

/* The largest of n non-negative floats (NaN above everything): a max of their bit patterns. */
static inline float largest(const float *values, int n) {
    uint32_t most = 0;
    for (int j = 0; j < n; j++) {
        const uint32_t u = float_to_bits(values[j]) & 0x7FFFFFFFu;
        most = u > most ? u : most;
    }
    return bits_to_float(most);
}

/* Plain comparisons: fminf/fmaxf are library calls, these are single instructions. A NaN
 * comes out as `high` (its code is unspecified in eager too). */
static inline float smaller(float a, float b) { return a < b ? a : b; }
static inline float larger(float a, float b) { return a > b ? a : b; }
static inline float clamp(float value, float low, float high) {
    return smaller(larger(value, low), high);
}

/* Decode a group's 8-bit moments into b->m and b->v. */
static inline void decode_group(Block *restrict b, const int8_t *restrict m_code,
                                const uint8_t *restrict r_code, uint16_t m_scale,
                                uint16_t r_scale, int first, int size, int compand) {
    const float m_factor = bf16_to_float(m_scale);
    const float r_factor = bf16_to_float(r_scale) * (float)(1.0 / 255.0);
    float *restrict m = b->m + first, *restrict v = b->v + first;
    if (compand) {
        for (int j = 0; j < size; j++) {
            const float c = (float)m_code[j];
            m[j] = c / (-fabsf(c) + 2.0f * MOMENTUM_LEVELS) * m_factor;
        }
    } else {
        for (int j = 0; j < size; j++) {
            m[j] = (float)m_code[j] * (float)(1.0 / 127.0) * m_factor;
        }
    }
    for (int j = 0; j < size; j++) {
        const float root = (float)r_code[j] * r_factor;
        v[j] = root * root;
    }
}

/* Encode a group's b->m and b->root against their new scales, rounded to bfloat16 (1 for an
 * all-zero group). */
static inline void encode_group(const Block *restrict b, int8_t *restrict m_code,
                                uint8_t *restrict r_code, uint16_t m_scale, uint16_t r_scale,
                                int first, int size, int compand) {
    const float m_factor = 1.0f / (m_scale ? bf16_to_float(m_scale) : 1.0f);
    const float r_factor = ROOT_LEVELS / (r_scale ? bf16_to_float(r_scale) : 1.0f);
    const float *restrict m = b->m + first, *restrict root = b->root + first;
    if (compand) {
        for (int j = 0; j < size; j++) {
            const float y = m[j] * m_factor;
            const float level = rintf(y / (fabsf(y) + 1.0f) * (2.0f * MOMENTUM_LEVELS));
            m_code[j] = (int8_t)(int)clamp(level, -MOMENTUM_LEVELS, MOMENTUM_LEVELS);
        }
    } else {
        for (int j = 0; j < size; j++) {
            const float level = rintf(m[j] * m_factor * MOMENTUM_LEVELS);
            m_code[j] = (int8_t)(int)clamp(level, -MOMENTUM_LEVELS, MOMENTUM_LEVELS);
        }
    }
    /* Nearest, but at least 1 for a positive root (see [Note: 8-bit moments]): eager's
     * ceil(min(level, 1)) of a non-negative level, written so that it vectorises. */
    for (int j = 0; j < size; j++) {
        const float level = root[j] * r_factor;
        const float rounded = larger(rintf(level), level > 0.0f ? 1.0f : 0.0f);
        r_code[j] = (uint8_t)(int)smaller(rounded, ROOT_LEVELS);
    }
}

static void step_grouped(const int64_t *p, const Hyper *h, float ic2, float step_size, Block *b) {
    const int flags = (int)p[PARAM_FLAGS];
    void *weight = (void *)p[PARAM_WEIGHT];
    const void *grad = (const void *)p[PARAM_GRAD];
    int8_t *weight_error = (int8_t *)p[PARAM_WEIGHT_ERROR];
    int8_t *m_code = (int8_t *)p[PARAM_A];
    uint16_t *m_scale = (uint16_t *)p[PARAM_B];
    uint8_t *r_code = (uint8_t *)p[PARAM_C];
    uint16_t *r_scale = (uint16_t *)p[PARAM_D];
    const int64_t rows = p[PARAM_ROWS], row_length = p[PARAM_ROW_LENGTH];
    const int64_t groups_per_row = (row_length + GROUP_SIZE - 1) / GROUP_SIZE;

    for (int64_t r = 0; r < rows; r++) {
        for (int64_t column = 0; column < row_length; column += BLOCK) {
            const int64_t at = r * row_length + column;
            const int n = row_length - column < BLOCK ? (int)(row_length - column) : BLOCK;
            const int groups = (n + GROUP_SIZE - 1) / GROUP_SIZE;
            uint16_t *ms = m_scale + r * groups_per_row + column / GROUP_SIZE;
            uint16_t *rs = r_scale + r * groups_per_row + column / GROUP_SIZE;
            load_weights(b, weight, weight_error, flags & FLAG_WEIGHT_BF16, at, n);
            load_grads(b, grad, flags & FLAG_GRAD_BF16, at, n);
            for (int k = 0; k < groups; k++) {
                const int first = k * GROUP_SIZE;
                const int size = n - first < GROUP_SIZE ? n - first : GROUP_SIZE;
                decode_group(b, m_code + at + first, r_code + at + first, ms[k], rs[k], first,
                             size, h->compand);
            }
            adamw(b, n, h, ic2, step_size);
            store_weights(b, weight, weight_error, flags & FLAG_WEIGHT_BF16, at, n);
            for (int k = 0; k < groups; k++) {
                const int first = k * GROUP_SIZE;
                const int size = n - first < GROUP_SIZE ? n - first : GROUP_SIZE;
                ms[k] = float_to_bf16(largest(b->m + first, size));
                rs[k] = float_to_bf16(largest(b->root + first, size));
                encode_group(b, m_code + at + first, r_code + at + first, ms[k], rs[k], first,
                             size, h->compand);
            }
        }
    }
}

static void step_flat(const int64_t *p, const Hyper *h, float ic2, float step_size, Block *b) {
    const int flags = (int)p[PARAM_FLAGS];
    void *weight = (void *)p[PARAM_WEIGHT];
    const void *grad = (const void *)p[PARAM_GRAD];
    int8_t *weight_error = (int8_t *)p[PARAM_WEIGHT_ERROR];
    uint16_t *m_high = (uint16_t *)p[PARAM_A];
    int8_t *m_error = (int8_t *)p[PARAM_B];
    uint16_t *v_high = (uint16_t *)p[PARAM_C];
    int8_t *v_error = (int8_t *)p[PARAM_D];
    const int64_t numel = p[PARAM_ROWS] * p[PARAM_ROW_LENGTH];
    for (int64_t at = 0; at < numel; at += BLOCK) {
        const int n = numel - at < BLOCK ? (int)(numel - at) : BLOCK;
        load_weights(b, weight, weight_error, flags & FLAG_WEIGHT_BF16, at, n);
        load_grads(b, grad, flags & FLAG_GRAD_BF16, at, n);
        for (int j = 0; j < n; j++) {
            b->m[j] = join24(m_high[at + j], m_error[at + j]);
            b->v[j] = join24(v_high[at + j], v_error[at + j]);
        }
        adamw(b, n, h, ic2, step_size);
        store_weights(b, weight, weight_error, flags & FLAG_WEIGHT_BF16, at, n);
        for (int j = 0; j < n; j++) {
            split24(b->m[j], &m_high[at + j], &m_error[at + j]);
            split24(b->v[j], &v_high[at + j], &v_error[at + j]);
        }
    }
}

/* Steps `count` parameters described by `params` (count rows of PARAM_FIELDS int64). */
void compact_adamw_step(const int64_t *params, int64_t count, double lr, double beta1,
                        double beta2, double eps, double weight_decay, int compand) {
    Block block;
    Hyper h;
    h.beta1 = (float)beta1;
    h.one_minus_beta1 = (float)(1.0 - beta1);
    h.beta2 = (float)beta2;
    h.one_minus_beta2 = (float)(1.0 - beta2);
    h.eps = (float)eps;
    h.decay = (float)(1.0 - lr * weight_decay);
    h.compand = compand;
    for (int64_t k = 0; k < count; k++) {
        const int64_t *p = params + k * PARAM_FIELDS;
        float *step = (float *)p[PARAM_STEP];
        *step = *step + 1.0f;
        const double t = (double)*step;
        const float ic2 = (float)(1.0 / sqrt(1.0 - pow(beta2, t)));
        const float step_size = (float)(lr / (1.0 - pow(beta1, t)));
        if (p[PARAM_FLAGS] & FLAG_GROUPED) {
            step_grouped(p, &h, ic2, step_size, &block);
        } else {
            step_flat(p, &h, ic2, step_size, &block);
        }
    }
}
