/* BatchNorm2d in training mode (batch statistics) followed by SiLU, forward and backward, on the CPU.
 *
 * The tensors are channels_last, so memory is a row-major [M = N*H*W, C] matrix and every inner loop runs over
 * contiguous channels, which the compiler vectorises (built with -O3 -march=native -fno-trapping-math; see
 * _bn_silu_build.py), or, where the CPU has AVX-512, the intrinsics below. Statistics and gradient sums accumulate in
 * float over blocks of BLOCK rows, then in double.
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

/* 1 where built with OpenMP (the kernels run on nt threads), else 0 (on one thread; nt is ignored). */
int bn_silu_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

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

/* AVX-512 (F, BW, VL, DQ: x86-64-v4), where -march=native has it: the same computations written with intrinsics,
 * 16 channels per vector with a masked tail. What the compiler cannot derive from the portable code above: exp's
 * 2^k by vscalefps, 1/d by vrcp14ps (14 bits) and one Newton step (~2^-27), and with AVX512-BF16 the float->bf16
 * rounding in one vcvtneps2bf16 (round to nearest even, as bf16_store; it flushes denormals to zero). On the
 * AMD EPYC of this machine class, yolov5s's 57 blocks forward + backward in bf16 took 59 ms against the portable
 * loops' 78 (scripts/bench_kernels.py --only bn_silu --threads 2). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define BN_SILU_AVX512 1

static inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

/* exp(-y) as exp_approx / exp_lo (degree 6 or 4), the exponent applied by vscalefps. */
static inline __m512 v_exp_neg(__m512 y, int degree6) {
    __m512 x = _mm512_sub_ps(_mm512_setzero_ps(), y);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p;
    if (degree6) {
        p = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    } else {
        p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 24.0f), r, _mm512_set1_ps(1.0f / 6.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    }
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, k);
}

static inline __m512 v_sigmoid(__m512 y, int degree6) {
    __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), v_exp_neg(y, degree6));
    __m512 r = _mm512_rcp14_ps(d);
    return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.0f)), r);
}

/* Masked loads and stores only for the tail: on AMD Zen 4 a masked store costs several times a plain one (with
 * them everywhere the backward ran 1.5x slower than the portable code). */
static inline __m512 v_ld(const float *p, __mmask16 m) {
    return m == 0xffff ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}

static inline void v_st(float *p, __mmask16 m, __m512 v) {
    if (m == 0xffff)
        _mm512_storeu_ps(p, v);
    else
        _mm512_mask_storeu_ps(p, m, v);
}

static inline __m512 v_load_bf16(const uint16_t *p, __mmask16 m) {
    __m256i h = m == 0xffff ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void v_store_bf16(uint16_t *p, __mmask16 m, __m512 v) {
#ifdef __AVX512BF16__
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    __m256i h = _mm512_cvtepi32_epi16(r);
#endif
    if (m == 0xffff)
        _mm256_storeu_si256((__m256i *)p, h);
    else
        _mm256_mask_storeu_epi16(p, m, h);
}
#endif

#define T uint16_t
#define SFX(name) name##_bf16
#define LOAD bf16_load
#define STORE bf16_store
#define SIGMOID sigmoid_lo
#define VLOAD v_load_bf16
#define VSTORE v_store_bf16
#define DEGREE6 0
#include "_bn_silu.c" /* this file again, with the next T */
#undef T
#undef SFX
#undef LOAD
#undef STORE
#undef SIGMOID
#undef VLOAD
#undef VSTORE
#undef DEGREE6

#define T float
#define SFX(name) name##_f32
#define LOAD f32_load
#define STORE f32_store
#define SIGMOID sigmoid
#define VLOAD v_ld
#define VSTORE v_st
#define DEGREE6 1
#include "_bn_silu.c" /* this file again, with the next T */
#undef T
#undef SFX
#undef LOAD
#undef STORE
#undef SIGMOID
#undef VLOAD
#undef VSTORE
#undef DEGREE6

#else /* ------------------------------------------------------------------- kernels for one storage type T */

/* The per-row loops (one row = the C channels of one pixel), vectorised by hand where AVX-512 is there. */

/* Over rows m0..m1: a[c] += x - shift; a[C + c] += (x - shift)^2. By hand, channel vector by channel vector
 * down the block (at most BLOCK rows of C values: in L1), so the sums stay in registers. */
static inline void SFX(stats_block)(const T *restrict x, int64_t m0, int64_t m1, const float *restrict shift,
                                    float *restrict a, int64_t C) {
#ifdef BN_SILU_AVX512
    for (int64_t c = 0; c < C; c += 16) {
        __mmask16 k = tail_mask(C - c);
        __m512 sh = v_ld(shift + c, k), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps();
        __m512 t1 = _mm512_setzero_ps(), t2 = _mm512_setzero_ps(); /* a second chain for odd rows */
        int64_t m = m0;
        for (; m + 1 < m1; m += 2) {
            __m512 v = _mm512_sub_ps(VLOAD(x + m * C + c, k), sh);
            __m512 w = _mm512_sub_ps(VLOAD(x + (m + 1) * C + c, k), sh);
            s1 = _mm512_add_ps(s1, v);
            s2 = _mm512_fmadd_ps(v, v, s2);
            t1 = _mm512_add_ps(t1, w);
            t2 = _mm512_fmadd_ps(w, w, t2);
        }
        if (m < m1) {
            __m512 v = _mm512_sub_ps(VLOAD(x + m * C + c, k), sh);
            s1 = _mm512_add_ps(s1, v);
            s2 = _mm512_fmadd_ps(v, v, s2);
        }
        v_st(a + c, k, _mm512_add_ps(v_ld(a + c, k), _mm512_add_ps(s1, t1)));
        v_st(a + C + c, k, _mm512_add_ps(v_ld(a + C + c, k), _mm512_add_ps(s2, t2)));
    }
#else
    for (int64_t m = m0; m < m1; m++) {
        const T *xr = x + m * C;
        for (int64_t c = 0; c < C; c++) {
            float v = LOAD(xr + c) - shift[c];
            a[c] += v;
            a[C + c] += v * v;
        }
    }
#endif
}

/* z = silu((x - mean) * scale + b) */
static inline void SFX(fwd_row)(const T *restrict xr, T *restrict zr, int64_t C, const float *restrict mean,
                                const float *restrict scale, const float *restrict b) {
#ifdef BN_SILU_AVX512
    for (int64_t c = 0; c < C; c += 16) {
        __mmask16 k = tail_mask(C - c);
        __m512 xc = _mm512_sub_ps(VLOAD(xr + c, k), v_ld(mean + c, k));
        __m512 y = _mm512_fmadd_ps(xc, v_ld(scale + c, k), v_ld(b + c, k));
        VSTORE(zr + c, k, _mm512_mul_ps(y, v_sigmoid(y, DEGREE6)));
    }
#else
    for (int64_t c = 0; c < C; c++) {
        float y = (LOAD(xr + c) - mean[c]) * scale[c] + b[c]; /* not x * scale + b': cancellation */
        STORE(zr + c, y * SIGMOID(y));
    }
#endif
}

/* Over rows m0..m1: dx = dy = g * s * (1 + y * (1 - s)), rounded to T; a[c] += dy, a[C + c] += dy * (x - mean)
 * with the rounded dy. Row by row: walking down the block as stats_block does was 1.2-1.4x slower here, the
 * sigmoid's work hiding the sums' loads and stores anyway. */
static inline void SFX(bwd_block1)(const T *restrict g, const T *restrict x, T *restrict dx, int64_t m0, int64_t m1,
                                   int64_t C, const float *restrict mean, const float *restrict scale,
                                   const float *restrict b, float *restrict a) {
#ifdef BN_SILU_AVX512
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t m = m0; m < m1; m++)
        for (int64_t c = 0; c < C; c += 16) {
            __mmask16 k = tail_mask(C - c);
            int64_t i = m * C + c;
            __m512 xc = _mm512_sub_ps(VLOAD(x + i, k), v_ld(mean + c, k));
            __m512 y = _mm512_fmadd_ps(xc, v_ld(scale + c, k), v_ld(b + c, k));
            __m512 sg = v_sigmoid(y, DEGREE6);
            __m512 u = _mm512_fmadd_ps(y, _mm512_sub_ps(one, sg), one);
            VSTORE(dx + i, k, _mm512_mul_ps(_mm512_mul_ps(VLOAD(g + i, k), sg), u));
            __m512 dy = VLOAD(dx + i, k); /* the stored (rounded) value, which the second pass reads */
            v_st(a + c, k, _mm512_add_ps(v_ld(a + c, k), dy));
            v_st(a + C + c, k, _mm512_fmadd_ps(dy, xc, v_ld(a + C + c, k)));
        }
#else
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
#endif
}

/* dr = (dy - k1 - (x - mean) * k2) * scale, in place */
static inline void SFX(bwd_row2)(const T *restrict xr, T *restrict dr, int64_t C, const float *restrict mean,
                                 const float *restrict k1, const float *restrict k2, const float *restrict scale) {
#ifdef BN_SILU_AVX512
    for (int64_t c = 0; c < C; c += 16) {
        __mmask16 k = tail_mask(C - c);
        __m512 xc = _mm512_sub_ps(VLOAD(xr + c, k), v_ld(mean + c, k));
        __m512 v = _mm512_sub_ps(VLOAD(dr + c, k), v_ld(k1 + c, k));
        v = _mm512_fnmadd_ps(xc, v_ld(k2 + c, k), v);
        VSTORE(dr + c, k, _mm512_mul_ps(v, v_ld(scale + c, k)));
    }
#else
    for (int64_t c = 0; c < C; c++)
        STORE(dr + c, (LOAD(dr + c) - k1[c] - (LOAD(xr + c) - mean[c]) * k2[c]) * scale[c]);
#endif
}

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
            SFX(stats_block)(x, m0, m1, shift, a, C);
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
    for (int64_t m = 0; m < M; m++) SFX(fwd_row)(x + m * C, z + m * C, C, mean, scale, b);
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
            SFX(bwd_block1)(g, x, dx, m0, m1, C, mean, scale, b, a);
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
    for (int64_t m = 0; m < M; m++) SFX(bwd_row2)(x + m * C, dx + m * C, C, mean, k1, k2, scale);
    free(scale);
    free(sum);
    return 0;
}

#endif
