/* BatchNorm2d in training mode (batch statistics) followed by SiLU, forward and backward, on the CPU.
 *
 * The tensors are channels_last, so memory is a row-major [M = N*H*W, C] matrix and every inner loop runs over
 * contiguous channels, which the compiler vectorises (built with -O3 -march=native -fno-trapping-math; see
 * bn_silu.py). Statistics and gradient sums accumulate in float over blocks of BLOCK rows, then in double.
 *
 * Forward:  mean, var over (N, H, W) per channel (shifted by the first row against cancellation);
 *           y = (x - mean) * invstd * w + b;  z = y * sigmoid(y)           (one pass; y is never stored)
 * Backward: y and sigmoid(y) are recomputed from x; dy = g * s * (1 + y * (1 - s)) is stored in dx (rounded to
 *           the tensor's dtype, as the unfused SiLU backward does) while sum(dy) and sum(dy * xhat) accumulate;
 *           then dx = (dy - mean(dy) - xhat * mean(dy * xhat)) * w * invstd in place.
 * The unfused PyTorch composition makes five passes forward and six backward over the activations and keeps y
 * for the backward; this makes two and two and keeps only x.
 *
 * The file includes itself twice to instantiate the kernels for bfloat16 (uint16_t storage) and float.
 */
#ifndef BN_SILU_BODY
#define BN_SILU_BODY

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 64

static inline float bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even; NaN stays NaN (quiet). */
static inline void bf16_store(uint16_t *p, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    *p = (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? ((u >> 16) | 0x40u) : r);
}

static inline float f32_load(const float *p) { return *p; }
static inline void f32_store(float *p, float f) { *p = f; }

/* exp(x): Cody-Waite range reduction and a degree-6 polynomial (Cephes expf, ~1 ulp) on a clamped range.
 * Branch-free, so it vectorises; a NaN argument gives a finite value here, but every caller multiplies the
 * result into y, so NaN still propagates to the output. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 80.0f ? 80.0f : x; /* 1 + exp(80) keeps recip's bit-trick guess positive */
    float k = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float s;
    memcpy(&s, &bits, 4);
    return p * s;
}

/* 1 / d for d in [1, 2^127]: a bit-trick guess and three Newton steps (~1e-7 relative). A vector division is
 * several times slower here and bounds the whole kernel. */
static inline float recip(float d) {
    uint32_t u;
    memcpy(&u, &d, 4);
    u = 0x7EF311C3u - u;
    float r;
    memcpy(&r, &u, 4);
    r = r * (2.0f - d * r);
    r = r * (2.0f - d * r);
    r = r * (2.0f - d * r);
    return r;
}

static inline float sigmoid(float y) { return recip(1.0f + exp_approx(-y)); }

/* One thread's 2C per-channel sums: float over BLOCK rows (vectorised), flushed into double after each block. */
typedef struct {
    float *a;
    double *d;
} acc_t;

static acc_t acc_new(int64_t C) {
    acc_t t = {calloc(2 * C, sizeof(float)), calloc(2 * C, sizeof(double))};
    return t;
}

static inline int acc_ok(const acc_t *t) { return t->a && t->d; }

static inline void acc_flush(acc_t *t, int64_t C) {
    for (int64_t c = 0; c < 2 * C; c++) {
        t->d[c] += t->a[c];
        t->a[c] = 0.0f;
    }
}

/* Inside the parallel region: add this thread's sums into sum (2C doubles) and free them. */
static void acc_merge(acc_t *t, double *sum, int64_t C) {
#pragma omp critical
    if (acc_ok(t))
        for (int64_t c = 0; c < 2 * C; c++) sum[c] += t->d[c];
    free(t->a);
    free(t->d);
}

/* For bfloat16 storage (8 significant bits, relative rounding up to 2^-9): exp with a degree-4 Taylor polynomial
 * (|r| <= ln2/2, error < 5e-5) and two Newton steps (< 7e-6), 50x below the rounding of the result. */
static inline float exp_lo(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 80.0f ? 80.0f : x; /* 1 + exp(80) keeps recip's bit-trick guess positive */
    float k = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float s;
    memcpy(&s, &bits, 4);
    return p * s;
}

static inline float sigmoid_lo(float y) {
    float d = 1.0f + exp_lo(-y);
    uint32_t u;
    memcpy(&u, &d, 4);
    u = 0x7EF311C3u - u;
    float r;
    memcpy(&r, &u, 4);
    r = r * (2.0f - d * r);
    r = r * (2.0f - d * r);
    return r;
}

#define T uint16_t
#define SFX(name) name##_bf16
#define LOAD bf16_load
#define STORE bf16_store
#define SIGMOID sigmoid_lo
#include "_bn_silu.c" /* this file again, with the next T */
#undef T
#undef SFX
#undef LOAD
#undef STORE
#undef SIGMOID

#define T float
#define SFX(name) name##_f32
#define LOAD f32_load
#define STORE f32_store
#define SIGMOID sigmoid
#include "_bn_silu.c" /* this file again, with the next T */
#undef T
#undef SFX
#undef LOAD
#undef STORE
#undef SIGMOID

#else /* ------------------------------------------------------------------- kernels for one storage type T */

/* Per-channel mean and biased variance of x [M, C]; returns 0, or -1 when out of memory. */
int SFX(bn_stats)(const T *restrict x, int64_t M, int64_t C, float *restrict mean, float *restrict var, int nt) {
    double *sum = calloc(2 * C, sizeof(double));
    float *shift = malloc(C * sizeof(float));
    if (!sum || !shift) {
        free(sum);
        free(shift);
        return -1;
    }
    for (int64_t c = 0; c < C; c++) shift[c] = LOAD(x + c);
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        acc_t t = acc_new(C);
        float *a = t.a;
        if (!acc_ok(&t)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t m0 = 0; m0 < M; m0 += BLOCK) {
            if (!acc_ok(&t)) continue;
            int64_t m1 = m0 + BLOCK < M ? m0 + BLOCK : M;
            for (int64_t m = m0; m < m1; m++) {
                const T *xr = x + m * C;
                for (int64_t c = 0; c < C; c++) {
                    float v = LOAD(xr + c) - shift[c];
                    a[c] += v;
                    a[C + c] += v * v;
                }
            }
            acc_flush(&t, C);
        }
        acc_merge(&t, sum, C);
    }
    if (!failed)
        for (int64_t c = 0; c < C; c++) {
            double m1 = sum[c] / (double)M;
            double v = sum[C + c] / (double)M - m1 * m1;
            mean[c] = (float)(m1 + shift[c]);
            var[c] = (float)(v > 0.0 ? v : 0.0);
        }
    free(sum);
    free(shift);
    return failed ? -1 : 0;
}

/* z = silu((x - mean) * invstd * w + b) */
int SFX(bn_silu_fwd)(const T *restrict x, T *restrict z, int64_t M, int64_t C, const float *restrict mean,
                     const float *restrict invstd, const float *restrict w, const float *restrict b, int nt) {
    float *scale = malloc(C * sizeof(float));
    if (!scale) return -1;
    for (int64_t c = 0; c < C; c++) scale[c] = invstd[c] * w[c];
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const T *xr = x + m * C;
        T *zr = z + m * C;
        for (int64_t c = 0; c < C; c++) {
            float y = (LOAD(xr + c) - mean[c]) * scale[c] + b[c]; /* not x * scale + b': cancellation */
            STORE(zr + c, y * SIGMOID(y));
        }
    }
    free(scale);
    return 0;
}

/* dx from g = dL/dz; also dL/dw (gw) and dL/db (gb). */
int SFX(bn_silu_bwd)(const T *restrict g, const T *restrict x, T *restrict dx, int64_t M, int64_t C,
                     const float *restrict mean, const float *restrict invstd, const float *restrict w,
                     const float *restrict b, float *restrict gw, float *restrict gb, int nt) {
    float *scale = malloc(3 * C * sizeof(float));
    double *sum = calloc(2 * C, sizeof(double));
    if (!scale || !sum) {
        free(scale);
        free(sum);
        return -1;
    }
    float *k1 = scale + C, *k2 = scale + 2 * C;
    for (int64_t c = 0; c < C; c++) scale[c] = invstd[c] * w[c];
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        acc_t t = acc_new(C);
        float *a = t.a;
        if (!acc_ok(&t)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t m0 = 0; m0 < M; m0 += BLOCK) {
            if (!acc_ok(&t)) continue;
            int64_t m1 = m0 + BLOCK < M ? m0 + BLOCK : M;
            for (int64_t m = m0; m < m1; m++) {
                const T *xr = x + m * C, *gr = g + m * C;
                T *dr = dx + m * C;
                for (int64_t c = 0; c < C; c++) {
                    float xc = LOAD(xr + c) - mean[c];
                    float y = xc * scale[c] + b[c];
                    float s = SIGMOID(y);
                    STORE(dr + c, LOAD(gr + c) * s * (1.0f + y * (1.0f - s)));
                    float dy = LOAD(dr + c); /* the stored (rounded) value, which the second pass reads */
                    a[c] += dy;
                    a[C + c] += dy * xc;
                }
            }
            acc_flush(&t, C);
        }
        acc_merge(&t, sum, C);
    }
    if (failed) {
        free(scale);
        free(sum);
        return -1;
    }
    for (int64_t c = 0; c < C; c++) {
        gb[c] = (float)sum[c];
        gw[c] = (float)(sum[C + c] * invstd[c]);
        k1[c] = (float)(sum[c] / (double)M);
        k2[c] = (float)(sum[C + c] / (double)M * invstd[c] * invstd[c]);
    }
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const T *xr = x + m * C;
        T *dr = dx + m * C;
        for (int64_t c = 0; c < C; c++)
            STORE(dr + c, (LOAD(dr + c) - k1[c] - (LOAD(xr + c) - mean[c]) * k2[c]) * scale[c]);
    }
    free(scale);
    free(sum);
    return 0;
}

#endif
