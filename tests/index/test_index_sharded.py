"""The index sharded across ranks (rlm.index.sharded): the merge of per-part top-k against a plain sort, and with
2 gloo processes: the neighbour table and online searches equal the 1-process memory's for exact indices, each
rank writes and reloads only its own part, and a damaged part is refused."""

from __future__ import annotations

import shutil
import socket

import numpy as np
import pytest
import torch
from retrieval_helpers import make_segments, random_docs

from rlm.index.build import IndexConfig
from rlm.index.memory import build_memory, indexed_rows
from rlm.index.search import Exclusions
from rlm.index.sharded import load_memory_for_search, merge_topk
from rlm.index.store import IndexNotFoundError

K, DIM = 3, 16
IDENTITY = {"name": "test", "config_hash": "c", "weights_hash": "w", "step": 5}


def test_merge_topk_equals_a_sort_of_all_candidates():
    """The merged top-k is the k best of all parts' candidates: score descending, then lower id; padding last."""
    rng = np.random.default_rng(0)
    P, Q = 3, 40
    scores = rng.integers(0, 5, size=(P, Q, K)).astype(np.float32)  # many ties
    ids = rng.permutation(P * Q * K).reshape(P, Q, K).astype(np.int64)
    scores[0, :5, 1:] = -np.inf  # a part with fewer than k results
    ids[0, :5, 1:] = -1
    got_s, got_i = merge_topk(scores, ids, K)
    for q in range(Q):
        pairs = zip(scores[:, q].ravel(), ids[:, q].ravel())
        cand = sorted((-float(s), int(i)) for s, i in pairs if i >= 0)[:K]
        np.testing.assert_array_equal(got_i[q], [i for _, i in cand])
        np.testing.assert_array_equal(got_s[q], [-s for s, _ in cand])


def corpus():
    """A segment table of 12 documents, 9 of them indexed, and one distinct unit vector per indexed segment."""
    segments = make_segments(random_docs(12, 37, seed=1), 8)
    rows = indexed_rows(segments, np.arange(9))
    vectors = np.random.default_rng(2).standard_normal((len(rows), DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return segments, rows, vectors


def queries(rank: int, segments, rows, both: bool = False):
    """Rank 0: 11 queries mixing indexed segments, not-indexed ones and outside ones (-1); rank 1: none, or with
    `both` 3 of its own (two indexed segments, one outside)."""
    if rank == 1 and both:
        ids = np.array([rows[3], rows[30], -1], dtype=np.int64)
        return np.random.default_rng(4).standard_normal((3, DIM)).astype(np.float32), ids
    if rank == 1:
        return np.zeros((0, DIM), dtype=np.float32), np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng(3)
    ids = np.concatenate([rows[[0, 5, 17, len(rows) - 1]], [len(segments) - 1, len(segments) - 2], [-1] * 5])
    return rng.standard_normal((len(ids), DIM)).astype(np.float32), ids.astype(np.int64)


def exclusions(rank: int, rows) -> Exclusions:
    """Rank 0: ranges of global ids its queries may not find (one of them over both ranks' parts); rank 1: none."""
    if rank == 1:
        return Exclusions([], [], [], [])
    return Exclusions(
        [0, 0, 3, 7, 9], rows[[1, 40, 17, 0, 30]], rows[[5, 41, 44, 3, 31]], [False, True, True, False, True]
    )


def _worker(rank: int, world: int, port: int, root: str, out: dict) -> None:
    import torch.distributed as dist

    from rlm.index.protocol import shard_range
    from rlm.index.sharded import build_sharded_memory, load_sharded_memory, part_dir

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        segments, rows, vectors = corpus()
        share = shard_range(len(rows), rank, world)
        for factory in ("torch", "Flat"):
            step_dir = f"{root}/{factory}/step-000000005"
            config = IndexConfig(factory=factory, target_recall=None)
            memory = build_sharded_memory(
                vectors[share.start : share.stop], segments, rows, K, IDENTITY, 5, config, step_dir
            )
            q, q_ids = queries(rank, segments, rows)
            found = memory.search_scored(q, q_ids, K).ids
            out[(factory, rank, "excluding")] = memory.search_scored(q, q_ids, K, exclusions(rank, rows)).ids
            q2, q2_ids = queries(rank, segments, rows, both=True)  # unequal, non-zero counts on both ranks
            routed = memory.search_scored(q2, q2_ids, K, exclusions(rank, rows))
            out[(factory, rank, "routed")] = (routed.ids, routed.scores, routed.excluded)
            dist.barrier()
            reloaded = load_sharded_memory(memory.parts, segments, rows, IDENTITY, K)
            again = reloaded.search_scored(q, q_ids, K).ids
            out[(factory, rank)] = (memory.neighbours, found, reloaded.neighbours, again, memory.parts)
            assert memory.path == part_dir(step_dir, rank, world).resolve()
        if rank == 1:  # a part cut short is refused on load (meta.json lists every file's size)
            vec = part_dir(f"{root}/Flat/step-000000005", 1, world) / "vectors.npy"
            vec.write_bytes(vec.read_bytes()[:-4])
            try:
                load_sharded_memory(memory.parts, segments, rows, IDENTITY, K)
                out["damaged"] = "loaded"
            except IndexNotFoundError as err:
                out["damaged"] = str(err)
    finally:
        dist.destroy_process_group()


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
def test_two_ranks_equal_one_process_for_exact_indices(tmp_path):
    """2 gloo ranks, each holding half the vectors: the same neighbour table and online search results as the
    1-process memory over all vectors ('torch' and faiss 'Flat'), on both ranks, before and after reloading."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(2, port, str(tmp_path), out), nprocs=2)
        got = dict(out)
    segments, rows, vectors = corpus()
    for factory in ("torch", "Flat"):
        config = IndexConfig(factory=factory, target_recall=None)
        whole = build_memory(vectors, segments, rows, K, IDENTITY, 5, config, None)
        q, q_ids = queries(0, segments, rows)
        want = whole.search_scored(q, q_ids, K).ids
        assert (whole.neighbours[rows] >= 0).all()  # a table that is full, so the comparison means something
        for rank in (0, 1):
            table, found, reloaded, again, parts = got[(factory, rank)]
            np.testing.assert_array_equal(table, whole.neighbours)
            np.testing.assert_array_equal(reloaded, whole.neighbours)
            if rank == 0:
                np.testing.assert_array_equal(found, want)
                np.testing.assert_array_equal(again, want)
                excluding = whole.search_scored(q, q_ids, K, exclusions(0, rows)).ids
                assert (excluding != want).any()  # the exclusions took something
                np.testing.assert_array_equal(got[(factory, 0, "excluding")], excluding)
            else:
                assert found.shape == again.shape == (0, K)
            # each rank's own queries, routed back to it alone, equal the 1-process search of them
            q2, q2_ids = queries(rank, segments, rows, both=True)
            alone = whole.search_scored(q2, q2_ids, K, exclusions(rank, rows))
            ids, scores, excluded = got[(factory, rank, "routed")]
            assert ids.shape == (len(q2), K) and (ids[q2_ids >= 0] >= 0).all()
            np.testing.assert_array_equal(ids, alone.ids)
            np.testing.assert_allclose(scores, alone.scores, rtol=1e-5)
            assert (excluded >= alone.excluded).all()  # summed over parts: an upper bound
            if rank == 0:
                assert alone.excluded.sum() > 0
            # each rank wrote only its own part: half of the rows
            part_rows = np.load(f"{parts[rank]}/rows.npy")
            assert abs(len(part_rows) - len(rows) / 2) <= 0.5
        both = np.concatenate([np.load(f"{p}/rows.npy") for p in got[(factory, 0)][4]])
        np.testing.assert_array_equal(both, rows)
    assert "vectors.npy" in got["damaged"] and "meta.json says" in got["damaged"]
    # outside training (validation, generation in one process) a part's directory loads every part, searched as one
    parts = got[("torch", 0)][4]
    whole = build_memory(
        vectors, segments, rows, K, IDENTITY, 5, IndexConfig("torch", target_recall=None), None
    )
    one = load_memory_for_search(parts[1])
    q, q_ids = queries(0, segments, rows)
    np.testing.assert_array_equal(one.search_scored(q, q_ids, K).ids, whole.search_scored(q, q_ids, K).ids)
    np.testing.assert_array_equal(one.neighbours, whole.neighbours)
    shutil.rmtree(parts[0])
    with pytest.raises(IndexNotFoundError, match="part 0 of the sharded index"):
        load_memory_for_search(parts[1])


# ----- through `rlm fit` with DDP -----

SHARDED = """
model:
  plugins:
    retrieval:
      schedule: every 2
      index_factory: Flat
      mode: blocking
      progress: false
      sharded: true
      warm_start: none  # the step-0 table (with the warm start the first comes at step 1)
"""


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("lookup", ["table", "search"])
def test_ddp_fit_with_a_sharded_index_and_resume(tmp_path, rlm_cache, lookup):
    """`rlm fit` on 2 gloo processes with sharded: true: each rank writes its own part (half the rows; with lookup
    'table' the whole table, the same on both; with 'search' no table, and every training step searches all the
    parts, a collective), validation searches online across the parts, the checkpoint names the parts, and a
    resumed run reloads each rank's part (the same files, no rebuild) and searches with it."""
    from cli_helpers import CONFIGS, DDP_2CPU, column, fit_args, read_metrics, run_rlm

    fragment = tmp_path / "sharded.yaml"
    fragment.write_text(SHARDED + f"      lookup: {lookup}\n")
    args = fit_args(CONFIGS / "plugins" / "retrieval.yaml", fragment) + DDP_2CPU
    run_rlm(args, tmp_path, rlm_cache)
    root = tmp_path / "runs/test/retrieval_index"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000000", "step-000000002"]
    parts = [root / "step-000000002" / f"rank-0000{r}-of-00002" for r in (0, 1)]
    rows = [np.load(p / "rows.npy") for p in parts]
    assert len(np.intersect1d(*rows)) == 0 and abs(len(rows[0]) - len(rows[1])) <= 1
    if lookup == "table":
        tables = [np.load(p / "neighbours.npy") for p in parts]
        np.testing.assert_array_equal(tables[0], tables[1])
        assert (tables[0][np.concatenate(rows)] >= 0).any()
    else:
        assert not any((p / "neighbours.npy").exists() for p in parts)
        coverage = column(read_metrics(tmp_path / "runs/test/version_0"), "train/retrieval/coverage")
        assert coverage and max(coverage) > 0  # the steps found neighbours by searching the parts
    ckpt = tmp_path / "runs/test/ckpt/last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["callbacks"][
        "RebuildCallback[retrieval]"
    ]
    assert state["parts"] == [str(p.resolve()) for p in parts] and state["last_step"] == 2
    assert column(read_metrics(tmp_path / "runs/test/version_0"), "val/retrieval/relevance")
    written = [(p / "meta.json").stat().st_ino for p in parts]

    # the periodic checkpoint of step 3 (rebuilt at 2; last.ckpt is the final step 4): the resumed run trains
    # step 3, where no rebuild is due
    step3 = tmp_path / "runs/test/ckpt/epoch=0-step=3.ckpt"
    resumed = fit_args(CONFIGS / "plugins" / "retrieval.yaml", fragment) + DDP_2CPU + ["--ckpt_path", step3]
    run_rlm(resumed, tmp_path, rlm_cache)
    after = read_metrics(tmp_path / "runs/test/version_0")  # the resumed run's metrics (step 3 only)
    assert column(after, "train/retrieval/relevance") and column(after, "train/retrieval/rebuild_s") == [0.0]
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000000", "step-000000002"]
    assert [(p / "meta.json").stat().st_ino for p in parts] == written  # reloaded, not rewritten
    if lookup == "table":
        np.testing.assert_array_equal(np.load(parts[1] / "neighbours.npy"), tables[1])


def test_sharded_auto_shards_from_shard_above_with_more_than_one_process():
    """'auto' shards from shard_above indexed segments, and only with more than one process; true and false decide
    alone; anything else is refused by name."""
    from rlm.plugin import make_config
    from rlm.plugins._retrieval_config import RetrievalConfig
    from rlm.plugins._retrieval_rebuild import shards
    from rlm.plugins.retrieval import RetrievalPlugin

    assert not shards("auto", 1, 10**9, 2**20) and not shards(True, 1, 10**9, 2**20)  # one process: never
    assert shards("auto", 2, 2**20, 2**20) and not shards("auto", 2, 2**20 - 1, 2**20)
    assert shards(True, 2, 5, 2**20) and not shards(False, 64, 10**9, 2**20)
    assert RetrievalConfig().sharded == "auto" and RetrievalConfig().shard_above == 2**20
    with pytest.raises(ValueError, match=r"option sharded must be one of \('auto',\) or bool, got 'yes'"):
        make_config(RetrievalPlugin, {"sharded": "yes"})
    with pytest.raises(ValueError, match="retrieval.shard_above must be a positive integer, got 0"):
        RetrievalConfig(shard_above=0)


BACKGROUND = """
model:
  plugins:
    retrieval:
      schedule: every 4
      index_factory: Flat
      mode: background
      lookup: search
      progress: false
      sharded: auto
      shard_above: 2  # the tiny corpus's segments are past it: sharded
      warm_start: none
"""


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("index_dim", ["null", "auto"])
def test_ddp_background_sharded_build_runs_off_the_training_thread(tmp_path, rlm_cache, index_dim):
    """`rlm fit` on 2 gloo processes, mode background, lookup search, sharded 'auto' past shard_above: each rank
    builds and writes its own part in its thread (no neighbour table), the rebuilds that land during training
    held the training thread up for 0 s (train/retrieval/rebuild_blocked_s; the unsharded path gathers and builds
    there), and the steps after them search the parts. index_dim 'auto' (past shard_above: narrowed to half the
    width): the training thread fits the projection (a collective: the only time it is held up), both parts hold
    the same one, and the thread indexes and writes the narrowed vectors."""
    from cli_helpers import CONFIGS, DDP_2CPU, column, fit_args, read_metrics, run_rlm

    from rlm.index.store import read_meta

    fragment = tmp_path / "background.yaml"
    fragment.write_text(BACKGROUND + f"      index_dim: {index_dim}\n")
    args = fit_args(CONFIGS / "plugins" / "retrieval.yaml", fragment) + DDP_2CPU + ["--trainer.max_steps=12"]
    run_rlm(args, tmp_path, rlm_cache)
    newest = sorted((tmp_path / "runs/test/retrieval_index").glob("step-*"))[-1]  # older ones are pruned
    parts = [newest / f"rank-0000{r}-of-00002" for r in (0, 1)]
    rows = [np.load(p / "rows.npy") for p in parts]
    assert len(np.intersect1d(*rows)) == 0 and abs(len(rows[0]) - len(rows[1])) <= 1
    assert not any((p / "neighbours.npy").exists() for p in parts)
    metas = [read_meta(p) for p in parts]
    projection = metas[0]["embedder"].get("projection")
    assert metas[1]["embedder"].get("projection") == projection  # every part narrowed alike
    assert (projection is None) == (index_dim == "null")
    if projection is not None:
        assert metas[0]["dim"] == projection["dim"] == projection["in_dim"] // 2
    metrics = read_metrics(tmp_path / "runs/test/version_0")
    landed = [r for r in metrics if r.get("train/retrieval/rebuild_s") not in (None, "", "0.0")]
    assert landed, "no background rebuild landed during the 12 steps"
    if projection is None:  # narrowed: the projection's fit (a collective) held the training thread up
        assert all(float(r["train/retrieval/rebuild_blocked_s"]) == 0.0 for r in landed)
    assert max(column(metrics, "train/retrieval/coverage")) > 0
