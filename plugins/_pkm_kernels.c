/* rlm PKM CPU kernels (loaded by plugins/_pkm_native.py): the fused row update, the per-sample-weight
   gradient of the value read, and the selection helpers of the search that have a hand-vectorised form
   (float32 only). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* One build runs at the best width of the machine that loads it (dispatched by the loader). */
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define PREFETCH_AHEAD 8 /* rows: random reads of a large table are latency-bound without it */

/* (v1, i1) comes before (v2, i2): larger value first, then lower index (a strict total order). */
#define BEFORE(v1, i1, v2, i2) ((v1) > (v2) || ((v1) == (v2) && (i1) < (i2)))

#define ADAM_AHEAD 4 /* rows of (p, m, v) prefetched ahead of the update: their reads are random */

/* Rows are prefetched into L2 (prefetcht1), not L1: a row is 16+ cache lines, and L1 prefetches of several rows
   take the few L1 miss buffers that the loads of the row being computed need. */
#define PREFETCH_LOCALITY 2

static inline void prefetch_row(const float *row, int64_t d) {
    for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(row + i, 0, PREFETCH_LOCALITY);
}

static inline void prefetch_row_for_write(float *row, int64_t d) {
    for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(row + i, 1, PREFETCH_LOCALITY);
}

CLONES void pkm_row_adam(float *p, float *m, float *v, const int64_t *rows, const int64_t *offsets,
                         const int64_t *tok, const float *w, const float *grad, int64_t u0, int64_t u1, int64_t d,
                         float step, float b1, float omb1, float b2, float omb2, float eps, float bc2_sqrt) {
    /* step = lr / bc1, omb1 = 1 - b1, omb2 = 1 - b2, bc2_sqrt: computed in double by the caller
       (1 - b2 in float32 is off by ~1e-5 relative for b2 = 0.999) and rounded once to float. */
    float *g = (float *)malloc(sizeof(float) * (size_t)d);
    for (int64_t u = u0; u < u1; ++u) {
        if (u + ADAM_AHEAD < u1) {
            const int64_t ahead = rows[u + ADAM_AHEAD] * d;
            prefetch_row_for_write(p + ahead, d), prefetch_row_for_write(m + ahead, d);
            prefetch_row_for_write(v + ahead, d);
        }
        memset(g, 0, sizeof(float) * (size_t)d);
        for (int64_t e = offsets[u]; e < offsets[u + 1]; ++e) {
            const float we = w[e];
            const float *gr = grad + tok[e] * d;
            for (int64_t j = 0; j < d; ++j) g[j] += we * gr[j];
        }
        float *pr = p + rows[u] * d, *mr = m + rows[u] * d, *vr = v + rows[u] * d;
        for (int64_t j = 0; j < d; ++j) {
            const float mj = b1 * mr[j] + omb1 * g[j];
            const float vj = b2 * vr[j] + omb2 * g[j] * g[j];
            mr[j] = mj;
            vr[j] = vj;
            pr[j] -= step * mj / (sqrtf(vj) / bc2_sqrt + eps);
        }
    }
    free(g);
}

CLONES void pkm_bag_dot(const float *values, const int64_t *slots, const float *grad, float *out, int64_t t0,
                        int64_t t1, int64_t m, int64_t d) {
    const int64_t end = t1 * m;
    for (int64_t t = t0; t < t1; ++t) {
        const float *gt = grad + t * d;
        for (int64_t j = 0; j < m; ++j) {
            const int64_t e = t * m + j;
            if (e + PREFETCH_AHEAD < end) prefetch_row(values + slots[e + PREFETCH_AHEAD] * d, d);
            const float *vr = values + slots[e] * d;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < d; ++i) acc += vr[i] * gt[i];
            out[t * m + j] = acc;
        }
    }
}

/* Selection helpers of the search that have a hand-vectorised form (float32 only). */
#define NOT_AVAILABLE (-2)
#define BISECT_STEPS 8 /* the bound ends within 1/256 of the range above the k-th largest */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* collect (below) for float32 with AVX-512 compress: 16 elements per step, no branch. */
__attribute__((target("avx512f"))) static int64_t collect_avx512(const float *x, int64_t n, float lo, float *cv,
                                                                 int32_t *cp) {
    const __m512 vlo = _mm512_set1_ps(lo);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i sixteen = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    int64_t c = 0, i = 0;
    for (; i + 16 <= n; i += 16, at = _mm512_add_epi32(at, sixteen)) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __mmask16 m = _mm512_cmp_ps_mask(v, vlo, _CMP_GE_OQ);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        /* register-form compress and a full store (cv, cp have 16 spare slots): the memory form is slow on AMD */
        _mm512_storeu_ps(cv + c, _mm512_maskz_compress_ps(m, v));
        _mm512_storeu_si512((void *)(cp + c), _mm512_maskz_compress_epi32(m, at));
        c += __builtin_popcount(m);
    }
    int bad = nan != 0;
    for (; i < n; ++i) bad |= x[i] != x[i], cv[c] = x[i], cp[c] = (int32_t)i, c += x[i] >= lo;
    return bad ? -1 : c;
}
static int has_avx512 = -1;
static int64_t collect_fast_f32(const float *x, int64_t n, float lo, float *cv, int32_t *cp) {
    if (has_avx512 < 0) __builtin_cpu_init(), has_avx512 = __builtin_cpu_supports("avx512f") != 0;
    return has_avx512 ? collect_avx512(x, n, lo, cv, cp) : NOT_AVAILABLE;
}
#else
static int64_t collect_fast_f32(const float *x, int64_t n, float lo, float *cv, int32_t *cp) {
    (void)x, (void)n, (void)lo, (void)cv, (void)cp;
    return NOT_AVAILABLE;
}
#endif
static int64_t collect_fast_f64(const double *x, int64_t n, double lo, double *cv, int32_t *cp) {
    (void)x, (void)n, (void)lo, (void)cv, (void)cp;
    return NOT_AVAILABLE;
}
