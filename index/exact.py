"""Exact inner-product search over unit vectors in torch: an index, and the reference every index's recall is
measured against; and the unit-vector input check every index shares."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch

from rlm.index._faiss import faiss


def as_unit_float32(x: np.ndarray | torch.Tensor, name: str = "vectors") -> np.ndarray:
    """C-contiguous float32 (n, d) with unit rows (zero rows stay zero); clear errors on bad input."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"{name} must be a 2-D (n, d) array with d > 0, got shape {x.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError(f"{name} contain NaN or inf values")
    norms = np.linalg.norm(x, axis=1, keepdims=True)  # (n, 1)
    if np.allclose(norms[norms > 0], 1.0, atol=1e-4):
        return x
    return x / np.maximum(norms, 1e-12)


class TorchExactIndex:
    """Exact inner-product search in torch over (n, d) unit vectors, on CUDA when torch has it: copied to the device
    at the first search and kept there, except a memmap searched on the CPU, or a base the device has no room for,
    which is read chunk by chunk at every search, so it never has to fit."""

    def __init__(self, vectors: np.ndarray, device: str | None = None, chunk_elems: int = 2**25) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.chunk_elems = chunk_elems  # bounds the (queries, base chunk) score matrix and each upload's copy
        self.vectors = vectors
        self._resident: torch.Tensor | None = None  # (n, d) float32 on self.device, made by _upload
        self._streamed = isinstance(vectors, np.memmap) and self.device.type == "cpu"

    @property
    def ntotal(self) -> int:
        """Number of indexed vectors."""
        return len(self.vectors)

    @property
    def d(self) -> int:
        """Dimension of the vectors."""
        return self.vectors.shape[1]

    def _upload(self) -> torch.Tensor:
        """The whole base as one (n, d) float32 tensor on the device (on the CPU, a float32 array as it is)."""
        x = self.vectors
        if self.device.type == "cpu" and not isinstance(x, np.memmap) and x.dtype == np.float32:
            if x.flags.writeable and x.flags.c_contiguous:
                return torch.from_numpy(x)  # no copy
        out = torch.empty(x.shape, dtype=torch.float32, device=self.device)
        step = max(1, self.chunk_elems // max(1, x.shape[1]))
        for lo in range(0, len(x), step):
            out[lo : lo + step].copy_(torch.from_numpy(np.array(x[lo : lo + step], dtype=np.float32)))
        return out

    def _base(self) -> torch.Tensor | None:
        """The resident base (uploaded at the first call), or None when it is streamed at every search."""
        if self._resident is None and not self._streamed:
            try:
                self._resident = self._upload()
            except torch.OutOfMemoryError:
                warnings.warn(
                    f"exact index: {self.ntotal} x {self.d} vectors do not fit on {self.device}; "
                    "streaming them from host memory at every search",
                    stacklevel=3,
                )
                self._streamed = True
        return self._resident

    def _chunk(self, base: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
        """Rows lo..hi-1 of the base on the device: a view of the resident copy, or read and copied now."""
        if base is not None:
            return base[lo:hi]
        chunk = self.vectors[lo:hi]
        if isinstance(chunk, np.memmap) or not chunk.flags.writeable or chunk.dtype != np.float32:
            chunk = np.array(chunk, dtype=np.float32)  # a memmap is read into memory, chunk by chunk
        return torch.from_numpy(chunk).to(self.device)

    @torch.no_grad()
    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k (scores (Q, k) float32, ids (Q, k) int64); -1 ids and -inf scores pad when k > n."""
        n, kk = self.ntotal, min(k, self.ntotal)
        base = self._base()
        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).to(self.device)  # (Q, d)
        best_s = torch.full((len(q), 0), -math.inf, device=self.device)
        best_i = torch.zeros((len(q), 0), dtype=torch.long, device=self.device)
        step = max(kk, self.chunk_elems // max(1, len(q)))
        for lo in range(0, n, step):
            scores = q @ self._chunk(base, lo, lo + step).T  # (Q, chunk)
            s, i = scores.topk(min(kk, scores.shape[1]), dim=1)
            # keep a running top-k over base chunks so the score matrix stays (Q, step)
            best_s, order = torch.cat([best_s, s], 1).topk(min(kk, best_s.shape[1] + s.shape[1]), dim=1)
            best_i = torch.cat([best_i, i + lo], 1).gather(1, order)
        scores = np.full((len(q), k), -np.inf, dtype=np.float32)
        ids = np.full((len(q), k), -1, dtype=np.int64)
        scores[:, :kk], ids[:, :kk] = best_s.cpu().numpy(), best_i.cpu().numpy()
        return scores, ids


def first_kept(
    ids: np.ndarray, scores: np.ndarray, keep: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's first k kept (ids, scores), order preserved, padded with (-1, -inf)."""
    order = np.argsort(~keep, axis=1, kind="stable")[:, :k]  # kept columns first, in rank order
    out_ids = np.take_along_axis(ids, order, 1)
    out_scores = np.take_along_axis(scores, order, 1).astype(np.float32)
    dropped = ~np.take_along_axis(keep, order, 1)
    out_ids[dropped], out_scores[dropped] = -1, -np.inf
    if out_ids.shape[1] < k:
        pad = k - out_ids.shape[1]
        out_ids = np.pad(out_ids, ((0, 0), (0, pad)), constant_values=-1)
        out_scores = np.pad(out_scores, ((0, 0), (0, pad)), constant_values=-np.inf)
    return out_ids, out_scores


# search_index scores batches of this many queries (inclusive) of a flat faiss index on the CPU with torch: faster
# than faiss's per-query path, slower than its blocked BLAS search on large batches
SCAN_QUERIES = (16, 512)


def flat_vectors(index: Any) -> np.ndarray | None:
    """(n, d) float32 view, without a copy, of the vectors of a non-empty inner-product faiss IndexFlat on the CPU;
    None for any other index."""
    if not isinstance(index, faiss.Index) or _is_gpu(index):
        return None
    flat = faiss.downcast_index(index)
    inner_product = isinstance(flat, faiss.IndexFlat) and flat.metric_type == faiss.METRIC_INNER_PRODUCT
    if not inner_product or not flat.ntotal:
        return None
    return faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d)


def exact_search(base: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k inner-product search with torch: the reference every index is checked against."""
    return TorchExactIndex(base).search(as_unit_float32(queries, "queries"), k)


def _is_gpu(index: Any) -> bool:
    if not isinstance(index, faiss.Index) or not hasattr(faiss, "GpuParameterSpace"):
        return False  # a torch index (exact or IVF), wherever its tensors are, is searched like a CPU one
    return "Gpu" in type(faiss.downcast_index(index)).__name__
