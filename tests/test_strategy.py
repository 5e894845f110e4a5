"""Strategy defaults and refusals (rlm/train/strategy.py): devices: auto gives 2 CPU processes under a multi-process
strategy, and strategies rlm cannot run end in one ``rlm fit: error:`` line."""

from __future__ import annotations

import pytest
from cli_helpers import CONFIGS, fit_args, read_metrics, run_rlm

from rlm.train.strategy import CPU_PROCESSES, check_strategy, resolve_devices, strategy_name


def test_strategy_names():
    assert strategy_name("ddp") == "ddp"
    assert strategy_name(None) == "auto"
    assert strategy_name("deepspeed_stage_2") == "deepspeedstage2"
    mp = {"class_path": "pytorch_lightning.strategies.ModelParallelStrategy", "init_args": {}}
    assert strategy_name(mp) == "modelparallel"


@pytest.mark.parametrize(
    ("strategy", "accelerator", "devices", "expected"),
    [
        ("ddp", "cpu", "auto", CPU_PROCESSES),
        ({"class_path": "pytorch_lightning.strategies.ModelParallelStrategy"}, "cpu", "auto", CPU_PROCESSES),
        ("ddp", "gpu", "auto", "auto"),  # Lightning's auto: every GPU
        ("ddp", "cpu", 3, 3),  # an explicit count is kept
        ("auto", "cpu", "auto", "auto"),  # one process: Lightning decides
        ("single_device", "cpu", "auto", "auto"),
    ],
)
def test_devices_auto(strategy, accelerator, devices, expected):
    assert resolve_devices(strategy, accelerator, devices) == expected


def test_unusable_strategies_are_refused_by_name():
    check_strategy("ddp")
    check_strategy({"class_path": "pytorch_lightning.strategies.ModelParallelStrategy"})
    with pytest.raises(ValueError, match="FSDP2 through ModelParallelStrategy"):
        check_strategy("fsdp")


def test_deepspeed_is_a_clear_error(tmp_path, rlm_cache):
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("deepspeed is installed here")
    proc = run_rlm(fit_args() + ["--trainer.strategy", "deepspeed"], tmp_path, rlm_cache, check=False)
    assert proc.returncode == 2
    assert "rlm fit: error: --trainer.strategy 'deepspeed' needs the deepspeed package" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_config_starts_two_cpu_processes(tmp_path, rlm_cache):
    args = fit_args(CONFIGS / "trainer" / "ddp.yaml") + ["--trainer.accelerator=cpu", "--trainer.max_steps=2"]
    proc = run_rlm(args, tmp_path, rlm_cache)
    out = proc.stdout + proc.stderr
    assert "distributed_backend=gloo" in out and "Starting with 2 processes" in out
    assert read_metrics(tmp_path / "runs/test/version_0")
