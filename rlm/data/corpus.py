"""Reading a corpus into a list of documents: the interpreter's stdlib, local files, or Hugging Face datasets.

Every source is read in a deterministic order (sorted paths, dataset row order), so `max_documents`
always picks the same documents and the corpus fingerprint is stable across runs.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

ACCEPTED = "'stdlib', 'hf:NAME' (a Hugging Face dataset name or a saved dataset's path), a file, a directory or a glob"
# Test suites are skipped: they are large, repetitive and full of deliberately odd code.
_STDLIB_SKIP_DIRS = {"test", "tests", "idlelib", "idle_test", "site-packages", "dist-packages"}
_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class Document:
    """One document of the corpus: a stable name (used in the fingerprint) and its text."""

    name: str
    text: str


def stdlib_paths() -> list[Path]:
    """The running interpreter's standard-library .py files, sorted, without test suites or site-packages."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(sysconfig.get_paths()["stdlib"]):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]  # prune: site-packages is huge
        paths += [Path(dirpath, f) for f in filenames if f.endswith(".py") and not f.startswith("test_")]
    return sorted(paths)


def _expand_path(spec: str, extensions: Sequence[str]) -> list[Path]:
    """Files named by one path spec: a file, a directory (recursively, by extension) or a glob."""
    if _GLOB_CHARS.intersection(spec):
        matches = sorted(Path(p) for p in glob.glob(spec, recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise FileNotFoundError(f"corpus glob {spec!r} matched no files; accepted: {ACCEPTED}")
        return files
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        exts = tuple(extensions)
        return sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(exts))
    raise FileNotFoundError(f"corpus path {spec!r} does not exist; accepted: {ACCEPTED}")


def _read_files(
    paths: list[Path], root: Path | None, limit: int | None, progress: bool, warn: bool = True
) -> Iterator[Document]:
    """Read UTF-8 files in order, skipping unreadable ones, stopping after `limit` non-empty documents.

    Names are relative to `root` when given (a directory, or the stdlib), so the corpus fingerprint does
    not depend on where the directory lives or how its path was spelled.
    """
    skipped, kept = 0, 0
    for path in tqdm(paths, desc="reading corpus", unit="file", disable=not progress, leave=False):
        if limit is not None and kept >= limit:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            skipped += 1
            continue
        if text:
            kept += 1
            yield Document(str(path.relative_to(root)) if root else str(path), text)
    if skipped and warn:
        warnings.warn(f"skipped {skipped} unreadable or non-UTF-8 file(s) in the corpus", stacklevel=3)


def is_saved_dataset(name: str) -> bool:
    """Whether ``name`` is a folder written by ``save_to_disk`` (else a hub name or a folder of data files)."""
    marks = ("dataset_info.json", "dataset_dict.json", "state.json")
    return os.path.isdir(name) and any(os.path.isfile(os.path.join(name, m)) for m in marks)


def _load_hf(
    name: str, split: str, config: str | None, text_field: str, limit: int | None
) -> Iterator[Document]:
    """Documents of a Hugging Face dataset: a saved dataset, a local folder of data files, or a hub name."""
    from rlm.extras import require

    datasets = require("datasets", "hf", "an hf: corpus")  # slow import, only when asked for

    if is_saved_dataset(name):
        ds = datasets.load_from_disk(name)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(
                    f"hf_split={split!r} is not in the saved dataset {name!r}; splits: {list(ds)}"
                )
            ds = ds[split]
    else:
        ds = datasets.load_dataset(name, config, split=split)
    if text_field not in ds.column_names:
        raise ValueError(f"text_field={text_field!r} is not a column of {name!r}; columns: {ds.column_names}")
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    for i, text in enumerate(ds[text_field]):
        if text is not None and not isinstance(text, str):
            raise ValueError(
                f"text_field={text_field!r} of {name!r} holds {type(text).__name__} values, not text"
            )
        if text:
            yield Document(f"hf:{name}/{split}/{i}", text)


def read_corpus(
    corpus: str | Sequence[str],
    *,
    extensions: Sequence[str] = (".py", ".txt", ".md"),
    max_documents: int | None = None,
    hf_split: str = "train",
    hf_config: str | None = None,
    text_field: str = "text",
    progress: bool = True,
) -> list[Document]:
    """Read every source of `corpus` in order; empty documents are dropped; at most `max_documents` kept."""
    specs = [corpus] if isinstance(corpus, str) else list(corpus)
    if not specs:
        raise ValueError(f"corpus is an empty list; accepted: {ACCEPTED}")
    docs: list[Document] = []
    for spec in specs:
        left = None if max_documents is None else max_documents - len(docs)
        if left == 0:
            break
        if spec == "stdlib":
            root = Path(sysconfig.get_paths()["stdlib"])
            # the stdlib has a few deliberately non-UTF-8 files: skip them quietly
            docs.extend(_read_files(stdlib_paths(), root, left, progress, warn=False))
        elif spec.startswith("hf:"):
            docs.extend(_load_hf(spec[3:], hf_split, hf_config, text_field, left))
        else:
            is_dir = Path(spec).expanduser().is_dir() and not _GLOB_CHARS.intersection(spec)
            root = Path(spec).expanduser() if is_dir else None
            docs.extend(_read_files(_expand_path(spec, extensions), root, left, progress))
    if not docs:
        raise ValueError(f"corpus {corpus!r} has no non-empty documents; accepted: {ACCEPTED}")
    return docs


def fingerprint(docs: Sequence[Document]) -> str:
    """sha256 over the documents' names and contents, in order."""
    h = hashlib.sha256()
    for doc in docs:
        h.update(doc.name.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
        h.update(doc.text.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()
