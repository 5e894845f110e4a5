"""Filtered neighbour tables (self, same-document future) against a brute-force reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlm.index.build import IndexConfig, build_index
from rlm.index.search import Exclusions, SegmentTable, neighbour_table, search_neighbours
from rlm.index.synthetic import clustered_unit_vectors

K = 8


def corpus(seed: int = 0, shuffle: bool = False) -> tuple[np.ndarray, SegmentTable]:
    """Segments of documents of very different lengths (one of 300 segments); each document is its own blob,
    so a segment's nearest vectors are mostly its own document's, the case the causal filter must handle."""
    rng = np.random.default_rng(seed)
    lengths = [300, 1, 2, 5] + list(rng.integers(1, 40, size=60))
    doc = np.repeat(np.arange(len(lengths)), lengths)
    offset = np.concatenate([np.arange(n) * 16 for n in lengths])  # segment_len 16
    centres = clustered_unit_vectors(len(lengths), 24, n_clusters=8, spread=1.0, seed=seed)
    x = centres[doc] + 0.6 * rng.standard_normal((len(doc), 24)).astype(np.float32) / np.sqrt(24)
    if shuffle:  # segment ids need not follow document order
        perm = rng.permutation(len(doc))
        x, doc, offset = x[perm], doc[perm], offset[perm]
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32), SegmentTable(doc, offset)


def reference(x, seg, k, exclude_self, causal, query_ids=None):
    """Brute force: every score, each query's excluded candidates set to -inf, then sorted."""
    query_ids = np.arange(len(x)) if query_ids is None else query_ids
    x64 = x.astype(np.float64)
    ids = np.full((len(query_ids), k), -1)
    scores = np.full((len(query_ids), k), -np.inf, dtype=np.float32)
    for row, q in enumerate(query_ids):
        s = x64 @ x64[q]  # (n,)
        if exclude_self:
            s[q] = -np.inf
        if causal:  # the target S_{t+1} and everything after it in the same document
            s[(seg.doc == seg.doc[q]) & (seg.offset > seg.offset[q])] = -np.inf
        order = np.argsort(-s, kind="stable")[:k]
        order = order[np.isfinite(s[order])]
        ids[row, : len(order)], scores[row, : len(order)] = order, s[order]
    return ids, scores


def assert_same_neighbours(x, got, ids, scores, query_rows=None):
    """Same scores; same ids except where two reference scores tie to float32 precision."""
    torch.testing.assert_close(got.scores, scores, rtol=1e-5, atol=1e-5)
    gap = np.abs(np.diff(scores, axis=1, prepend=np.inf, append=-np.inf))  # (Q, k+1)
    unambiguous = (np.minimum(gap[:, :-1], gap[:, 1:]) > 1e-5) | (ids == -1)
    np.testing.assert_array_equal(got.ids[unambiguous], ids[unambiguous])
    rows = np.arange(len(ids)) if query_rows is None else query_rows
    real = got.ids >= 0
    true_scores = np.einsum("qd,qkd->qk", x[rows], x[np.maximum(got.ids, 0)])
    torch.testing.assert_close(got.scores[real], true_scores[real].astype(np.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("exclude_self", "causal"), [(True, True), (True, False), (False, True)])
def test_neighbour_table_matches_brute_force(shuffle, exclude_self, causal):
    x, seg = corpus(shuffle=shuffle)
    index = build_index(x, IndexConfig(factory="Flat"))
    # fetch=K+1 forces the refill loop for the rows whose top candidates are mostly excluded
    got = search_neighbours(index, x, K, None, seg, exclude_self, causal, batch_size=97, fetch=K + 1)
    ids, scores = reference(x, seg, K, exclude_self, causal)
    assert_same_neighbours(x, got, ids, scores)


def test_causal_rows_are_padded_when_too_few_allowed():
    x, seg = corpus()
    x, seg = x[:300], SegmentTable(seg.doc[:300], seg.offset[:300])  # one document only
    table = neighbour_table(build_index(x, IndexConfig(factory="Flat")), x, K, seg)
    assert (table.ids[0] == -1).all() and np.isneginf(table.scores[0]).all()  # S_0 has no past
    assert (table.ids[3, :3] >= 0).all() and (table.ids[3, 3:] == -1).all()  # S_3 may see S_0..S_2
    assert set(table.ids[3, :3]) == {0, 1, 2}


def test_outside_queries_are_not_filtered():
    x, seg = corpus()
    index = build_index(x, IndexConfig(factory="Flat"))
    got = search_neighbours(index, x[:20], K, np.full(20, -1), seg)
    ids, _ = reference(x, seg, K, True, True, query_ids=np.arange(20))  # filtered reference differs
    assert (got.ids[:, 0] == np.arange(20)).all()  # each finds itself first
    assert not np.array_equal(got.ids, ids)


def test_filters_on_an_approximate_index_equal_filtering_its_full_ranking():
    x, seg = corpus(seed=1)
    index = build_index(x, IndexConfig(factory="IVF16,Flat", target_recall=None))
    index.index.nprobe = 3
    got = neighbour_table(index, x, K, seg, fetch=K + 1)
    _, full = index.search(x, index.ntotal)  # the index's whole ranking (-1 past the probed lists)
    for q in range(0, len(x), 7):
        allowed = [
            z
            for z in full[q]
            if z >= 0 and z != q and not (seg.doc[z] == seg.doc[q] and seg.offset[z] > seg.offset[q])
        ]
        expect = (allowed + [-1] * K)[:K]
        np.testing.assert_array_equal(got.ids[q], expect)


def test_bad_filter_inputs_are_clear_errors():
    x, seg = corpus()
    index = build_index(x, IndexConfig(factory="Flat"))
    with pytest.raises(ValueError, match="causal filtering needs the segment table"):
        search_neighbours(index, x[:4], K, np.arange(4), None, causal=True)
    with pytest.raises(ValueError, match="query_ids must have shape"):
        search_neighbours(index, x[:4], K, np.arange(3), seg)
    with pytest.raises(ValueError, match="segment table has 3 rows"):
        search_neighbours(index, x[:4], K, None, SegmentTable(seg.doc[:3], seg.offset[:3]))
    with pytest.raises(ValueError, match="query_ids must be <"):
        search_neighbours(index, x[:2], K, np.array([0, len(x)]), seg)


def test_an_empty_index_finds_nothing():
    x, seg = corpus()
    empty = build_index(x[:0], IndexConfig(factory="Flat"))
    got = search_neighbours(empty, x[:3], K, np.full(3, -1), seg)
    assert (got.ids == -1).all() and np.isneginf(got.scores).all()


def test_exclusions_match_brute_force_and_count_what_they_took():
    """Row ranges excluded per query (beyond the causal filter) equal setting them to -inf in the full ranking;
    Neighbours.excluded counts the counted ranges' rows among the top k the rest of the filter would give."""
    x, seg = corpus()
    rng = np.random.default_rng(5)
    index = build_index(x, IndexConfig(factory="Flat"))
    query_ids = np.concatenate([np.arange(0, len(x), 7), [-1] * 5])  # some outside queries
    q = x[np.maximum(query_ids, 0)]
    E = 300
    ex = Exclusions(
        rng.integers(0, len(q), E),
        lo := rng.integers(0, len(x), E),
        lo + rng.integers(0, 20, E),
        rng.random(E) < 0.5,
    )
    got = search_neighbours(
        index, q, K, query_ids, seg, True, True, batch_size=13, fetch=K + 1, exclusions=ex
    )
    x64 = x.astype(np.float64)
    for row, qid in enumerate(query_ids):
        s = x64 @ x64[max(qid, 0)]
        if qid >= 0:
            s[qid] = -np.inf
            s[(seg.doc == seg.doc[qid]) & (seg.offset > seg.offset[qid])] = -np.inf
        banned = np.zeros((2, len(x)), dtype=bool)
        for e in np.flatnonzero(ex.query == row):
            banned[int(ex.counted[e]), ex.lo[e] : ex.hi[e]] = True
        s[banned[0]] = -np.inf
        shown = np.argsort(-s, kind="stable")[:K]
        want = int(banned[1][shown[np.isfinite(s[shown])]].sum())
        s[banned[1]] = -np.inf
        order = np.argsort(-s, kind="stable")[:K]
        order = order[np.isfinite(s[order])]
        np.testing.assert_array_equal(got.ids[row, : len(order)], order)
        assert (got.ids[row, len(order) :] == -1).all() and got.excluded[row] == want
    assert got.excluded.sum() > 0
