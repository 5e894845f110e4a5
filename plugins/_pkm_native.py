"""A fused CPU kernel for the PKM value update: per distinct row, reduce its gradient and apply Adam in place.

For each distinct row u of the value table (rows sorted, its lookups e in [offsets[u], offsets[u+1])):
    g = sum_e w[e] * grad[tok[e]]                       the sum-EmbeddingBag gradient of that row
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
which is torch.optim.Adam's update (Kingma & Ba, Alg. 1, bias-corrected) restricted to touched rows. One pass
reads and writes each touched row of (p, m, v) once; nothing of size (rows, d) is allocated. A second kernel
computes the per-sample-weight gradient of the value read, values[slots[t, j]] . grad[t], without gathering
the rows. Work is split into contiguous ranges run on Python threads (ctypes releases the GIL), so no OpenMP
runtime is involved.

The C source is compiled once with the system C compiler into the rlm cache and loaded with ctypes; when no
compiler is found, ``load()`` returns None and the caller uses its PyTorch path (same numbers, slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

SOURCE = r"""
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

static inline void prefetch_row(const float *row, int64_t d) {
    for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(row + i);
}

CLONES void pkm_row_adam(float *p, float *m, float *v, const int64_t *rows, const int64_t *offsets,
                         const int64_t *tok, const float *w, const float *grad, int64_t u0, int64_t u1, int64_t d,
                         float lr, float b1, float b2, float eps, float bc1, float bc2_sqrt) {
    float *g = (float *)malloc(sizeof(float) * (size_t)d);
    const float step = lr / bc1;
    for (int64_t u = u0; u < u1; ++u) {
        if (u + 2 < u1) {
            const int64_t ahead = rows[u + 2] * d;
            prefetch_row(p + ahead, d), prefetch_row(m + ahead, d), prefetch_row(v + ahead, d);
        }
        memset(g, 0, sizeof(float) * (size_t)d);
        for (int64_t e = offsets[u]; e < offsets[u + 1]; ++e) {
            const float we = w[e];
            const float *gr = grad + tok[e] * d;
            for (int64_t j = 0; j < d; ++j) g[j] += we * gr[j];
        }
        float *pr = p + rows[u] * d, *mr = m + rows[u] * d, *vr = v + rows[u] * d;
        for (int64_t j = 0; j < d; ++j) {
            const float mj = b1 * mr[j] + (1.0f - b1) * g[j];
            const float vj = b2 * vr[j] + (1.0f - b2) * g[j] * g[j];
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

_LIB: ctypes.CDLL | None = None
_TRIED = False
_POOL: ThreadPoolExecutor | None = None


def _cache_dir() -> Path:
    root = os.environ.get("RLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rlm")
    return Path(root) / "native"


def _build(target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc, clang) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "pkm_row_adam.c", Path(tmp) / target.name
        src.write_text(SOURCE)
        subprocess.run(
            [cc, "-O3", "-fopenmp-simd", "-shared", "-fPIC", "-o", str(out), str(src), "-lm"],
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
    target = _cache_dir() / f"pkm_row_adam_{hashlib.sha1(SOURCE.encode()).hexdigest()[:12]}.so"
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as err:
        warnings.warn(f"pkm: fused value update unavailable ({err}); using the PyTorch path", stacklevel=2)
        return None
    lib.pkm_row_adam.restype = lib.pkm_bag_dot.restype = None
    lib.pkm_row_adam.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 3 + [ctypes.c_float] * 6
    lib.pkm_bag_dot.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
    _LIB = lib
    return lib


def _fits(floats: tuple[Tensor, ...], ints: tuple[Tensor, ...]) -> bool:
    ok = all(t.device.type == "cpu" and t.is_contiguous() for t in (*floats, *ints))
    return ok and all(t.dtype == torch.float32 for t in floats) and all(t.dtype == torch.int64 for t in ints)


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
    bc1, bc2_sqrt = 1 - betas[0] ** step, (1 - betas[1] ** step) ** 0.5
    ptrs = [t.data_ptr() for t in (p, m, v, rows, offsets, tok, w, grad)]
    hyper = (lr, betas[0], betas[1], eps, bc1, bc2_sqrt)
    _parallel(U, lambda lo, hi: lib.pkm_row_adam(*ptrs, lo, hi, d, *hyper), min_per_thread=256)
    return True
