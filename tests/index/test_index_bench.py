"""A smoke test of benchmarks/index.py at a tiny size: it runs and prints its tables, ratios last."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "index.py"


def test_index_benchmark_runs_small(capsys):
    spec = importlib.util.spec_from_file_location("index_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--n", "3000", "--dim", "16", "--queries", "50", "--clusters", "10", "--types", "IVF8,Flat"]
    bench.main([*args, "--table-exact-queries", "100", "--repeat", "1", "--segments-per-doc", "10"])
    out = capsys.readouterr().out
    assert "| exact faiss Flat (baseline) |" in out and "| auto = Flat |" in out and "| IVF8,Flat |" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    data_rows = [line for line in rows if "speed-up" not in line]  # 3 index rows, 2 neighbour-table rows
    assert len(data_rows) == 5 and all(line.rstrip(" |").endswith("x") for line in data_rows)  # ratio last
