"""Index benchmark: build time, queries/s and recall@k of the 'auto' index and of named faiss types, against
exact faiss flat search measured in the same run; then the time of a full causal neighbour table.

    python benchmarks/index.py                      # 200k clustered unit vectors of dim 256 (a few minutes)
    python benchmarks/index.py --n 20000 --dim 64   # a quick run

Goal for 'auto': recall@10 >= 0.95 at >= 8x the exact search's queries/s.
Queries are held-out vectors drawn from the same blobs as the data. recall@k = |found & exact| / k.
"""

from __future__ import annotations

import argparse
import time

import faiss
import numpy as np

from rlm.index.build import IndexConfig, build_index, recall_at_k
from rlm.index.search import SegmentTable, neighbour_table
from rlm.index.synthetic import clustered_unit_vectors


def timed(fn, *args, repeat: int = 1, **kwargs):
    """(result, seconds): the best of `repeat` runs, which filters out other processes' load on a shared machine."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return out, best


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200_000, help="indexed vectors")
    p.add_argument("--dim", type=int, default=256, help="dimension")
    p.add_argument("--queries", type=int, default=2000, help="held-out queries")
    p.add_argument("--clusters", type=int, default=100, help="gaussian blobs on the sphere")
    p.add_argument("--spread", type=float, default=2.0, help="blob noise norm relative to its unit centre")
    p.add_argument("--k", type=int, default=10, help="recall@k and neighbours per row")
    p.add_argument("--types", default="IVF1024,Flat;IVF1024,SQ8;HNSW32", help="';'-separated faiss factories")
    p.add_argument(
        "--target-recall", type=float, default=0.95, help="recall the nprobe/efSearch tuning aims at"
    )
    p.add_argument(
        "--table-exact-queries", type=int, default=4000, help="rows the exact table time is extrapolated from"
    )
    p.add_argument(
        "--segments-per-doc", type=int, default=50, help="synthetic documents for the causal filter"
    )
    p.add_argument("--repeat", type=int, default=3, help="searches are timed as the best of this many runs")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    x = clustered_unit_vectors(a.n + a.queries, a.dim, a.clusters, a.spread, a.seed)
    base, queries = x[: a.n], x[a.n :]
    print(
        f"{a.n} x {a.dim} clustered unit vectors ({a.clusters} blobs, spread {a.spread}), {a.queries} held-out "
        f"queries, k={a.k}, faiss {faiss.__version__}, {faiss.omp_get_max_threads()} threads\n"
    )

    flat, flat_build = timed(lambda: (lambda i: (i.add(base), i)[1])(faiss.IndexFlatIP(a.dim)))
    (_, exact_ids), exact_s = timed(flat.search, queries, a.k, repeat=a.repeat)
    exact_qps = a.queries / exact_s
    print(f"| index | params | build s | queries/s | recall@{a.k} | speed-up vs exact flat |")
    print("|---|---|---|---|---|---|")
    print(f"| exact faiss Flat (baseline) | - | {flat_build:.1f} | {exact_qps:.0f} | 1.000 | 1.00x |")
    built_auto = None
    for factory in ["auto", *filter(None, a.types.split(";"))]:
        built, build_s = timed(build_index, base, IndexConfig(factory=factory, target_recall=a.target_recall))
        (_, ids), search_s = timed(built.search, queries, a.k, repeat=a.repeat)
        qps = a.queries / search_s
        name = f"auto = {built.factory}" if factory == "auto" else factory
        params = ", ".join(f"{k}={v}" for k, v in built.search_params.items()) or "-"
        print(
            f"| {name} | {params} | {build_s:.1f} | {qps:.0f} | {recall_at_k(ids, exact_ids, a.k):.3f} | "
            f"{qps / exact_qps:.2f}x |"
        )
        if factory == "auto":
            built_auto = built

    # the neighbour table: every vector's top-k, excluding itself and its document's later segments
    segments = SegmentTable(np.arange(a.n) // a.segments_per_doc, (np.arange(a.n) % a.segments_per_doc) * 64)
    _, auto_s = timed(neighbour_table, built_auto, base, a.k, segments)
    m = min(a.table_exact_queries, a.n)
    _, part_s = timed(neighbour_table, flat, base[:m], a.k, SegmentTable(segments.doc, segments.offset))
    exact_table_s = part_s * a.n / m
    print(f"\n| neighbour table ({a.n} rows, k={a.k}, causal) | seconds | rows/s | speed-up vs exact flat |")
    print("|---|---|---|---|")
    print(
        f"| exact faiss Flat (baseline; extrapolated from {m} rows) | {exact_table_s:.1f} | {a.n / exact_table_s:.0f} | 1.00x |"
    )
    print(
        f"| auto = {built_auto.factory} | {auto_s:.1f} | {a.n / auto_s:.0f} | {exact_table_s / auto_s:.2f}x |"
    )


if __name__ == "__main__":
    main()
