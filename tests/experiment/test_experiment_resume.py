"""Experiment reruns: resume from the newest loadable checkpoint (or afresh), metrics history kept and stitched."""

from __future__ import annotations

from pathlib import Path

import pytest
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


def test_a_checkpoint_of_the_last_step_is_used_as_it_is_not_resumed(tmp_path, capsys):
    """A run whose summary went, with its last.ckpt damaged, but a loadable checkpoint of its last step: resuming
    it trained nothing and saved no last.ckpt, so its evaluation failed on every rerun. The checkpoint becomes
    last.ckpt instead, and nothing is trained; with the run's metrics gone too, it trains afresh."""
    run = Run("base", 0, tmp_path / "base" / "seed0", {"trainer": {"max_steps": 30}})
    run.dir.mkdir(parents=True)
    (run.dir / "fingerprint").write_text(run.fingerprint + "\n")
    ckpt = run.dir / "ckpt"
    atomic_save({"global_step": 30}, ckpt / "epoch=0-step=30.ckpt")
    (ckpt / "last.ckpt").write_bytes(b"PK\x03\x04 cut short")
    _csv(run.dir / METRICS_CSV, [(28, 3.0), (29, 2.9)])
    assert _prepare_dir(run) is None
    assert torch.load(ckpt / "last.ckpt", weights_only=False)["global_step"] == 30
    assert (run.dir / METRICS_CSV).is_file()  # kept in place: no new attempt logs
    (run.dir / METRICS_CSV).unlink()
    assert _prepare_dir(run) == [] and "its metrics are gone; starting afresh" in capsys.readouterr().out
    assert not ckpt.exists()


def test_a_run_folder_the_runner_did_not_write_is_refused_not_deleted(tmp_path):
    """out/VARIANT/seedN holding someone's files (no fingerprint, no job.json) was deleted to train the run."""
    from rlm.experiment.runner import execute

    run = Run("base", 0, tmp_path / "base" / "seed0", {"model": {"d_model": 8}})
    run.dir.mkdir(parents=True)
    (run.dir / "notes.txt").write_text("mine\n")
    for call in (lambda: _prepare_dir(run), lambda: execute(run, tmp_path)):
        with pytest.raises(
            ValueError, match=r"holds files that rlm experiment did not write \('notes.txt'"
        ) as err:
            call()
        assert str(run.dir) in str(err.value) and "choose another --out" in str(err.value)
    assert sorted(p.name for p in run.dir.iterdir()) == ["notes.txt"]
    (run.dir / "notes.txt").unlink()  # an empty folder is taken
    assert _prepare_dir(run) == [] and (run.dir / "fingerprint").is_file()
