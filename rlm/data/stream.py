"""Streaming ``hf:`` corpora into the token cache without holding them in memory (``data.streaming: true``).

Two passes: one trains the tokenizer on the training documents, one encodes every document into shards of about
SHARD_TOKENS tokens, each published before the next (a stopped build resumes after the last), then copied into
store.py's layout. Unlike the in-memory build, the key describes the source (its content is unknown until read),
a seeded hash of a document's index holds it out (the count is unknown in advance), and nothing is deduplicated.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from rlm.data.corpus import Document, hf_dataset, named_read_errors
from rlm.data.pretrained import TRAIN, open_cached
from rlm.data.store import (
    _ENCODE_BATCH,
    FORMAT_VERSION,
    CacheKey,
    framed,
    make_tokenizer,
    new_entry,
    token_dtype,
)

SHARD_TOKENS = 1 << 24  # tokens per shard: the most the build holds in memory at once


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
