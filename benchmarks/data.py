"""Data pipeline speed: building the cache vs reusing it, and training batches from the memory map against a
per-window Dataset + default collate in a torch DataLoader (the usual way), measured in the same run.

    python benchmarks/data.py                                    # the whole stdlib corpus, vocab 4096
    python benchmarks/data.py --max-documents 50 --vocab-size 512 --batches 20   # a quick smoke run

The cache is built in a fresh temporary directory (or --cache-dir), so the first row is a cold build.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

from rlm.data.module import RLMDataModule  # noqa: E402
from rlm.data.windows import IGNORE_INDEX, TrainLoader, Windows  # noqa: E402


class PerWindow(Dataset):
    """Baseline: one window per __getitem__, built with tensor ops; the DataLoader stacks them."""

    def __init__(self, windows: Windows) -> None:
        self.w = windows

    def __len__(self) -> int:
        return len(self.w)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        w, seg, T = self.w, self.w.segments, self.w.seq_len
        doc, start = int(w.doc[i]), int(w.start[i])
        lo, hi = w.doc_offsets[doc] + start, min(w.doc_offsets[doc + 1], w.doc_offsets[doc] + start + T + 1)
        toks = torch.from_numpy(seg.corpus_tokens[lo:hi].astype(np.int64))  # (<= T+1,)
        n = min(len(toks), T)
        tokens = torch.full((T,), seg.pad_id, dtype=torch.long)
        tokens[:n] = toks[:n]
        targets = torch.full((T,), IGNORE_INDEX, dtype=torch.long)
        targets[: len(toks) - 1] = toks[1:]
        segs = seg.window_segments(np.array([doc]), np.array([start]), T // seg.segment_len)[0]
        return {
            "tokens": tokens,
            "targets": targets,
            "mask": torch.arange(T) < n,
            "segment_ids": torch.from_numpy(segs),
            "doc_ids": torch.tensor(doc),
            "starts": torch.tensor(start),
        }


def per_batch_seconds(batches, n: int) -> float:
    """Mean seconds per batch over n batches of an iterable (after one warm-up batch)."""
    it = iter(batches)
    next(it)
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark, print and return its tables."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-documents", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--segment-len", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--batches", type=int, default=200, help="batches timed per row")
    p.add_argument("--corpus", default="stdlib")
    p.add_argument("--cache-dir", default=None, help="default: a fresh temporary directory (a cold build)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        kw = dict(
            corpus=a.corpus,
            max_documents=a.max_documents,
            vocab_size=a.vocab_size,
            seq_len=a.seq_len,
            segment_len=a.segment_len,
            cache_dir=a.cache_dir or tmp,
            progress=False,
        )
        t0 = time.perf_counter()
        dm = RLMDataModule(**kw)
        dm.setup()
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        RLMDataModule(**kw).setup()
        cached = time.perf_counter() - t0
        store, windows = dm.store, dm.windows("train")
        setup_rows = [
            [
                "setup (read corpus, fingerprint, load cache)",
                f"{store.n_docs} docs, {len(store.tokens):,} tokens",
                build,
                cached,
                build / cached,
            ]
        ]
        print(table(["what", "corpus", "cold build s", "cached s", "ratio"], setup_rows))
        check = np.arange(min(len(windows), 4))
        want = windows.collate(check)
        got = torch.utils.data.default_collate([PerWindow(windows)[int(i)] for i in check])
        assert all(torch.equal(want[k], got[k]) for k in want), "the baseline must build the same batches"
        rows = []
        for bs in a.batch_sizes:
            n = min(a.batches, len(windows) // bs - 1)
            ours = per_batch_seconds(TrainLoader(windows, bs, seed=0), n)
            base = per_batch_seconds(DataLoader(PerWindow(windows), batch_size=bs, shuffle=True), n)
            rows.append([bs, a.seq_len, n, base * 1e3, ours * 1e3, base / ours])
        print()
        loader_table = table(
            [
                "batch",
                "seq_len",
                "batches",
                "per-window DataLoader ms/batch",
                "TrainLoader ms/batch",
                "speed-up",
            ],
            rows,
        )
        print(loader_table)
    return loader_table


if __name__ == "__main__":
    main()
