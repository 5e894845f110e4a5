"""Building an index in shards (vectors embedded in parts, by several processes or machines) and merging
them on disk, so an index can outgrow one machine's memory.

The recipe is faiss's own (wiki 'Indexes that do not fit in RAM', faiss.contrib.ondisk):
1. prepare_shards: train one IVF index on a sample and save it empty (every shard shares its quantizer);
2. add_shard (one call per shard, anywhere): add that shard's vectors with their global ids to a copy of
   the trained index and save it, with the shard's exact top-k for the tuning queries;
3. merge_shards: merge all shards' inverted lists into one on-disk .ivfdata file (memory-mapped when
   searched) and write the index directory. The shards' exact top-k merge into the global exact top-k,
   so nprobe is tuned without ever holding all vectors in memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from rlm.index._faiss import faiss, merge_ondisk
from rlm.index.build import (
    BuiltIndex,
    IndexConfig,
    as_unit_float32,
    choose_factory,
    exact_search,
    gpu_available,
    make_faiss_index,
    train_index,
    tune_search_params,
)
from rlm.index.search import SegmentTable
from rlm.index.store import IVFDATA, VECTORS, IndexDir, atomic_dir, load_index_dir, write_dir_contents

PLAN, TRAINED, TUNE = "plan.json", "trained.faiss", "tune_queries.npy"


def _shard_name(shard: int, suffix: str) -> str:
    return f"shard-{shard:05d}.{suffix}"


def _write_atomic(path: Path, write: Any) -> None:
    """Write one file via write(tmp_path) and rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _save_npy(path: Path, **arrays: np.ndarray) -> None:
    def write(name: str) -> None:
        with open(name, "wb") as f:
            if len(arrays) == 1:
                np.save(f, next(iter(arrays.values())))
            else:
                np.savez(f, **arrays)

    _write_atomic(path, write)


def prepare_shards(
    work_dir: str | os.PathLike,
    train_vectors: np.ndarray,
    n_total: int,
    config: IndexConfig | None = None,
    train_ids: np.ndarray | None = None,
) -> str:
    """Train the shared IVF index on a sample and save it in work_dir; returns the resolved factory.

    n_total: the number of vectors all shards will hold ('auto' sizes the IVF for it).
    train_ids: global ids of the training sample, if it comes from the data (they become tuning queries
    whose own id is not counted as a neighbour).
    """
    config = config or IndexConfig()
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    x = as_unit_float32(train_vectors, "train_vectors")
    factory = config.factory
    if factory == "auto":  # always IVF here: only IVF inverted lists merge on disk
        factory = choose_factory(n_total, x.shape[1], config.memory_budget_bytes, flat_below=0)
    index = make_faiss_index(factory, x.shape[1])
    try:
        faiss.extract_index_ivf(index)
    except RuntimeError:
        raise ValueError(
            f"sharded builds need an IVF factory (its lists merge on disk), got {factory!r}"
        ) from None
    index = train_index(index, x, factory, gpu_available() if config.gpu is None else config.gpu)
    _write_atomic(work / TRAINED, lambda name: faiss.write_index(index, name))
    rng = np.random.default_rng(config.seed)
    pick = np.sort(rng.choice(len(x), size=min(config.tune_queries, len(x)), replace=False))
    ids = np.full(len(pick), -1, dtype=np.int64) if train_ids is None else np.asarray(train_ids)[pick]
    _save_npy(work / TUNE, queries=x[pick], ids=ids)
    plan = {"factory": factory, "dim": x.shape[1], "n_total": n_total, "config": vars(config)}
    _write_atomic(work / PLAN, lambda name: Path(name).write_text(json.dumps(plan, indent=2)))
    return factory


def load_trained(work_dir: str | os.PathLike) -> faiss.Index:
    """The trained, empty index every shard starts from."""
    return faiss.read_index(str(Path(work_dir) / TRAINED))


def _tune_set(work: Path) -> tuple[np.ndarray, np.ndarray]:
    with np.load(work / TUNE) as z:
        return z["queries"], z["ids"]


def add_shard(
    work_dir: str | os.PathLike, shard: int, vectors: np.ndarray, ids: np.ndarray, store_vectors: bool = True
) -> Path:
    """Add one shard's vectors (row j has global id ids[j]) to the trained index and save it in work_dir."""
    work = Path(work_dir)
    plan = json.loads((work / PLAN).read_text())
    x, ids = as_unit_float32(vectors), np.ascontiguousarray(ids, dtype=np.int64)
    if ids.shape != (len(x),):
        raise ValueError(f"ids must have shape ({len(x)},), got {ids.shape}")
    if len(ids) and (ids.min() < 0 or ids.max() >= plan["n_total"]):
        raise ValueError(
            f"shard {shard} ids must lie in [0, {plan['n_total']}), got [{ids.min()}, {ids.max()}]"
        )
    index = load_trained(work)
    index.add_with_ids(x, ids)
    path = work / _shard_name(shard, "faiss")
    queries, _ = _tune_set(work)
    k = plan["config"]["tune_k"] + 1
    scores, local = exact_search(x, queries, k)  # (Q, k) over this shard only
    exact_ids = np.full_like(local, -1)
    exact_ids[local >= 0] = ids[local[local >= 0]]  # shard rows -> global ids
    _save_npy(work / _shard_name(shard, "exact.npz"), scores=scores, ids=exact_ids)
    if store_vectors:
        _save_npy(work / _shard_name(shard, "vectors.npz"), vectors=x, ids=ids)
    _write_atomic(
        path, lambda name: faiss.write_index(index, name)
    )  # last: its presence marks the shard done
    return path


def _merge_exact(parts: list[tuple[np.ndarray, np.ndarray]], k: int) -> np.ndarray:
    """Global exact top-k ids from every shard's exact top-k (the union holds the global top-k)."""
    scores = np.concatenate([s for s, _ in parts], axis=1)  # (Q, shards*k)
    ids = np.concatenate([i for _, i in parts], axis=1)
    scores = np.where(ids >= 0, scores, -np.inf)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(ids, order, 1)


def merge_shards(
    work_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    segments: SegmentTable,
    fingerprint: str,
    embedder: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> IndexDir:
    """Merge every shard in work_dir into an on-disk index directory at out_dir (written atomically)."""
    work = Path(work_dir)
    plan = json.loads((work / PLAN).read_text())
    config = IndexConfig(**plan["config"])
    shards = sorted(work.glob("shard-*.faiss"))
    if not shards:
        raise ValueError(f"no shards in {work}: run add_shard for each part first")
    index = load_trained(work)
    with atomic_dir(out_dir) as tmp:
        merge_ondisk(index, [str(p) for p in shards], str(tmp / IVFDATA))
        if index.ntotal != len(segments):
            raise ValueError(f"shards hold {index.ntotal} vectors, the segment table {len(segments)}")
        built = BuiltIndex(index, plan["factory"])
        if config.target_recall is not None:
            queries, query_ids = _tune_set(work)
            parts = []
            for p in shards:
                with np.load(p.with_name(p.name.replace(".faiss", ".exact.npz"))) as z:
                    parts.append((z["scores"], z["ids"]))
            exact_ids = _merge_exact(parts, config.tune_k + 1)
            built.search_params, built.tuned_recall = tune_search_params(
                index, queries, query_ids, exact_ids, config.tune_k, config.target_recall
            )
        vector_files = [p.with_name(p.name.replace(".faiss", ".vectors.npz")) for p in shards]
        if all(f.exists() for f in vector_files):
            # filled shard by shard into a memory-mapped file, so all vectors never sit in memory at once
            out = np.lib.format.open_memmap(
                tmp / VECTORS, mode="w+", dtype=np.float32, shape=(index.ntotal, index.d)
            )
            for f in vector_files:
                with np.load(f) as z:
                    out[z["ids"]] = z["vectors"]
            out.flush()
            del out
        write_dir_contents(
            tmp, built, segments, fingerprint, embedder, None, {"shards": len(shards), **(extra or {})}
        )
    return load_index_dir(out_dir)
