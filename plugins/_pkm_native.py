"""CPU kernels of the PKM: the fused value update, the exact product-key search, and huge-page tables.

The value update: per distinct row, reduce its gradient and apply Adam in place.

For each distinct row u of the value table (rows sorted, its lookups e in [offsets[u], offsets[u+1])):
    g = sum_e w[e] * grad[tok[e]]                       the sum-EmbeddingBag gradient of that row
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
which is torch.optim.Adam's update (Kingma & Ba, Alg. 1, bias-corrected) restricted to touched rows. One pass
reads and writes each touched row of (p, m, v) once; nothing of size (rows, d) is allocated. A second kernel
computes the per-sample-weight gradient of the value read, values[slots[t, j]] . grad[t], without gathering
the rows. The search (``product_search``) selects, per token and head, the exact top-k of the n^2 sums of
two halves' sub-key scores: per half a lower bound on the k-th score from group maxima, the few elements
that reach it ranked by counting (branch-free), then the same over the ~k ln k candidate pairs; ~5x less
CPU time than torch.topk over the rows. Work is split into contiguous ranges run on Python threads (ctypes
releases the GIL), so no OpenMP runtime is involved. ``huge_page_empty`` allocates tables whose random rows
would otherwise miss the TLB on nearly every access.

The C source is compiled once with the system C compiler into the rlm cache and loaded with ctypes; when no
compiler is found, ``load()`` returns None and the caller uses its PyTorch path (same numbers, slower).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

_KERNELS = r"""
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

static inline void prefetch_row(const float *row, int64_t d) {
    for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(row + i);
}

static inline void prefetch_row_for_write(float *row, int64_t d) {
    for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(row + i, 1);
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
"""

# Selection helpers of the search that have a hand-vectorised form (float32 only).
_FAST = r"""
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
"""

# The exact product-key search, written once for a scalar type and instantiated for float32 and float64.
_SEARCH = r"""
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
"""

SOURCE = (
    _KERNELS
    + _FAST
    + "".join(
        _SEARCH.replace("scalar_t", ctype).replace("_SFX", suffix)
        for ctype, suffix in (("float", "_f32"), ("double", "_f64"))
    )
)

# -fno-math-errno: sqrtf need not set errno, so it vectorises (the Adam update is 4x faster); results are
# the same, IEEE square roots being correctly rounded either way.
CFLAGS = ("-O3", "-fno-math-errno", "-fopenmp-simd", "-shared", "-fPIC")
HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and most aarch64 kernels
_MADV_HUGEPAGE = 14  # linux/mman.h

_LIB: ctypes.CDLL | None = None
_TRIED = False
_POOL: ThreadPoolExecutor | None = None


def _cache_dir() -> Path:
    root = os.environ.get("RLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rlm")
    return Path(root) / "native"


def _compiler() -> str | None:
    """The C compiler: $CC, else cc, gcc or clang on PATH; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _compiler_version(cc: str | None) -> str:
    """The first line of ``cc --version`` (names the compiler and its version), or '' when it cannot run."""
    if cc is None:
        return ""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0].strip() if out else ""


def cache_key(cc: str | None) -> str:
    """The built library's name key: source, flags, machine architecture and compiler (its version string).

    A cache directory shared between x86-64 and aarch64 nodes, or between compilers, then holds one library
    per (architecture, compiler) instead of one that the other machines cannot load.
    """
    parts = (SOURCE, " ".join(CFLAGS), platform.machine(), sys.platform, _compiler_version(cc))
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:12]


def _build(target: Path, cc: str | None) -> None:
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc, clang) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "pkm_row_adam.c", Path(tmp) / target.name
        src.write_text(SOURCE)
        subprocess.run(
            [cc, *CFLAGS, "-o", str(out), str(src), "-lm"],
            check=True,
            capture_output=True,
        )
        os.replace(out, target)  # atomic: concurrent processes never load a half-written library


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None (with a warning) when it cannot be built."""
    global _LIB, _TRIED
    if _TRIED:
        return _LIB
    _TRIED = True
    if os.environ.get("RLM_PKM_NATIVE", "1") == "0":
        return None
    cc = _compiler()
    target = _cache_dir() / f"pkm_native_{cache_key(cc)}.so"
    try:
        if not target.exists():
            _build(target, cc)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as err:
        warnings.warn(f"pkm: native kernels unavailable ({err}); using the PyTorch paths", stacklevel=2)
        return None
    lib.pkm_row_adam.restype = lib.pkm_bag_dot.restype = None
    lib.pkm_row_adam.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 3 + [ctypes.c_float] * 7
    lib.pkm_bag_dot.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
    for fn in (lib.pkm_search_f32, lib.pkm_search_f64):
        fn.restype = ctypes.c_int64
        fn.argtypes = (
            [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
        )
    _LIB = lib
    return lib


def _fits(floats: tuple[Tensor, ...], ints: tuple[Tensor, ...], dtype: torch.dtype = torch.float32) -> bool:
    ok = all(t.device.type == "cpu" and t.is_contiguous() for t in (*floats, *ints))
    return ok and all(t.dtype == dtype for t in floats) and all(t.dtype == torch.int64 for t in ints)


def _parallel(total: int, run, min_per_thread: int) -> None:
    """Call run(lo, hi) over contiguous ranges of [0, total) on up to torch.get_num_threads() threads."""
    global _POOL
    threads = max(1, min(torch.get_num_threads(), total // min_per_thread))
    if threads == 1:
        run(0, total)
        return
    if _POOL is None or _POOL._max_workers < threads:
        _POOL = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pkm-native")
    list(_POOL.map(lambda i: run(total * i // threads, total * (i + 1) // threads), range(threads)))


def bag_dot(values: Tensor, slots: Tensor, grad: Tensor) -> Tensor | None:
    """out[t, j] = values[slots[t, j]] . grad[t], (N, m): the per-sample-weight gradient of a sum-EmbeddingBag.

    None when the kernel is unavailable or the tensors do not fit it (float32, CPU, contiguous).
    """
    lib = load() if _fits((values, grad), (slots,)) else None
    if lib is None:
        return None
    (N, m), d = slots.shape, values.shape[1]
    out = torch.empty(N, m, dtype=torch.float32)
    ptrs = [t.data_ptr() for t in (values, slots, grad, out)]
    _parallel(N, lambda lo, hi: lib.pkm_bag_dot(*ptrs, lo, hi, m, d), min_per_thread=64)
    return out


def row_adam(
    p: Tensor, m: Tensor, v: Tensor, rows: Tensor, offsets: Tensor, tok: Tensor, w: Tensor, grad: Tensor,
    lr: float, betas: tuple[float, float], eps: float, step: int,
) -> bool:  # fmt: skip
    """Run the fused update in place; False when the kernel is unavailable or the tensors do not fit it.

    p, m, v: (S, d) float32 CPU contiguous; rows (U,) sorted distinct; offsets (U+1,); tok, w (E,) in row
    order; grad (N, d).
    """
    lib = load() if _fits((p, m, v, w, grad), (rows, offsets, tok)) else None
    if lib is None:
        return False
    U, d = rows.numel(), p.shape[1]
    # Every constant in double precision (Python floats), rounded to float32 once when passed.
    b1, b2 = float(betas[0]), float(betas[1])
    bc1, bc2_sqrt = 1.0 - b1**step, math.sqrt(1.0 - b2**step)
    ptrs = [t.data_ptr() for t in (p, m, v, rows, offsets, tok, w, grad)]
    hyper = (lr / bc1, b1, 1.0 - b1, b2, 1.0 - b2, eps, bc2_sqrt)
    _parallel(U, lambda lo, hi: lib.pkm_row_adam(*ptrs, lo, hi, d, *hyper), min_per_thread=256)
    return True


def product_search(
    s1: Sequence[Tensor], s2: Sequence[Tensor], k: int
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Exact top-k of s1[h][t, i] + s2[h][t, j] over all (i, j), per token t and head h: (scores, i, j), (N, H, k).

    s1, s2: per head h, the (N, n) sub-key scores of each half (float32 or float64, CPU, contiguous). Scores
    are sorted descending; equal scores are ordered by the rank of i in its half, then of j (a half ranks
    by score descending, then id). None when the kernel is unavailable, the tensors do not fit it, or a
    score is NaN.
    """
    H, dtype = len(s1), s1[0].dtype
    if dtype not in (torch.float32, torch.float64) or len(s2) != H or s1[0].dim() != 2:
        return None
    N, n = s1[0].shape
    if not _fits((*s1, *s2), (), dtype) or any(t.shape != (N, n) for t in (*s1, *s2)):
        return None
    lib = load()
    if lib is None or not 0 < k <= n:
        return None
    scores = torch.empty(N, H, k, dtype=dtype)
    i, j = (torch.empty(N, H, k, dtype=torch.int64) for _ in range(2))
    fn = lib.pkm_search_f32 if dtype == torch.float32 else lib.pkm_search_f64
    heads1, heads2 = ((ctypes.c_void_p * H)(*(t.data_ptr() for t in half)) for half in (s1, s2))
    outs = [t.data_ptr() for t in (scores, i, j)]
    failed: list[int] = []  # rows with a NaN, per range (list.append is atomic)
    _parallel(
        N * H, lambda lo, hi: failed.append(fn(heads1, heads2, N, H, n, k, *outs, lo, hi)), min_per_thread=64
    )
    return None if any(failed) else (scores, i, j)


def _advise_huge_pages(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) a range; False where unsupported (not Linux, no libc, THP off: harmless)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return False
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised contiguous CPU tensor on 2 MiB-aligned memory advised for transparent huge pages.

    A memory table of a million rows is read and written at random rows: on 4 KiB pages nearly every row
    access misses the TLB, on 2 MiB pages the whole table fits in it. Kernels with THP in 'madvise' mode (a
    common default) only back advised ranges with huge pages, and only when advised before the first touch,
    hence the advice here, before anything is written. Small tensors, and other default devices than the CPU,
    get a plain ``torch.empty``.
    """
    probe = torch.empty((), dtype=dtype)  # on torch's default device
    nbytes = math.prod(shape) * probe.element_size()
    if nbytes < 4 * HUGE_PAGE or probe.device.type != "cpu":
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # over-allocate, then take the aligned part
    start = -raw.data_ptr() % HUGE_PAGE
    out = raw[start : start + nbytes].view(dtype).view(shape)  # keeps raw's storage alive
    _advise_huge_pages(out.data_ptr(), nbytes)
    return out
