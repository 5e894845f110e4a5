"""Searching an index on the device: faiss-gpu when installed, else torch over the index's own data when it
fits. TorchIVFIndex keeps faiss's centroids, lists and nprobe but decodes the codes once (sa_decode) and
scores each probed list exactly: faiss's lookup tables compute the same <q, centroid> + <q, decoded residual>,
up to float rounding."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from rlm.index._faiss import faiss
from rlm.index.build import BuiltIndex, gpu_available, to_gpu
from rlm.index.exact import TorchExactIndex, _is_gpu, flat_vectors

DECODE_ROWS = 65536  # vectors decoded per faiss sa_decode call (bounds the host copy)
HEADROOM = 0.5  # a torch search may take this share of the device's free memory; training needs the rest


def device_index(index: Any, device: torch.device) -> tuple[Any, str]:
    """(what to search on ``device`` instead of ``index``, a phrase saying which search): faiss-gpu when installed,
    else a torch search over the index's own data when it fits (HEADROOM), else ``index`` itself."""
    raw = index.index if isinstance(index, BuiltIndex) else index
    name = index.factory if isinstance(index, BuiltIndex) else type(raw).__name__
    if _is_gpu(raw):
        return raw, f"faiss-gpu ({name}, already on the GPU)"
    if isinstance(raw, TorchExactIndex) and raw.device == device:
        return raw, f"exact torch search on {device}"
    if isinstance(raw, faiss.Index) and gpu_available():
        moved, on_gpu = to_gpu(raw)
        if on_gpu:
            return moved, f"faiss-gpu ({name})"
    base = raw.vectors if isinstance(raw, TorchExactIndex) else flat_vectors(raw)
    need = None if base is None else base.shape[0] * base.shape[1] * 4
    if base is None and (ivf := plain_ivf(raw)) is not None:  # float32 vectors and int64 ids, centroids
        need = int(ivf.ntotal) * (4 * ivf.d + 8) + int(ivf.nlist) * ivf.d * 4
    if need is None:
        return index, f"faiss-cpu ({name}: no torch search for this index type)"
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else math.inf
    if need > HEADROOM * free:
        room = f"{name} needs {need / 2**30:.2f} GiB, {device} has {free / 2**30:.2f} GiB free"
        return index, f"faiss-cpu ({room})"
    if base is not None:
        return TorchExactIndex(base, device=str(device)), f"exact torch search on {device} ({name})"
    ivf = TorchIVFIndex(raw, device, name)
    return ivf, f"torch IVF search on {device} ({name}, nprobe {ivf.nprobe})"


def plain_ivf(index: Any) -> Any:
    """The index as a faiss IndexIVF when it is a plain inner-product IVF index on the CPU, else None."""
    if not isinstance(index, faiss.Index):
        return None
    down = faiss.downcast_index(index)
    if not isinstance(down, faiss.IndexIVF) or down.metric_type != faiss.METRIC_INNER_PRODUCT:
        return None
    return down


class TorchIVFIndex:
    """Search a plain inner-product IVF faiss index (see plain_ivf) with torch on ``device``; nprobe is the faiss
    index's, read at every search, so set_search_params on it applies here too."""

    def __init__(
        self, index: Any, device: str | torch.device, factory: str | None = None, chunk_elems: int = 2**25
    ) -> None:
        ivf = plain_ivf(index)
        if ivf is None:
            what = factory or type(index).__name__
            raise ValueError(
                f"the torch IVF search takes a plain inner-product IVF index (IVF{{n}},Flat, IVF{{n}},SQ8, "
                f"IVF{{n}},PQ{{m}}), got {what!r}; use faiss-gpu, or the CPU search"
            )
        self._owner = index  # ivf is a view of its C++ object: kept so that it stays alive
        self.faiss_index, self.device, self.chunk_elems = ivf, torch.device(device), chunk_elems
        sizes, ids, codes = _lists(ivf)
        self.ntotal, self.d, self.nlist = int(ivf.ntotal), int(ivf.d), int(ivf.nlist)
        centroids = ivf.quantizer.reconstruct_n(0, self.nlist)
        self.centroids = torch.from_numpy(centroids).to(self.device)  # (nlist, d)
        self.sizes = torch.from_numpy(sizes).to(self.device)  # (nlist,) vectors in each list
        self.starts = self.sizes.cumsum(0) - self.sizes  # (nlist,) each list's first row below
        self.ids = torch.from_numpy(ids).to(self.device)  # (n,) faiss id of each row, the rows list by list
        self.vectors = torch.empty((self.ntotal, self.d), dtype=torch.float32, device=self.device)  # (n, d)
        lists = np.repeat(np.arange(self.nlist, dtype=np.int64), sizes)  # (n,) list of each row
        for lo in range(0, self.ntotal, DECODE_ROWS):
            hi = min(lo + DECODE_ROWS, self.ntotal)
            self.vectors[lo:hi] = torch.from_numpy(_decode(ivf, lists[lo:hi], codes[lo:hi]))
        self._sorted_sizes = np.sort(sizes)[::-1].cumsum()  # (nlist,): most vectors any p lists can hold

    @property
    def nprobe(self) -> int:
        """Lists probed per query: the faiss index's own setting."""
        return min(int(self.faiss_index.nprobe), self.nlist)

    @torch.no_grad()
    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores (Q, k) float32, ids (Q, k) int64) over the nprobe lists whose centroids score highest;
        -1 ids and -inf scores pad when the probed lists hold fewer than k vectors."""
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        ids = np.full((len(queries), k), -1, dtype=np.int64)
        if self.ntotal == 0 or len(queries) == 0:
            return scores, ids
        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).to(self.device)  # (Q, d)
        p = self.nprobe
        width = int(self._sorted_sizes[p - 1])  # C: candidates of the fullest p lists, known without a sync
        kk = min(k, width)
        rows = max(1, self.chunk_elems // max(1, width * self.d))  # queries per chunk: (rows, C, d) gathered
        out_s, out_i = [], []
        for lo in range(0, len(q), rows):
            s, i = self._search_chunk(q[lo : lo + rows], p, width, kk)
            out_s.append(s)
            out_i.append(i)
        scores[:, :kk], ids[:, :kk] = torch.cat(out_s).cpu().numpy(), torch.cat(out_i).cpu().numpy()
        return scores, ids

    def _search_chunk(self, q: torch.Tensor, p: int, width: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(Qc, k) scores and ids of queries (Qc, d): the probed lists' rows laid side by side, C wide, scored."""
        probe = (q @ self.centroids.T).topk(p, dim=1).indices  # (Qc, p) lists, best centroid first
        sizes = self.sizes[probe]  # (Qc, p)
        ends = sizes.cumsum(1)  # (Qc, p) end of each probed list among the query's candidates
        col = torch.arange(width, device=q.device).repeat(len(q), 1)  # (Qc, C)
        slot = torch.searchsorted(ends, col, right=True)  # (Qc, C) probed list holding candidate c
        real = slot < p  # (Qc, C): past the probed lists' vectors, padding
        slot = slot.clamp(max=p - 1)
        row = self.starts[probe].gather(1, slot) + col - (ends - sizes).gather(1, slot)  # (Qc, C)
        row = torch.where(real, row, 0)
        s = torch.einsum("qd,qcd->qc", q, self.vectors[row]).masked_fill(~real, -math.inf)  # (Qc, C)
        top_s, top_c = s.topk(k, dim=1)  # (Qc, k)
        top_i = torch.where(real.gather(1, top_c), self.ids[row.gather(1, top_c)], -1)
        return top_s, top_i


def _lists(ivf: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sizes (nlist,), ids (n,), codes (n, code_size) uint8) of every inverted list, list by list."""
    lists = ivf.invlists
    sizes = np.array([lists.list_size(i) for i in range(ivf.nlist)], dtype=np.int64)
    ids = np.empty(int(sizes.sum()), dtype=np.int64)
    codes = np.empty((len(ids), lists.code_size), dtype=np.uint8)
    at = 0
    for i in np.flatnonzero(sizes):
        n = int(sizes[i])
        id_ptr, code_ptr = lists.get_ids(int(i)), lists.get_codes(int(i))
        ids[at : at + n] = faiss.rev_swig_ptr(id_ptr, n)
        codes[at : at + n] = faiss.rev_swig_ptr(code_ptr, n * lists.code_size).reshape(n, -1)
        lists.release_ids(int(i), id_ptr)
        lists.release_codes(int(i), code_ptr)
        at += n
    return sizes, ids, codes


def _decode(ivf: Any, lists: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """(n, d) float32 vectors of codes (n, code_size) stored in `lists` (n,): faiss's standalone decoding, whose
    codes begin with the list number in coarse_code_size() little-endian bytes."""
    prefix = lists.astype("<i8").view(np.uint8).reshape(len(lists), 8)[:, : ivf.coarse_code_size()]
    return ivf.sa_decode(np.ascontiguousarray(np.concatenate([prefix, codes], 1)))
