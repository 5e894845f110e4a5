"""kNN-LM datastore key extraction: where its time goes, and the build's entries() against the loop it replaced
(the full forward pass, LM head included, under no_grad at torch's thread count), measured in the same run.

    python benchmarks/knnlm_build.py --ckpt runs/default/version_0/checkpoints/last.ckpt [--tokens 20000]

Each variant extracts the keys of the same leading training documents (OMP_NUM_THREADS=1: as ``rlm knnlm
build`` runs on a 2-core machine, rlm.cli.commands.limit_threads); the variants alternate over --repeat
rounds and each row is its median, so a load that drifts hits them alike. "forward only" runs the blocks over
batches collated beforehand (no loader, no host copies): the floor the other rows are measured against.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402


def baseline(module, windows, batch_size: int, layer: str, head: bool = True) -> Iterator[tuple]:
    """The key loop before: the whole model (logits too) under no_grad, at whatever thread count torch has;
    ``head=False``: the blocks only, under inference_mode."""
    from rlm.data.windows import IGNORE_INDEX, eval_loader
    from rlm.eval.datastore import reading_keys

    mode = torch.no_grad() if head else torch.inference_mode()
    with reading_keys(module, layer) as hooked, mode:
        module.eval()
        for batch in eval_loader(windows, batch_size):
            ctx = module.make_context(batch, "test", segments=windows.segments)
            (module.model if head else module.model.hidden)(batch["tokens"], ctx)
            keys = hooked["keys"].to(torch.float16).cpu().numpy()
            targets = batch["targets"].cpu().numpy()
            for b in range(len(targets)):
                n = int((targets[b] != IGNORE_INDEX).sum())
                yield keys[b, :n], targets[b, :n], int(batch["doc_ids"][b]), int(batch["starts"][b])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--tokens", type=int, default=20000, help="keys of the leading training documents")
    p.add_argument("--layer", default="final", choices=["final", "ffn_input", "attn_input"])
    p.add_argument("--repeat", type=int, default=2, help="rounds over the variants")
    a = p.parse_args(argv)
    from rlm.data.windows import eval_loader
    from rlm.eval.datastore import entries, first_docs, load_for_knn, reading_keys, window_targets, windows_of

    module, data, store = load_for_knn(a.ckpt, None, "cpu", False)
    windows = windows_of(data, store, first_docs(store, store.train_docs, a.tokens))
    n, bs, threads = window_targets(windows), data.val_batch_size, torch.get_num_threads()
    collated = list(eval_loader(windows, bs))

    def drain(it: Iterator[tuple], write: bool = False) -> list[np.ndarray]:
        out, keys, pos = [], np.empty((n, module.model_config.d_model), np.float16), 0
        for kv, *_ in it:
            if write:  # what the build does with each window's keys
                keys[pos : pos + len(kv)] = kv
                pos += len(kv)
            else:
                out.append(kv)
        return out

    def at(count: int, fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            torch.set_num_threads(count)
            try:
                return fn()
            finally:
                torch.set_num_threads(threads)

        return run

    def forward_only() -> None:
        with reading_keys(module, a.layer) as hooked, torch.inference_mode():
            for batch in collated:
                module.model.hidden(
                    batch["tokens"], module.make_context(batch, "test", segments=windows.segments)
                )
                hooked["keys"].numpy()

    quiet = dict(progress=False)
    variants = {
        f"before: full forward, no_grad, torch's {threads} thread(s)": at(
            threads, lambda: drain(baseline(module, windows, bs, a.layer))
        ),
        "before, 1 thread": at(1, lambda: drain(baseline(module, windows, bs, a.layer))),
        f"blocks only, inference_mode, {threads} thread(s)": at(
            threads, lambda: drain(baseline(module, windows, bs, a.layer, head=False))
        ),
        "blocks only, inference_mode, 1 thread": at(
            1, lambda: drain(baseline(module, windows, bs, a.layer, head=False))
        ),
        "now: entries() (blocks only, threads timed)": lambda: drain(
            entries(module, windows, bs, a.layer, **quiet)
        ),
        "entries() + writing the keys": lambda: drain(entries(module, windows, bs, a.layer, **quiet), True),
        f"entries(), batch {bs * 4}": lambda: drain(entries(module, windows, bs * 4, a.layer, **quiet)),
        "forward only, 1 thread (batches collated before)": at(1, forward_only),
    }
    if threads == 1:  # the 1-thread rows would repeat the rows above
        variants = {name: fn for name, fn in variants.items() if not name.endswith(", 1 thread")}
    load = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(a.repeat):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    old = np.concatenate(drain(baseline(module, windows, bs, a.layer)))
    new = np.concatenate(drain(entries(module, windows, bs, a.layer, **quiet)))
    base = statistics.median(times[next(iter(variants))])
    base1 = statistics.median(times.get("before, 1 thread", times[next(iter(variants))]))
    rows = []
    for name, ts in times.items():
        s = statistics.median(ts)
        rows.append([name, s, n / s, base / s, base1 / s])
    print(f"{a.ckpt}: {n:,} keys ({len(windows)} windows of {windows.seq_len}, batch {bs}), layer {a.layer}, "
          f"d_model {module.model_config.d_model}, vocab {module.model_config.vocab_size}; torch threads "
          f"{threads}; load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} cores)")  # fmt: skip
    print(table(["variant", "seconds (median)", "keys/s", "x before", "x before at 1 thread"], rows))
    print(f"max |key before - key now| {np.abs(old.astype(np.float32) - new.astype(np.float32)).max():.3g} "
          f"(float16 keys, {len(old):,} of them)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
