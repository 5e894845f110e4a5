"""The narrow embedding (rlm.index.projection, docs/SCALE.md section 10): the PCA against a numpy SVD, the
recall of a narrowed index against the full-width exact search, the retriever's query path against a by-hand
projected exact search, the identity check that refuses an index of another projection, the rebuild callback's
use of index_dim, and with 2 gloo processes the same projection on every rank and the 1-process search."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from retrieval_helpers import corpus_of, make_segments, random_docs, tiny_model

from rlm.data.windows import Windows
from rlm.index.build import IndexConfig, TorchExactIndex, exact_search
from rlm.index.memory import build_memory, embed_rows, indexed_rows, load_memory
from rlm.index.projection import (
    PROJECTION,
    Projection,
    fit_pca,
    fit_projection,
    index_width,
    load_projection,
)
from rlm.index.search import SegmentTable as IndexSegments
from rlm.index.search import search_neighbours
from rlm.index.sharded import load_memory_for_search
from rlm.index.store import IndexMismatchError, read_meta
from rlm.plugin import Context
from rlm.plugins._retrieval_config import RetrievalConfig
from rlm.plugins._retrieval_rebuild import RebuildCallback

IDENTITY = {"name": "test", "config_hash": "c", "weights_hash": "w", "step": 3}
FLAT = IndexConfig(factory="Flat", target_recall=None)


def low_rank(n: int, dim: int, rank: int, seed: int = 0) -> np.ndarray:
    """(n, dim) unit vectors near a rank-`rank` subspace with distinct variances per direction, off the origin."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.standard_normal((dim, dim)))[0]
    latent = rng.standard_normal((n, rank)) * np.linspace(4.0, 1.0, rank)  # (n, rank)
    x = latent @ basis[:, :rank].T + 0.15 * rng.standard_normal((n, dim)) + 2.0 * basis[:, rank]
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def by_hand(sample: np.ndarray, x: np.ndarray, m: int) -> np.ndarray:
    """The reference: numpy SVD of the sample, not centred (the search ranks by inner products, see
    rlm.index.projection), x onto the top m right singular vectors, renormalised."""
    _, _, vt = np.linalg.svd(sample, full_matrices=False)
    y = x @ vt[:m].T
    return y / np.maximum(
        np.linalg.norm(y, axis=1, keepdims=True), 1e-12
    )  # a zero query (padding) stays zero


def recall_at_10(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / truth.shape[1] for a, b in zip(found, truth)]))


# ----- numerics -----


def test_pca_matches_a_numpy_svd_of_the_uncentred_sample(monkeypatch):
    """fit_pca's directions are numpy's SVD of the uncentred sample (each up to its sign), its mean zero, its rows
    orthonormal, and the projected vectors equal the by-hand normalise(x @ V_m) up to the sign of each component."""
    x = low_rank(3000, 48, 10)
    m = 8
    p = fit_pca(x, m)
    np.testing.assert_array_equal(p.mean, np.zeros(48, dtype=np.float32))
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    sign = np.sign(np.sum(p.components * vt[:m], axis=1, keepdims=True))  # (m, 1)
    np.testing.assert_allclose(p.components, sign * vt[:m], atol=1e-4)
    np.testing.assert_allclose(p.components @ p.components.T, np.eye(m), atol=1e-5)
    np.testing.assert_allclose(p.apply(x[:50]), sign.T * by_hand(x, x[:50], m), atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(p.apply(x), axis=1), 1.0, atol=1e-5)
    whole = p.apply(x)
    monkeypatch.setattr("rlm.index.projection.APPLY_CHUNK", 7)  # narrowed in chunks: the same rows
    np.testing.assert_allclose(p.apply(x), whole, atol=1e-6)
    assert p.apply(np.zeros((0, 0))).shape == (0, m)  # a rank with no query
    with pytest.raises(ValueError, match="from 48 to 8 dims"):
        p.apply(x[:, :8])  # queries of the index's own (narrowed) width are not queries of its embedder


def test_index_width_and_the_config_field():
    """None: full width; an integer: that width, below the vectors'; 'auto': min(256, half) from shard_above rows,
    full width below, so small runs are unchanged by the default."""
    assert RetrievalConfig().index_dim == "auto"
    assert index_width("auto", 2048, 2**20 - 1, 2**20) is None
    assert index_width("auto", 2048, 2**20, 2**20) == 256
    assert index_width("auto", 256, 2**20, 2**20) == 128
    assert index_width(None, 2048, 2**30, 2**20) is None
    assert index_width(64, 2048, 10, 2**20) == 64
    with pytest.raises(ValueError, match="index_dim=64 must be below the embedding width 64"):
        index_width(64, 64, 10, 2**20)
    for bad in ("half", 0, -3, 1.5, True):
        with pytest.raises(ValueError, match=rf"retrieval.index_dim={bad!r}; accepted: null"):
            RetrievalConfig(index_dim=bad)
    with pytest.raises(
        ValueError, match="index_dim=32 must be below the width of the 'tokens' embedder's vect"
    ):
        tiny_model(embedder="tokens", index_dim=32)  # d_model 32: e(.) is 32 wide (its states 64)


def segments_for(n_rows: int, seed: int = 1):
    """A segment table with at least n_rows segments (documents of 9 segments of 8 tokens), all indexed."""
    docs = random_docs(-(-n_rows // 9), 72, seed=seed)
    segments = make_segments(docs, 8)
    rows = indexed_rows(segments, np.arange(len(docs)))
    return segments, rows


@pytest.mark.parametrize("factory", ["torch", "Flat"])
def test_narrowed_index_keeps_recall_of_the_full_width_exact_search(factory):
    """A seeded low-rank set: the index narrowed 64 -> 16 by PCA finds >= 0.9 of the full-width exact top 10 of
    outside queries (0.97); narrowed to 8, below the rank of the data (a deliberately bad width), it does not, so the
    check can fail."""
    segments, rows = segments_for(4000)
    vectors = low_rank(len(rows) + 300, 64, 12, seed=5)
    vectors, queries = vectors[: len(rows)], vectors[len(rows) :]
    _, truth = exact_search(vectors, queries, 10)  # (300, 10) rows of the full-width exact search
    recall = {}
    for m in (16, 8):
        p = fit_projection(vectors, m)
        config = IndexConfig(factory, target_recall=None)
        memory = build_memory(p.apply(vectors), segments, rows, 10, IDENTITY, 3, config, None, False, p)
        # global ids; every segment is a row
        found = memory.search_scored(queries, np.full(len(queries), -1), 10).ids
        recall[m] = recall_at_10(found, rows[truth])
    assert recall[16] >= 0.9, recall
    assert recall[8] < 0.7, recall  # 0.57: fewer directions than the data has


# ----- the retriever's query path -----


def test_retriever_search_equals_a_by_hand_projected_exact_search(tmp_path):
    """lookup 'search' with a narrowed index: each chunk's neighbours, found by the plugin from its full-width
    e(S_t), equal an exact search of by-hand projected queries (numpy SVD) over by-hand projected rows with the
    same causal filter; the relevance bias still gets the full-width e(.) of the live encoder."""
    segments, offsets = corpus_of(random_docs(14, 72, seed=3))
    rows = indexed_rows(segments, np.arange(14))
    model = tiny_model(embedder="tokens", warm_start="none", lookup="search", index_dim=12)
    plugin = model.plugins["retrieval"]
    embedder = plugin.snapshot(3)
    full = embed_rows(embedder, segments, rows, 64, 0, 1, False)  # (R, 64)
    p = fit_projection(full, 12)
    memory = build_memory(
        p.apply(full), segments, rows, 2, embedder.embedder_identity(), 3, FLAT, None, False, p
    )
    plugin.use_memory(memory)
    batch = Windows(segments, offsets, np.arange(14), 32).collate(np.arange(0, 40, 3))
    seg = batch["segment_ids"].numpy()
    ctx = Context(
        tokens=batch["tokens"],
        mask=batch["mask"],
        stage="train",
        segment_ids=batch["segment_ids"],
        segments=segments,
    )
    plugin.prepare(ctx, batch)
    inputs = ctx.extras["retrieval"]
    got = inputs.ids.numpy()  # (B, 4, 2)
    # by hand: chunk j's query is segment j - 1 of the window; chunk 0's the document's previous segment, if any
    first = np.where((batch["starts"].numpy() > 0) & (seg[:, 0] > 0), seg[:, 0] - 1, -1)
    q_ids = np.concatenate([first[:, None], seg[:, :-1]], 1)  # (B, 4)
    e = plugin._embed_queries(inputs.query_tokens.reshape(-1, 8), inputs.query_mask.reshape(-1, 8)).numpy()
    hand_rows, hand_q = by_hand(full, full, 12), by_hand(full, e, 12)
    index_segments = IndexSegments(segments.doc[rows], segments.start[rows])
    want = search_neighbours(TorchExactIndex(hand_rows), hand_q, 2, q_ids.reshape(-1), index_segments).ids
    want = np.where(q_ids.reshape(-1, 1) >= 0, np.where(want >= 0, rows[np.maximum(want, 0)], -1), -1)
    assert (got >= 0).sum() > 20  # most chunks found neighbours, so the comparison means something
    np.testing.assert_array_equal(got.reshape(-1, 2), want)
    # the relevance bias: cos(e(S_t), e(z)) of the live encoder's full-width vectors, not of the narrowed ones
    relevance = plugin.encoded(ctx).relevance.detach().numpy()  # (B*4, 2)
    nb, ok = got.reshape(-1, 2), got.reshape(-1, 2) >= 0
    cos = (e[:, None, :] * full[memory.row_of[np.maximum(nb, 0)]]).sum(-1)  # (B*4, 2)
    narrow = (hand_q[:, None, :] * hand_rows[memory.row_of[np.maximum(nb, 0)]]).sum(-1)
    np.testing.assert_allclose(relevance[ok], cos[ok], atol=1e-5)
    assert np.abs(narrow[ok] - cos[ok]).max() > 1e-2


# ----- storage and the identity check -----


def test_narrowed_index_is_stored_and_refused_by_another_projection(tmp_path):
    """The projection is written beside the index (listed and checksummed in meta.json) and recorded in its embedder
    identity; a narrowed index loaded for a full-width search is refused, and a full-width one for a narrowed
    search; loaded for search, it narrows the queries as it was built."""
    segments, rows = segments_for(300)
    vectors = low_rank(len(rows), 32, 8, seed=2)
    p = fit_projection(vectors, 8)
    narrow = build_memory(
        p.apply(vectors), segments, rows, 2, IDENTITY, 3, FLAT, tmp_path / "narrow", True, p
    )
    full = build_memory(vectors, segments, rows, 2, IDENTITY, 3, FLAT, tmp_path / "full", True)
    meta = read_meta(tmp_path / "narrow")
    assert (
        meta["dim"] == 8 and meta["embedder"]["projection"] == p.identity() == narrow.identity["projection"]
    )
    assert PROJECTION in meta["sha256"]  # listed and checksummed like every file of the index
    assert np.load(tmp_path / "narrow" / "vectors.npy").shape == (len(rows), 8)  # written narrowed
    assert full.identity["projection"] is None and load_projection(tmp_path / "full") is None
    with pytest.raises(
        IndexMismatchError, match="projected from 32 to 8 dims, but the search expects vectors at"
    ):
        load_memory(tmp_path / "narrow", segments, full.identity, 2)
    with pytest.raises(
        IndexMismatchError, match="at the embedder's full width, but the search expects vectors pro"
    ):
        load_memory(tmp_path / "full", segments, narrow.identity, 2)
    other = fit_projection(vectors[::2], 8)  # another rebuild's projection: the same width, other directions
    with pytest.raises(IndexMismatchError, match="index projection"):
        load_memory(tmp_path / "narrow", segments, {**IDENTITY, "projection": other.identity()}, 2)
    again = load_memory(tmp_path / "narrow", segments, narrow.identity, 2)
    loaded = load_memory_for_search(tmp_path / "narrow")
    q = vectors[:20] + 0.01
    for memory in (again, loaded):
        np.testing.assert_array_equal(memory.projection.components, p.components)
        np.testing.assert_array_equal(
            memory.search_scored(q, np.full(20, -1), 2).ids, narrow.search_scored(q, np.full(20, -1), 2).ids
        )


class Owner:
    """A stand-in MemoryOwner: embeds segments with a fixed table of vectors, takes memories."""

    prepare_seconds = 0.0

    def __init__(self, table: np.ndarray) -> None:
        self.table, self.memory = torch.from_numpy(table), None

    def snapshot(self, step: int) -> Owner:
        return self

    def embed_segments(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.table[tokens[:, 0]]  # each test segment starts with its own id (see callback_for)

    def embedder_identity(self) -> dict:
        return dict(IDENTITY)

    def use_memory(self, memory) -> None:
        self.memory = memory


def callback_for(tmp_path, n: int, **options) -> tuple[RebuildCallback, Owner, np.ndarray]:
    """A rebuild callback over n one-token-id segments whose embedder returns low_rank vectors, set up as
    on_fit_start would (no trainer: one process)."""
    vectors = low_rank(n, 32, 8, seed=4)
    docs = [np.array([i] * 8) for i in range(n)]  # one segment per document, its first token is its row
    segments = make_segments(docs, 8)
    owner = Owner(vectors)
    config = RetrievalConfig(
        k=2, index_factory="Flat", target_recall=None, progress=False, lookup="search", **options
    )
    cb = RebuildCallback(owner, config)
    cb.segments, cb.rows, cb._root, cb._writer = segments, np.arange(n), tmp_path, True
    return cb, owner, vectors


@pytest.mark.parametrize("mode", ["blocking", "background"])
def test_rebuild_narrows_as_index_dim_asks_and_resumes_only_on_the_same_width(tmp_path, mode):
    """The callback fits the projection on the vectors it indexes (the same as fit_projection of them), writes it
    with the index, and a checkpoint's index is reused only when index_dim asks for its width; 'auto' narrows only
    from shard_above rows, so the default leaves a small index at full width."""
    trainer = SimpleNamespace(global_rank=0, world_size=1)
    cb, owner, vectors = callback_for(tmp_path, 200, index_dim=8, mode=mode)
    if mode == "blocking":
        cb._rebuild_blocking(trainer, 3)
    else:
        cb._start_background(trainer, 3)
        cb._collect(trainer, wait=True)
    memory = owner.memory
    want = fit_projection(vectors, 8)
    np.testing.assert_array_equal(memory.projection.components, want.components)
    assert (
        memory.identity["projection"] == want.identity() == read_meta(memory.path)["embedder"]["projection"]
    )
    state = cb.state_dict()
    for index_dim, reused in ((8, True), (None, False), (4, False), ("auto", False)):
        again, owner2, _ = callback_for(tmp_path, 200, index_dim=index_dim, shard_above=100)
        again.load_state_dict(state)
        assert again._try_reuse() is reused, index_dim
        assert (owner2.memory is not None) is reused
    auto, owner3, _ = callback_for(tmp_path / "auto", 200, index_dim="auto", shard_above=150)
    auto._rebuild_blocking(trainer, 4)
    assert owner3.memory.projection.dim == 16  # half of 32 (below 256)
    small, owner4, _ = callback_for(tmp_path / "small", 200, index_dim="auto")  # the config's default
    small._rebuild_blocking(trainer, 4)
    assert owner4.memory.projection is None and owner4.memory.identity["projection"] is None
    assert not (owner4.memory.path / PROJECTION).exists()


# ----- 2 processes -----


class GlooStrategy:
    """The few calls of a Lightning strategy the rebuild callback makes, on the default gloo process group."""

    root_device = torch.device("cpu")

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t.contiguous())
        return torch.stack(out)

    def barrier(self, name: str | None = None) -> None:
        import torch.distributed as dist

        dist.barrier()


def _worker(rank: int, port: int, root: str, out: dict) -> None:
    import torch.distributed as dist

    from rlm.index.protocol import shard_range
    from rlm.index.sharded import build_sharded_memory, fit_projection_across_ranks

    world = 2  # spawn_local's processes
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        segments, rows = segments_for(600)
        vectors = low_rank(len(rows), 32, 8, seed=6)
        share = shard_range(len(rows), rank, world)
        shard = vectors[share.start : share.stop]
        # a small sample: each rank contributes 100 evenly spaced rows of its share
        p = fit_projection_across_ranks(shard, lambda d: d // 4, sample=200)
        memory = build_sharded_memory(
            p.apply(shard), segments, rows, 3, IDENTITY, 3, FLAT, f"{root}/s", True, p
        )
        q = low_rank(40, 32, 8, seed=7)[rank * 20 : (rank + 1) * 20]
        q_ids = rows[np.arange(rank, 40, 2)]
        out[rank] = (
            p.mean,
            p.components,
            memory.neighbours,
            memory.search_scored(q, q_ids, 3).ids,
            memory.parts,
        )
        # the rebuild callback: the vectors narrowed before the gather (unsharded) or the parts' build (sharded)
        trainer = SimpleNamespace(global_rank=rank, world_size=world, strategy=GlooStrategy())
        for sharded in (False, True):
            cb, owner, _ = callback_for(Path(root) / f"callback-{sharded}", 200, index_dim=8, sharded=sharded)
            cb.table, cb._writer = True, rank == 0
            cb._rebuild_blocking(trainer, 3)
            got = owner.memory
            out[(sharded, rank)] = (got.projection.mean, got.projection.components, got.neighbours, got.parts)
    finally:
        dist.destroy_process_group()


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
def test_two_ranks_fit_one_projection_and_search_as_one_process(tmp_path):
    """2 gloo ranks: both hold the same projection, fitted on the gathered per-rank samples (equal to the 1-process
    fit on those rows), and the sharded narrowed index gives the 1-process narrowed index's table and search; the
    rebuild callback, unsharded and sharded, narrows alike on both ranks and gives the 1-process table."""
    from rlm.distributed.parallel import spawn_local
    from rlm.index.projection import sample_rows
    from rlm.index.protocol import shard_range

    got = spawn_local(_worker, str(tmp_path))
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_array_equal(got[0][1], got[1][1])
    segments, rows = segments_for(600)
    vectors = low_rank(len(rows), 32, 8, seed=6)
    sample = np.concatenate(
        [
            vectors[share.start + sample_rows(len(share), 100)]
            for share in (shard_range(len(rows), r, 2) for r in (0, 1))
        ]
    )
    np.testing.assert_allclose(got[0][1], fit_pca(sample, 8).components, atol=1e-5)
    p = Projection(got[0][0], got[0][1])  # the ranks' projection, so the comparison below is exact
    whole = build_memory(p.apply(vectors), segments, rows, 3, IDENTITY, 3, FLAT, None, True, p)
    for rank in (0, 1):
        np.testing.assert_array_equal(got[rank][2], whole.neighbours)
        q = low_rank(40, 32, 8, seed=7)[rank * 20 : (rank + 1) * 20]
        np.testing.assert_array_equal(
            got[rank][3], whole.search_scored(q, rows[np.arange(rank, 40, 2)], 3).ids
        )
    assert (whole.neighbours[rows] >= 0).all()
    # outside training: every part, searched as one, narrowed alike
    one = load_memory_for_search(got[0][4][1])
    q = low_rank(40, 32, 8, seed=7)
    np.testing.assert_array_equal(
        one.search_scored(q, np.full(40, -1), 3).ids, whole.search_scored(q, np.full(40, -1), 3).ids
    )
    # the callback on 2 ranks, unsharded (gathered narrowed, rank 0 builds) and sharded: one projection, fitted on
    # every rank's vectors (as the 1-process fit), and the 1-process table of the vectors narrowed by it
    cb, _, vectors = callback_for(tmp_path, 200, index_dim=8)
    for sharded in (False, True):
        mean, components, table, parts = got[(sharded, 0)]
        np.testing.assert_array_equal(components, got[(sharded, 1)][1])
        np.testing.assert_array_equal(table, got[(sharded, 1)][2])
        np.testing.assert_allclose(components, fit_projection(vectors, 8).components, atol=1e-5)
        p = Projection(mean, components)
        whole = build_memory(p.apply(vectors), cb.segments, cb.rows, 2, IDENTITY, 3, FLAT, None, True, p)
        np.testing.assert_array_equal(table, whole.neighbours)
        assert (parts is not None) == sharded
