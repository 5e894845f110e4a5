"""Index directories: round trip, metadata checks, atomic writes, memory-mapped loading."""

from __future__ import annotations

import json
import os

import faiss
import numpy as np
import pytest

from rlm.index.build import IndexConfig, exact_search, recall_at_k
from rlm.index.search import SegmentTable
from rlm.index.store import (
    IndexMismatchError,
    IndexNotFoundError,
    build_index_dir,
    load_index_dir,
    read_meta,
)
from rlm.index.synthetic import clustered_unit_vectors

EMBEDDER = {"name": "meanpool@1", "config_hash": "c0ffee", "weights_hash": "beef", "step": 100}


def segments(n: int) -> SegmentTable:
    return SegmentTable(np.arange(n) // 10, (np.arange(n) % 10) * 32)


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    return clustered_unit_vectors(3000, 32, n_clusters=30, seed=2)


@pytest.mark.parametrize("factory", ["Flat", "IVF32,SQ8", "HNSW16", "torch"])
def test_round_trip_keeps_results_and_metadata(tmp_path, vectors, factory):
    fp = "corpus-a"
    config = IndexConfig(factory=factory)
    built = build_index_dir(tmp_path / "idx", vectors, segments(len(vectors)), fp, EMBEDDER, config)
    loaded = load_index_dir(tmp_path / "idx", expect_fingerprint=fp, expect_embedder=EMBEDDER)
    q = vectors[:50]
    np.testing.assert_array_equal(loaded.index.search(q, 10)[1], built.index.search(q, 10)[1])
    meta = loaded.meta
    assert (meta["count"], meta["dim"], meta["metric"], meta["factory"]) == (
        3000,
        32,
        "inner_product",
        factory,
    )
    assert meta["fingerprint"] == fp and meta["embedder"] == EMBEDDER
    np.testing.assert_array_equal(loaded.segments.doc, np.arange(3000) // 10)
    np.testing.assert_array_equal(loaded.vectors, vectors)
    if factory.startswith("IVF"):  # the tuned nprobe travels in the metadata and is set on load
        assert meta["search_params"]["nprobe"] == faiss.extract_index_ivf(loaded.index).nprobe
    _, exact = exact_search(vectors, q, 10)
    assert recall_at_k(loaded.search(q, 10).ids, exact, 10) >= 0.9


def test_mismatched_corpus_or_embedder_is_refused(tmp_path, vectors):
    build_index_dir(
        tmp_path / "idx", vectors, segments(3000), "corpus-a", EMBEDDER, IndexConfig(factory="Flat")
    )
    with pytest.raises(
        IndexMismatchError, match="built from corpus 'corpus-a'.*current corpus is 'corpus-b'"
    ):
        load_index_dir(tmp_path / "idx", expect_fingerprint="corpus-b")
    with pytest.raises(IndexMismatchError, match="weights_hash: index has 'beef', expected 'f00d'"):
        load_index_dir(tmp_path / "idx", expect_embedder={**EMBEDDER, "weights_hash": "f00d"})
    with pytest.raises(IndexMismatchError, match="step: index has 100, expected 200"):
        load_index_dir(tmp_path / "idx", expect_embedder={"step": 200})
    load_index_dir(tmp_path / "idx", "corpus-a", {"name": "meanpool@1"})  # a subset of the identity is fine


@pytest.mark.parametrize("victim", ["faiss.write_index", "os.replace"])
def test_interrupted_write_leaves_nothing_that_loads(tmp_path, vectors, monkeypatch, victim):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-write")

    module, name = victim.split(".")
    monkeypatch.setattr({"faiss": faiss, "os": os}[module], name, crash)
    with pytest.raises(KeyboardInterrupt):
        build_index_dir(
            tmp_path / "idx", vectors, segments(3000), "fp", EMBEDDER, IndexConfig(factory="Flat")
        )
    monkeypatch.undo()
    with pytest.raises(IndexNotFoundError, match="no index at"):
        load_index_dir(tmp_path / "idx")
    assert os.listdir(tmp_path) == []  # the temporary directory was cleaned up too


def test_interrupted_rewrite_keeps_the_old_index(tmp_path, vectors, monkeypatch):
    build_index_dir(tmp_path / "idx", vectors, segments(3000), "old", EMBEDDER, IndexConfig(factory="Flat"))

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(faiss, "write_index", crash)
    with pytest.raises(OSError, match="disk full"):
        build_index_dir(
            tmp_path / "idx", vectors, segments(3000), "new", EMBEDDER, IndexConfig(factory="Flat")
        )
    monkeypatch.undo()
    assert load_index_dir(tmp_path / "idx").meta["fingerprint"] == "old"


def test_truncated_file_is_detected(tmp_path, vectors):
    build_index_dir(tmp_path / "idx", vectors, segments(3000), "fp", EMBEDDER, IndexConfig(factory="Flat"))
    with open(tmp_path / "idx" / "index.faiss", "r+b") as f:
        f.truncate(100)
    with pytest.raises(IndexNotFoundError, match="index.faiss is 100 bytes"):
        read_meta(tmp_path / "idx")


def test_mmap_loading_gives_the_same_results(tmp_path, vectors):
    build_index_dir(
        tmp_path / "idx", vectors, segments(3000), "fp", EMBEDDER, IndexConfig(factory="IVF32,Flat")
    )
    in_ram, mapped = load_index_dir(tmp_path / "idx", mmap=False), load_index_dir(tmp_path / "idx", mmap=True)
    q = vectors[:40]
    np.testing.assert_array_equal(in_ram.index.search(q, 5)[1], mapped.index.search(q, 5)[1])


def test_bad_arguments_are_clear_errors(tmp_path, vectors):
    with pytest.raises(ValueError, match="segment table has 10 rows for 3000 vectors"):
        build_index_dir(tmp_path / "a", vectors, segments(10), "fp", EMBEDDER, IndexConfig(factory="Flat"))
    with pytest.raises(ValueError, match="embedder identity lacks \\['step'\\]"):
        identity = {k: v for k, v in EMBEDDER.items() if k != "step"}
        build_index_dir(tmp_path / "b", vectors, segments(3000), "fp", identity, IndexConfig(factory="Flat"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "meta.json").write_text(json.dumps({"format_version": 99}))
    with pytest.raises(IndexNotFoundError, match="format 99"):
        load_index_dir(tmp_path / "c")
