"""Indices over raw vectors by squared L2 distance, for token-level kNN-LM datastores (Khandelwal et al. 2020, who
found L2 better than inner product). Keys stream from an on-disk float16 array in chunks, never all in memory as
float32. 'SQfp16' is exact; 'IVF{nlist},PQ{m}' is tuned to a target recall@k against exact search."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from rlm.index._faiss import faiss
from rlm.index.build import ivf_of, make_faiss_index, set_search_params, tunable_param, tune_search_params

ADD_CHUNK = 65536  # keys converted to float32 and added per faiss call
EXACT = "SQfp16"
REFINE_FACTOR = 4  # a refined index re-ranks this many times k candidates of its quantised search exactly
PLATEAU = 0.005  # tuning stops doubling nprobe once recall gains less (a product quantiser's ceiling)
BLAS_QUERIES = 32  # from this many queries on, an exact index is searched by exact_l2's matrix products
EXACT_CHUNK = 65536  # keys converted to float32 per matrix product of exact_l2
CANDIDATES = 2  # exact_l2 re-ranks this many times k candidates of its matrix products by direct distances
RERANK_QUERIES = 1024  # queries whose candidates exact_l2 re-ranks at once, (1024, 2k, d) float32
TRAIN_KEYS = 131072  # keys an index is trained on (more where an IVF needs 40 per list)
TUNE_QUERIES = 256  # keys of the index searched as queries while nprobe is tuned


@dataclass
class L2Index:
    """A searchable L2 index and how it was made."""

    index: Any
    factory: str
    search_params: dict[str, int] = field(default_factory=dict)
    tuned_recall: float | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # wall-clock seconds of train, add, tune


def choose_l2_factory(n: int, dim: int, flat_below: int = 1_000_000) -> str:
    """'SQfp16' (exact) below ``flat_below`` keys, else IVF-PQ with ~8 dims per code byte whose REFINE_FACTOR x k
    candidates are re-ranked by exact float16 distances (the kNN distribution is a softmax of distances, which PQ's
    blur); nlist ~ 2*sqrt(n), half of build.nlist_for's, as k-means over millions of keys is slow."""
    if n <= 0 or dim <= 0:
        raise ValueError(f"need n > 0 keys of dim > 0, got n={n}, dim={dim}")
    if n < flat_below:
        return EXACT
    nlist = max(1, min(int(round(2 * math.sqrt(n))), n // 39))
    m = max(d for d in range(1, min(dim, 64) + 1) if dim % d == 0 and d <= max(1, dim // 8))
    return f"IVF{nlist},PQ{m},Refine({EXACT})"


def bytes_per_key(factory: str, dim: int) -> int:
    """Bytes the index stores per key (codes, the 8-byte id of IVF lists, refinement keys)."""
    refine = 2 * dim if f"Refine({EXACT})" in factory else 4 * dim if "RFlat" in factory else 0
    if factory == EXACT:
        return 2 * dim
    if factory in ("Flat", "IndexFlatL2"):
        return 4 * dim
    if ",PQ" in factory:
        m = int(factory.split(",PQ")[1].split("x")[0].split(",")[0])
        return m + 8 + refine
    return 4 * dim + 8 + refine  # a safe upper bound for other strings


def exact_l2(
    base: np.ndarray,
    queries: np.ndarray,
    k: int,
    exclude: tuple[int, int] | None = None,
    chunk: int = EXACT_CHUNK,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k (squared L2 distances (Q, k) ascending, ties by id; ids (Q, k); inf and -1 past the last key) of
    queries over ``base`` (N, d) of any float dtype without the ids of ``exclude``, an [lo, hi) range: the reference
    every L2 index is checked against. Candidates come from matrix products over ``chunk`` keys at a time (faiss.knn),
    whose |q|^2 + |x|^2 - 2 q.x rounds near ties into either order; their direct distances decide."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    heap = faiss.ResultHeap(len(q), CANDIDATES * k)
    lo_x, hi_x = exclude or (0, 0)
    # the keys left of the excluded range, then right of it
    for start, stop in ((0, lo_x), (hi_x, len(base))):
        for lo in range(start, min(stop, len(base)), chunk):
            d, i = faiss.knn(q, np.asarray(base[lo : min(lo + chunk, stop)], dtype=np.float32), heap.k)
            heap.add_result(d, np.where(i >= 0, i + lo, -1))
    heap.finalize()
    cand = heap.I  # (Q, K) candidate ids, -1 past the last key
    d = np.concatenate([_direct_l2(q[lo : lo + RERANK_QUERIES], base, cand[lo : lo + RERANK_QUERIES])
                        for lo in range(0, len(q), RERANK_QUERIES)])  # fmt: skip
    order = np.lexsort((np.where(cand >= 0, cand, np.iinfo(np.int64).max), d), axis=1)[:, :k]
    return np.take_along_axis(d, order, 1), np.take_along_axis(cand, order, 1)


def _direct_l2(q: np.ndarray, base: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Squared L2 distances (B, K) of queries (B, d) to base[ids] (inf where an id is -1), summed as faiss sums them:
    an exact index's scan finds these very numbers."""
    rows = np.asarray(base[np.maximum(ids, 0).ravel()], dtype=np.float32)  # (B * K, d)
    of = np.repeat(np.arange(len(ids)), ids.shape[1])  # (B * K,) the query of each row
    each, d = np.arange(len(rows)), np.empty(len(rows), np.float32)  # named: swig_ptr keeps no array alive
    ptr = faiss.swig_ptr
    faiss.pairwise_indexed_L2sqr(q.shape[1], len(rows), ptr(q), ptr(of), ptr(rows), ptr(each), ptr(d))
    return np.where(ids >= 0, d.reshape(ids.shape), np.inf)


def exact_keys(index: Any) -> np.ndarray | None:
    """The (N, d) keys of an exact index ('SQfp16' float16, 'Flat' float32), a view of its codes; None for others.
    Valid while ``index`` lives."""
    ix = faiss.downcast_index(index)
    if isinstance(ix, faiss.IndexScalarQuantizer) and ix.sq.qtype == faiss.ScalarQuantizer.QT_fp16:
        dtype = np.float16
    elif isinstance(ix, faiss.IndexFlat) and ix.metric_type == faiss.METRIC_L2:
        dtype = np.float32
    else:
        return None
    if not ix.ntotal:
        return np.zeros((0, ix.d), dtype)
    return faiss.rev_swig_ptr(ix.codes.data(), ix.ntotal * ix.code_size).view(dtype).reshape(ix.ntotal, ix.d)


def build_l2_index(
    keys: np.ndarray,
    factory: str,
    target_recall: float | None = 0.9,
    tune_k: int = 32,
    progress: bool = False,
) -> L2Index:
    """Train, fill and tune an L2 index over ``keys`` (N, d), row i getting id i; ``keys`` may be a float16
    memmap: it is read ``ADD_CHUNK`` rows at a time."""
    n, dim = keys.shape
    index = empty_l2_index(dim, factory)
    rng = np.random.default_rng(0)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    if not index.is_trained:
        sample = np.sort(rng.choice(n, size=min(n, l2_train_size(index)), replace=False))
        train_l2_index(index, factory, np.asarray(keys[sample], dtype=np.float32))
    seconds["train"] = time.perf_counter() - start
    start = time.perf_counter()
    add_l2(index, keys, f"add to {factory}", progress)
    seconds["add"] = time.perf_counter() - start
    built = L2Index(index, factory, seconds=seconds)
    start = time.perf_counter()
    tune_l2(built, keys, target_recall, tune_k, rng)
    seconds["tune"] = time.perf_counter() - start
    return built


def empty_l2_index(dim: int, factory: str) -> Any:
    """A new, untrained faiss L2 index of ``factory``; ValueError for a string faiss cannot build."""
    return make_faiss_index(factory, dim, faiss.METRIC_L2)


def l2_train_size(index: Any) -> int:
    """Keys to train ``index`` on: TRAIN_KEYS, or more where an IVF needs >= 39 per centroid."""
    ivf = ivf_of(index)
    return max(TRAIN_KEYS, 40 * ivf.nlist if ivf is not None else 0)


def train_l2_index(index: Any, factory: str, sample: np.ndarray) -> None:
    """Train ``index`` (its coarse quantiser and product quantiser) on float32 ``sample`` (S, d)."""
    ivf = ivf_of(index)
    need = max(ivf.nlist if ivf is not None else 1, 256 if ",PQ" in factory else 1)
    if len(sample) < need:
        raise ValueError(
            f"too few keys to train {factory!r}: got {len(sample)}, it needs at least {need}; "
            f"use factory '{EXACT}' (exact) or 'auto'"
        )
    index.train(np.ascontiguousarray(sample, dtype=np.float32))


def add_l2(index: Any, keys: np.ndarray, desc: str, progress: bool) -> None:
    """Add ``keys`` (N, d), any float dtype, ``ADD_CHUNK`` rows at a time; ids continue from ``index.ntotal``."""
    with tqdm(total=len(keys), desc=desc, disable=not progress, unit="key") as bar:
        for lo in range(0, len(keys), ADD_CHUNK):
            chunk = np.asarray(keys[lo : lo + ADD_CHUNK], dtype=np.float32)
            index.add(chunk)
            bar.update(len(chunk))


def tune_l2(
    built: L2Index, keys: np.ndarray, target_recall: float | None, tune_k: int, rng: np.random.Generator
) -> None:
    """Set a refinement's k_factor and tune nprobe (or the index's own knob) of ``built.index``, which holds
    exactly ``keys``, to ``target_recall`` @ ``tune_k`` against exact search; recorded in ``built``."""
    index, n = built.index, len(keys)
    if _refine(index) is not None:
        _refine(index).k_factor = REFINE_FACTOR
        built.search_params["k_factor"] = REFINE_FACTOR
    knob = tunable_param(index)
    if target_recall is not None and knob is not None:
        qids = np.sort(rng.choice(n, size=min(n, TUNE_QUERIES), replace=False))
        queries = np.asarray(keys[qids], dtype=np.float32)
        # k + 1: each query is a key of the index and finds itself first; recall is measured without it
        _, exact = exact_l2(keys, queries, tune_k + 1)
        tuned, built.tuned_recall = tune_search_params(
            index, queries, qids, exact, tune_k, target_recall, knob, plateau=PLATEAU, apply=apply_params
        )
        built.search_params.update(tuned)


def _refine(index: Any) -> Any:
    down = faiss.downcast_index(index)
    return down if isinstance(down, faiss.IndexRefine) else None


def apply_params(index: Any, params: dict[str, int]) -> None:
    """Set nprobe (on the IVF part, through a refinement wrapper) and k_factor (on the refinement)."""
    if "nprobe" in params and ivf_of(index) is not None:
        ivf_of(index).nprobe = int(params["nprobe"])
    if "k_factor" in params and _refine(index) is not None:
        _refine(index).k_factor = float(params["k_factor"])
    rest = {k: v for k, v in params.items() if k not in ("nprobe", "k_factor")}
    if rest:
        set_search_params(index, rest)


def search_l2(
    index: Any,
    queries: np.ndarray,
    k: int,
    exclude: tuple[int, int] | None = None,
    params: dict | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(squared distances (Q, k), ids (Q, k), -1 padded) of float32 queries; ``exclude``: an [lo, hi) id range no
    query may find (its own document), applied inside the search, so the excluded keys never change what is found."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    keys = exact_keys(index)
    if keys is not None and len(q) >= BLAS_QUERIES:
        # faiss scans every key per query, bound by memory once the keys outgrow the cache; exact_l2 reads each
        # chunk once for all queries. A few queries (generation) would spend longer converting keys to float32
        return exact_l2(keys, q, k, exclude)
    params = params or {}
    if exclude is None:
        apply_params(index, params)
        return index.search(q, k)
    sel = faiss.IDSelectorNot(faiss.IDSelectorRange(int(exclude[0]), int(exclude[1])))
    ivf = ivf_of(index)
    if ivf is not None:
        inner = faiss.SearchParametersIVF(sel=sel, nprobe=int(params.get("nprobe", ivf.nprobe)))
    else:
        inner = faiss.SearchParameters(sel=sel)
    refine = _refine(index)
    if refine is not None:
        kf = float(params.get("k_factor", refine.k_factor))
        sp = faiss.IndexRefineSearchParameters(k_factor=kf, base_index_params=inner)
        return index.search(q, k, params=sp)
    return index.search(q, k, params=inner)
