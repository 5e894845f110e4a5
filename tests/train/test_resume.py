"""Nothing lost, nothing silent: NaN stops training, checkpoints are written atomically, ``--ckpt_path last``
finds the run's newest loadable checkpoint across logger versions and skips damaged ones."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from cli_helpers import column, fit_args, read_metrics, run_rlm
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

from rlm.train.checkpoint import (
    AtomicCheckpointIO,
    CheckpointHygiene,
    atomic_save,
    dict_diff,
    load_checkpoint_file,
)
from rlm.train.guard import NonFiniteError, NonFiniteGuard
from rlm.train.module import LMModule, WarmupCosine, warmup_cosine
from rlm.train.resume import checkpoint_roots, newest_loadable


class _Toy(pl.LightningModule):
    """A linear regression whose loss turns NaN at ``nan_at`` (a global step)."""

    def __init__(self, nan_at: int, where: str = "loss") -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.nan_at, self.where = nan_at, where

    def training_step(self, batch, batch_idx):
        x = batch[0]
        loss = self.lin(x).pow(2).mean()
        if self.global_step == self.nan_at:
            if self.where == "loss":
                loss = loss * float("nan")
            else:  # finite loss, non-finite gradient: sqrt'(0) = inf
                loss = loss + torch.sqrt(torch.zeros((), requires_grad=True) * self.lin.bias.sum() * 0)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _toy_fit(
    tmp_path: Path,
    module: _Toy,
    max_steps: int = 10,
    save_top_k: int = -1,
    ckpt_path: Path | None = None,
    every_n: int = 1,
    guard: NonFiniteGuard | None = None,
) -> pl.Trainer:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[
            guard or NonFiniteGuard(),
            CheckpointHygiene(),
            ModelCheckpoint(
                dirpath=tmp_path / "ckpt", every_n_train_steps=every_n, save_last=True, save_top_k=save_top_k
            ),
        ],
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_non_finite_stops_at_its_step_and_names_the_last_finite_checkpoint(tmp_path, where):
    with pytest.raises(
        NonFiniteError, match=r"at step 3; training stopped\. Suspects: the learning rate"
    ) as e:
        _toy_fit(tmp_path, _Toy(nan_at=3, where=where))
    assert ("non-finite loss" if where == "loss" else "non-finite gradients in lin.") in str(e.value)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert f"the last finite checkpoint is kept: {last}" in str(e.value)
    ckpt = torch.load(last, weights_only=False)
    assert ckpt["global_step"] == 3
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    assert not list((tmp_path / "ckpt").glob("*step=4*"))


@pytest.mark.parametrize("where", ["loss", "grad"])
@pytest.mark.parametrize(
    ("nan_at", "every_n", "seen_at"),
    [
        (5, 2, 6),  # read before the checkpoint of step 6: the last one kept is step 4's
        (5, 100, 7),  # no checkpoint in between: read at step 7, the 4th-step read ((7 + 1) % 4 == 0)
        (8, 100, 10),  # the last steps, between two reads: read when training ends
    ],
)
def test_a_guard_reading_every_4_steps_names_the_first_bad_step_and_no_checkpoint_takes_it(
    tmp_path, where, nan_at, every_n, seen_at
):
    # docs/SCALE.md section 11: the guard records on the device and reads (a host sync) every 4 optimizer steps, before
    # each checkpoint and at the end; the run stops within 4 steps, naming the first bad one, and every
    # checkpoint written is finite and from before it.
    guard = NonFiniteGuard(every_n_steps=4)
    with pytest.raises(
        NonFiniteError, match=rf"at step {nan_at}; training stopped \(seen at step {seen_at}"
    ) as e:
        _toy_fit(tmp_path, _Toy(nan_at=nan_at, where=where), every_n=every_n, guard=guard)
    assert ("non-finite loss (nan)" if where == "loss" else "non-finite gradients") in str(e.value)
    assert seen_at - nan_at < 4 or seen_at == 10
    for path in (tmp_path / "ckpt").glob("*.ckpt"):
        ckpt = torch.load(path, weights_only=False)
        assert ckpt["global_step"] <= nan_at
        assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())


def test_the_guard_reads_every_step_on_a_cpu_and_refuses_a_zero_period():
    trainer = pl.Trainer(logger=False, log_every_n_steps=50, enable_progress_bar=False)
    assert NonFiniteGuard().period(trainer, _Toy(nan_at=-1)) == 1  # a host read on a CPU waits for nothing
    assert NonFiniteGuard(every_n_steps=7).period(trainer, _Toy(nan_at=-1)) == 7
    with pytest.raises(ValueError, match="every_n_steps=0"):
        NonFiniteGuard(every_n_steps=0)


def test_atomic_save_keeps_the_old_file_on_a_full_disk(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    atomic_save({"a": torch.ones(3)}, target)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=f"cannot write checkpoint '{target}': No space left on device"):
        AtomicCheckpointIO().save_checkpoint({"a": torch.zeros(3)}, target)
    monkeypatch.undo()
    torch.testing.assert_close(torch.load(target)["a"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file left


def test_truncated_checkpoint_is_named_and_last_skips_it(tmp_path, capsys):
    old, new = tmp_path / "v0" / "a.ckpt", tmp_path / "v1" / "b.ckpt"
    atomic_save({"global_step": 1}, old)
    atomic_save({"global_step": 2, "pad": torch.zeros(1000)}, new)
    new.write_bytes(new.read_bytes()[:500])  # what a copy cut short leaves
    with pytest.raises(ValueError, match=f"checkpoint '{new}' cannot be loaded .*truncated or damaged"):
        load_checkpoint_file(new)
    path, ckpt = newest_loadable([tmp_path])
    assert path == old.resolve() and ckpt["global_step"] == 1
    assert f"skipping {new}" in capsys.readouterr().err
    old.write_bytes(b"")
    with pytest.raises(ValueError, match="none of the 2 checkpoints under .* loads"):
        newest_loadable([tmp_path])
    with pytest.raises(ValueError, match="no checkpoint under"):
        newest_loadable([tmp_path / "nothing"])


def test_last_means_the_highest_step_not_the_newest_file(tmp_path):
    """After a copy, an rsync or a touch, an old checkpoint is the newest file; `last` still takes the step-15
    one (issue 24, defect 9). Among equal steps the newest file wins."""
    import os

    early, late = tmp_path / "v0" / "epoch=0-step=3.ckpt", tmp_path / "v1" / "epoch=0-step=15.ckpt"
    atomic_save({"global_step": 15}, late)
    atomic_save({"global_step": 3}, early)
    os.utime(late, (1_000_000, 1_000_000))  # the step-15 file now looks years old
    path, ckpt = newest_loadable([tmp_path])
    assert path == late.resolve() and ckpt["global_step"] == 15
    again = tmp_path / "v2" / "last.ckpt"
    atomic_save({"global_step": 15, "newer": True}, again)
    assert newest_loadable([tmp_path])[1].get("newer") is True


def test_checkpoint_roots_cover_dirpaths_logger_versions_and_the_root():
    trainer = {
        "default_root_dir": "runs/x",
        "logger": [{"class_path": "CSVLogger", "init_args": {"save_dir": "runs", "name": "x"}}],
        "callbacks": [
            {"class_path": "pytorch_lightning.callbacks.ModelCheckpoint", "init_args": {"dirpath": "c"}}
        ],
    }
    assert checkpoint_roots(trainer) == [Path("c"), Path("runs/x")]


def test_dict_diff_names_only_the_keys_that_differ():
    a = {"model": {"d_model": 64, "n_layers": 2}, "plugins": {"pkm": {"topk": 8, "heads": 4}}}
    b = {"model": {"d_model": 64, "n_layers": 3}, "plugins": {"pkm": {"topk": 8, "heads": 2}}}
    assert dict_diff(a, b) == [
        "model.n_layers: checkpoint has 2, this run has 3",
        "plugins.pkm.heads: checkpoint has 4, this run has 2",
    ]
    assert dict_diff({"betas": (0.9, 0.95)}, {"betas": [0.9, 0.95]}) == []


def _versioned_config(tmp_path: Path) -> Path:
    """The test setup with a logger version per run and checkpoints in each version's folder (the default)."""
    cfg = {
        "trainer": {
            "default_root_dir": "runs/v",
            "logger": [
                # name and version set: a later file's item of the same class merges into the earlier one's
                {
                    "class_path": "pytorch_lightning.loggers.CSVLogger",
                    "init_args": {"save_dir": "runs", "name": "lightning_logs", "version": None},
                }
            ],
            "callbacks": [
                {
                    "class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
                    "init_args": {
                        "dirpath": None,
                        "save_last": True,
                        "every_n_train_steps": 3,
                        "save_top_k": -1,
                    },
                }
            ],
        }
    }
    path = tmp_path / "versioned.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_ckpt_path_last_resumes_across_logger_versions_and_skips_damaged(tmp_path, rlm_cache):
    args = fit_args(_versioned_config(tmp_path))
    run_rlm(args + ["--trainer.max_steps=3"], tmp_path, rlm_cache)
    v0 = tmp_path / "runs/lightning_logs/version_0"
    assert (v0 / "checkpoints/last.ckpt").is_file()
    proc = run_rlm(args + ["--trainer.max_steps=6", "--ckpt_path", "last"], tmp_path, rlm_cache)
    assert f"resuming from {(v0 / 'checkpoints/last.ckpt').resolve()} (step 3)" in proc.stderr
    v1 = tmp_path / "runs/lightning_logs/version_1"
    assert column(read_metrics(v1), "step")[0] >= 3  # continued, not from step 0
    for p in (v1 / "checkpoints").glob("*.ckpt"):  # every newer file damaged: the older one is taken
        p.write_bytes(p.read_bytes()[:1000])
    proc = run_rlm(args + ["--trainer.max_steps=4", "--ckpt_path", "last"], tmp_path, rlm_cache)
    assert "skipping" in proc.stderr and "truncated or damaged" in proc.stderr
    assert "(step 3)" in proc.stderr
    bad = v1 / "checkpoints/last.ckpt"
    proc = run_rlm(args + ["--ckpt_path", bad], tmp_path, rlm_cache, check=False)
    assert proc.returncode == 2 and f"rlm fit: error: checkpoint '{bad}' cannot be loaded" in proc.stderr
    assert "Traceback" not in proc.stderr


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_nan_run_exits_non_zero_naming_step_and_lr(tmp_path, rlm_cache):
    proc = run_rlm(fit_args() + ["--model.optim.lr", "1e3"], tmp_path, rlm_cache, check=False)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert "rlm fit: error: non-finite" in err and "at step 1" in err and "model.optim.lr=1000.0" in err
    assert "Traceback" not in err


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_a_changed_optim_on_resume_is_named_in_a_warning(tmp_path, rlm_cache):
    run_rlm(fit_args() + ["--trainer.max_steps=2"], tmp_path, rlm_cache)
    ckpt = tmp_path / "runs/test/ckpt/last.ckpt"
    proc = run_rlm(
        fit_args() + ["--trainer.max_steps=3", "--ckpt_path", ckpt, "--model.optim.lr=0.01"],
        tmp_path,
        rlm_cache,
    )
    assert "resuming keeps the checkpoint's optimizer settings; ignored" in proc.stderr
    assert "model.optim.lr: checkpoint has 0.003, this run has 0.01" in proc.stderr
    assert "model.optim.weight_decay" not in proc.stderr  # only the keys that differ


# ---- the learning-rate schedule keeps its horizon on resume ----------------------------------------------
def test_the_schedule_stays_at_its_floor_past_its_horizon():
    f = WarmupCosine(warmup=2, total=8, min_ratio=0.1)
    rates = [f(s) for s in range(20)]
    assert rates[:2] == [0.5, 1.0] and rates[2] == 1.0  # warmup, then the cosine's top
    assert all(a > b for a, b in zip(rates[2:8], rates[3:9]))  # down to the floor at the horizon
    assert rates[8:] == [pytest.approx(0.1)] * 12  # and there it stays
    assert rates == [warmup_cosine(s, 2, 8, 0.1) for s in range(20)]


_TINY = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
_LR, _WARMUP, _FLOOR = 1e-2, 1, 0.1


class _Rates(pl.Callback):
    """The learning rate of each scheduled group at every step, as the optimizer uses it."""

    def __init__(self) -> None:
        self.at: dict[int, list[float]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        sched = trainer.lr_scheduler_configs[0].scheduler
        groups = zip(trainer.optimizers[0].param_groups, sched.lr_lambdas)
        self.at[trainer.global_step] = [g["lr"] for g, f in groups if isinstance(f, WarmupCosine)]


def _lm_fit(tmp_path: Path, max_steps: int, ckpt_path: Path | None = None, **optim) -> _Rates:
    """An in-process fit of a tiny LMModule on random tokens, checkpointing its last step under tmp_path."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        t = torch.randint(0, _TINY["vocab_size"], (2, 17), generator=g)
        batches.append(
            {"tokens": t[:, :-1], "targets": t[:, 1:], "mask": torch.ones(2, 16, dtype=torch.bool)}
        )
    module = LMModule(
        model=_TINY, optim=dict(lr=_LR, warmup_steps=_WARMUP, min_lr_ratio=_FLOOR, **optim), peak_flops=1e12
    )
    rates = _Rates()
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[rates, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    return rates


def test_a_resumed_run_keeps_the_saved_horizon_and_stays_at_the_floor_past_it(tmp_path, caplog):
    first = _lm_fit(tmp_path, max_steps=4)
    ckpt = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)
    saved = [f for f in ckpt["lr_schedulers"][0]["lr_lambdas"] if f is not None]
    assert saved and all(f["total"] == 4 for f in saved)  # the horizon travels with the run
    with caplog.at_level(logging.INFO):
        resumed = _lm_fit(tmp_path, max_steps=8, ckpt_path=tmp_path / "last.ckpt")
    assert sorted(resumed.at) == [4, 5, 6, 7]
    last = first.at[3]
    for step in (4, 5, 6, 7):  # no jump up: the cosine ended at step 4, the floor holds from there
        assert resumed.at[step] == pytest.approx([_FLOOR * _LR] * len(last)) and resumed.at[step] <= last
    notice = [r.getMessage() for r in caplog.records if "learning-rate schedule ends" in r.getMessage()]
    assert len(notice) == 1 and "ends at step 4 and this run goes on to step 8" in notice[0]
    assert "--model.optim.total_steps" in notice[0]


def test_optim_total_steps_lays_the_schedule_out_anew_on_resume(tmp_path, caplog):
    _lm_fit(tmp_path, max_steps=4)
    with caplog.at_level(logging.INFO):
        resumed = _lm_fit(tmp_path, max_steps=8, ckpt_path=tmp_path / "last.ckpt", total_steps=8)
    for step in (4, 5, 6, 7):  # asked for: the cosine over 8 steps, from the resumed step on
        assert resumed.at[step][0] == pytest.approx(_LR * warmup_cosine(step, _WARMUP, 8, _FLOOR))
    assert not any("learning-rate schedule ends" in r.getMessage() for r in caplog.records)
    ckpt = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)
    assert all(f["total"] == 8 for f in ckpt["lr_schedulers"][0]["lr_lambdas"] if f is not None)
    with pytest.raises(ValueError, match="optim.total_steps must be >= 1"):
        LMModule(model=_TINY, optim=dict(total_steps=0))


def _lr_at(run_dir: Path) -> dict[int, list[float]]:
    """The logged learning rates (every lr-AdamW... column of metrics.csv), by step."""
    out: dict[int, list[float]] = {}
    for row in read_metrics(run_dir):
        rates = [float(v) for k, v in sorted(row.items()) if k.startswith("lr-AdamW") and v not in (None, "")]
        if rates:
            out[int(row["step"])] = rates
    return out


# slow: the printed resume command and --model.optim.total_steps go through the real CLI (its config merge)
@pytest.mark.slow
def test_the_printed_resume_command_continues_the_learning_rate_schedule(tmp_path, rlm_cache):
    args = fit_args() + ["--model.optim.warmup_steps=1", "--model.optim.min_lr_ratio=0.1"]
    first = run_rlm(args + ["--trainer.max_steps=4"], tmp_path, rlm_cache)
    label = "resume (on to step 8, lr at its floor from step 4)"
    line = next(ln for ln in first.stdout.splitlines() if ln.strip().startswith(label))
    command = line.strip()[len(label) :].strip()
    assert command.endswith("--ckpt_path last --trainer.max_steps 8")
    before = _lr_at(tmp_path / "runs/test/version_0")
    again = run_rlm([*command.split()[1:], "--trainer.enable_progress_bar=false"], tmp_path, rlm_cache)
    assert (
        "the learning-rate schedule ends at step 4 and this run goes on to step 8"
        in again.stdout + again.stderr
    )
    after = _lr_at(tmp_path / "runs/test/version_0")  # the test config's logger writes version 0 each time
    lr = yaml.safe_load((tmp_path / "runs/test/version_0/config.yaml").read_text())["model"]["optim"]["lr"]
    assert min(after) == 4 and after[4][0] <= before[3][0]  # no jump up at the first resumed step
    assert after[4][0] == pytest.approx(0.1 * lr) and after[7][0] == pytest.approx(0.1 * lr)
    # a new horizon, asked for at resume, is taken (not replaced by the checkpoint's optim settings)
    config = tmp_path / "runs/test/version_0/config.yaml"
    third = run_rlm(
        [
            "fit",
            "--config",
            config,
            "--ckpt_path",
            "last",
            "--trainer.max_steps=12",
            "--model.optim.total_steps=12",
        ],
        tmp_path,
        rlm_cache,
    )
    assert "total_steps" not in third.stderr  # not among the ignored optim settings
    rates = _lr_at(tmp_path / "runs/test/version_0")
    for step in (8, 11):
        assert rates[step][0] == pytest.approx(lr * warmup_cosine(step, 1, 12, 0.1))
