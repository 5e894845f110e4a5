"""kNN-LM datastores (Khandelwal et al. 2020): one entry per token of a collection, the key the LM's context
state at position t, the value the token at t + 1; built from a checkpoint, tied to its weights.

A directory holds index.faiss (or, built with ``shard_keys``, index-000.faiss, ...: runs of whole documents added
to copies of one trained index, their offsets in meta.json's "shards"), values.npy, docs.npy (each document's
entry range) and meta.json (the checkpoint's fingerprint, the tuned parameters, every file's sha256).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from rlm.checksums import META_SHA, check_sealed, meta_digest, read_manifest, seal
from rlm.data.module import RLMDataModule
from rlm.data.store import TokenStore
from rlm.data.windows import IGNORE_INDEX, Windows, eval_loader
from rlm.eval.evaluate import windows_of

LAYERS = ("final", "ffn_input", "attn_input")
"""Where keys are read: the LM head's input, the last block's normed FFN input (kNN-LM's best, its table 5), or
the last block's normed attention input (the query of the knn_attention plugin)."""
FORMAT = 2  # meta.json's format: it holds its files' checksums and its own
META = "meta.json"
WHAT = "kNN-LM datastore"
REBUILD = "rebuild it with `rlm knnlm build --ckpt CKPT --out DIR`"


def model_fingerprint(module: Any) -> str:
    """sha256 over the model's weights (names, shapes, dtypes and bytes): the identity a datastore is tied to."""
    h = hashlib.sha256()
    for name, t in sorted(module.model.state_dict().items()):
        if not isinstance(t, torch.Tensor):  # a plugin's extra state (the retriever's index path)
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # 0-dim too
    return h.hexdigest()[:24]


@contextlib.contextmanager
def reading_keys(module: Any, layer: str) -> Iterator[dict[str, torch.Tensor]]:
    """Yield a dict whose 'keys' is set, at every forward, to the chosen layer's states (B, T, d)."""
    if layer not in LAYERS:
        raise ValueError(f"key layer {layer!r}; accepted: {list(LAYERS)}")
    model = module.model
    target = {
        "final": model.norm,
        "ffn_input": model.blocks[-1].ffn_norm,
        "attn_input": model.blocks[-1].attn_norm,
    }[layer]
    out: dict[str, torch.Tensor] = {}
    handle = target.register_forward_hook(lambda _mod, _inp, output: out.update(keys=output.detach()))
    try:
        yield out
    finally:
        handle.remove()


def read_datastore_meta(path: str | os.PathLike[str], verify: bool | None = None) -> dict[str, Any]:
    """``path``'s meta.json, checked against its files (checksums unless ``verify`` False or RLM_INDEX_VERIFY=0)."""
    path = Path(path)
    if not (path / META).is_file():
        raise FileNotFoundError(f"no {WHAT} at {path} ({META} missing); build one with "
                                "`rlm knnlm build --ckpt CKPT --out DIR`")  # fmt: skip
    meta = read_manifest(path, META, WHAT, ValueError)
    if "embedder" in meta and "format_version" in meta:  # rlm.index.store's meta.json
        raise ValueError(f"{path} is a retrieval index (rlm index build), not a {WHAT}: "
                         f"`rlm index info {path}` reads it")  # fmt: skip
    if meta.get("format") != FORMAT:
        raise ValueError(f"{WHAT} at {path}: {META} says format {meta.get('format')!r}, this rlm reads {FORMAT} "
                         f"(not a datastore, or one from another rlm); {REBUILD}")  # fmt: skip
    check_sealed(path, meta, META, WHAT, REBUILD, ValueError, verify)
    return meta


def doc_hash(tokens: np.ndarray) -> str:
    """A document's identity by its tokens (a copy of a datastore document is excluded as the document is)."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int64).tobytes()).hexdigest()[:24]


class Datastore:
    """A built datastore directory (either layout)."""

    def __init__(self, path: str | os.PathLike[str], verify: bool | None = None) -> None:
        self.path = Path(path)
        self.meta: dict[str, Any] = read_datastore_meta(self.path, verify)
        shards = self.meta.get("shards") or [{"file": "index.faiss", "offset": 0}]
        self.indexes = [self._read_index(sh["file"]) for sh in shards]
        self.offsets = [int(sh["offset"]) for sh in shards]  # each shard's first global entry id
        self.values = np.load(self.path / "values.npy", mmap_mode="r")  # (N,) int32 next tokens
        docs = np.load(self.path / "docs.npy")  # (D, 2) int64 [lo, hi) entry range of each document
        self.ranges = {h: (int(lo), int(hi)) for h, (lo, hi) in zip(self.meta["doc_hashes"], docs)}
        self.doc_ids = {int(d): self.ranges[h] for d, h in zip(self.meta["doc_ids"], self.meta["doc_hashes"])}
        self._hashes: dict[tuple[str, int], str] = {}  # (cache entry, document) -> its doc_hash
        ends = [o + int(ix.ntotal) for o, ix in zip(self.offsets, self.indexes)]
        if self.offsets != [0, *ends[:-1]] or ends[-1] != len(self.values):
            raise ValueError(f"datastore {self.path}: its index shards hold entries {list(zip(self.offsets, ends))}, "
                             f"not the {len(self.values)} values in order")  # fmt: skip

    def _read_index(self, name: str) -> Any:
        """One index file; a damaged one (checksums skipped) is an error naming it."""
        from rlm.index._faiss import faiss

        try:
            return faiss.read_index(str(self.path / name))
        except RuntimeError as err:  # faiss's message is its source line and the failed read
            cause = str(err).strip().splitlines()[0]
            raise ValueError(
                f"damaged {WHAT} at {self.path}: faiss cannot read {name} ({cause}); {REBUILD}"
            ) from None

    def check_model(self, module: Any) -> None:
        """Refuse a model other than the one whose states the keys are."""
        fp = model_fingerprint(module)
        if fp != self.meta["fingerprint"]:
            raise ValueError(
                f"datastore {self.path} was built from the states of another model (fingerprint "
                f"{self.meta['fingerprint']}, checkpoint {self.meta['checkpoint']!r}); this model's is {fp}. "
                "Keys are a model's own states: build a datastore from this checkpoint"
            )

    def exclusion(self, store_root: str, doc: int, tokens: np.ndarray) -> tuple[int, int] | None:
        """The entry range a query of this document must not see: the same document of the same cache entry, or
        a document with the same tokens (a copy)."""
        if store_root == self.meta["store"] and doc in self.doc_ids:
            return self.doc_ids[doc]
        key = (store_root, doc)
        if key not in self._hashes:  # once per document, not once per window
            self._hashes[key] = doc_hash(tokens)
        return self.ranges.get(self._hashes[key])

    def search(
        self, queries: np.ndarray, k: int, exclude: tuple[int, int] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(squared distances (Q, k), values (Q, k), -1 where none) of float32 queries."""
        from rlm.index.knn import search_l2

        params = self.meta.get("search_params") or {}
        if len(self.indexes) == 1:
            d, ids = search_l2(self.indexes[0], queries, k, exclude, params)
        else:
            d, ids = self._search_shards(queries, k, exclude, params)
        vals = np.where(ids >= 0, np.asarray(self.values)[np.maximum(ids, 0)], -1)
        return np.where(ids >= 0, d, np.inf).astype(np.float32), vals

    def _search_shards(
        self, queries: np.ndarray, k: int, exclude: tuple[int, int] | None, params: dict[str, Any]
    ) -> tuple[np.ndarray, np.ndarray]:
        """(distances, global ids) of the k nearest: each shard's top-k merged by distance (ties by entry id)."""
        from rlm.index.knn import search_l2

        ds, ids = [], []
        for off, index in zip(self.offsets, self.indexes):
            local = None
            if exclude is not None:
                lo, hi = max(exclude[0] - off, 0), min(exclude[1] - off, int(index.ntotal))
                local = (lo, hi) if lo < hi else None
            d, i = search_l2(index, queries, k, local, params)
            ds.append(np.where(i >= 0, d, np.inf))
            ids.append(np.where(i >= 0, i + off, -1))
        d, i = np.concatenate(ds, 1), np.concatenate(ids, 1)  # (Q, shards * k)
        order = np.lexsort((np.where(i >= 0, i, np.iinfo(np.int64).max), d), axis=1)[:, :k]
        return np.take_along_axis(d, order, 1), np.take_along_axis(i, order, 1)


LOG_EVERY = 30.0  # seconds between the plain progress lines printed when stderr is not a terminal


class Progress:
    """A tqdm bar on a terminal; elsewhere (a log file) a stderr line every ``LOG_EVERY`` seconds and at the end."""

    def __init__(self, desc: str, total: int, unit: str, enabled: bool = True) -> None:
        self.desc, self.total, self.unit, self.done = desc, total, unit, 0
        self.start = self.last = time.perf_counter()
        self.enabled = enabled
        tty = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=desc, unit=unit, disable=not tty)
        self.lines = enabled and not tty

    def update(self, n: int) -> None:
        """Count n more done."""
        self.bar.update(n)
        self.done += n
        now = time.perf_counter()
        if not self.lines or (now - self.last < LOG_EVERY and self.done < self.total):
            return
        self.last = now
        rate = self.done / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate else float("inf")
        print(f"{self.desc}: {self.done:,}/{self.total:,} {self.unit} ({self.done / max(self.total, 1):.0%}), "
              f"{rate:,.0f} {self.unit}/s, {now - self.start:,.0f} s elapsed, ETA {eta:,.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip

    def note(self, message: str) -> None:
        """A line about this phase, above the bar on a terminal."""
        if self.enabled:
            tqdm.write(f"{self.desc}: {message}", file=sys.stderr)

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()


def window_targets(windows: Any) -> int:
    """Targets (keys) of all ``windows``: each window's min(T, what is left of its document after its start)."""
    left = np.diff(windows.doc_offsets)[windows.doc] - 1 - windows.start  # (W,)
    return int(np.minimum(left, windows.seq_len).sum())


def phase(progress: bool, message: str) -> None:
    """A line on stderr about a build phase that has no bar of its own (faiss's training)."""
    if progress:
        print(f"rlm knnlm: {message}", file=sys.stderr, flush=True)


def entries(
    module: Any, windows: Any, batch_size: int, layer: str, progress: bool, desc: str = "datastore keys"
) -> Iterator[tuple]:
    """(keys (n, d) float16, values (n,), doc) of every window, in order (no LM head runs).

    On a CPU the first batches alternate one thread and torch's thread count and the faster is kept: on a shared
    machine a parallel region waits for its slowest thread. The keys are the same either way."""
    threads = torch.get_num_threads()
    counts = (1, threads) if module.device.type == "cpu" and threads > 1 else (threads,)
    times: dict[int, list[float]] = {n: [] for n in counts}
    trial = 3 * len(counts)  # batches timed, 3 per thread count; fewer once one count is clearly faster
    loader = eval_loader(windows, batch_size)
    bar = Progress(desc, window_targets(windows), "keys", progress)
    try:
        with reading_keys(module, layer) as hooked, torch.inference_mode():
            module.eval()
            for i, batch in enumerate(loader):
                trying = counts[i % len(counts)] if i < trial else None
                if trying is not None:
                    torch.set_num_threads(trying)
                start = time.perf_counter()
                batch = {key: v.to(module.device) for key, v in batch.items()}
                ctx = module.make_context(batch, "test", segments=windows.segments)
                module.model.hidden(batch["tokens"], ctx)
                keys = hooked["keys"].to(torch.float16).cpu().numpy()  # (B, T, d)
                targets = batch["targets"].cpu().numpy()  # (B, T)
                if trying is not None:
                    times[trying].append(time.perf_counter() - start)
                    best, *rest = sorted(counts, key=lambda n: statistics.median(times[n] or [math.inf]))
                    # twice as fast in every batch so far: the rest of the trial would only cost time
                    clear = bool(rest) and all(times.values()) and 2 * max(times[best]) < min(times[rest[0]])
                    if clear or i == trial - 1 or i == len(loader) - 1:
                        trial = i + 1
                        torch.set_num_threads(best)
                        each = statistics.median(times[best])
                        bar.note(f"about {each * len(loader):,.0f} s for {len(loader):,} batches of {batch_size} "
                                 f"windows ({each:.3g} s each at {best} of {threads} torch threads"
                                 + (", the faster on the first batches)" if rest else ")"))  # fmt: skip
                real = (targets != IGNORE_INDEX).sum(1)  # (B,) targets of each window
                bar.update(int(real.sum()))
                for b in range(len(targets)):
                    yield keys[b, : real[b]], targets[b, : real[b]], int(batch["doc_ids"][b])
    finally:
        torch.set_num_threads(threads)
        bar.close()


def estimate(n_tokens: int, dim: int, factory: str, shard_tokens: int | None = None) -> dict[str, int]:
    """Bytes a build needs on disk (the float16 keys while building, then the files) and in memory (the index,
    the k-means sample); sharded (``shard_tokens``, the largest shard's keys): no keys on disk, one shard's keys
    and index in memory."""
    from rlm.index.knn import EXACT, TRAIN_KEYS, bytes_per_key

    index = n_tokens * bytes_per_key(factory, dim)
    ivf = re.match(r"IVF(\d+)", factory)
    if ivf:  # the coarse centroids (nlist, d) float32, and a product quantiser's 256-entry codebooks
        index += int(ivf[1]) * dim * 4 + (256 * dim * 4 if ",PQ" in factory else 0)
    sample = min(n_tokens, TRAIN_KEYS) * dim * 4  # the k-means sample, float32
    files, keys = index + n_tokens * 4, n_tokens * 2 * dim  # the int32 values; the float16 keys
    if shard_tokens is None:
        return {"disk": files + keys, "memory": index + sample, "index": index, "keys": keys, "files": files}
    shard = shard_tokens * (bytes_per_key(factory, dim) + 2 * dim)
    sample = 0 if factory in (EXACT, "Flat", "IndexFlatL2") else sample  # an exact index is not trained
    return {"disk": files, "memory": shard + sample, "index": index, "keys": 0, "files": files}


def shard_docs(lengths: np.ndarray, shard_keys: int) -> list[slice]:
    """Runs of whole documents (slices) that each end at the first document bringing them to ``shard_keys`` keys
    (``lengths``: keys per document)."""
    if shard_keys < 1:
        raise ValueError(f"shard_keys={shard_keys}; accepted: a positive integer (keys per index shard)")
    out, lo, total = [], 0, 0
    for i, n in enumerate(lengths):
        total += int(n)
        if total >= shard_keys:
            out.append(slice(lo, i + 1))
            lo, total = i + 1, 0
    if lo < len(lengths):
        out.append(slice(lo, len(lengths)))
    return out


def load_for_knn(
    ckpt_path: str, corpus: list[str] | None, device: str, progress: bool
) -> tuple[Any, RLMDataModule, TokenStore]:
    """The checkpoint's module and a data module over its own corpus (or ``corpus``, read with its tokenizer)."""
    from rlm.eval.evaluate import checkpoint_data, load_module

    data, store = checkpoint_data(ckpt_path, corpus, progress, force=bool(corpus))
    return load_module(ckpt_path, device, store.tokenizer), data, store


def build_datastore(
    ckpt_path: str,
    out: str | os.PathLike[str],
    corpus: list[str] | None = None,
    layer: str = "final",
    factory: str = "auto",
    k: int = 32,
    target_recall: float | None = 0.9,
    flat_below: int = 1_000_000,
    batch_size: int | None = None,
    device: str = "cpu",
    progress: bool = True,
    max_documents: int | None = None,
    documents: list[int] | None = None,
    tuner: Callable[[Datastore, Any, RLMDataModule, TokenStore], dict[str, Any]] | None = None,
    shard_keys: int | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Build a datastore from a checkpoint over its own training split, or every document of ``corpus``;
    ``tuner`` (rlm.eval.knnlm.build's) then chooses lam and the temperature. Returns meta.json's contents."""
    from rlm.index._faiss import faiss
    from rlm.index.knn import build_l2_index, choose_l2_factory
    from rlm.index.store import atomic_dir
    from rlm.outdir import claim_out_dir

    if k < 1:
        raise ValueError(f"k={k}; accepted: a positive integer")
    if shard_keys is not None and shard_keys < 1:
        raise ValueError(f"shard_keys={shard_keys}; accepted: a positive integer (keys per index shard)")
    out = claim_out_dir(out, reads=[ckpt_path, *(corpus or [])], force=force, own=("meta.json", "format"))
    bars = progress and sys.stderr.isatty()  # for the tqdm bars of rlm.data and rlm.index: a terminal only
    module, data, store = load_for_knn(ckpt_path, corpus, device, bars)
    docs = store.train_docs if not corpus else np.arange(store.n_docs)
    if documents is not None:  # an explicit subset (tests, ablations)
        docs = np.asarray([d for d in docs if int(d) in set(documents)], dtype=np.int64)
    if max_documents is not None:
        docs = docs[:max_documents]
    if not len(docs):
        raise ValueError(f"no documents to build a datastore from ({'corpus ' + str(corpus) if corpus else 'the training split'} is empty)")  # fmt: skip
    n = int((store.doc_lengths[docs] - 1).sum())  # every target of every document
    dim = module.model_config.d_model
    resolved = factory if factory != "auto" else choose_l2_factory(n, dim, flat_below)
    parts = shard_docs(store.doc_lengths[docs] - 1, shard_keys) if shard_keys is not None else None
    biggest = max(int((store.doc_lengths[docs[p]] - 1).sum()) for p in parts) if parts else None
    need = estimate(n, dim, resolved, biggest)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    try:  # physical memory available now
        mem = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # the system does not say: unbounded
        mem = 1 << 62
    print(f"rlm knnlm: {n:,} keys of dim {dim} ({len(docs)} documents), index {resolved}: a datastore of about "
          f"{need['files'] / 2**20:,.1f} MiB; {need['disk'] / 2**20:,.0f} MiB of disk while building ({free / 2**20:,.0f} MiB free), "
          f"{need['memory'] / 2**20:,.0f} MiB of memory ({mem / 2**20:,.0f} MiB available)"
          + (f"; {len(parts)} shards of up to {biggest:,} keys, searching loads all "
             f"{need['index'] / 2**20:,.0f} MiB of index" if parts else ""), file=sys.stderr)  # fmt: skip
    if need["disk"] > free:
        raise ValueError(f"the datastore needs about {need['disk'] / 2**20:,.0f} MiB of disk under {out.parent} "
                         f"and {free / 2**20:,.0f} MiB are free; choose another --out or a smaller index "
                         "(--factory IVF...,PQ16)")  # fmt: skip
    if need["memory"] > mem:
        raise ValueError(f"the index needs about {need['memory'] / 2**20:,.0f} MiB of memory and "
                         f"{mem / 2**20:,.0f} MiB are available; use a product-quantised factory "
                         "(--factory IVF4096,PQ16) or fewer --max-documents")  # fmt: skip
    tok = Path(store.root) / "tokenizer.model"  # its hash names the token mapping the keys were read under
    start = time.perf_counter()
    with atomic_dir(out) as tmp:
        if parts is not None:
            built, shards = _build_shards(tmp, module, data, store, docs, parts, resolved, layer,
                                          batch_size or data.val_batch_size, target_recall, k, progress)  # fmt: skip
            embed_s = built.seconds.pop("keys")
        else:
            keys = np.lib.format.open_memmap(tmp / "keys.npy", mode="w+", dtype=np.float16, shape=(n, dim))
            values = np.zeros(n, dtype=np.int32)
            ranges = np.zeros((len(docs), 2), dtype=np.int64)
            windows = windows_of(data, store, docs)
            found = entries(module, windows, batch_size or data.val_batch_size, layer, progress)
            pos = _fill(found, keys, values, ranges, {int(d): i for i, d in enumerate(docs)}, 0)
            assert pos == n, (pos, n)
            keys.flush()
            embed_s = time.perf_counter() - start
            phase(progress, f"index {resolved}: training, adding {n:,} keys and tuning")
            built = build_l2_index(keys, resolved, target_recall, tune_k=k, progress=bars)
            times = ", ".join(f"{name} {t:.1f} s" for name, t in built.seconds.items())
            phase(progress, f"index {resolved}: {times}")
            faiss.write_index(built.index, str(tmp / "index.faiss"))
            del keys
            (tmp / "keys.npy").unlink()
            np.save(tmp / "values.npy", values)
            np.save(tmp / "docs.npy", ranges)
            shards = None
        meta = {
            "format": FORMAT,
            "checkpoint": str(Path(ckpt_path).resolve()),
            "fingerprint": model_fingerprint(module),
            "tokenizer": hashlib.sha256(tok.read_bytes()).hexdigest()[:24] if tok.is_file() else None,
            "store": str(Path(store.root).resolve()),
            "corpus": corpus if corpus else data.corpus,
            "split": "all" if corpus else "train",
            "layer": layer,
            "dim": dim,
            "entries": n,
            "factory": built.factory,
            "search_params": built.search_params,
            "tuned_recall": built.tuned_recall,
            "k": k,
            "doc_ids": [int(d) for d in docs],
            "doc_hashes": [doc_hash(store.doc_tokens(int(d))) for d in docs],
            "seconds": {"keys": embed_s, **built.seconds},
            "bytes": {
                "index": sum((tmp / sh["file"]).stat().st_size for sh in shards or [{"file": "index.faiss"}]),
                "values": (tmp / "values.npy").stat().st_size,
            },
        }
        if shards is not None:
            meta.update(shard_keys=shard_keys, shards=shards)
        meta = seal(tmp, meta)
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
        if tuner is not None and not corpus and len(store.val_docs):
            ds = Datastore(tmp, verify=False)  # just written and sealed: hashing it again proves nothing
            phase(progress, "tuning lam and the temperature on the validation split")
            meta = {**meta, "tuning": tuner(ds, module, data, store)}
            # the files are as sealed: only meta.json's own checksum changes
            meta[META_SHA] = meta_digest(meta)
            (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
    meta["seconds"]["total"] = time.perf_counter() - start
    return meta


def _build_shards(tmp: Path, module: Any, data: RLMDataModule, store: TokenStore, docs: np.ndarray,
                  parts: list[slice], factory: str, layer: str, batch_size: int, target_recall: float | None, k: int,
                  progress: bool) -> tuple[Any, list[dict[str, Any]]]:  # fmt: skip
    """Write values.npy, docs.npy and one index file per shard into ``tmp``: the index is trained once on the keys
    of random documents, then each shard's keys are added to a copy of it and written before the next shard's;
    nprobe is tuned on the first. Returns (an L2Index without its index, the shards' meta.json entries)."""
    from rlm.index._faiss import faiss
    from rlm.index.knn import L2Index, add_l2, empty_l2_index, l2_train_size, train_l2_index, tune_l2

    bars = progress and sys.stderr.isatty()
    lengths = store.doc_lengths[docs] - 1
    n, dim = int(lengths.sum()), module.model_config.d_model
    rng = np.random.default_rng(0)
    seconds = {"keys": 0.0, "train": 0.0, "add": 0.0, "tune": 0.0}
    start = time.perf_counter()
    index = empty_l2_index(dim, factory)
    if not index.is_trained:
        size, perm = min(n, l2_train_size(index)), rng.permutation(len(docs))
        picked = perm[: np.searchsorted(np.cumsum(lengths[perm]), size) + 1]  # random documents, size keys
        windows = windows_of(data, store, docs[np.sort(picked)])
        sample = np.concatenate([kv for kv, *_ in entries(module, windows, batch_size, layer, progress,
                                                          "training sample keys")])  # fmt: skip
        rows = np.sort(rng.choice(len(sample), size=min(len(sample), size), replace=False))
        phase(progress, f"index {factory}: training on {len(rows):,} keys")
        train_l2_index(index, factory, np.asarray(sample[rows], dtype=np.float32))
        del sample
        took = time.perf_counter() - start
        phase(progress, f"index {factory}: trained in {took:.1f} s (sample keys included)")
    seconds["train"] = time.perf_counter() - start
    trained = faiss.serialize_index(index)  # every shard starts from a copy: shared centroids and codebooks
    built = L2Index(index, factory, seconds=seconds)
    values = np.lib.format.open_memmap(tmp / "values.npy", mode="w+", dtype=np.int32, shape=(n,))
    ranges = np.zeros((len(docs), 2), dtype=np.int64)
    shards: list[dict[str, Any]] = []
    pos, segments = 0, None
    bar = Progress("datastore shards", len(parts), "shards", progress)
    for s, part in enumerate(parts):
        start, offset = time.perf_counter(), pos
        keys = np.empty((int(lengths[part].sum()), dim), dtype=np.float16)
        row = {int(d): part.start + i for i, d in enumerate(docs[part])}
        # one segment table (over the whole store) for every shard's windows
        windows = windows_of(data, store, docs[part]) if segments is None else Windows(
            segments, store.doc_offsets, docs[part], data.seq_len)  # fmt: skip
        segments = windows.segments
        found = entries(module, windows, batch_size, layer, progress, f"keys of shard {s}")
        pos = _fill(found, keys, values, ranges, row, pos, offset)
        assert pos - offset == len(keys), (pos - offset, len(keys))
        seconds["keys"] += time.perf_counter() - start
        start = time.perf_counter()
        shard = faiss.deserialize_index(trained)
        add_l2(shard, keys, f"add to shard {s}", bars)
        seconds["add"] += time.perf_counter() - start
        if s == 0:
            start = time.perf_counter()
            built.index = shard
            tune_l2(built, keys, target_recall, tune_k=k, rng=rng)
            seconds["tune"] = time.perf_counter() - start
        name = f"index-{s:03d}.faiss"
        faiss.write_index(shard, str(tmp / name))
        shards.append(
            {"file": name, "offset": offset, "entries": len(keys), "documents": part.stop - part.start}
        )
        del keys, shard
        bar.update(1)
    bar.close()
    assert pos == n, (pos, n)
    values.flush()
    del values
    np.save(tmp / "docs.npy", ranges)
    built.index = None
    return built, shards


def _fill(found: Iterator[tuple], keys: np.ndarray, values: np.ndarray, ranges: np.ndarray, row: dict, pos: int,
          offset: int = 0) -> int:  # fmt: skip
    """Write the entries from global entry ``pos`` on (keys[i - offset] is entry i) and each document's [lo, hi)
    entry range into ranges[row[doc]]; returns the next entry."""
    for kv, vv, doc in found:
        i = row[doc]
        if ranges[i, 1] == 0:
            ranges[i, 0] = pos
        keys[pos - offset : pos - offset + len(kv)] = kv
        values[pos : pos + len(vv)] = vv
        pos += len(kv)
        ranges[i, 1] = pos
    return pos


def first_docs(store: TokenStore, docs: np.ndarray, tokens: int) -> np.ndarray:
    """The fewest leading documents of ``docs`` that hold at least ``tokens`` targets."""
    lengths = np.cumsum(store.doc_lengths[docs] - 1)
    return docs[: int(np.searchsorted(lengths, tokens)) + 1]
