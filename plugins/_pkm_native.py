"""CPU kernels of the PKM (plugins/_pkm_kernels.c, _pkm_search.c), compiled on first use and loaded with ctypes.

The fused value update, per distinct row u (its lookups e in [offsets[u], offsets[u+1])):
    g = sum_e w[e] * grad[tok[e]]                       the sum-EmbeddingBag gradient of that row
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
torch.optim.Adam's update (Kingma & Ba, Alg. 1) on touched rows; also the value read's per-sample-weight
gradient and the exact product-key search. Ranges run on Python threads (ctypes releases the GIL). Without a
compiler ``load()`` returns None and callers take their PyTorch path (same numbers, slower).
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

_HERE = Path(__file__).resolve().parent
# The search is written once for scalar_t and instantiated for float32 and float64.
SOURCE = (_HERE / "_pkm_kernels.c").read_text() + "".join(
    (_HERE / "_pkm_search.c").read_text().replace("scalar_t", ctype).replace("_SFX", suffix)
    for ctype, suffix in (("float", "_f32"), ("double", "_f64"))
)

# -fno-math-errno: sqrtf need not set errno, so the Adam loop vectorises (same results: IEEE sqrt is exact).
CFLAGS = ("-O3", "-fno-math-errno", "-fopenmp-simd", "-shared", "-fPIC")
HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and most aarch64 kernels
_MADV_HUGEPAGE = 14  # linux/mman.h

_LIB: ctypes.CDLL | None = None
_TRIED = False
_POOL: ThreadPoolExecutor | None = None


def _compiler() -> str | None:
    """$CC, else cc, gcc or clang on PATH, else None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _compiler_version(cc: str | None) -> str:
    """The first line of ``cc --version``, or '' when it cannot run."""
    if cc is None:
        return ""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0].strip() if out else ""


def cache_key(cc: str | None) -> str:
    """The built library's name key: source, flags, architecture and compiler (a cache shared by machines)."""
    parts = (SOURCE, " ".join(CFLAGS), platform.machine(), sys.platform, _compiler_version(cc))
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:12]


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None (with a warning) when it cannot be built."""
    global _LIB, _TRIED
    if _TRIED:
        return _LIB
    _TRIED = True
    cc = _compiler()
    cache = os.environ.get("RLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rlm")
    target = Path(cache) / "native" / f"pkm_native_{cache_key(cc)}.so"
    try:
        if not target.exists():
            if cc is None:
                raise RuntimeError("no C compiler (cc, gcc, clang) on PATH")
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src, out = Path(tmp) / "pkm_row_adam.c", Path(tmp) / target.name
                src.write_text(SOURCE)
                subprocess.run(
                    [cc, *CFLAGS, "-o", str(out), str(src), "-lm"], check=True, capture_output=True
                )
                os.replace(out, target)  # atomic: concurrent processes never load a half-written library
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
    """values[slots[t, j]] . grad[t], (N, m); None unless the kernel runs on them (float32, CPU, contiguous)."""
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
    """Run the fused update in place; False when the kernel is unavailable or the tensors do not fit it. p, m, v:
    (S, d) float32 CPU contiguous; rows (U,) sorted distinct; offsets (U+1,); tok, w (E,) in row order; grad (N, d)."""
    lib = load() if _fits((p, m, v, w, grad), (rows, offsets, tok)) else None
    if lib is None:
        return False
    U, d = rows.numel(), p.shape[1]
    # Constants in double precision, rounded to float32 once when passed.
    b1, b2 = float(betas[0]), float(betas[1])
    bc1, bc2_sqrt = 1.0 - b1**step, math.sqrt(1.0 - b2**step)
    ptrs = [t.data_ptr() for t in (p, m, v, rows, offsets, tok, w, grad)]
    hyper = (lr / bc1, b1, 1.0 - b1, b2, 1.0 - b2, eps, bc2_sqrt)
    _parallel(U, lambda lo, hi: lib.pkm_row_adam(*ptrs, lo, hi, d, *hyper), min_per_thread=256)
    return True


def product_search(
    s1: Sequence[Tensor], s2: Sequence[Tensor], k: int
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Exact top-k of s1[h][t, i] + s2[h][t, j] over all (i, j): (scores, i, j), (N, H, k), sorted descending
    (ties by the rank of i, then j). s1, s2: per head, (N, n) float32 or float64 CPU contiguous scores. None when
    the kernel does not run on them or a score is NaN."""
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


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised CPU tensor on 2 MiB-aligned memory advised for transparent huge pages (random rows of a
    large table miss the TLB with 4 KiB pages), advised before the first touch as THP 'madvise' needs. Small
    tensors and other default devices get a plain ``torch.empty``."""
    probe = torch.empty((), dtype=dtype)  # on torch's default device
    nbytes = math.prod(shape) * probe.element_size()
    if nbytes < 4 * HUGE_PAGE or probe.device.type != "cpu":
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # over-allocate, then take the aligned part
    start = -raw.data_ptr() % HUGE_PAGE
    out = raw[start : start + nbytes].view(dtype).view(shape)  # keeps raw's storage alive
    # elsewhere, or without libc or THP, the advice is skipped (harmless)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise(ctypes.c_void_p(out.data_ptr()), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)
        except OSError:
            pass
    return out
