"""Batched, filtered search: the retriever's neighbour tables. Filters follow MARGE for causal LMs
(Komatsuzaki 2020): S_t's neighbours condition the prediction of S_{t+1}, so a query segment never retrieves
itself, its target or any later segment of its document. Rows left short of k are searched again with twice
the fetch size, so the result equals filtering the full ranking. Exclusions add row ranges a query must not
find (the exact-copy filter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rlm.index.build import as_unit_float32, max_k, search_index
from rlm.index.exact import first_kept


@dataclass
class SegmentTable:
    """Where each indexed segment comes from: segment id s is (doc[s], offset[s])."""

    doc: np.ndarray  # (S,) int64 document id of each segment
    offset: np.ndarray  # (S,) int64 token offset of each segment in its document (orders them within it)

    def __post_init__(self) -> None:
        self.doc = np.asarray(self.doc, dtype=np.int64)
        self.offset = np.asarray(self.offset, dtype=np.int64)
        if self.doc.ndim != 1 or self.doc.shape != self.offset.shape:
            raise ValueError(
                f"doc and offset must be 1-D of one length, got {self.doc.shape} and {self.offset.shape}"
            )

    def __len__(self) -> int:
        return len(self.doc)


@dataclass
class Neighbours:
    """A neighbour table: row q holds query q's top-k allowed results, best first."""

    ids: np.ndarray  # segment ids, (Q, k) int64; -1 where fewer than k results were allowed
    scores: np.ndarray  # cosine similarities, (Q, k) float32; -inf where ids is -1
    excluded: np.ndarray | None = None  # (Q,) results counted exclusions took from each top k


@dataclass
class Exclusions:
    """Row ranges some queries must not find: query[e] keeps no row r with lo[e] <= r < hi[e]."""

    query: np.ndarray  # (E,) position of the query (a row of the queries array), int64
    lo: np.ndarray  # (E,) first excluded row, int64
    hi: np.ndarray  # (E,) end of the excluded rows (exclusive), int64
    counted: np.ndarray  # (E,) bool: count the results this exclusion removes (Neighbours.excluded)

    def __post_init__(self) -> None:
        self.query, self.lo, self.hi = (
            np.asarray(a, dtype=np.int64).reshape(-1) for a in (self.query, self.lo, self.hi)
        )
        self.counted = np.broadcast_to(np.asarray(self.counted, dtype=bool), self.query.shape)
        if not len(self.query) == len(self.lo) == len(self.hi):
            raise ValueError(
                f"exclusions of unequal lengths: {len(self.query)}, {len(self.lo)}, {len(self.hi)}"
            )

    def hits(self, rows: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(R, F) bool each: the candidates of queries `rows` (ascending) in an uncounted, a counted exclusion."""
        out = np.zeros((2, *cand.shape), dtype=bool)
        if len(self.query) and len(rows):
            pos = np.minimum(np.searchsorted(rows, self.query), len(rows) - 1)
            mine = rows[pos] == self.query  # (E,) exclusions of the queries searched now
            pos, lo, hi, counted = pos[mine], self.lo[mine], self.hi[mine], self.counted[mine]
            c = cand[pos]  # (E', F)
            inside = (c >= lo[:, None]) & (c < hi[:, None])
            np.logical_or.at(out, (counted.astype(np.int64), pos), inside)
        return out[0], out[1]


def allowed(
    cand: np.ndarray, query_ids: np.ndarray, segments: SegmentTable | None, exclude_self: bool, causal: bool
) -> np.ndarray:
    """(Q, F) bool: which candidate ids (Q, F) query rows may keep; query id -1 means an outside query."""
    keep = cand >= 0
    inside = (query_ids >= 0)[:, None]  # (Q, 1): outside queries are never filtered
    if exclude_self:
        keep &= ~(inside & (cand == query_ids[:, None]))
    if causal:
        if segments is None:
            raise ValueError("causal filtering needs the segment table (document and offset of each segment)")
        safe_c, safe_q = np.where(keep, cand, 0), np.maximum(query_ids, 0)
        same_doc = segments.doc[safe_c] == segments.doc[safe_q][:, None]  # (Q, F)
        # S_{t+1} and later are the target and its future; S_t itself is excluded only by exclude_self
        later = segments.offset[safe_c] > segments.offset[safe_q][:, None]
        keep &= ~(inside & same_doc & later)
    return keep


def search_neighbours(
    index: Any,
    queries: np.ndarray,
    k: int,
    query_ids: np.ndarray | None = None,
    segments: SegmentTable | None = None,
    exclude_self: bool = True,
    causal: bool = True,
    batch_size: int = 4096,
    fetch: int | None = None,
    exclusions: Exclusions | None = None,
) -> Neighbours:
    """Filtered top-k neighbours of queries (Q, d) in `index` (search(x, k) -> (scores, ids), ntotal); query_ids:
    (Q,) segment id of each (-1: outside, unfiltered; None: query q is segment q); fetch: the first fetch size."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    q = as_unit_float32(queries, "queries")
    query_ids = (
        np.arange(len(q), dtype=np.int64) if query_ids is None else np.asarray(query_ids, dtype=np.int64)
    )
    if query_ids.shape != (len(q),):
        raise ValueError(f"query_ids must have shape ({len(q)},), got {query_ids.shape}")
    if segments is not None and len(segments) < index.ntotal:
        raise ValueError(f"segment table has {len(segments)} rows but the index holds {index.ntotal} vectors")
    if causal and segments is not None and (query_ids >= len(segments)).any():
        raise ValueError(f"query_ids must be < {len(segments)} (segment table rows) or -1 (outside queries)")
    filtering = exclude_self or causal or exclusions is not None
    ids = np.full((len(q), k), -1, dtype=np.int64)
    scores = np.full((len(q), k), -np.inf, dtype=np.float32)
    excluded = None if exclusions is None else np.zeros(len(q), dtype=np.int64)
    first = fetch or (2 * k + 8 if filtering else k)
    limit = max_k(index)  # rows still short at this fetch size stay padded (only on GPU: k <= 2048)
    if limit == 0:  # an empty index: nothing to find
        return Neighbours(ids, scores, excluded)
    for lo in range(0, len(q), batch_size):
        rows = np.arange(lo, min(lo + batch_size, len(q)))
        size = min(first, limit)
        while len(rows):
            s, i = search_index(index, q[rows], size)  # (R, size)
            keep = allowed(i, query_ids[rows], segments, exclude_self, causal) if filtering else i >= 0
            if exclusions is not None:
                plain, counted = exclusions.hits(rows, i)
                keep &= ~plain
                # what the counted exclusions take from the top k that the rest of the filter would give
                shown = keep & (np.cumsum(keep, 1) <= k)
                excluded[rows] = (shown & counted).sum(1)
                keep &= ~counted
            ids[rows], scores[rows] = first_kept(i, s, keep, k)
            # refill rows short of k whose search came back full (the index may hold more allowed ones)
            short = (keep.sum(1) < k) & (i[:, -1] >= 0) & (size < limit)
            rows, size = rows[short], min(2 * size, limit)
    return Neighbours(ids, scores, excluded)


def neighbour_table(
    index: Any, vectors: np.ndarray, k: int, segments: SegmentTable | None, **kwargs
) -> Neighbours:
    """Every indexed segment's top-k causally allowed neighbours (query s is segment s, never its own neighbour)."""
    return search_neighbours(index, vectors, k, None, segments, **kwargs)
