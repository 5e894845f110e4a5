/* The exact product-key search (plugins/_pkm_native.py), written once for a scalar type scalar_t and
   instantiated for float32 and float64 by replacing scalar_t and the suffix _SFX. */
/* A value that at least k of a[0..m) reach (1 <= k <= m), close to the k-th largest: bisection on [min, max]
   that only moves the bound up while k values still reach it (any NaN midpoint simply fails the count). */
static inline __attribute__((always_inline)) scalar_t kth_bound_SFX(const scalar_t *restrict a, int64_t m,
                                                                    int64_t k) {
    scalar_t lo = a[0], hi = a[0];
#pragma omp simd reduction(min : lo) reduction(max : hi)
    for (int64_t g = 0; g < m; ++g) lo = a[g] < lo ? a[g] : lo, hi = a[g] > hi ? a[g] : hi;
    for (int step = 0; step < BISECT_STEPS; ++step) {
        const scalar_t mid = lo + (hi - lo) / 2;
        int32_t count = 0;
#pragma omp simd reduction(+ : count)
        for (int64_t g = 0; g < m; ++g) count += a[g] >= mid;
        if (count >= k) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* The k first of c candidates (cv, cp) in BEFORE order, sorted, into (val, idx). A candidate's rank is the
   number of candidates that come before it, counted for all candidates at once (branch-free, vectorised over
   them; c is a small multiple of k). cv, cp and rank hold c + 16; val and idx k + 1 (slot k takes the rest). */
static inline __attribute__((always_inline)) void rank_select_SFX(scalar_t *restrict cv, int32_t *restrict cp,
                                                                  int32_t *restrict rank, int64_t c, int64_t k,
                                                                  scalar_t *restrict val, int32_t *restrict idx) {
    const int64_t padded = (c + 15) & ~(int64_t)15;
    for (int64_t e = c; e < padded; ++e) cv[e] = -INFINITY, cp[e] = INT32_MAX; /* never before anything */
    memset(rank, 0, sizeof(int32_t) * (size_t)padded);
    for (int64_t f = 0; f < c; ++f) {
        const scalar_t v = cv[f];
        const int32_t p = cp[f];
#pragma omp simd
        for (int64_t e = 0; e < padded; ++e) rank[e] += (v > cv[e]) | ((v == cv[e]) & (p < cp[e]));
    }
    for (int64_t e = 0; e < c; ++e) {
        const int32_t r = rank[e] < k ? rank[e] : (int32_t)k;
        val[r] = cv[e], idx[r] = cp[e];
    }
}

/* Elements of x (n) that reach lo, with their positions, into (cv, cp); -1 when x holds a NaN. */
static inline __attribute__((always_inline)) int64_t collect_SFX(const scalar_t *restrict x, int64_t n,
                                                                 scalar_t lo, scalar_t *restrict cv,
                                                                 int32_t *restrict cp) {
    const int64_t fast = collect_fast_SFX(x, n, lo, cv, cp);
    if (fast != NOT_AVAILABLE) return fast;
    int64_t c = 0;
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) {
        const scalar_t v = x[i];
        bad |= v != v;
        cv[c] = v, cp[c] = (int32_t)i, c += v >= lo; /* branch-free: about half of x's blocks hold one */
    }
    return bad ? -1 : c;
}

/* Sorted top-k of row x (n) into (val, idx) in BEFORE order; 0 when x holds a NaN. Scratch: gm (2k), cv, cp
   and rank (n + 16). A lower bound first: the row is cut into G = 2k strided groups {g, g+G, ...}; k group maxima
   (distinct elements) reach the bound, so every top-k element does too, and only a few elements do. */
static inline __attribute__((always_inline)) int row_topk_SFX(const scalar_t *restrict x, int64_t n, int64_t k,
                                                              scalar_t *restrict gm, scalar_t *restrict cv,
                                                              int32_t *restrict cp, int32_t *restrict rank,
                                                              scalar_t *restrict val, int32_t *restrict idx) {
    const int64_t G = 2 * k, R = n / G;
    scalar_t lo = -INFINITY;
    if (R >= 2) {
        memcpy(gm, x, sizeof(scalar_t) * (size_t)G);
        for (int64_t r = 1; r < R; ++r) {
            const scalar_t *xr = x + r * G;
#pragma omp simd
            for (int64_t g = 0; g < G; ++g) gm[g] = xr[g] > gm[g] ? xr[g] : gm[g];
        }
        lo = kth_bound_SFX(gm, G, k);
    }
    const int64_t c = collect_SFX(x, n, lo, cv, cp);
    if (c < k) return 0; /* a NaN (c < k cannot happen otherwise) */
    rank_select_SFX(cv, cp, rank, c, k, val, idx);
    return 1;
}

/* Top-k of the sums t1[a] + t2[b] of two sorted lists, in order (sum desc, a, b), as positions into (pa, pb).
   Pairs with (a+1)(b+1) > k are beaten by the (a+1)(b+1) - 1 pairs (a' <= a, b' <= b), which all come first
   in that order (rounding is monotone; ties go to the lower ranks), so only the np pairs listed in (pa, pb),
   in (a, b) order, with (a+1)(b+1) <= k are candidates (about k ln k of them). */
static inline __attribute__((always_inline)) void pair_topk_SFX(const scalar_t *t1, const scalar_t *t2, int64_t k,
                                                                const int32_t *pa, const int32_t *pb, int64_t np,
                                                                scalar_t *restrict sums, scalar_t *restrict cv,
                                                                int32_t *restrict cp, int32_t *restrict rank,
                                                                scalar_t *restrict sv, int32_t *restrict pos) {
    for (int64_t e = 0; e < np; ++e) sums[e] = t1[pa[e]] + t2[pb[e]];
    const scalar_t lo = kth_bound_SFX(sums, np, k);
    int64_t c = 0;
    for (int64_t e = 0; e < np; ++e) cv[c] = sums[e], cp[c] = (int32_t)e, c += sums[e] >= lo;
    rank_select_SFX(cv, cp, rank, c, k, sv, pos);
}

/* Rows r in [r0, r1) of the (N, H) grid: s1[h], s2[h] (N, n) sub-key scores of head h; outputs (N, H, k):
   scores, and the selected sub-key ids i (half 1) and j (half 2). Returns the number of rows with a NaN. */
CLONES int64_t pkm_search_SFX(const scalar_t *const *s1, const scalar_t *const *s2, int64_t N, int64_t H,
                              int64_t n, int64_t k, scalar_t *scores, int64_t *oi, int64_t *oj, int64_t r0,
                              int64_t r1) {
    int64_t np = 0;
    for (int64_t a = 0; a < k; ++a) np += k / (a + 1);
    const size_t ns = (size_t)(n > np ? n : np) + 16, ks = (size_t)k + 1;
    scalar_t *gm = (scalar_t *)malloc(sizeof(scalar_t) * (2 * ks + 2 * ns + 3 * ks));
    scalar_t *cv = gm + 2 * ks, *sums = cv + ns, *t1 = sums + ns, *t2 = t1 + ks, *sv = t2 + ks;
    int32_t *cp = (int32_t *)malloc(sizeof(int32_t) * (2 * ns + 2 * (size_t)np + 3 * ks));
    int32_t *rank = cp + ns, *pa = rank + ns, *pb = pa + np, *i1 = pb + np, *i2 = i1 + ks, *pos = i2 + ks;
    np = 0;
    for (int32_t a = 0; a < k; ++a)
        for (int32_t b = 0; (a + 1) * (b + 1) <= k; ++b) pa[np] = a, pb[np] = b, ++np;
    int64_t failed = 0;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t t = r / H, h = r % H;
        if (!row_topk_SFX(s1[h] + t * n, n, k, gm, cv, cp, rank, t1, i1) ||
            !row_topk_SFX(s2[h] + t * n, n, k, gm, cv, cp, rank, t2, i2)) {
            ++failed;
            continue;
        }
        pair_topk_SFX(t1, t2, k, pa, pb, np, sums, cv, cp, rank, sv, pos);
        for (int64_t e = 0; e < k; ++e)
            scores[r * k + e] = sv[e], oi[r * k + e] = i1[pa[pos[e]]], oj[r * k + e] = i2[pb[pos[e]]];
    }
    free(gm);
    free(cp);
    return failed;
}
