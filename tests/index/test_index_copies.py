"""Exact copies of indexed text (rlm.index.copies) against a brute-force scan, hash collisions included."""

from __future__ import annotations

import numpy as np
from retrieval_helpers import make_segments

from rlm.index import copies
from rlm.index.copies import SegmentHashes, TextRuns


def docs_with_repeats() -> list[np.ndarray]:
    """Documents over a 2-token vocabulary (many repeated runs and segments), of uneven lengths."""
    rng = np.random.default_rng(0)
    return [rng.integers(4, 6, size=n) for n in (5, 17, 24, 3, 40)]


def test_segment_hashes_find_every_exact_copy_and_nothing_else():
    seg = make_segments(docs_with_repeats(), 4)
    indexed = np.flatnonzero(seg.doc != 2)
    found = SegmentHashes(seg, indexed)
    rows = np.arange(len(seg))
    row, ids = found.find(seg.tokens(rows), seg.length[rows])
    got = set(zip(row.tolist(), ids.tolist()))
    want = {
        (a, b)
        for a in rows
        for b in indexed
        if seg.length[a] == seg.length[b]
        and (seg.tokens([a])[0, : seg.length[a]] == seg.tokens([b])[0, : seg.length[b]]).all()
    }
    assert got == want and len(want) > len(rows)  # repeats: rows with several copies


def test_text_runs_find_every_copy_at_a_stride_position(monkeypatch):
    seg = make_segments(docs_with_repeats(), 4)
    monkeypatch.setattr(copies, "_BASE", 1)  # every row of the same token sum collides: only the check tells
    runs = TextRuns(seg, np.array([0, 1, 4]), run=3, stride=2)
    queries = np.random.default_rng(1).integers(4, 6, size=(50, 3))
    row, doc, pos = runs.find(queries)
    got = set(zip(row.tolist(), doc.tolist(), pos.tolist()))
    want = set()
    for d in (0, 1, 4):
        text = seg.corpus_tokens[seg.start[seg.first[d]] :][: sum(seg.length[seg.doc_segments(d)])]
        for p in range(0, len(text) - 2, 2):
            want |= {(r, d, p) for r in range(50) if (queries[r] == text[p : p + 3]).all()}
    assert got == want and want
