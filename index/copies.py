"""Exact copies of indexed text: the indexed segments holding exactly given tokens (SegmentHashes), and where
a run of tokens occurs in the indexed documents (TextRuns), so the retriever treats a query copied from
another text as that document's own. Every hash hit is checked token by token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

_BASE = 0x9E3779B97F4A7C15  # odd: the row hash is a polynomial in it, mod 2^64
_LENGTH = 0xC2B2AE3D27D4EB4F  # mixes a segment's real length into its hash
_CHUNK = 1 << 16  # rows hashed at a time


def row_hashes(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(N,) uint64 hashes of token rows (N, L) with lengths (N,) real tokens (the rest padding)."""
    powers = np.full(tokens.shape[-1], _BASE, dtype=np.uint64)
    powers[:1] = 1
    powers = np.cumprod(powers)[::-1]  # (L,) _BASE^(L-1-i), wrapping mod 2^64 as the products below
    h = (tokens.astype(np.uint64) * powers).sum(-1, dtype=np.uint64)
    return h + np.asarray(lengths).astype(np.uint64) * np.uint64(_LENGTH)


def _sorted_hashes(n: int, hash_of: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(sorted hashes, the position in 0..n-1 of each) of n rows hashed _CHUNK at a time by hash_of(positions)."""
    parts = np.array_split(np.arange(n), max(1, -(-n // _CHUNK)))
    h = np.concatenate([np.zeros(0, dtype=np.uint64)] + [hash_of(p) for p in parts])
    order = np.argsort(h, kind="stable")
    return h[order], order


def spread(count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For counts (N,): (item, rank) of every element of the ragged ranges 0..count[i]-1, in order."""
    item = np.repeat(np.arange(len(count)), count)
    return item, np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)


def _hits(hashes: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(query row, position in hashes) of every entry of sorted `hashes` equal to a query hash h (N,)."""
    lo = np.searchsorted(hashes, h, "left")
    row, rank = spread(np.searchsorted(hashes, h, "right") - lo)  # each row's hits
    return row, lo[row] + rank


class SegmentHashes:
    """The hashes of some segments of a table (the indexed ones), sorted, to find exact copies."""

    def __init__(self, segments: Any, ids: np.ndarray) -> None:
        self.segments = segments  # rlm.data.SegmentTable
        ids = np.asarray(ids, dtype=np.int64)
        self.hashes, order = _sorted_hashes(
            len(ids), lambda p: row_hashes(segments.tokens(ids[p]), segments.length[ids[p]])
        )
        self.ids = ids[order]  # the segment id of each hash

    def find(self, tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which row, segment id) of every segment holding exactly the real tokens of a row (N, L) of `lengths`."""
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        row, at = _hits(self.hashes, row_hashes(tokens, lengths))
        seg = self.ids[at]
        if not len(seg):
            return row, seg
        real = np.arange(tokens.shape[-1]) < lengths[row][:, None]  # compare real tokens: padding may differ
        same = (self.segments.length[seg] == lengths[row]) & (
            (self.segments.tokens(seg) == tokens[row]) | ~real
        ).all(1)
        return row[same], seg[same]


class TextRuns:
    """Runs of `run` tokens of some documents, at every multiple of `stride` of each document, hashed: any text of
    at least run + stride - 1 tokens copied from one of them holds one of these runs whole."""

    def __init__(self, segments: Any, docs: np.ndarray, run: int, stride: int) -> None:
        if run < 1 or stride < 1:
            raise ValueError(f"run={run} and stride={stride} must be positive")
        self.segments, self.run, self.stride = segments, run, stride
        docs = np.unique(np.asarray(docs, dtype=np.int64))
        last = segments.first[docs + 1] - 1  # each document's last segment (documents have one at least)
        start = segments.start[segments.first[docs]]  # (D,) first token of each document
        n = np.maximum(segments.start[last] + segments.length[last] - start - run, -1) // stride + 1  # runs
        which, rank = spread(n)
        doc, pos = docs[which], rank * stride  # pos: in the document
        self.abs = start[which] + pos  # (N,) position of each run in the token array
        self.hashes, order = _sorted_hashes(
            len(doc), lambda p: row_hashes(self._tokens(p), np.full(len(p), run))
        )
        self.doc, self.pos, self.abs = doc[order], pos[order], self.abs[order]

    def _tokens(self, i: np.ndarray) -> np.ndarray:
        """(len(i), run) tokens of runs i (in the order of self.abs)."""
        return np.asarray(
            self.segments.corpus_tokens[self.abs[i][:, None] + np.arange(self.run)], dtype=np.int64
        )

    def find(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(which row, document, position in it) of every indexed run holding exactly a row (N, run) of tokens."""
        tokens = np.asarray(tokens, dtype=np.int64)
        row, at = _hits(self.hashes, row_hashes(tokens, np.full(len(tokens), self.run)))
        same = (self._tokens(at) == tokens[row]).all(1) if len(at) else np.zeros(0, dtype=bool)
        return row[same], self.doc[at[same]], self.pos[at[same]]
