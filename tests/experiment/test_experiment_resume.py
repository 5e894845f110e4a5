"""Experiment reruns: resume from the newest loadable checkpoint (or afresh), metrics history kept and stitched."""

from __future__ import annotations

from pathlib import Path

import torch

from rlm.experiment.runner import _prepare_dir
from rlm.experiment.runs import METRICS_CSV, Run, run_metrics, series
from rlm.train.checkpoint import atomic_save


def _csv(path: Path, rows: list[tuple[int, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("step,train/loss,time/train_s\n" + "".join(f"{s},{v},{s * 2.0}\n" for s, v in rows))


def _run(tmp_path: Path) -> Run:
    run = Run("base", 0, tmp_path / "base" / "seed0", {"model": {"d_model": 8}})
    run.dir.mkdir(parents=True)
    (run.dir / "fingerprint").write_text(run.fingerprint + "\n")
    return run


def test_resume_takes_the_newest_loadable_checkpoint_and_keeps_the_metrics(tmp_path, capsys):
    run = _run(tmp_path)
    ckpt = run.dir / "ckpt"
    atomic_save({"global_step": 3}, ckpt / "epoch=0-step=3.ckpt")
    atomic_save({"global_step": 6, "pad": torch.zeros(100)}, ckpt / "last.ckpt")
    (ckpt / "last.ckpt").write_bytes((ckpt / "last.ckpt").read_bytes()[:300])  # a kill mid-copy
    _csv(run.dir / METRICS_CSV, [(0, 5.0), (1, 4.0), (2, 3.0), (3, 2.5), (4, 2.4)])
    assert _prepare_dir(run) == ["--ckpt_path", str((ckpt / "epoch=0-step=3.ckpt").resolve())]
    assert "skipping" in capsys.readouterr().out
    # The resumed attempt logs from step 3 on; steps 3 and 4 of the first attempt were trained again.
    _csv(run.dir / METRICS_CSV, [(3, 2.6), (4, 2.3), (5, 2.0)])
    rows = run_metrics(run.dir)
    assert series(rows, "train/loss") == [(0, 5.0), (1, 4.0), (2, 3.0), (3, 2.6), (4, 2.3), (5, 2.0)]
    assert [t for _, t in series(rows, "time/train_s")] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


def test_rerun_starts_afresh_when_no_checkpoint_loads(tmp_path, capsys):
    run = _run(tmp_path)
    (run.dir / "ckpt").mkdir()
    (run.dir / "ckpt" / "last.ckpt").write_bytes(b"PK\x03\x04 truncated")
    assert _prepare_dir(run) == []
    assert "starting afresh" in capsys.readouterr().out
    assert sorted(p.name for p in run.dir.iterdir()) == ["fingerprint"]


def test_a_damaged_last_checkpoint_is_removed_so_the_rerun_can_write_it_again(tmp_path, capsys):
    """A damaged last.ckpt beside a loadable step-30 checkpoint: the rerun resumes from step 30 and the damaged
    file goes, so the final save can write last.ckpt (and the test evaluation read it) instead of failing on
    every rerun (issue 24, defect 4)."""
    run = _run(tmp_path)
    ckpt = run.dir / "ckpt"
    atomic_save({"global_step": 30}, ckpt / "epoch=0-step=30.ckpt")
    (ckpt / "last.ckpt").write_bytes(b"PK\x03\x04 cut short")
    assert _prepare_dir(run) == ["--ckpt_path", str((ckpt / "epoch=0-step=30.ckpt").resolve())]
    assert not (ckpt / "last.ckpt").exists()
