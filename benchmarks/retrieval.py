"""Cost of MARGE-style retrieval, each measured against its baseline in the same run.

1. Training step time with retrieval (k neighbours, cross-attention; the default and the variants in
   STEP_VARIANTS, with continuations among them) against the same model without, on an index of
   --step-segments segments (the default corpus' size, since lookup 'search' scans it every step); and the
   share of the step spent finding the neighbours (prepare(): the online search, or the table lookup, and the
   token gather); a step before the first index (the warm start, or warm_start none); and one step's online
   search, faiss's flat search against the torch scan the retriever uses. Goal: a step with retrieval (k=2,
   with continuations or without) <= 1.4x a base step.
2. Rebuild time against corpus size, with the neighbour table (lookup 'table': embed every segment, build the
   index, search it for every segment) and without (lookup 'search': embed and index), and its share of
   training wall-clock under the default schedule (one rebuild every `--interval` steps).
3. Steps/s while a background rebuild runs, relative to no rebuild, against a blocking rebuild. Goal: the
   background mode hides most of the rebuild's cost.

One step = forward + backward + AdamW on windows of a random-token corpus (timing does not depend on
the tokens). Variants are timed in interleaved rounds so a noisy neighbour slows them alike.

    python benchmarks/retrieval.py                                   # d=256, 4 layers, seq 256, segments of 64
    python benchmarks/retrieval.py --d 32 --layers 2 --seq 32 --segment 8 --batch 2 --docs 40 \\
        --step-segments 400 --sizes 200 400 --steps 2 --rounds 1     # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from rlm.data.segments import SegmentTable
from rlm.data.windows import Windows
from rlm.index.build import IndexConfig, as_unit_float32, flat_vectors, search_index
from rlm.index.memory import build_memory, embed_rows, indexed_rows
from rlm.model import ModelConfig, Transformer
from rlm.plugin import Context

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options: model shape, corpus sizes, timing effort."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--segment", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--docs", type=int, default=400, help="documents of the training corpus (table 3)")
    p.add_argument(
        "--step-segments",
        type=int,
        default=51200,
        help="segments of table 1's corpus (an online search per step scans them; the default corpus has ~51k)",
    )
    p.add_argument("--doc-len", type=int, default=1024, help="tokens per document")
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[2000, 8000, 32000, 51200],
        help="segments (table 2; the default corpus indexes about 51k training segments)",
    )
    p.add_argument(
        "--interval",
        type=int,
        default=500,
        help="steps between rebuilds (the default schedule's, to step 2000)",
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--factory", default="auto", help="index factory")
    p.add_argument(
        "--target-recall",
        type=float,
        default=0.95,
        help="recall@10 against exact search every table build is tuned to (the retriever's default)",
    )
    p.add_argument(
        "--tables",
        nargs="+",
        choices=["step", "rebuild", "background"],
        default=["step", "rebuild", "background"],
        help="which tables to print",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: stable timings on a shared machine)"
    )
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="tables 1-2: wall-clock, or process CPU time (stable on a busy machine; use with --threads 1)",
    )
    return p.parse_args(argv)


CLOCK = time.perf_counter
"""Clock of tables 1 and 2: wall-clock, or with --clock cpu the process's CPU time (all its threads, faiss's
included), which a busy shared machine does not inflate. Table 3 (overlap with a background thread) is always
wall-clock."""


def corpus(
    n_docs: int, doc_len: int, segment: int, vocab: int, seed: int = 0
) -> tuple[SegmentTable, np.ndarray]:
    """Random-token documents as a SegmentTable, and the document offsets."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, vocab, size=n_docs * doc_len).astype(np.int64)
    offsets = np.arange(n_docs + 1, dtype=np.int64) * doc_len
    return SegmentTable(tokens, offsets, segment, 0, f"bench-{n_docs}-{doc_len}-{segment}"), offsets


def model_for(a: argparse.Namespace, retrieval: bool, **options) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=a.vocab, d_model=a.d, n_layers=a.layers, n_heads=a.heads, max_seq_len=a.seq)
    plugins = {"retrieval": {"layers": [-1], "k": a.k, "progress": False, **options}} if retrieval else {}
    return Transformer(cfg, plugins)


def rebuild(model: Transformer, segments: SegmentTable, a: argparse.Namespace, step: int = 0):
    """One full rebuild: snapshot, embed every segment, index, and (lookup 'table') the neighbour table; not
    written to disk."""
    plugin = model.plugins["retrieval"]
    rows = indexed_rows(segments, np.arange(len(segments.first) - 1))
    embedder = plugin.snapshot(step)
    vectors = embed_rows(embedder, segments, rows, 256, 0, 1, False)
    # the retriever's own flat_below: exact search up to there, as its rebuilds do
    cfg = IndexConfig(factory=a.factory, target_recall=a.target_recall, flat_below=plugin.config.flat_below)
    table = plugin.config.lookup == "table"
    return build_memory(vectors, segments, rows, a.k, embedder.embedder_identity(), step, cfg, None, table)


class Stepper:
    """Training steps of one model on shuffled windows; records the time spent in prepare()."""

    def __init__(self, model: Transformer, windows: Windows, batch: int) -> None:
        self.model, self.windows, self.batch = model, windows, batch
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.rng = np.random.default_rng(0)
        self.prepare_s = 0.0

    def step(self) -> None:
        b = self.windows.collate(self.rng.choice(len(self.windows), self.batch, replace=False))
        t0 = CLOCK()
        ctx = Context(
            tokens=b["tokens"],
            mask=b["mask"],
            segment_ids=b["segment_ids"],
            doc_ids=b["doc_ids"],
            segments=self.windows.segments,
        )
        for plugin in self.model.plugins.values():
            plugin.prepare(ctx, b)
        self.prepare_s += CLOCK() - t0
        logits = self.model(b["tokens"], ctx)
        loss = F.cross_entropy(logits.flatten(0, 1), b["targets"].flatten(), ignore_index=-100)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def time(self, steps: int) -> float:
        """Seconds per step over `steps` steps."""
        t0 = CLOCK()
        for _ in range(steps):
            self.step()
        return (CLOCK() - t0) / steps


STEP_VARIANTS = {
    "default: embedder tokens, neighbour_grad none, lookup search, no continuations": {},
    "with continuations (each neighbour and its next segment: 2x the keys), lookup search": {
        "continuation": True
    },
    "lookup table": {"lookup": "table"},
    "neighbour_grad full, lookup table": {"neighbour_grad": "full", "lookup": "table"},
    "k=1: one neighbour with its continuation, lookup search": {"k": 1, "continuation": True},
    "embedder shared 1 block, neighbour_grad full, table": {
        "embedder": "shared",
        "neighbour_grad": "full",
        "lookup": "table",
    },
    "embedder shared 1 block, neighbour_grad none, table": {
        "embedder": "shared",
        "neighbour_grad": "none",
        "lookup": "table",
    },
}
"""Table 1's retrieval variants (k neighbours without continuations unless said): the options over the default."""


def step_table(a: argparse.Namespace) -> tuple[str, float]:
    per_doc = a.doc_len // a.segment
    segments, offsets = corpus(max(1, a.step_segments // per_doc), a.doc_len, a.segment, a.vocab)
    windows = Windows(segments, offsets, np.arange(len(offsets) - 1), a.seq)
    steppers = {"no retrieval": Stepper(model_for(a, False), windows, a.batch)}
    for name, options in STEP_VARIANTS.items():
        label = name if "k" in options else f"retrieval k={a.k}, {name}"
        steppers[label] = Stepper(model_for(a, True, **options), windows, a.batch)
    for s in list(steppers.values())[1:]:
        s.model.plugins["retrieval"].use_memory(rebuild(s.model, segments, a))
    # before the first index: the warm start's neighbours (the document's own past), or none at all
    for name, warm in (("warm start (the default)", "recent"), ("warm_start none: no retrieval yet", "none")):
        steppers[f"retrieval k={a.k}, before the first index, {name}"] = Stepper(
            model_for(a, True, warm_start=warm), windows, a.batch
        )
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for s in steppers.values():
        s.time(2)  # warm-up
        s.prepare_s = 0.0
    for _ in range(a.rounds):
        for name, s in steppers.items():
            times[name].append(s.time(a.steps))
    med = {name: statistics.median(t) for name, t in times.items()}
    base = med["no retrieval"]
    rows = [[name, f"{1000 * t:.1f}", "", t / base] for name, t in med.items()]
    name, retr = list(steppers.items())[1]
    prep = retr.prepare_s / (a.rounds * a.steps)
    rows.append(
        [
            "finding the neighbours (prepare)",
            f"{1000 * prep:.2f}",
            "share of the retrieval step",
            prep / med[name],
        ]
    )
    rows += search_rows(a, retr.model.plugins["retrieval"].memory, base)
    out = table(["training step", "ms/step", "note", "ratio"], rows)
    out += f"\nstep ratio, {name} / no retrieval: {med[name] / base:.2f}x (goal <= 1.4x)"
    cont = next(n for n in med if "with continuations" in n)
    out += f"\nstep ratio, {cont} / no retrieval: {med[cont] / base:.2f}x (goal <= 1.4x)"
    out += f"\n(index of {len(segments)} segments; prepare() holds the online search with lookup 'search')"
    return out, med[name]


def search_rows(a: argparse.Namespace, memory, base_s: float) -> list[list]:
    """One step's online search (its B * n query segments, search_neighbours' first fetch of 2k + 8) of the
    retriever's exact flat index: faiss's own search against search_index's torch scan, interleaved; the ratio
    column is the share of a base step. Empty unless the index is an exact flat faiss index."""
    if flat_vectors(memory.index.index) is None:
        return []
    n_q, fetch = a.batch * -(-a.seq // a.segment), 2 * a.k + 8
    q = as_unit_float32(np.random.default_rng(1).standard_normal((n_q, memory.index.index.d)))
    searches = {
        "faiss IndexFlat.search": lambda: memory.index.index.search(q, fetch),
        "search_index, as the retriever searches (a torch scan of 16-512 queries)": lambda: search_index(
            memory.index, q, fetch
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in searches}
    for fn in searches.values():
        fn()  # warm-up
    for _ in range(a.rounds):
        for name, fn in searches.items():
            t0 = CLOCK()
            for _ in range(4 * a.steps):
                fn()
            times[name].append((CLOCK() - t0) / (4 * a.steps))
    med = {name: statistics.median(t) for name, t in times.items()}
    faiss_s = med["faiss IndexFlat.search"]
    return [
        [
            f"online search of one step ({n_q} queries, top {fetch} of {memory.index.ntotal}): {name}",
            f"{1000 * t:.2f}",
            f"{faiss_s / t:.2f}x faiss's speed",
            t / base_s,
        ]
        for name, t in med.items()
    ]


def rebuild_table(a: argparse.Namespace, step_s: float) -> str:
    rows = []
    models = {lookup: model_for(a, True, lookup=lookup) for lookup in ("table", "search")}
    for n in a.sizes:
        docs = max(1, n * a.segment // a.doc_len)
        segments, _ = corpus(docs, a.doc_len, a.segment, a.vocab, seed=n)
        for lookup, model in models.items():
            t0 = CLOCK()
            memory = rebuild(model, segments, a)
            sec = CLOCK() - t0
            share = sec / (sec + a.interval * step_s)
            recall = "" if memory.recall is None else f"{memory.recall:.3f}"
            rows.append(
                [
                    len(segments),
                    "embed, index, table" if lookup == "table" else "embed, index (lookup search)",
                    memory.index.factory,
                    recall,
                    f"{sec:.2f}",
                    f"{1000 * sec / len(segments):.3f}",
                    a.interval,
                    share,
                ]
            )
    return table(
        [
            "segments",
            "rebuild",
            "index",
            "recall@10 vs exact",
            "rebuild s",
            "ms/segment",
            "steps between rebuilds",
            "share of training wall-clock",
        ],
        rows,
    )


def background_table(a: argparse.Namespace, segments: SegmentTable, offsets: np.ndarray) -> str:
    windows = Windows(segments, offsets, np.arange(len(offsets) - 1), a.seq)
    s = Stepper(model_for(a, True), windows, a.batch)
    plugin = s.model.plugins["retrieval"]
    plugin.use_memory(rebuild(s.model, segments, a))
    s.time(2)
    quiet = s.time(a.steps * a.rounds)  # s/step with no rebuild
    t0 = time.perf_counter()
    plugin.use_memory(rebuild(s.model, segments, a, step=1))
    blocking = time.perf_counter() - t0
    # background: a snapshot embeds and indexes in a thread while the steps go on; count steps until it is done
    done = threading.Event()
    result = {}

    def work():
        result["memory"] = rebuild(s.model, segments, a, step=2)
        done.set()

    t0 = time.perf_counter()
    thread = threading.Thread(target=work)
    thread.start()
    n = 0
    while not done.is_set():
        s.step()
        n += 1
    thread.join()
    plugin.use_memory(result["memory"])
    during = (time.perf_counter() - t0) / max(n, 1)
    extra_bg = n * (during - quiet)  # training time lost to the background rebuild
    rows = [
        ["no rebuild", f"{1 / quiet:.2f}", "", 1.0],
        ["blocking rebuild", "0 (training waits)", f"{blocking:.2f} s lost", 0.0],
        [
            f"background rebuild ({n} steps overlap it)",
            f"{1 / during:.2f}",
            f"{extra_bg:.2f} s lost",
            quiet / during,
        ],
        ["share of the blocking cost hidden by background", "", "", 1 - max(extra_bg, 0.0) / blocking],
    ]
    return table(["mode", "steps/s", "rebuild cost to training", "ratio"], rows)


def main(argv: list[str] | None = None) -> None:
    global CLOCK
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    segments, offsets = corpus(a.docs, a.doc_len, a.segment, a.vocab)
    print(
        f"model d={a.d} layers={a.layers} seq={a.seq} segment={a.segment} batch={a.batch} k={a.k}; "
        f"table 3's corpus {len(segments)} segments; torch threads {torch.get_num_threads()}; clock {a.clock}\n"
    )
    step_s = None
    if "step" in a.tables:
        steps, step_s = step_table(a)
        print(steps + "\n")
    if "rebuild" in a.tables:
        print(rebuild_table(a, step_s or 0.0) + "\n")
    if "background" in a.tables:
        print(background_table(a, segments, offsets))


if __name__ == "__main__":
    main()
