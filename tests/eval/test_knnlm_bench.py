"""benchmarks/knnlm.py on the CPU, as its GPU mode runs: the device and the search it names are the ones used, and
the search is set against the forward pass of the same scoring."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# slow: builds a kNN-LM datastore (and its lambda tuning) and scores the test split twice
@pytest.mark.slow
def test_the_benchmark_names_its_device_and_search_and_falls_back_from_faiss_gpu(
    trained, rlm_cache, monkeypatch, tmp_path, capsys
):
    monkeypatch.setenv("RLM_CACHE", str(rlm_cache))
    spec = importlib.util.spec_from_file_location("knnlm_bench", ROOT / "benchmarks" / "knnlm.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "knnlm_bench", bench)
    spec.loader.exec_module(bench)
    argv = ["--ckpt", str(trained()), "--out", str(tmp_path), "--factory", "Flat", "--max-documents", "5",
            "--test-tokens", "200", "--device", "cpu", "--faiss-gpu"]  # fmt: skip
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "knnlm.json").read_text())
    assert result["device"] == "cpu" and result["search"].startswith("faiss-cpu")
    assert "--faiss-gpu: this faiss has no GPU" in out  # faiss-cpu here: said, and searched on the CPU
    assert f"model on cpu, datastore searched by {result['search']}" in out
    assert result["tokens"] >= 200 and result["search_ratio"] > 0
    assert result["by_lam"]["0.0"] == pytest.approx(result["lm_loss"])  # lam 0: the LM alone
