"""benchmarks/gpu.py: the smoke run writes its table and JSON with every row; without CUDA the real run says so and
exits 0; the estimate mode and pytest's summary parsing."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from rlm.cli.merge import merge_configs
from rlm.train.memory import estimate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_smoke_run_writes_the_table_and_json_with_every_row(bench, tmp_path):
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = (tmp_path / "gpu.md").read_text()
    res = json.loads((tmp_path / "gpu.json").read_text())
    names = list(bench.variants(bench.SMOKE))
    assert len(names) == 9 and set(res["plugins"]) == {"dense", *names}
    for row in ("| eager |", "| compiled |", *(f"| {n} |" for n in ["dense", *names])):
        assert row in report, row
    for mode in ("eager", "compiled"):
        r = res["dense"][mode]
        assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(2 * 64 / r["step_s"])
        assert r["mfu"] == pytest.approx(r["flops_per_step"] / r["step_s"] / res["peak_flops"])
    assert res["plugins"]["dense"]["ratio"] == 1.0
    s = bench.SMOKE
    for name, r in res["plugins"].items():
        assert r["step_s"] > 0 and r["peak_bytes"] is None  # no CUDA: no measured peak
        cfg = {
            "model": {
                "model": bench.model_fields(s),
                "plugins": ({} if name == "dense" else bench.variants(s)[name]),
            },
            "data": {"batch_size": s.batch, "seq_len": s.seq},
            "trainer": {"precision": "bf16-mixed"},
        }
        assert r["estimate_bytes"] == estimate(cfg)["total_bytes"]
    assert res["plugins"]["moe 64 grouped"]["goal"] == 1.5 and res["plugins"]["pkm 32^2"]["goal"] == 1.3
    assert "IVF" in res["plugins"]["retrieval k=2"]["factory"]  # the smoke run builds an IVF index too
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
    est = estimate(merge_configs(files), 50257)
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
