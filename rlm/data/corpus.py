"""Reading a corpus into a list of documents: the interpreter's stdlib, local files, or Hugging Face datasets.

Every source is read in a deterministic order (sorted paths, dataset row order), so `max_documents` always picks
the same documents and the fingerprint is stable. Local files are one document each, except the record formats in
READERS (.jsonl, .json, .parquet): one document per row, its ``text_field``; empty or null texts are skipped.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from rlm.extras import require

ACCEPTED = (
    "'stdlib', 'hf:NAME' (a Hugging Face dataset name, a saved dataset's path or a data file's path), a file, "
    "a directory or a glob"
)
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
        files = [p for p in sorted(Path(p) for p in glob.glob(spec, recursive=True)) if p.is_file()]
        if not files:
            raise FileNotFoundError(f"corpus glob {spec!r} matched no files; accepted: {ACCEPTED}")
        return files
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"corpus path {spec!r} does not exist; accepted: {ACCEPTED}")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(tuple(extensions)))
    if files:
        return files
    # none: name the data.extensions it was read with, and the endings the folder does hold
    found = Counter(p.suffix or p.name for p in path.rglob("*") if p.is_file())
    if not found:
        raise ValueError(f"corpus directory {spec!r} holds no files; accepted: {ACCEPTED}")
    listed = ", ".join(f"{ext} ({n})" for ext, n in found.most_common(10))
    raise ValueError(
        f"corpus directory {spec!r} has no files ending in data.extensions={list(extensions)}; it holds {listed}. "
        f"Set data.extensions to the endings to read, e.g. --data.extensions='[{found.most_common(1)[0][0]}]'"
    )


def _json_rows(path: Path) -> Iterator[Any]:
    """The values of a JSON-lines file, one a line (blank lines skipped), or the list a .json file holds (JSON
    lines under a .json name are read as such, as datasets reads them)."""
    if path.suffix.lower() == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            pass
        else:
            if not isinstance(rows, list):
                raise ValueError(
                    f"corpus file {str(path)!r} holds a JSON {type(rows).__name__}; accepted: a list of objects, "
                    "or one object per line"
                )
            yield from rows
            return
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(
                        f"corpus file {str(path)!r} line {line_no} is not JSON ({err}); accepted: one JSON "
                        "object per line"
                    ) from err


def _json_texts(path: Path, text_field: str) -> Iterator[Any]:
    """`text_field` of each row of a .jsonl/.json file; rows are objects, the first must hold the field."""
    missing = 0
    for i, row in enumerate(_json_rows(path)):
        if not isinstance(row, dict):
            raise ValueError(
                f"row {i} of corpus file {str(path)!r} is a JSON {type(row).__name__}; accepted: objects "
                f"with a {text_field!r} field"
            )
        if text_field not in row:
            if i == 0:  # a wrong field name: say so at once rather than skip every row
                raise ValueError(
                    f"text_field={text_field!r} is not a field of corpus file {str(path)!r} (row 0); its "
                    f"fields: {list(row)}. Set data.text_field to one of them"
                )
            missing += 1
        yield row.get(text_field)
    if missing:
        warnings.warn(
            f"skipped {missing} row(s) of {str(path)!r} without a {text_field!r} field", stacklevel=4
        )


def _parquet_texts(path: Path, text_field: str) -> Iterator[Any]:
    """The `text_field` column of a parquet file, in row order, read in batches (only that column)."""
    pq = require("pyarrow.parquet", "hf", "a .parquet corpus file")
    file = pq.ParquetFile(path)
    if text_field not in file.schema_arrow.names:
        raise ValueError(
            f"text_field={text_field!r} is not a column of corpus file {str(path)!r}; its columns: "
            f"{file.schema_arrow.names}. Set data.text_field to one of them"
        )
    for batch in file.iter_batches(batch_size=4096, columns=[text_field]):
        yield from batch.column(0).to_pylist()


# Record formats, by file ending: a reader yields each row's `text_field` value (None where it is missing).
READERS = {".jsonl": _json_texts, ".json": _json_texts, ".parquet": _parquet_texts}


def _read_files(
    paths: list[Path],
    root: Path | None,
    limit: int | None,
    progress: bool,
    warn: bool = True,
    text_field: str = "text",
) -> Iterator[Document]:
    """Read UTF-8 files in order, skipping unreadable ones, stopping after `limit` non-empty documents. Names are
    relative to `root` when given, so the fingerprint does not depend on where the directory lives. A malformed
    record file (READERS) is an error, not skipped: its rows were asked for by field."""
    skipped, kept = 0, 0
    for path in tqdm(paths, desc="reading corpus", unit="file", disable=not progress, leave=False):
        if limit is not None and kept >= limit:
            break
        name = str(path.relative_to(root)) if root else str(path)
        if path.suffix.lower() in READERS:  # a document per row, named NAME/ROW
            try:
                for i, text in enumerate(READERS[path.suffix.lower()](path, text_field)):
                    if text is not None and not isinstance(text, str):
                        raise ValueError(
                            f"text_field={text_field!r} of corpus file {str(path)!r} row {i} is "
                            f"{type(text).__name__}, not text; set data.text_field to a text field"
                        )
                    if text and limit is not None and kept >= limit:
                        break
                    if text:
                        kept += 1
                        yield Document(f"{name}/{i}", text)
            except UnicodeDecodeError as err:
                raise ValueError(f"corpus file {str(path)!r} is not UTF-8 ({err})") from err
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            skipped += 1
            continue
        if text:
            kept += 1
            yield Document(name, text)
    if skipped and warn:
        warnings.warn(f"skipped {skipped} unreadable or non-UTF-8 file(s) in the corpus", stacklevel=3)


# datasets' builder for a single data file given as hf:PATH (load_dataset(PATH) takes folders and hub names only)
_HF_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow",
                ".txt": "text"}  # fmt: skip


def hf_dataset(name: str, split: str, config: str | None, streaming: bool = False) -> Any:
    """The ``split`` of an hf: source: a dataset saved with save_to_disk, a local data file, a local folder of
    data files, or a hub name; an IterableDataset when ``streaming``."""
    datasets = require("datasets", "hf", "an hf: corpus")  # slow import, only when asked for
    marks = ("dataset_info.json", "dataset_dict.json", "state.json")  # a folder written by save_to_disk
    if os.path.isdir(name) and any(os.path.isfile(os.path.join(name, m)) for m in marks):
        ds = datasets.load_from_disk(name)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(
                    f"hf_split={split!r} is not in the saved dataset {name!r}; splits: {list(ds)}"
                )
            ds = ds[split]
        return ds.to_iterable_dataset() if streaming else ds
    if os.path.isfile(name):  # the file is the split
        builder = _HF_BUILDERS.get(Path(name).suffix.lower())
        if builder is None:
            raise ValueError(
                f"hf:{name} is a file datasets cannot read by its ending; accepted: {list(_HF_BUILDERS)}"
            )
        with open(name, "rb") as f:  # read in chunks: a data file may be large
            blank = not any(chunk.strip() for chunk in iter(lambda: f.read(1 << 16), b""))
        if blank:  # datasets fails on it with StopIteration or "corresponds to no data"
            raise ValueError(f"hf:{name} is empty; accepted: a {builder} data file with at least one row")
        try:
            return datasets.load_dataset(builder, data_files={split: name}, split=split, streaming=streaming)
        except datasets.exceptions.DatasetGenerationError as err:
            raise _data_file_error(name, builder, err) from err
    return datasets.load_dataset(name, config, split=split, streaming=streaming)


def json_file_problem(path: Path) -> ValueError | None:
    """The error naming the first malformed line of a .json/.jsonl file (as rlm reads them); None if none is."""
    try:
        for _ in _json_rows(path):
            pass
    except ValueError as err:
        return err
    return None


def _data_file_error(name: str, builder: str, err: Exception) -> ValueError:
    """datasets' failure to read the local data file ``name`` as an error naming the file: for JSON, the first
    bad line (datasets' own message counts rows within a block, not lines of the file); else datasets' reason."""
    if builder == "json" and (located := json_file_problem(Path(name))):
        return located
    reason = str(err.__cause__ or err).strip()
    return ValueError(f"hf:{name} cannot be read as {builder} data: {reason}")


def named_read_errors(name: str, rows: Iterable[Any]) -> Iterator[Any]:
    """The rows of a streamed hf: source; a local data file that datasets fails to parse midway (it raises
    pyarrow's or pandas' ValueErrors then) is named in the error."""
    builder = _HF_BUILDERS.get(Path(name).suffix.lower()) if os.path.isfile(name) else None
    try:
        yield from rows
    except ValueError as err:
        if builder is None:
            raise
        raise _data_file_error(name, builder, err) from err


def _load_hf(
    name: str, split: str, config: str | None, text_field: str, limit: int | None
) -> Iterator[Document]:
    """Documents of a Hugging Face dataset (see hf_dataset), in row order."""
    ds = hf_dataset(name, split, config)
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
            files = _expand_path(spec, extensions)
            docs.extend(_read_files(files, root, left, progress, text_field=text_field))
    if not docs:
        raise ValueError(f"corpus {corpus!r} has no non-empty documents; accepted: {ACCEPTED}")
    return docs


def fingerprint(docs: Sequence[Document]) -> str:
    """sha256 over the documents' names and contents, in order."""
    h = hashlib.sha256()
    for doc in docs:
        for part in (doc.name, doc.text):
            h.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()
