"""A retrieval memory: an index over the training segments, its neighbour table and rows, as a rebuild writes it
and a resumed run, validation or generation loads it."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from rlm.checksums import META_SHA, file_sha256, meta_digest
from rlm.data.segments import SegmentTable
from rlm.index.build import TORCH, IndexConfig, build_index
from rlm.index.copies import SegmentHashes, TextRuns
from rlm.index.device_search import device_index
from rlm.index.projection import Projection, with_projection
from rlm.index.protocol import Embedder, embed_all
from rlm.index.search import Exclusions, Neighbours, neighbour_table, search_neighbours
from rlm.index.search import SegmentTable as IndexSegments
from rlm.index.store import (
    META,
    IndexMismatchError,
    IndexNotFoundError,
    _save_npy,
    atomic_dir,
    load_index_dir,
    read_meta,
    write_dir_contents,
)

NEIGHBOURS, ROWS = "neighbours.npy", "rows.npy"
SEARCH_DEVICES = ("cuda",)  # device types whose models search the memory there; a CPU model keeps faiss-cpu
CORPUS, DOC_OFFSETS, CORPUS_TOKENS = "corpus.json", "doc_offsets.npy", "corpus_tokens.npy"


@dataclass
class RetrievalMemory:
    """An index over the training segments and their precomputed neighbour table."""

    segments: Any  # the data's rlm.data.SegmentTable
    rows: np.ndarray  # (R,) global segment id of each index row
    index: Any  # searchable index over the R rows (search(x, k) -> (scores, row ids))
    index_segments: IndexSegments  # (document, offset) of each row, for the causal filter
    neighbours: np.ndarray | None
    """(S, k) global neighbour ids of every global segment id (-1: none); None when the rebuild made no table
    (lookup 'search': each training step searches its own queries)."""
    identity: dict[str, Any]  # the embedder identity of the vectors, with "projection" (with_projection)
    step: int  # training step of the rebuild
    path: Path | None = None  # the index directory it was written to or loaded from
    recall: float | None = None  # recall@TUNE_K against exact search (1.0 when exact; None when unmeasured)
    parts: list[str] | None = None  # a sharded index's part directories, in rank order
    projection: Projection | None = None  # the PCA that narrowed the vectors and narrows every query
    row_of: np.ndarray = field(init=False)  # (S,) index row of each global segment id, -1 when not indexed
    _searched: tuple[torch.device, Any] | None = field(default=None, init=False, repr=False)  # place_search's
    collective: ClassVar[bool] = False  # whether every rank calls search together (a sharded index)

    def __post_init__(self) -> None:
        if np.any(np.diff(self.rows) <= 0):
            raise ValueError("the indexed rows must be global segment ids in increasing order")
        self.row_of = np.full(len(self.segments), -1, dtype=np.int64)
        self.row_of[self.rows] = np.arange(len(self.rows))

    def indexed_mask(self) -> np.ndarray:
        """(S,) bool: which global segment ids the index holds."""
        return self.row_of >= 0

    @cached_property
    def segment_copies(self) -> SegmentHashes:
        """The indexed segments' hashes, to find exact copies of segments."""
        return SegmentHashes(self.segments, np.flatnonzero(self.indexed_mask()))

    @cached_property
    def text_copies(self) -> TextRuns:
        """Runs of L // 2 tokens of the indexed documents every L // 2 tokens (L the segment length): any L tokens
        copied from them hold such a run."""
        half = max(1, self.segments.segment_len // 2)
        return TextRuns(self.segments, np.unique(self.segments.doc[self.indexed_mask()]), half, half)

    def place_search(self, device: torch.device) -> None:
        """Search on ``device`` from now on when it is one of SEARCH_DEVICES (device_index), saying how on stderr;
        a sharded memory keeps its parts' search."""
        if self.collective or device.type not in SEARCH_DEVICES:
            return
        if self._searched is None or self._searched[0] != device:
            index, how = device_index(self.index, device)
            self._searched = (device, index)
            print(f"rlm: retrieval search: {how}", file=sys.stderr)

    def project(self, queries: np.ndarray) -> np.ndarray:
        """(Q, D) full-width query vectors in the index's width: narrowed by its projection, if it has one."""
        return queries if self.projection is None else self.projection.apply(queries)

    def search_scored(
        self, queries: np.ndarray, query_ids: np.ndarray, k: int, exclusions: Exclusions | None = None
    ) -> Neighbours:
        """Causally filtered top-k (global ids) of full-width queries with global ids (-1: outside), minus the
        exclusions' ranges of global ids."""
        rows = np.where(query_ids >= 0, self.row_of[np.maximum(query_ids, 0)], -1)
        index = self.index if self._searched is None else self._searched[1]
        found = search_neighbours(
            index, self.project(queries), k, rows, self.index_segments, exclusions=self._as_rows(exclusions)
        )
        found.ids = np.where(found.ids >= 0, self.rows[np.maximum(found.ids, 0)], -1)
        return found

    def _as_rows(self, exclusions: Exclusions | None) -> Exclusions | None:
        """Ranges of global ids as ranges of this index's rows (the rows are increasing global ids)."""
        if exclusions is None:
            return None
        lo, hi = np.searchsorted(self.rows, exclusions.lo), np.searchsorted(self.rows, exclusions.hi)
        return Exclusions(exclusions.query, lo, hi, exclusions.counted)


@runtime_checkable
class MemoryOwner(Protocol):
    """What the rebuild callback needs from the retriever."""

    prepare_seconds: float  # time spent on retrieval in the last step (for the retrieval-time fraction)

    def snapshot(self, step: int) -> Embedder:
        """A frozen copy of the embedder, safe to run in another thread."""
        ...

    def use_memory(self, memory: RetrievalMemory | None) -> None:
        """Take a new memory (an atomic swap)."""
        ...


def indexed_rows(segments: Any, docs: np.ndarray) -> np.ndarray:
    """Global ids of every segment of `docs` (the training documents), in order."""
    return np.flatnonzero(np.isin(segments.doc, np.asarray(docs)))


def embed_rows(
    embedder: Embedder,
    segments: Any,
    rows: np.ndarray,
    batch_size: int,
    rank: int,
    world: int,
    progress: bool,
) -> np.ndarray:
    """This rank's shard (rlm.index.protocol.shard_range) of the rows' embeddings, float32."""
    L = segments.segment_len

    def tokens_of(i: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        ids = rows[i]
        mask = np.arange(L) < segments.length[ids][:, None]  # (b, L)
        return torch.from_numpy(segments.tokens(ids)), torch.from_numpy(mask)

    return embed_all(embedder, tokens_of, len(rows), batch_size, rank, world, progress and rank == 0)


def build_memory(
    vectors: np.ndarray,
    segments: Any,
    rows: np.ndarray,
    k: int,
    identity: dict[str, Any],
    step: int,
    index_config: IndexConfig,
    path: Path | None,
    table: bool = True,
    projection: Projection | None = None,
) -> RetrievalMemory:
    """Index the rows' vectors (already narrowed by `projection`), find every row's k causal neighbours (table=False:
    none, the owner searches online), and write it all to `path` atomically."""
    identity = with_projection(identity, projection)
    built = build_index(vectors, index_config)
    recall = built.tuned_recall
    if recall is None and built.factory in ("Flat", TORCH):
        recall = 1.0  # exact search
    index_segments = IndexSegments(segments.doc[rows], segments.start[rows])
    neighbours = None
    if table:
        found = neighbour_table(built, vectors, k, index_segments).ids  # (R, k) row ids
        neighbours = np.full((len(segments), k), -1, dtype=np.int64)
        neighbours[rows] = np.where(found >= 0, rows[np.maximum(found, 0)], -1)
    memory = RetrievalMemory(
        segments,
        rows,
        built,
        index_segments,
        neighbours,
        identity,
        step,
        recall=recall,
        projection=projection,
    )
    if path is not None:
        extra = {"k": k, "recall": recall, "target_recall": index_config.target_recall}
        write_memory(path, memory, vectors, extra)
    return memory


def write_memory(path: Path, memory: RetrievalMemory, vectors: np.ndarray, extra: dict[str, Any]) -> None:
    """Write a memory (its index over `vectors`, table, rows, corpus reference, projection) to `path` atomically."""
    m = memory
    with atomic_dir(path) as tmp:
        if m.neighbours is not None:
            _save_npy(tmp / NEIGHBOURS, m.neighbours)
        _save_npy(tmp / ROWS, m.rows)
        save_corpus_ref(tmp, m.segments)
        if m.projection is not None:
            m.projection.save(tmp)
        write_dir_contents(tmp, m.index, m.index_segments, m.segments.fingerprint, m.identity, vectors, extra)
    memory.path = Path(path).resolve()


def save_corpus_ref(tmp: Path, segments: Any) -> None:
    """Say where the segments' tokens are, so the memory loads without the data module: a memmap (the data cache)
    by its file, any other array copied."""
    doc_offsets = np.append(segments.start[segments.first[:-1]], segments.start[-1] + segments.length[-1])
    _save_npy(tmp / DOC_OFFSETS, doc_offsets)
    tokens = segments.corpus_tokens
    ref = {
        "segment_len": segments.segment_len,
        "pad_id": int(segments.pad_id),
        "fingerprint": segments.fingerprint,
    }
    if isinstance(tokens, np.memmap) and tokens.filename:
        ref.update(file=str(Path(tokens.filename).resolve()), offset=tokens.offset, dtype=tokens.dtype.str)
        ref["shape"] = list(tokens.shape)
    else:
        _save_npy(tmp / CORPUS_TOKENS, np.asarray(tokens))
    (tmp / CORPUS).write_text(json.dumps(ref))


def load_corpus_ref(path: Path) -> SegmentTable:
    """The segment table a memory was built on, from the reference save_corpus_ref wrote."""
    ref = json.loads((path / CORPUS).read_text())
    if "file" in ref:
        if not Path(ref["file"]).exists():
            raise IndexNotFoundError(f"the corpus tokens of the index at {path} are gone: {ref['file']}")
        tokens = np.memmap(
            ref["file"],
            dtype=np.dtype(ref["dtype"]),
            mode="r",
            offset=ref["offset"],
            shape=tuple(ref["shape"]),
        )
    else:
        tokens = np.load(path / CORPUS_TOKENS, mmap_mode="r")
    return SegmentTable(
        tokens, np.load(path / DOC_OFFSETS), ref["segment_len"], ref["pad_id"], ref["fingerprint"]
    )


def copy_memory(src: str | Path, dst: Path) -> dict[str, Any]:
    """Copy a verified, unsharded memory to a new folder ``dst`` that stands alone (corpus tokens it references in a
    data cache copied in, checksums rewritten); returns its metadata."""
    src = Path(src)
    meta = read_meta(src, verify=True)
    if "shard" in meta:
        raise ValueError(
            f"the index at {src} is one part of a sharded index; only an unsharded index is copied"
        )
    shutil.copytree(src, dst)
    ref = json.loads((dst / CORPUS).read_text())
    if "file" in ref:
        _save_npy(dst / CORPUS_TOKENS, np.asarray(load_corpus_ref(src).corpus_tokens))
        ref = {k: v for k, v in ref.items() if k not in ("file", "offset", "dtype", "shape")}
        (dst / CORPUS).write_text(json.dumps(ref))
        for name in (CORPUS, CORPUS_TOKENS):
            meta["files"][name] = (dst / name).stat().st_size
            meta.setdefault("sha256", {})[name] = file_sha256(dst / name)
        meta[META_SHA] = meta_digest(meta)
        (dst / META).write_text(json.dumps(meta, indent=2))
    return meta


def load_table(path: Path) -> np.ndarray | None:
    """The neighbour table written beside an index, or None when its rebuild made none (lookup 'search')."""
    return np.load(path / NEIGHBOURS) if (path / NEIGHBOURS).exists() else None


def load_part_memory(path: str | Path) -> RetrievalMemory:
    """A written memory with its own segment table (one part of a sharded index: that part)."""
    path = Path(path)
    loaded = load_index_dir(path)
    return _memory_from(loaded, path, load_corpus_ref(path), loaded.meta["embedder"])


def load_memory(path: Path, segments: Any, identity: dict[str, Any], k: int) -> RetrievalMemory:
    """Load a written memory, refusing one from another corpus, embedder, projection or k (IndexMismatchError)."""
    loaded = load_index_dir(path, expect_fingerprint=segments.fingerprint, expect_embedder=identity)
    if loaded.meta.get("k") != k:
        raise IndexMismatchError(f"index at {path} has k={loaded.meta.get('k')}, this run wants k={k}")
    return _memory_from(loaded, path, segments, identity)


def _memory_from(loaded: Any, path: Path, segments: Any, identity: dict[str, Any]) -> RetrievalMemory:
    """The memory of a loaded index directory, with the neighbour table and rows written beside it."""
    return RetrievalMemory(
        segments,
        np.load(path / ROWS),
        loaded.index,
        loaded.segments,
        load_table(path),
        identity,
        int(identity["step"]),
        path.resolve(),
        loaded.meta.get("recall", loaded.meta.get("tuned_recall")),
        projection=loaded.projection,
    )
