"""Preemption (issue 24): SIGTERM to a real `rlm fit` saves last.ckpt and exits 143; SIGTERM to a real
`rlm experiment run` stops it with the run unfinished, and the next run resumes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from cli_helpers import TINY, read_metrics

ENV_KEYS = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _start(args: list, cwd: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "RLM_CACHE": str(cache), **ENV_KEYS}
    return subprocess.Popen([sys.executable, "-m", "rlm", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _wait_for(folder: Path, pattern: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Poll until a file matching ``pattern`` appears in ``folder`` (a periodic checkpoint: training is under way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        if folder.is_dir() and any(folder.glob(pattern)):
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"nothing matching {pattern} in {folder} after {timeout}s")


# slow: signals and restarts real training processes
@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_143_and_the_run_resumes(tmp_path, rlm_cache):
    args = ["fit", *[a for p in TINY for a in ("--config", p)], "--trainer.max_steps=400",
            "--trainer.val_check_interval=400"]  # fmt: skip
    proc = _start(args, tmp_path, rlm_cache)
    _wait_for(tmp_path / "runs/test/ckpt", "epoch=*-step=3.ckpt", proc)  # fast.yaml saves every 3 steps
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert "stopped by SIGTERM at step" in out and "Traceback" not in out
    last = tmp_path / "runs/test/ckpt/last.ckpt"
    step = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert 3 <= step < 400
    # the rerun resumes at that step: its first logged step is the saved one
    more = ["fit", *[a for p in TINY for a in ("--config", p)], f"--trainer.max_steps={step + 2}",
            "--ckpt_path", "last", "--trainer.logger.init_args.version=1"]  # fmt: skip
    proc = _start(more, tmp_path, rlm_cache)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    # exactly the two steps left were trained: nothing lost, nothing trained twice
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == step + 2
    steps = [int(r["step"]) for r in read_metrics(tmp_path / "runs/test/version_1") if r.get("train/loss")]
    assert steps == [step, step + 1]  # the logged step is global_step (see the in-process test below)


# slow: signals and restarts real training processes
@pytest.mark.slow
def test_sigterm_to_the_experiment_runner_leaves_the_run_unfinished_and_the_rerun_finishes_it(
    tmp_path, rlm_cache
):
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({
        "name": "preempt", "base": [str(p) for p in TINY], "seeds": [0], "variants": {"baseline": {}},
        "common": {"trainer": {"max_steps": 300, "val_check_interval": 300, "limit_val_batches": 1}},
    }))  # fmt: skip
    out = tmp_path / "out"
    runner = _start(["experiment", "run", exp, "--out", out], tmp_path, rlm_cache)
    _wait_for(out / "baseline/seed0/ckpt", "epoch=*-step=3.ckpt", runner)
    runner.send_signal(signal.SIGTERM)  # the runner alone: it passes the signal on to its rlm fit
    text, _ = runner.communicate(timeout=120)
    assert runner.returncode == 143, text
    assert "stopped by SIGTERM" in text and "finished" not in text.split("stopped by SIGTERM")[0][-200:]
    run = out / "baseline/seed0"
    assert not (run / "summary.json").exists() and (run / "ckpt/last.ckpt").is_file()
    saved = torch.load(run / "ckpt/last.ckpt", map_location="cpu", weights_only=False)["global_step"]
    assert 3 <= saved < 300
    # shorten the run so the rerun finishes quickly: same fingerprint is not needed to resume a checkpoint
    spec = yaml.safe_load(exp.read_text())
    spec["common"]["trainer"]["max_steps"] = saved + 2
    exp.write_text(yaml.safe_dump(spec))
    again = _start(["experiment", "run", exp, "--out", out], tmp_path, rlm_cache)
    text, _ = again.communicate(timeout=600)
    assert again.returncode == 0, text
    assert (out / "baseline/seed0/summary.json").is_file()


def test_the_runner_maps_a_sigterm_exit_to_preempted(tmp_path, monkeypatch):
    """An rlm fit that exits 143 (or dies by the signal) raises Preempted instead of counting as a result."""
    from rlm.experiment import runner
    from rlm.experiment.runner import Preempted
    from rlm.experiment.runs import Run

    run = Run("base", 0, tmp_path / "base" / "seed0", {"trainer": {"max_steps": 3}})
    for code in (143, -signal.SIGTERM):
        monkeypatch.setattr(runner, "_run_forwarding_sigterm", lambda *a, code=code: code)
        with pytest.raises(
            Preempted, match=r"base/seed0: stopped by SIGTERM after \d+s; its last.ckpt is kept"
        ):
            runner.train(run)
        assert float((run.dir / "wall_s").read_text()) >= 0  # the stopped run's time counts
    monkeypatch.setattr(runner, "_run_forwarding_sigterm", lambda *a: 1)
    assert runner.train(run)[0] is False


class _StopAtValidationEnd(pl.Callback):
    """Sends this process SIGTERM at the end of the validation of step ``at``: Lightning raises it after counting
    the step's batch, the moment whose checkpoint used to resume with every logged step one too high."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self.at and not trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGTERM)


class _Steps(pl.Callback):
    """(global_step, the step Lightning hands the loggers) at each training batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx
    ) -> None:
        self.seen.append((trainer.global_step, trainer.fit_loop.epoch_loop._batches_that_stepped))


def _boring_fit(root: Path, max_steps: int, *callbacks: pl.Callback, ckpt_path: str | None = None) -> None:
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.demos.boring_classes import BoringModel
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    from rlm.train.checkpoint import CheckpointHygiene

    trainer = pl.Trainer(
        max_steps=max_steps, val_check_interval=3, check_val_every_n_epoch=None, limit_val_batches=1,
        num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, accelerator="cpu", devices=1,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=100),
                   CheckpointHygiene(), *callbacks],
    )  # fmt: skip
    try:
        trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    except SIGTERMException:
        pass


def test_a_sigterm_after_validation_resumes_with_the_same_batches_and_logged_steps(tmp_path):
    """No batch is skipped or trained twice across a SIGTERM and its resume, and the loggers' step stays equal to
    global_step: Lightning counted the last batch again when resuming at a validation step (issue 24)."""
    straight = _Steps()
    _boring_fit(tmp_path / "straight", 9, straight)
    first, second = _Steps(), _Steps()
    _boring_fit(tmp_path / "split", 9, first, _StopAtValidationEnd(6))
    last = tmp_path / "split/ckpt/last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 6
    _boring_fit(tmp_path / "split", 9, second, ckpt_path=str(last))
    assert straight.seen == [(s, s) for s in range(9)]
    assert first.seen + second.seen == straight.seen
