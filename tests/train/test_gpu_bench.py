"""benchmarks/gpu.py: the smoke run writes its table and JSON with every row; without CUDA the real run says so and
exits 0; the estimate mode and pytest's summary parsing."""

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

from rlm.experiment.spec import merge
from rlm.model.memory import estimate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# slow: three in-process `rlm fit` runs of a 12-layer model and a compiled transformers GPT-2, about 40 s
@pytest.mark.slow
def test_smoke_run_times_rlm_fit_and_the_peer_and_writes_the_table(bench, tmp_path, rlm_cache):
    """The rows are `rlm fit` itself (the StepTimer's JSON: steps, tokens, FLOPs), each plugin row's ratio is over
    the dense compiled step, the peer's MFU is credited with the dense row's FLOPs per token."""
    threads = torch.get_num_threads()
    try:
        argv = ["--smoke", "--out", str(tmp_path), "--cache", str(rlm_cache), "--only", "pkm 1024^2"]
        assert bench.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    report = (tmp_path / "gpu.md").read_text()
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert list(res["rows"]) == ["dense eager", "dense compiled", "pkm 1024^2"]
    dense = res["rows"]["dense compiled"]
    for name, r in res["rows"].items():
        assert "error" not in r, r
        assert len(r["steps_s"]) == 2 and r["step_s"] == pytest.approx(statistics.median(r["steps_s"]))
        assert r["tokens"] == 2 * 64 and r["tokens_per_s"] == pytest.approx(128 / r["step_s"])
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / res["peak_flops"])
        assert r["ratio"] == pytest.approx(r["step_s"] / dense["step_s"]) and r["estimate_bytes"] > 0
        assert f"| {name} |" in report
    assert res["rows"]["pkm 1024^2"]["params"] > dense["params"]  # the memory is in the model that ran
    peer = res["peer"]
    assert peer["mfu"] == pytest.approx(dense["flops_per_token"] * 128 / peer["step_s"] / res["peak_flops"])
    assert "| transformers GPT2LMHeadModel (peer, compiled) |" in report
    assert "| (smoke) |" in report and "| met |" not in report and "| missed |" not in report


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a GPU")
def test_without_cuda_the_real_run_says_so_and_measures_nothing(bench, tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path / "out")]) == 0
    assert "no CUDA device, nothing measured" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_estimate_mode_prints_the_configs_memory(bench, capsys):
    files = [
        ROOT / "configs" / "model" / "gpt2_small.yaml",
        ROOT / "configs" / "plugins" / "gpt2" / "pkm.yaml",
    ]
    assert bench.main(["--estimate", *(f"--config={f}" for f in files), "--vocab-size", "50257"]) == 0
    out = capsys.readouterr().out
    est = estimate(merge(files), 50257)
    assert f"parameters {est['params']:,} ({est['row_adam_params']:,} under PKM's row Adam)" in out


def test_pytest_summary_counts(bench):
    line = "3 passed, 12 skipped, 1 failed, 2 errors, 1400 deselected in 41.20s"
    assert bench.summary_counts(line) == {
        "passed": 3,
        "skipped": 12,
        "failed": 1,
        "error": 2,
        "deselected": 1400,
    }
    assert bench.summary_counts("no tests ran in 0.01s") == {}


def test_unknown_only_row_is_named(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--smoke", "--only", "moe 9"])
