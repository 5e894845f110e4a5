"""The retriever at evaluation, causal for any evaluated text (Komatsuzaki 2020, sec. 5.4): the index knows a
training query by id, an evaluated text is not indexed, so a text copying L / 2 tokens of an indexed document is
filtered as that document's query would be (copy_exclusions), indexed copies of the evaluated document's future are
not retrieved (future_exclusions: a leakage filter reads the future, as RETRO's evaluation, Borgeaud et al. 2022),
and a document the index does not hold gets its own past, scored and merged (score_candidates, merge_by_score)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlm.data.segments import SegmentTable
from rlm.index.copies import spread
from rlm.index.memory import RetrievalMemory
from rlm.index.search import Exclusions


def same_table(a: Any, b: Any) -> bool:
    """Whether two segment tables are one: the same object, or their fingerprints match."""
    return a is b or (a.fingerprint is not None and a.fingerprint == b.fingerprint)


def window_table(tokens: Tensor, mask: Tensor, L: int, pad_id: int) -> tuple[SegmentTable, np.ndarray]:
    """For a batch that names no segments (generation): a table with each row's real tokens as one document, and the
    (B, n) ids of the row's segments in it."""
    B, T = tokens.shape
    lengths = mask.sum(1).cpu().numpy().astype(np.int64)  # (B,)
    tok = tokens.cpu().numpy()
    flat = np.concatenate([tok[b, : lengths[b]] for b in range(B)]).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    table = SegmentTable(flat, offsets, L, pad_id, None)  # no fingerprint: never the index's table
    return table, table.window_segments(np.arange(B), np.zeros(B, dtype=np.int64), -(-T // L))


def segment_tensors(seg: Any, ids: np.ndarray, device: Any) -> tuple[Tensor, Tensor]:
    """Tokens and real-token mask (N, L) of segments ``ids`` (N,) of table ``seg``, on ``device``."""
    mask = np.arange(seg.segment_len) < seg.length[ids][:, None]
    return torch.from_numpy(seg.tokens(ids)).to(device), torch.from_numpy(mask).to(device)


def copy_exclusions(
    memory: RetrievalMemory, q_tokens: np.ndarray, q_mask: np.ndarray, continuation: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query, lo, hi): the memory's ids lo <= id < hi that query b * n + j may not find because its text up to S_t's
    end (q_tokens[b, :j + 1], of the (B, n, L) query segments) copies their document."""
    B, n, L = q_tokens.shape
    runs = memory.text_copies
    g = runs.run
    text, real = q_tokens.reshape(B, n * L), q_mask.reshape(B, n * L)
    grams = np.lib.stride_tricks.sliding_window_view(text, g, axis=1)  # (B, nL - g + 1, g): every run of g
    b, p = np.nonzero(np.lib.stride_tricks.sliding_window_view(real, g, axis=1).all(-1))
    row, doc, at = runs.find(grams[b, p])
    b, p = b[row], p[row]  # text[p:p + g] of row b is an exact copy of document `doc` at position `at`
    # the copy lies inside the text up to chunk j's S_t (which ends at (j + 1) L) for j >= (p + g) / L - 1
    first = -(-(p + g) // L) - 1
    m, r = spread(n - first)
    j = first[m] + r
    start = j * L - p[m] + at[m]  # where S_t starts in the copied document, read through the copy
    # allowed: the segments that end by S_t's start (no continuation) or, with it, whose continuation does
    seg = memory.segments
    lo = seg.first[doc[m]] + np.maximum(start // L if continuation else -(-start // L), 0)
    hi = seg.first[doc[m] + 1]
    keep = lo < hi
    query, lo, hi = b[m][keep] * n + j[keep], lo[keep], hi[keep]
    # one range per query and document (hi): the widest, the first by lo
    order = np.lexsort((lo, hi, query))
    query, lo, hi = query[order], lo[order], hi[order]
    _, first_of = np.unique(np.stack([query, hi], 1), axis=0, return_index=True)
    return query[first_of], lo[first_of], hi[first_of]


def future_exclusions(
    memory: RetrievalMemory, own: Any, docs: np.ndarray, seg_ids: np.ndarray, continuation: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query, lo, hi): the memory's segments that copy a segment of the evaluated document at or after chunk j's
    target (with continuations, also the one before such a copy). own: the batch's table; docs (B,) each row's
    document in it; seg_ids (B, n) the window's segments, chunk j's target seg_ids[:, j] (-1 past the end)."""
    B, n = seg_ids.shape
    t0 = seg_ids[:, 0]  # chunk 0's target; chunk j's is t0 + j
    m, r = spread(np.where(t0 >= 0, own.first[docs + 1] - t0, 0))
    future = t0[m] + r  # (F,) every segment of each row's document from chunk 0's target on
    uniq, inv = np.unique(future, return_inverse=True)
    which, g = memory.segment_copies.find(own.tokens(uniq), own.length[uniq])
    order = np.argsort(which, kind="stable")
    which, g = which[order], g[order]
    lo_at = np.searchsorted(which, inv, "left")
    e, r = spread(np.searchsorted(which, inv, "right") - lo_at)
    row, f, copy = m[e], future[e], g[lo_at[e] + r]  # future segment f of row `row` is copied by `copy`
    c, j = spread(np.minimum(n, f - t0[row] + 1))  # chunks whose target is at or before f
    copy = copy[c]
    seg = memory.segments
    lo = np.where(continuation & (copy > seg.first[seg.doc[copy]]), copy - 1, copy)
    return row[c] * n + j, lo, copy + 1


def as_exclusions(rows: np.ndarray, parts: list[tuple[tuple[np.ndarray, ...], bool]]) -> Exclusions:
    """Exclusions of the searched queries `rows` (ascending among the B * n) from ((query, lo, hi), counted)."""
    query, lo, hi = (np.concatenate(x) for x in zip(*(ranges for ranges, _ in parts)))
    counted = np.concatenate([np.full(len(q), count) for (q, _, _), count in parts])
    pos = np.minimum(np.searchsorted(rows, query), max(len(rows) - 1, 0))
    ok = rows[pos] == query if len(rows) else np.zeros(len(query), bool)
    return Exclusions(pos[ok], lo[ok], hi[ok], counted[ok])


def score_candidates(own: Any, cands: np.ndarray, e_q: Tensor, embed) -> np.ndarray:
    """(B, n, c) cosine of each candidate segment of `own` (-1: none, -inf) to its query's e(S_t) (e_q (B * n, D))
    under the current embedder, each distinct candidate embedded once."""
    B, n, c = cands.shape
    score = np.full(cands.shape, -np.inf, dtype=np.float32)
    present = cands >= 0
    if not present.any():
        return score
    ids, inverse = np.unique(cands[present], return_inverse=True)
    device = e_q.device
    e_c = embed(*segment_tensors(own, ids, device))  # (U, D)
    b, j, _ = np.nonzero(present)
    query = torch.from_numpy(b * n + j).to(device)  # (P,) the query of each present candidate
    cos = (e_q[query] * e_c[torch.from_numpy(inverse).to(device)]).sum(-1)  # (P,)
    score[present] = cos.float().cpu().numpy()
    return score


def merge_by_score(
    ids: np.ndarray, scores: np.ndarray, more: np.ndarray, more_scores: np.ndarray, k: int
) -> np.ndarray:
    """(..., k) ids of the k best of two lists (..., a), (..., c) by score (-1 / -inf: none), ties to the first."""
    all_ids = np.concatenate([ids, more], -1)
    all_scores = np.where(all_ids >= 0, np.concatenate([scores, more_scores], -1), -np.inf)
    order = np.argsort(-all_scores, axis=-1, kind="stable")[..., :k]
    best = np.take_along_axis(all_ids, order, -1)
    return np.where(np.take_along_axis(all_scores, order, -1) > -np.inf, best, -1)
