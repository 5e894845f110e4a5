"""Fixed-length segments of every document, with global ids (MARGE-style retrieval units, Komatsuzaki 2020)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


class SegmentTable:
    """Every document cut into segments of `segment_len` tokens, with ids global over all documents, in order: the
    k-th of document d (ids `doc_segments(d)`) covers its tokens [k * segment_len, (k + 1) * segment_len)."""

    def __init__(
        self, tokens: np.ndarray, doc_offsets: np.ndarray, segment_len: int, pad_id: int, fingerprint: str
    ) -> None:
        if segment_len < 1:
            raise ValueError(f"segment_len={segment_len}; accepted: a positive integer")
        self.segment_len = segment_len  # tokens per segment
        self.pad_id = pad_id  # filler for the tail of a short last segment
        self.fingerprint = fingerprint  # corpus + tokenizer + segment_len, which indices built on it match
        self.corpus_tokens = tokens  # the whole token array the segments index into (usually memory-mapped)
        doc_len = np.diff(doc_offsets)  # (n_docs,)
        n_seg = -(-doc_len // segment_len)  # ceil
        self.first = np.zeros(len(doc_len) + 1, dtype=np.int64)  # (n_docs + 1,) d owns first[d]:first[d + 1]
        np.cumsum(n_seg, out=self.first[1:])
        self.doc = np.repeat(np.arange(len(doc_len), dtype=np.int64), n_seg)  # (S,) document of each segment
        k = np.arange(len(self.doc), dtype=np.int64) - self.first[self.doc]  # index of the segment in its doc
        self.offset = k * segment_len  # (S,) offset of each segment's first token inside its document
        self.start = doc_offsets[self.doc] + self.offset  # (S,) ... and in the token array
        self.length = np.minimum(segment_len, doc_offsets[self.doc + 1] - self.start)  # (S,) real tokens

    def __len__(self) -> int:
        return len(self.doc)

    # Ship a memory-mapped token array to loader workers as its file, not as a copy of its contents.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if isinstance(self.corpus_tokens, np.memmap):
            t = self.corpus_tokens
            state["corpus_tokens"] = (str(t.filename), t.offset, t.dtype.str, t.shape)
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["corpus_tokens"], tuple):
            filename, offset, dtype, shape = state["corpus_tokens"]
            state["corpus_tokens"] = np.memmap(
                filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape
            )
        self.__dict__.update(state)

    def doc_segments(self, doc: int) -> range:
        """The ids of document `doc`'s segments, in order."""
        return range(int(self.first[doc]), int(self.first[doc + 1]))

    def ids_of_docs(self, docs: np.ndarray) -> np.ndarray:
        """Segment ids of the given documents (for example the training split), in order."""
        docs = np.asarray(docs, dtype=np.int64)
        counts = self.first[docs + 1] - self.first[docs]
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(self.first[docs], counts) + within

    def tokens(self, ids: np.ndarray) -> np.ndarray:
        """(len(ids), segment_len) tokens of the given segments, padded with pad_id."""
        ids = np.asarray(ids, dtype=np.int64)
        cols = np.arange(self.segment_len)
        real = cols < self.length[ids][:, None]  # (n, L)
        out = np.full((len(ids), self.segment_len), self.pad_id, dtype=np.int64)
        out[real] = self.corpus_tokens[(self.start[ids][:, None] + cols)[real]]
        return out

    def window_segments(self, docs: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
        """(B, n) ids of the n segments from offset `starts` (multiples of segment_len) of `docs`; -1 past the end."""
        ids = self.first[docs][:, None] + starts[:, None] // self.segment_len + np.arange(n)  # (B, n)
        return np.where(ids < self.first[docs + 1][:, None], ids, -1)


@runtime_checkable
class SegmentSource(Protocol):
    """A data module whose batches' segment_ids and doc_ids index its `segments` (rlm.data.RLMDataModule)."""

    segments: SegmentTable
