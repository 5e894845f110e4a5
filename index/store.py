"""Index directories, written under a temporary name and renamed into place, so a crash mid-write never leaves
a directory at DIR that loads. DIR holds meta.json (written last; sizes and checksums of the rest), index.faiss
(not for 'torch'), vectors.npy, segment_doc.npy and segment_offset.npy ((S,) document and token offset of each
row), rows.npy ((S,) corpus segment id of each row, if only some are indexed), projection.npz (if narrowed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlm.checksums import check_sealed, read_manifest, seal
from rlm.index._faiss import faiss
from rlm.index.build import (
    TORCH,
    BuiltIndex,
    IndexConfig,
    TorchExactIndex,
    as_unit_float32,
    build_index,
    gpu_available,
    set_search_params,
    to_gpu,
)
from rlm.index.projection import Projection, load_projection
from rlm.index.search import Neighbours, SegmentTable, search_neighbours

FORMAT_VERSION = 1
META, INDEX, VECTORS = "meta.json", "index.faiss", "vectors.npy"
SEG_DOC, SEG_OFFSET, ROWS = "segment_doc.npy", "segment_offset.npy", "rows.npy"
EMBEDDER_KEYS = ("name", "config_hash", "weights_hash", "step")
PROJECTION_KEY = "projection"  # the embedder identity's record of the index's projection (None: full width)
MMAP_ABOVE = 2**30  # indices larger than this (bytes) are memory-mapped on load unless told otherwise


class IndexMismatchError(ValueError):
    """The index directory was built from another corpus or by another embedder than expected."""


class IndexNotFoundError(FileNotFoundError):
    """No complete index directory at the path (missing, interrupted write, or damaged)."""


@dataclass
class IndexDir:
    """A loaded index directory."""

    path: Path  # where it was loaded from
    meta: dict[str, Any]  # the parsed meta.json
    index: Any  # faiss.Index or TorchExactIndex, search parameters already set
    segments: SegmentTable  # the row -> (document, offset) map
    vectors: np.ndarray | None  # the indexed (narrowed) vectors, memory-mapped, when stored
    projection: Projection | None = None  # what narrowed the vectors and narrows queries (None: full width)

    @property
    def rows(self) -> np.ndarray:
        """(count,) global segment id of each index row (the identity unless rows.npy says otherwise)."""
        if (self.path / ROWS).exists():
            return np.load(self.path / ROWS, mmap_mode="r")
        return np.arange(self.meta["count"], dtype=np.int64)

    def search(self, queries: np.ndarray, k: int, **filters: Any) -> Neighbours:
        """Filtered top-k search of full-width outside queries, or of segments (pass query_ids)."""
        filters.setdefault("query_ids", np.full(len(queries), -1, dtype=np.int64))
        if self.projection is not None:
            queries = self.projection.apply(queries)
        return search_neighbours(self.index, queries, k, segments=self.segments, **filters)


def process_alive(pid: int) -> bool:
    """Whether a process with this pid is running (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def recover_swap(path: str | os.PathLike) -> Path | None:
    """Finish the swap of a writer killed between its two renames (``path`` moved aside to ``.NAME.old-*``, the new
    ``.NAME.tmp-PID-*`` not yet in): the new one when complete (meta.json is written last), else the old one goes
    back. Returns what was restored, or None."""
    path = Path(path)
    if path.exists() or not path.parent.is_dir():
        return None
    olds = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if not olds:
        return None
    news = [
        p
        for p in path.parent.glob(f".{path.name}.tmp-*-*")
        if (m := re.fullmatch(rf"\.{re.escape(path.name)}\.tmp-(\d+)-[0-9a-f]{{8}}", p.name))
        and not process_alive(int(m.group(1)))
        and (p / META).is_file()
    ]
    source = max(news, key=lambda p: p.stat().st_mtime) if news else olds[-1]
    os.replace(source, path)
    return source


def remove_stale_tmp(parent: str | os.PathLike) -> list[Path]:
    """Delete the `.NAME.tmp-PID-*` / `.NAME.old-*` folders that killed writers (not live ones) left in `parent`."""
    removed = []
    for p in Path(parent).glob(".*.*-*"):
        m = re.fullmatch(r"\..+\.(tmp-(\d+)-[0-9a-f]{8}|old-[0-9a-f]{8})", p.name)
        if not m or not p.is_dir():
            continue
        pid = int(m.group(2)) if m.group(2) else None
        if pid is not None and (pid == os.getpid() or process_alive(pid)):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary sibling directory; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_swap(path)  # before the debris goes: an interrupted swap's copies are the only index there is
    remove_stale_tmp(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        try:
            yield tmp
        # a full disk: the path and the cause, not faiss's byte counts or safetensors' traceback
        except Exception as err:
            from rlm.data.store import write_failure

            failure = write_failure(path, err)
            if failure is None:
                raise
            raise failure from err
        old = None
        if path.exists():
            # rename(2) cannot replace a non-empty directory: move the old one aside first
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object, so numpy does not append '.npy' to the name
        np.save(f, np.asarray(array))


def write_dir_contents(
    tmp: Path,
    built: BuiltIndex,
    segments: SegmentTable,
    fingerprint: str,
    embedder: dict[str, Any],
    vectors: np.ndarray,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write an index directory's files into `tmp` (meta.json last); the caller renames `tmp` into place."""
    if len(segments) != built.ntotal:
        raise ValueError(f"segment table has {len(segments)} rows for {built.ntotal} vectors")
    missing = [key for key in EMBEDDER_KEYS if key not in embedder]
    if missing:
        raise ValueError(f"embedder identity lacks {missing}; expected keys {list(EMBEDDER_KEYS)}")
    if built.factory != TORCH:
        faiss.write_index(built.cpu_index(), str(tmp / INDEX))
    _save_npy(tmp / VECTORS, vectors)
    _save_npy(tmp / SEG_DOC, segments.doc)
    _save_npy(tmp / SEG_OFFSET, segments.offset)
    meta = {
        "format_version": FORMAT_VERSION,
        "count": int(built.ntotal),
        "dim": int(built.index.d),
        "metric": "inner_product",
        "normalised": True,
        "factory": built.factory,
        "search_params": built.search_params,
        "tuned_recall": built.tuned_recall,
        "fingerprint": fingerprint,
        "embedder": {key: embedder[key] for key in EMBEDDER_KEYS + (PROJECTION_KEY,) if key in embedder},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "faiss_version": faiss.__version__,
        **(extra or {}),
    }
    (tmp / META).write_text(json.dumps(seal(tmp, meta), indent=2))


def build_index_dir(
    path: str | os.PathLike,
    vectors: np.ndarray,
    segments: SegmentTable,
    fingerprint: str,
    embedder: dict[str, Any],
    config: IndexConfig | None = None,
    extra: dict[str, Any] | None = None,
    rows: np.ndarray | None = None,
    progress: bool = False,
) -> IndexDir:
    """Build an index over `vectors` (row i = segment i of `segments`) and write it as a directory at `path`; rows:
    the corpus-wide segment id of each row, when only part of the corpus is indexed."""
    config = config or IndexConfig()
    built = build_index(vectors, config, progress=progress)
    keep = built.index.vectors if built.factory == TORCH else as_unit_float32(vectors)
    with atomic_dir(path) as tmp:
        if rows is not None:
            if len(rows) != built.ntotal:
                raise ValueError(f"rows has {len(rows)} entries for {built.ntotal} vectors")
            _save_npy(tmp / ROWS, np.asarray(rows, dtype=np.int64))
        write_dir_contents(tmp, built, segments, fingerprint, embedder, keep, extra)
    return load_index_dir(path, gpu=config.gpu)


def read_meta(path: str | os.PathLike, verify: bool | None = None) -> dict[str, Any]:
    """The metadata of a complete index directory, after checking every listed file is there, full size, and
    (``verify``; default: unless RLM_INDEX_VERIFY=0) has the checksum meta.json records."""
    path = Path(path)
    recover_swap(path)
    meta = read_manifest(path, META, "index", IndexNotFoundError)
    # indices written before meta.json had its own checksum still load
    check_sealed(path, meta, META, "index", "rebuild it", IndexNotFoundError, verify, unsealed_ok=True)
    if meta.get("format_version") != FORMAT_VERSION:
        raise IndexNotFoundError(
            f"index at {path} has format {meta.get('format_version')}, expected {FORMAT_VERSION}"
        )
    return meta


def check_identity(
    meta: dict[str, Any], path: Path, expect_fingerprint: str | None, expect_embedder: dict[str, Any] | None
) -> None:
    """Raise IndexMismatchError when the index is from another corpus or embedder than expected."""
    if expect_fingerprint is not None and meta["fingerprint"] != expect_fingerprint:
        raise IndexMismatchError(
            f"index at {path} was built from corpus {meta['fingerprint']!r}, but the current corpus is "
            f"{expect_fingerprint!r}: rebuild it for this data (rlm index build)"
        )
    have = meta["embedder"]
    if expect_embedder and PROJECTION_KEY in expect_embedder:
        got, want = have.get(PROJECTION_KEY), expect_embedder[PROJECTION_KEY]
        if got != want:
            raise IndexMismatchError(
                f"index at {path} holds vectors {_width(got)}, but the search expects vectors {_width(want)} "
                f"(index projection {got!r}, expected {want!r}): searched with another projection its results "
                "mean nothing; rebuild it"
            )
    diff = [
        f"{key}: index has {have.get(key)!r}, expected {want!r}"
        for key, want in (expect_embedder or {}).items()
        if have.get(key) != want
    ]
    if diff:
        raise IndexMismatchError(
            f"index at {path} was built by another embedder ({', '.join(diff)}): its vectors are stale; rebuild it"
        )


def _width(projection: dict[str, Any] | None) -> str:
    if projection is None:
        return "at the embedder's full width"
    return f"projected from {projection['in_dim']} to {projection['dim']} dims"


def load_index_dir(
    path: str | os.PathLike,
    expect_fingerprint: str | None = None,
    expect_embedder: dict[str, Any] | None = None,
    mmap: bool | None = None,
    gpu: bool | None = None,
    verify: bool | None = None,
) -> IndexDir:
    """Load and check an index directory; IndexMismatchError when it is from another corpus or embedder than
    expected (expect_embedder: a subset of the identity). mmap: memory-map the index (None: when larger than
    MMAP_ABOVE); gpu: move it to the GPU (None: when faiss has one and it is not mapped)."""
    path = Path(path)
    meta = read_meta(path, verify)
    check_identity(meta, path, expect_fingerprint, expect_embedder)
    projection = load_projection(path)
    if (projection.identity() if projection else None) != meta["embedder"].get(PROJECTION_KEY):
        raise IndexNotFoundError(
            f"damaged index at {path}: its projection file does not match the projection meta.json records"
        )
    vectors = np.load(path / VECTORS, mmap_mode="r") if (path / VECTORS).exists() else None
    segments = SegmentTable(np.load(path / SEG_DOC, mmap_mode="r"), np.load(path / SEG_OFFSET, mmap_mode="r"))
    if meta["factory"] == TORCH:
        index = TorchExactIndex(vectors)
    else:
        if mmap is None:
            mmap = (path / INDEX).stat().st_size > MMAP_ABOVE
        index = faiss.read_index(str(path / INDEX), faiss.IO_FLAG_MMAP if mmap else 0)
        if (gpu if gpu is not None else gpu_available() and not mmap) and gpu_available():
            index, _ = to_gpu(index)
        set_search_params(index, meta["search_params"])
    return IndexDir(path, meta, index, segments, vectors, projection)
