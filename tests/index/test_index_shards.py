"""Sharded builds merged on disk equal a single build over the same trained quantizer."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from rlm.index.build import IndexConfig, build_index, exact_search, set_search_params
from rlm.index.protocol import shard_range
from rlm.index.search import SegmentTable
from rlm.index.shards import _merge_exact, _tune_set, add_shard, load_trained, merge_shards, prepare_shards
from rlm.index.store import load_index_dir
from rlm.index.synthetic import clustered_unit_vectors

N, DIM, SHARDS = 4000, 32, 3
EMBEDDER = {"name": "test", "config_hash": "c", "weights_hash": "w", "step": 1}


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    return clustered_unit_vectors(N, DIM, n_clusters=30, spread=1.0, seed=3)


def sharded(tmp_path, vectors, factory="IVF32,Flat", order=range(SHARDS)):
    work = tmp_path / "work"
    config = IndexConfig(factory=factory, tune_queries=200)
    prepare_shards(work, vectors[:1500], N, config, train_ids=np.arange(1500))
    for r in order:  # shards may arrive in any order, from anywhere
        part = shard_range(N, r, SHARDS)
        add_shard(work, r, vectors[part.start : part.stop], np.arange(part.start, part.stop))
    segments = SegmentTable(np.arange(N) // 8, np.arange(N) % 8)
    return work, merge_shards(work, tmp_path / "idx", segments, "fp", EMBEDDER)


def test_shard_build_and_merge_equal_a_single_build(tmp_path, vectors):
    work, merged = sharded(tmp_path, vectors, order=[2, 0, 1])
    single = build_index(
        vectors, IndexConfig(factory="IVF32,Flat", target_recall=None), trained=load_trained(work)
    )
    set_search_params(single.index, merged.meta["search_params"])
    q = clustered_unit_vectors(200, DIM, n_clusters=30, spread=1.0, seed=4)
    s_merged, i_merged = merged.index.search(q, 10)
    s_single, i_single = single.search(q, 10)
    np.testing.assert_array_equal(i_merged, i_single)
    torch.testing.assert_close(s_merged, s_single)
    assert merged.meta["count"] == N and merged.meta["shards"] == SHARDS
    assert merged.meta["tuned_recall"] >= 0.95 and merged.meta["search_params"]["nprobe"] >= 1
    np.testing.assert_array_equal(merged.vectors, vectors)  # reassembled by id from the shards


def test_merged_index_lives_on_disk_and_survives_a_move(tmp_path, vectors):
    _, merged = sharded(tmp_path, vectors)
    assert (tmp_path / "idx" / "index.ivfdata").stat().st_size >= N * DIM * 4  # the lists are in that file
    q = vectors[:20]
    expected = merged.index.search(q, 5)[1]
    shutil.move(tmp_path / "idx", tmp_path / "moved")
    np.testing.assert_array_equal(load_index_dir(tmp_path / "moved").index.search(q, 5)[1], expected)


def test_shards_exact_top_k_merge_into_the_global_one(tmp_path, vectors):
    work, _ = sharded(tmp_path, vectors)
    queries, _ = _tune_set(work)
    parts = []
    for r in range(SHARDS):
        with np.load(work / f"shard-{r:05d}.exact.npz") as z:
            parts.append((z["scores"], z["ids"]))
    _, exact = exact_search(vectors, queries, 11)
    np.testing.assert_array_equal(_merge_exact(parts, 11), exact)


def test_shard_guards(tmp_path, vectors):
    assert prepare_shards(tmp_path / "a", vectors, N, IndexConfig(factory="auto")).startswith("IVF")
    with pytest.raises(ValueError, match="sharded builds need an IVF factory"):
        prepare_shards(tmp_path / "b", vectors, N, IndexConfig(factory="HNSW16"))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 4000\)"):
        add_shard(tmp_path / "a", 0, vectors[:10], np.arange(N, N + 10))
    with pytest.raises(ValueError, match="no shards"):
        merge_shards(tmp_path / "a", tmp_path / "out", SegmentTable(np.zeros(N), np.zeros(N)), "fp", EMBEDDER)
