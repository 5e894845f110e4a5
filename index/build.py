"""Build a vector index over unit vectors (inner product, i.e. cosine): faiss factory strings, an automatic choice,
GPU placement, and nprobe/efSearch tuned to a target recall against exact search."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from rlm.index._faiss import faiss
from rlm.index.exact import (
    SCAN_QUERIES,
    TorchExactIndex,
    _is_gpu,
    as_unit_float32,
    exact_search,
    first_kept,
    flat_vectors,
)

TORCH = "torch"  # factory name of the exact torch search: the vectors themselves are the index
ADD_CHUNK = 65536  # vectors added per faiss call
MIN_POINTS_PER_CENTROID = 39  # faiss warns below this many training points per k-means centroid
TUNE_K, TUNE_QUERIES = 10, 1000  # tuning measures recall@TUNE_K of this many indexed vectors as queries
GPU_MAX_K = 2048  # faiss GPU indices return at most this many results per query


@dataclass
class IndexConfig:
    """How to build an index."""

    factory: str = "auto"
    """'auto', 'torch' (exact torch search) or a faiss factory string such as 'IVF1024,SQ8' or 'HNSW32'."""
    memory_budget_gb: float = 4.0
    """Most memory the stored codes may take; 'auto' picks flat, SQ8 or PQ codes to fit it."""
    flat_below: int = 32768
    """'auto' keeps exact flat search below this many vectors (IVF buys little there)."""
    target_recall: float | None = 0.95
    """Tune nprobe/efSearch until recall@TUNE_K on a sample reaches this; None: no tuning."""
    gpu: bool | None = None
    """Train and search on GPU: None means whenever faiss sees a GPU; True requires one."""

    def __post_init__(self) -> None:
        if not isinstance(self.factory, str) or not self.factory.strip():
            raise ValueError(
                f"index.factory must be 'auto', 'torch' or a faiss factory string, got {self.factory!r}"
            )
        if not self.memory_budget_gb > 0:
            raise ValueError(f"index.memory_budget_gb must be positive, got {self.memory_budget_gb}")
        if self.flat_below < 0:
            raise ValueError(f"index.flat_below must be >= 0, got {self.flat_below}")
        if self.target_recall is not None and not 0.0 < self.target_recall <= 1.0:
            raise ValueError(f"index.target_recall must be in (0, 1] or null, got {self.target_recall}")
        if self.gpu and not gpu_available():
            raise ValueError(
                "index.gpu=True but faiss sees no GPU (install faiss-gpu, or use gpu: null/false)"
            )


@dataclass
class BuiltIndex:
    """A searchable index and how it was made."""

    index: Any  # a faiss.Index or a TorchExactIndex; both have search(x, k) -> (scores, ids) and ntotal
    factory: str  # the resolved factory ('IVF1789,SQ8', 'Flat', 'torch'), never 'auto'
    search_params: dict[str, int] = field(default_factory=dict)  # nprobe/efSearch, set again after loading
    tuned_recall: float | None = None  # recall@TUNE_K on the tuning sample with search_params, when tuned
    on_gpu: bool = False  # whether `index` lives on a GPU

    @property
    def ntotal(self) -> int:
        """Number of indexed vectors."""
        return int(self.index.ntotal)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores float32 (Q, k), ids int64 (Q, k)) of L2-normalised queries; -1 ids pad."""
        return search_index(self.index, as_unit_float32(queries, "queries"), k)

    def cpu_index(self) -> Any:
        """The index on the CPU, as it must be to be written."""
        return faiss.index_gpu_to_cpu(self.index) if self.on_gpu else self.index


def gpu_available() -> bool:
    """Whether this faiss build has a GPU to use."""
    return hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0


_GPU_RESOURCES: dict[int, Any] = {}  # one faiss StandardGpuResources per GPU, reused


def cpu_to_gpu(index: Any) -> Any:
    """A CPU faiss index copied to this rank's own GPU under torch.distributed, else to every visible GPU."""
    import torch
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not (distributed and torch.cuda.is_available()):
        return faiss.index_cpu_to_all_gpus(index)
    device = int(torch.cuda.current_device())
    if device not in _GPU_RESOURCES:
        _GPU_RESOURCES[device] = faiss.StandardGpuResources()
    return faiss.index_cpu_to_gpu(_GPU_RESOURCES[device], device, index)


def to_gpu(index: Any) -> tuple[Any, bool]:
    """(cpu_to_gpu(index), True), or (index, False) for types faiss cannot move (e.g. HNSW)."""
    try:
        return cpu_to_gpu(index), True
    except (RuntimeError, AttributeError) as err:
        warnings.warn(
            f"keeping {type(index).__name__} on the CPU: faiss cannot move it to a GPU ({err})", stacklevel=2
        )
        return index, False


def max_k(index: Any) -> int:
    """The largest k one search of this index may ask for."""
    on_gpu = index.on_gpu if isinstance(index, BuiltIndex) else _is_gpu(index)
    return min(int(index.ntotal), GPU_MAX_K) if on_gpu else int(index.ntotal)


def nlist_for(n: int) -> int:
    """IVF list count for n vectors: ~4*sqrt(n) (the faiss guidelines' lower end), capped at n/39."""
    return max(1, min(int(round(4 * math.sqrt(n))), n // MIN_POINTS_PER_CENTROID))


def choose_factory(n: int, dim: int, memory_budget_bytes: int, flat_below: int = 32768) -> str:
    """What 'auto' resolves to: flat for small n, else IVF with nlist_for(n) lists and the richest codes that fit
    the budget: float32, SQ8 (4x smaller), else PQ with the most 1-byte sub-quantisers that fit."""
    if n <= 0 or dim <= 0:
        raise ValueError(f"need n > 0 vectors of dim > 0, got n={n}, dim={dim}")
    nlist = nlist_for(n)
    if n < max(flat_below, MIN_POINTS_PER_CENTROID * 4) and n * dim * 4 <= memory_budget_bytes:
        return "Flat"
    centroids = nlist * dim * 4
    for code, nbytes in (("Flat", 4 * dim), ("SQ8", dim)):
        if n * (nbytes + 8) + centroids <= memory_budget_bytes:  # codes + 8-byte ids
            return f"IVF{nlist},{code}"
    per_vector = (memory_budget_bytes - centroids) // n - 8
    m = max((m for m in range(1, dim + 1) if dim % m == 0 and m <= per_vector), default=0)
    if m == 0 or n < 256:
        raise ValueError(
            f"{n} vectors of dim {dim} do not fit memory_budget_gb={memory_budget_bytes / 2**30:.3g} "
            f"even as product-quantised codes; raise the budget"
        )
    return f"IVF{nlist},PQ{m}"


def ivf_of(index: Any) -> Any:
    """The IndexIVF inside a faiss index (through pre-transforms and refinements), or None."""
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


def make_faiss_index(factory: str, dim: int, metric: int | None = None) -> faiss.Index:
    """An empty faiss index (inner product unless `metric`) from a factory string; ValueError for a bad string."""
    try:
        return faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT if metric is None else metric)
    except RuntimeError as err:
        raise ValueError(f"faiss cannot build factory string {factory!r} for dim {dim}: {err}") from None


def train_index(index: faiss.Index, train: np.ndarray, factory: str, gpu: bool) -> faiss.Index:
    """Train `index` on `train` (k-means on the GPU when `gpu`) and return it on the CPU."""
    if index.is_trained:
        return index
    ivf = ivf_of(index)
    pq = getattr(faiss.downcast_index(ivf if ivf is not None else index), "pq", None)
    need = max(ivf.nlist if ivf is not None else 1, pq.ksub if pq is not None else 1)  # lists, PQ centroids
    if len(train) < need:
        raise ValueError(
            f"too few vectors to train {factory!r}: got {len(train)}, it needs at least {need} "
            f"(IVF lists / PQ centroids; faiss recommends {MIN_POINTS_PER_CENTROID}x per IVF list). "
            f"Use fewer IVF lists, factory 'Flat', or 'auto', which picks nlist <= n/{MIN_POINTS_PER_CENTROID}"
        )
    if ivf is not None and gpu:
        # k-means on GPU is the expensive part of training (faiss's documented recipe)
        ivf.clustering_index = cpu_to_gpu(faiss.IndexFlatIP(ivf.d))
    index.train(train)
    if ivf is not None:
        ivf.clustering_index = None
    return index


def search_index(index: Any, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """index.search(queries, k), but a batch of SCAN_QUERIES queries of a flat inner-product faiss index on the
    CPU is scored by torch over its vectors (the same results, faster)."""
    if isinstance(index, BuiltIndex):
        index = index.index
    lo, hi = SCAN_QUERIES
    base = flat_vectors(index) if lo <= len(queries) <= hi else None
    if base is None:
        return index.search(queries, k)
    return TorchExactIndex(base, device="cpu").search(queries, k)


def recall_at_k(found: np.ndarray, exact: np.ndarray, k: int) -> float:
    """Mean |found[:, :k] & exact[:, :k]| / k over queries (the 'k-recall@k' of the faiss wiki)."""
    found, exact = found[:, :k], exact[:, :k]
    hits = sum(len(np.intersect1d(f[f >= 0], e[e >= 0])) for f, e in zip(found, exact))
    return hits / (k * len(exact)) if len(exact) else 1.0


def set_search_params(index: Any, params: dict[str, int]) -> None:
    """Set nprobe/efSearch on a faiss index, through any wrappers (pre-transforms, refinement, GPU)."""
    if not params or isinstance(index, TorchExactIndex):
        return
    space = faiss.GpuParameterSpace() if _is_gpu(index) else faiss.ParameterSpace()
    for name, value in params.items():
        space.set_index_parameter(index, name, value)


def tunable_param(index: Any) -> tuple[str, int] | None:
    """(name, largest useful value) of the speed/recall knob of this index, or None for exact ones."""
    ivf = ivf_of(index) if not isinstance(index, TorchExactIndex) else None
    if ivf is not None:
        return "nprobe", int(ivf.nlist)
    if hasattr(faiss.downcast_index(index), "hnsw"):
        return "efSearch", 4096
    return None


def tune_search_params(
    index: Any,
    sample: np.ndarray,
    sample_ids: np.ndarray,
    exact_ids: np.ndarray,
    k: int,
    target: float,
    knob: tuple[str, int],
    plateau: float | None = None,
    apply: Any = set_search_params,
) -> tuple[dict[str, int], float]:
    """Smallest value of `knob` whose recall@k on the sample reaches `target` (else the best, with a warning), set
    by `apply`; exact_ids: the exact top-(k+1), each query's own id dropped from both as the neighbour tables drop
    it; plateau: stop doubling once recall gains less (a product quantiser caps recall)."""
    name, top = knob

    def recall(value: int) -> float:
        apply(index, {name: value})
        _, ids = index.search(sample, k + 1)
        return recall_at_k(drop_self(ids), drop_self(exact_ids), k)

    def drop_self(ids: np.ndarray) -> np.ndarray:  # each row's first k ids other than its own, -1 padded
        return first_kept(ids, np.zeros(ids.shape, np.float32), ids != sample_ids[:, None], k)[0]

    # doubling, then bisection between the last failure and the first success: ~2*log2(top) searches
    # efSearch below k is meaningless (faiss searches max(efSearch, k) candidates)
    lo, value, prev = (0, 1, -1.0) if name == "nprobe" else (k, max(16, k), -1.0)
    while True:
        r = recall(value)
        if r >= target or value >= top:
            break
        if plateau is not None and r - prev < plateau:
            value, r = lo, prev  # the last doubling bought nothing: keep the cheaper value
            break
        lo, value, prev = value, min(2 * value, top), r
    if r < target:
        warnings.warn(f"{name}={value} reaches recall@{k}={r:.3f} < target {target}", stacklevel=2)
        apply(index, {name: value})
        return {name: value}, r
    hi, best = value, r
    while hi - lo > max(1, hi // 8):  # stop within ~12% of the smallest sufficient value
        mid = (lo + hi) // 2
        r = recall(mid)
        if r >= target:
            hi, best = mid, r
        else:
            lo = mid
    apply(index, {name: hi})
    return {name: hi}, best


def build_index(vectors: np.ndarray, config: IndexConfig | None = None, progress: bool = False) -> BuiltIndex:
    """Build (train, add, tune) an index over `vectors`, row i getting id i."""
    config = config or IndexConfig()
    x = as_unit_float32(vectors)
    n, dim = x.shape
    factory = config.factory
    if factory == TORCH:
        return BuiltIndex(TorchExactIndex(x), TORCH)
    if factory == "auto":
        factory = choose_factory(n, dim, int(config.memory_budget_gb * 2**30), config.flat_below)
    use_gpu = gpu_available() if config.gpu is None else config.gpu
    index = train_index(make_faiss_index(factory, dim), x, factory, use_gpu)
    knob = tunable_param(index)  # read on the CPU index, before a GPU copy hides its structure
    on_gpu = False
    if use_gpu:
        index, on_gpu = to_gpu(index)
    with tqdm(total=n, desc=f"add to {factory}", disable=not progress, unit="vec") as bar:
        for lo in range(0, n, ADD_CHUNK):
            index.add(x[lo : lo + ADD_CHUNK])
            bar.update(len(x[lo : lo + ADD_CHUNK]))
    built = BuiltIndex(index, factory, on_gpu=on_gpu)
    if config.target_recall is not None and knob is not None:
        sample_ids = np.sort(np.random.default_rng(0).choice(n, size=min(TUNE_QUERIES, n), replace=False))
        _, exact_ids = exact_search(x, x[sample_ids], TUNE_K + 1)
        built.search_params, built.tuned_recall = tune_search_params(
            index, x[sample_ids], sample_ids, exact_ids, TUNE_K, config.target_recall, knob
        )
    return built
