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


def test_deepspeed_is_a_clear_error(tmp_path, rlm_cache, rlm_main):
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("deepspeed is installed here")
    proc = rlm_main(fit_args() + ["--trainer.strategy", "deepspeed"], tmp_path, rlm_cache)
    assert proc.returncode == 2
    assert "rlm fit: error: --trainer.strategy 'deepspeed' needs the deepspeed package" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_config_starts_two_cpu_processes(tmp_path, rlm_cache):
    args = fit_args(CONFIGS / "trainer" / "ddp.yaml") + ["--trainer.accelerator=cpu", "--trainer.max_steps=2"]
    proc = run_rlm(args, tmp_path, rlm_cache)
    out = proc.stdout + proc.stderr
    assert "distributed_backend=gloo" in out and "Starting with 2 processes" in out
    assert read_metrics(tmp_path / "runs/test/version_0")


def test_lightning_commands_release_the_process_group(tmp_path, monkeypatch):
    """`rlm fit|validate|test` shut the process group down before returning, on success and on error, so no
    gloo worker thread outlives the interpreter (the CI abort at DDP teardown: a worker freeing a collective's
    tensors during Py_FinalizeEx could not take the GIL and the process died with SIGABRT)."""
    import torch
    import torch.distributed as dist

    import rlm.cli.lightning_cli
    from rlm.cli.commands import run_lightning

    def fake_cli(*args, fail: bool, **kwargs):
        # what Lightning's DDP leaves behind: an initialised group with a finished collective
        store = dist.FileStore(str(tmp_path / f"store-{fail}"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        out = [torch.zeros(3)]
        dist.all_gather(out, torch.ones(3))
        if fail:
            raise ValueError("a config check failed")

    for fail in (False, True):
        monkeypatch.setattr(rlm.cli.lightning_cli, "RLMCLI", lambda *a, fail=fail, **k: fake_cli(fail=fail))
        if fail:
            with pytest.raises(ValueError, match="config check"):
                run_lightning("fit", [])
        else:
            assert run_lightning("fit", []) == 0
        assert not dist.is_initialized()


def test_lightning_model_parallel_becomes_rlms_with_its_init_args():
    from jsonargparse import Namespace

    from rlm.train.strategy import RLM_MODEL_PARALLEL, ModelParallelStrategy, use_rlm_model_parallel

    for strategy in (
        {"class_path": "pytorch_lightning.strategies.ModelParallelStrategy", "init_args": {"x": 1}},
        Namespace(class_path="lightning.pytorch.strategies.ModelParallelStrategy", init_args={"x": 1}),
    ):
        swapped = use_rlm_model_parallel(strategy)
        assert swapped["class_path"] == RLM_MODEL_PARALLEL and swapped["init_args"] == {"x": 1}
    assert use_rlm_model_parallel("ddp") == "ddp"
    assert use_rlm_model_parallel({"class_path": "my.Strategy"}) == {"class_path": "my.Strategy"}
    # devices: auto still resolves by the name
    assert strategy_name({"class_path": RLM_MODEL_PARALLEL}) == "modelparallel"
    assert RLM_MODEL_PARALLEL == f"{ModelParallelStrategy.__module__}.ModelParallelStrategy"
