"""The tokenized corpus on disk: one token array (memory-mapped), document offsets, the split, the tokenizer.

Layout of one cache entry, `<cache_dir>/<key digest>/`:
  tokenizer.model   sentencepiece model trained on the training documents only (or a copy of data.tokenizer's;
                    a Hugging Face tokenizer is copied to hf_tokenizer/ instead)
  tokens.npy        every document as [bos] + ids + [eos], concatenated; uint16 (uint32 above 65535 ids)
  doc_offsets.npy   int64 (n_docs + 1,): document d is tokens[doc_offsets[d]:doc_offsets[d + 1]]
  train_docs.npy, val_docs.npy, test_docs.npy   int64 document ids, sorted, disjoint (test_docs.npy may be absent:
                  an empty test split)
  removed_docs.npy  int64 document ids, sorted: near-duplicates of a kept document, in no split (still encoded, so
                  ids stay those of the corpus); absent when dedup_threshold is None
  meta.json         the key and the documents' names (a streamed corpus: a name prefix and the count)
The entry is built in a temporary directory and renamed into place, so a reader never sees half of it.

A streamed ``hf:`` corpus (``data.streaming: true``) is never held in memory: one pass trains the tokenizer, one
encodes every document into shards of about SHARD_TOKENS tokens, each published before the next (a stopped build
resumes after the last), then copied into this layout. Its key describes the source (its content is unknown until
read), a seeded hash of a document's index holds it out (the count is unknown in advance); nothing is deduplicated.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from rlm.data.corpus import Document, hf_dataset, named_read_errors
from rlm.data.dedup import removed_documents
from rlm.data.pretrained import TRAIN, HFTokenizer, copy_tokenizer, open_cached
from rlm.data.tokenizer import Tokenizer

FORMAT_VERSION = 1
_ENCODE_BATCH = 64  # documents per sentencepiece call: big enough for its threads, small for a smooth bar
SHARD_TOKENS = 1 << 24  # tokens per shard of a streamed build: the most it holds in memory at once


@dataclass(frozen=True)
class CacheKey:
    """Everything the tokenizer and the token cache depend on."""

    corpus: str  # sha256 of the documents' names and contents
    vocab_size: int  # requested sentencepiece vocabulary size
    model_type: str  # sentencepiece model type
    seed: int  # seed of the document split and the tokenizer trainer
    val_fraction: float  # fraction of documents held out (the tokenizer never sees them)
    max_tokenizer_chars: int  # characters of training text the tokenizer trainer sees
    test_fraction: float = 0.0  # fraction held out for the test split (the tokenizer never sees them)
    tokenizer: str = TRAIN  # 'train', or the digest of the files of the tokenizer data.tokenizer names
    dedup_threshold: float | None = None  # shingle Jaccard of near-duplicates removed before the split

    def digest(self) -> str:
        """A short, stable name for this key (fields at their _OPTIONAL default are left out, so an entry keeps its
        name when a field is added)."""
        fields = {k: v for k, v in asdict(self).items() if not (k in _OPTIONAL and v == _OPTIONAL[k])}
        payload = json.dumps({"format": FORMAT_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:20]


# None here, not the data module's default (0.8): an entry built without deduplication keeps its name, and a
# module at the default asks for another entry instead of silently reusing it.
_OPTIONAL = {"test_fraction": 0.0, "tokenizer": TRAIN, "dedup_threshold": None}


def split_train_val_test(
    n_docs: int, val_fraction: float, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted (train, val, test) document ids from one seeded permutation: the first round(val_fraction * n)
    are validation, the next round(test_fraction * n) test, the rest training. A nonzero fraction holds out
    at least one document while at least one stays for training."""
    n_val, n_test = round(val_fraction * n_docs), round(test_fraction * n_docs)
    if val_fraction > 0 and n_docs > 1:
        n_val = min(max(n_val, 1), n_docs - 1)  # keep at least one document on each side
    if test_fraction > 0 and n_docs - n_val > 1:
        n_test = min(max(n_test, 1), n_docs - n_val - 1)
    else:
        n_test = min(n_test, max(n_docs - n_val - 1, 0))
    perm = np.random.default_rng(seed).permutation(n_docs)
    parts = perm[n_val + n_test :], perm[:n_val], perm[n_val : n_val + n_test]
    return tuple(np.sort(p).astype(np.int64) for p in parts)  # type: ignore[return-value]


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """The smallest unsigned type that holds every id."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def framed(tok: Tokenizer | HFTokenizer, texts: list[str], dtype: type) -> list[np.ndarray]:
    """Each text's tokens as [bos] + ids + [eos]."""
    return [np.array([tok.bos_id, *ids, tok.eos_id], dtype=dtype) for ids in tok.encode_batch(texts)]


_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES}


def write_failure(path: str | os.PathLike[str], err: BaseException) -> OSError | None:
    """An OSError naming ``path``, its cause and the free space, for a failed write (numpy's bare "N requested and
    M written", faiss's short-write RuntimeError, ENOSPC, Rust's "(os error 28)"); None for other errors."""
    text = str(err)
    rust = re.search(r"\(os error (\d+)\)", text)
    if rust and not isinstance(err, OSError):
        err = OSError(int(rust.group(1)), os.strerror(int(rust.group(1))))
    if isinstance(err, OSError):
        if err.errno not in _WRITE_ERRNOS and "written" not in text:
            return None  # e.g. a missing input file: not a write failure
    elif not isinstance(err, RuntimeError) or not any(w in text for w in ("write", "written", "space")):
        return None
    parent = Path(path).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        free = f"{shutil.disk_usage(parent).free / 2**20:,.0f} MiB free there"
    except OSError:
        free = "free space unknown"
    reason = err.strerror if isinstance(err, OSError) and err.strerror else text
    return OSError(f"cannot write {str(path)!r}: {reason} ({free}; a full disk or an unwritable folder)")


@contextlib.contextmanager
def new_entry(root: Path) -> Iterator[Path]:
    """A temporary folder to fill, renamed to ``root`` at the end of the block (a concurrent builder's folder,
    published first, is kept: a folder appears at ``root`` only whole); a failed write is named with the free
    space."""
    tmp = root.parent / f".{root.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        try:
            os.replace(tmp, root)
        except OSError:
            if not root.is_dir():  # not a concurrent builder that won the race: a real failure
                raise
    except (OSError, RuntimeError) as err:
        failure = write_failure(root, err)
        if failure is None:
            raise
        raise failure from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_store(
    root: Path, docs: Sequence[Document], key: CacheKey, progress: bool = True, tokenizer: str = TRAIN
) -> None:
    """Remove near-duplicates (``key.dedup_threshold``), split the rest, train the tokenizer on the training
    documents (or copy ``tokenizer``), encode everything; publish atomically at `root`."""
    with new_entry(root) as tmp:
        removed = None
        if key.dedup_threshold is not None:
            removed = removed_documents([d.text for d in docs], key.dedup_threshold, progress=progress)
            if progress:
                tqdm.write(f"removed {len(removed)} of {len(docs)} documents as near-duplicates "
                           f"(shingle Jaccard >= {key.dedup_threshold})")  # fmt: skip
        # the seeded split of the kept documents, mapped back to corpus ids
        kept = np.setdiff1d(np.arange(len(docs), dtype=np.int64), removed if removed is not None else [])
        parts = split_train_val_test(len(kept), key.val_fraction, key.test_fraction, key.seed)
        train, val, test = (kept[p] for p in parts)
        tok = make_tokenizer(tmp, key, (docs[i].text for i in train), len(train), tokenizer, progress)
        pieces = []
        with tqdm(
            total=len(docs), desc="encoding corpus", unit="doc", disable=not progress, leave=False
        ) as bar:
            for first in range(0, len(docs), _ENCODE_BATCH):
                batch = [d.text for d in docs[first : first + _ENCODE_BATCH]]
                pieces += framed(tok, batch, token_dtype(tok.vocab_size))
                bar.update(len(batch))
        offsets = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in pieces], out=offsets[1:])
        arrays = {"tokens": np.concatenate(pieces), "doc_offsets": offsets, "train_docs": train,
                  "val_docs": val, "test_docs": test, "removed_docs": removed}  # fmt: skip
        for name, array in arrays.items():
            if array is not None:
                np.save(tmp / f"{name}.npy", array)
        meta = {"format": FORMAT_VERSION, "key": asdict(key), "names": [d.name for d in docs]}
        if removed is not None:
            meta.update(near_duplicates_removed=len(removed), dedup_threshold=key.dedup_threshold)
        (tmp / "meta.json").write_text(json.dumps(meta))


def make_tokenizer(
    folder: Path, key: CacheKey, texts: Iterable[str], n_train: int | None, tokenizer: str, progress: bool
) -> Tokenizer | HFTokenizer:
    """The entry's tokenizer in ``folder``: trained on ``texts`` (training documents) or copied from ``tokenizer``."""
    if tokenizer != TRAIN:
        return copy_tokenizer(tokenizer, folder)
    if progress:
        docs = f"{n_train} documents" if n_train is not None else "the streamed training documents"
        tqdm.write(f"training a {key.model_type} tokenizer (vocab {key.vocab_size}) on {docs}")
    return Tokenizer.train(
        texts,
        folder / "tokenizer.model",
        vocab_size=key.vocab_size,
        model_type=key.model_type,
        max_chars=key.max_tokenizer_chars,
        seed=key.seed,
    )


def stream_key(
    specs: Sequence[str], split: str, config: str | None, text_field: str, limit: int | None
) -> str:
    """The cache key's corpus field for a streamed source: a digest of its description."""
    names = [os.path.abspath(s[3:]) if os.path.exists(s[3:]) else s[3:] for s in specs]
    desc = {"stream": names, "split": split, "config": config, "text_field": text_field, "limit": limit}
    return "stream:" + hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def stream_documents(
    specs: Sequence[str], split: str, config: str | None, text_field: str, limit: int | None
) -> Iterator[Document]:
    """The documents of ``hf:`` sources, in order, read lazily; empty texts are skipped; at most ``limit``."""
    docs = itertools.chain.from_iterable(_stream_one(s[3:], split, config, text_field) for s in specs)
    return itertools.islice(docs, limit)


def _stream_one(name: str, split: str, config: str | None, text_field: str) -> Iterator[Document]:
    """The documents of one hf: source, streamed; empty texts are skipped."""
    ds = hf_dataset(name, split, config, streaming=True)
    for i, row in enumerate(named_read_errors(name, ds)):
        if text_field not in row:
            raise ValueError(f"text_field={text_field!r} is not a column of {name!r}; columns: {list(row)}")
        text = row[text_field]
        if text is not None and not isinstance(text, str):
            raise ValueError(
                f"text_field={text_field!r} of {name!r} row {i} is {type(text).__name__}, not text"
            )
        if text:
            yield Document(f"hf:{name}/{split}/{i}", text)


def held_out(seed: int, index: int, val_fraction: float) -> bool:
    """Whether document ``index`` is a validation document: a seeded hash, uniform in [0, 1), < val_fraction."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < val_fraction


def build_stream_store(
    root: Path,
    documents: Callable[[], Iterator[Document]],
    key: CacheKey,
    name_prefix: str,
    tokenizer: str = TRAIN,
    progress: bool = True,
) -> None:
    """Tokenizer, shards, then the cache entry at ``root``; ``documents()`` starts the stream afresh."""
    work = root.parent / f".{root.name}.stream"  # kept until the entry is published: a rerun resumes here
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "tok").is_dir():
        with new_entry(work / "tok") as tmp:
            train_texts = (
                d.text for i, d in enumerate(documents()) if not held_out(key.seed, i, key.val_fraction)
            )
            make_tokenizer(tmp, key, train_texts, None, tokenizer, progress)
    tok = open_cached(work / "tok")
    shards = sorted(work.glob("shard_*.npz"))
    done = sum(len(np.load(s)["lengths"]) for s in shards)
    dtype = token_dtype(tok.vocab_size)
    pieces: list[np.ndarray] = []

    def flush() -> None:
        path = work / f"shard_{len(shards):06d}.npz"
        tmp = work / f".shard.tmp{os.getpid()}.npz"
        lengths = np.array([len(p) for p in pieces], dtype=np.int64)
        np.savez(tmp, tokens=np.concatenate(pieces), lengths=lengths)
        os.replace(tmp, path)
        shards.append(path)
        pieces.clear()

    # resume: skip what the shards hold (read, not encoded)
    stream = itertools.islice(documents(), done, None)
    n_tokens = 0
    with tqdm(desc="encoding stream", unit="doc", initial=done, disable=not progress, leave=False) as bar:
        while batch := list(itertools.islice(stream, _ENCODE_BATCH)):
            for piece in framed(tok, [d.text for d in batch], dtype):
                pieces.append(piece)
                n_tokens += len(piece)
                if n_tokens >= SHARD_TOKENS:
                    flush()
                    n_tokens = 0
            bar.update(len(batch))
    if pieces:
        flush()
    # the shards copied into one memory-mapped tokens.npy, published atomically
    lengths = np.concatenate([np.load(s)["lengths"] for s in shards]) if shards else np.zeros(0, np.int64)
    n = len(lengths)
    if n == 0:
        raise ValueError("the streamed corpus has no non-empty documents")
    val = np.array([held_out(key.seed, i, key.val_fraction) for i in range(n)])
    if key.val_fraction > 0 and n > 1 and not val.any():
        # at least one document on each side, as the in-memory split (the tokenizer was trained on this one)
        val[-1] = True
    if val.all():
        val[0] = False
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    with new_entry(root) as tmp:
        tokens = np.lib.format.open_memmap(
            tmp / "tokens.npy", mode="w+", dtype=dtype, shape=(int(offsets[-1]),)
        )
        at = 0
        for s in shards:
            part = np.load(s)["tokens"]
            tokens[at : at + len(part)] = part
            at += len(part)
        tokens.flush()
        del tokens
        np.save(tmp / "doc_offsets.npy", offsets)
        np.save(tmp / "train_docs.npy", np.flatnonzero(~val).astype(np.int64))
        np.save(tmp / "val_docs.npy", np.flatnonzero(val).astype(np.int64))
        shutil.copytree(work / "tok", tmp, dirs_exist_ok=True)
        meta = {"format": FORMAT_VERSION, "key": asdict(key), "name_prefix": name_prefix, "n_docs": n}
        (tmp / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(work, ignore_errors=True)


def _load_or_empty(path: Path) -> np.ndarray:
    return np.load(path) if path.is_file() else np.zeros(0, dtype=np.int64)


class TokenStore:
    """A built cache entry, memory-mapped; pickles as its path (cheap to send to loader workers)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.tokens: np.ndarray = np.load(self.root / "tokens.npy", mmap_mode="r")  # all documents, in order
        self.doc_offsets: np.ndarray = np.load(self.root / "doc_offsets.npy")  # (n_docs + 1,) int64
        self.train_docs: np.ndarray = np.load(self.root / "train_docs.npy")  # sorted document ids, as below
        self.val_docs: np.ndarray = np.load(self.root / "val_docs.npy")
        self.test_docs = _load_or_empty(self.root / "test_docs.npy")
        self.removed_docs = _load_or_empty(self.root / "removed_docs.npy")  # near-duplicates, in no split
        self.tokenizer = open_cached(self.root)
        meta = json.loads((self.root / "meta.json").read_text())
        self.names: Sequence[str] = (
            meta["names"] if "names" in meta else _Names(meta["name_prefix"], meta["n_docs"])
        )
        # Refuse an entry whose arrays disagree (a damaged or foreign cache), naming what to delete.
        n = len(self.names)
        problems = [
            meta.get("format") != FORMAT_VERSION and f"format {meta.get('format')} != {FORMAT_VERSION}",
            len(self.doc_offsets) != n + 1 and f"{len(self.doc_offsets)} offsets for {n} documents",
            self.doc_offsets[-1] != len(self.tokens)
            and f"offsets end at {self.doc_offsets[-1]}, not {len(self.tokens)}",
            len(self.train_docs) + len(self.val_docs) + len(self.test_docs) + len(self.removed_docs) != n
            and "the split and the removed near-duplicates do not cover every document",
        ]
        if any(problems):
            raise ValueError(
                f"token cache {self.root} is inconsistent ({'; '.join(p for p in problems if p)}): delete it to "
                "rebuild"
            )

    def __getstate__(self) -> dict[str, str]:
        return {"root": str(self.root)}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["root"])

    @staticmethod
    def exists(root: str | os.PathLike[str]) -> bool:
        """Whether a complete entry is at `root` (meta.json is written last, inside the atomic rename)."""
        return (Path(root) / "meta.json").is_file()

    @property
    def n_docs(self) -> int:
        return len(self.doc_offsets) - 1

    @property
    def doc_lengths(self) -> np.ndarray:
        """(n_docs,) tokens per document, bos and eos included."""
        return np.diff(self.doc_offsets)

    def doc_tokens(self, doc: int) -> np.ndarray:
        """Tokens of one document, [bos] + ids + [eos]."""
        return self.tokens[self.doc_offsets[doc] : self.doc_offsets[doc + 1]]


class _Names(Sequence[str]):
    """The names of a streamed corpus's documents, PREFIX + index, without a list of millions of strings."""

    def __init__(self, prefix: str, n: int) -> None:
        self.prefix, self.n = prefix, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        return f"{self.prefix}{range(self.n)[i]}"  # IndexError past either end
