"""What a run of ``rlm fit`` does around the training: the trainer it builds from the user's values, and what
it leaves on disk and prints."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from cli_helpers import TINY, fit_args, read_metrics, run_rlm


def test_limit_val_batches_1_is_one_batch_and_1_0_the_whole_set(tmp_path, monkeypatch):
    """`1` (flag or YAML) reaches the Trainer and the config.yaml it saves as the int 1, one batch; `1.0` as the
    float, the whole set: Lightning types limit_*_batches Optional[Union[int, float]], int first, and jsonargparse
    tries a union's types in order."""
    from rlm.cli.lightning_cli import RLMCLI
    from rlm.data.module import RLMDataModule
    from rlm.train.module import LMModule

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLM_CACHE", str(tmp_path / "cache"))
    configs = [a for p in TINY for a in ("--config", str(p))]

    def build(*flags: str) -> RLMCLI:
        return RLMCLI(LMModule, RLMDataModule, args=[*configs, *flags], run=False, seed_everything_default=0,
                      parser_kwargs={"parser_mode": "omegaconf+"})  # fmt: skip

    cli = build("--trainer.limit_val_batches", "1", "--trainer.limit_test_batches=1.0")
    t = cli.trainer
    # config.yaml as SaveConfigCallback writes it
    saved = yaml.safe_load(cli.parser.dump(cli.config, skip_none=False))["trainer"]
    for value in (t.limit_val_batches, saved["limit_val_batches"]):
        assert value == 1 and isinstance(value, int)
    for value in (t.limit_test_batches, saved["limit_test_batches"]):
        assert value == 1.0 and isinstance(value, float)
    cfg = tmp_path / "one.yaml"
    cfg.write_text("trainer:\n  limit_val_batches: 1\n")
    t = build("--config", str(cfg)).trainer
    assert t.limit_val_batches == 1 and isinstance(t.limit_val_batches, int)


@pytest.fixture(scope="module")
def tiny_fit(tmp_path_factory, rlm_cache):
    """One 2-step tiny fit validating on one batch: (workdir, the finished process)."""
    work = tmp_path_factory.mktemp("fit")
    args = [
        *fit_args(),
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches",
        "1",
        "--trainer.enable_progress_bar=true",  # where the pytree warning used to appear
    ]
    return work, run_rlm(args, work, rlm_cache)


# slow: reads the real `rlm fit` subprocess of tiny_fit (its files, its output as a user sees it)
@pytest.mark.slow
def test_the_saved_config_keeps_limit_val_batches_1_as_an_integer(tiny_fit):
    work, _ = tiny_fit
    saved = yaml.safe_load((work / "runs/test/version_0/config.yaml").read_text())["trainer"]
    assert saved["limit_val_batches"] == 1 and isinstance(
        saved["limit_val_batches"], int
    )  # a rerun: one batch


def test_a_fit_failing_before_its_first_step_leaves_no_version_folder(tmp_path, rlm_cache, rlm_main):
    """The data module's check of the batch size runs inside trainer.fit, after the loggers made their folders
    (issue 24: an empty version_N was left behind, and the next run took version_N+1)."""
    old = tmp_path / "runs/test/version_7"
    old.mkdir(parents=True)  # an earlier run's folder: not this run's to remove
    (old / "hparams.yaml").write_text("{}\n")
    proc = rlm_main([*fit_args(), "--data.batch_size=100000"], tmp_path, rlm_cache)
    assert proc.returncode == 2 and "fewer than batch_size=100000" in proc.stderr, proc.stderr
    assert sorted(p.name for p in (tmp_path / "runs/test").iterdir()) == [".rlm-fit.lock", "version_7"]
    assert "created by this run before it failed" in proc.stderr


def test_only_folders_created_by_the_run_and_holding_startup_files_are_removed(tmp_path):
    from rlm.cli.check import new_dirs, remove_unused_dirs

    kept, gone = tmp_path / "a/version_0", tmp_path / "a/tb/version_0"
    fresh = new_dirs([kept, gone, tmp_path])
    assert fresh == [gone, kept, tmp_path / "a/tb", tmp_path / "a"]
    (kept / "checkpoints").mkdir(parents=True)
    (kept / "metrics.csv").write_text("step\n0\n")  # trained: kept
    gone.mkdir(parents=True)
    (gone / "hparams.yaml").write_text("{}\n")
    (gone / "events.out.tfevents.1.host.2.0").write_bytes(b"")
    assert remove_unused_dirs(fresh) == [gone, tmp_path / "a/tb"]
    assert (kept / "metrics.csv").is_file() and not (tmp_path / "a/tb").exists()


def _block(stdout: str) -> dict[str, str]:
    """The end-of-run block's ``name  value`` lines (after its title line)."""
    lines = stdout[stdout.index("rlm fit: finished") :].splitlines()
    return {k: v.strip() for k, v in (ln.strip().split("  ", 1) for ln in lines[1:] if ln.startswith("  "))}


# slow: reads the real `rlm fit` subprocess of tiny_fit (its files, its output as a user sees it)
@pytest.mark.slow
def test_the_end_of_a_fit_says_where_everything_went_and_what_to_run_next(tiny_fit, rlm_cache):
    work, proc = tiny_fit
    title = proc.stdout[proc.stdout.index("rlm fit: finished") :].splitlines()[0]
    val = float(title.split("val/loss ")[1].split(" ")[0])
    assert re.search(
        r"val/loss [0-9.]+ on 1 of \d+ batches,", title
    )  # limit_val_batches 1: a subset, said so
    rows = [r for r in read_metrics(work / "runs/test/version_0") if r.get("val/loss")]
    assert title.startswith("rlm fit: finished at step 2, val/loss") and val == round(
        float(rows[-1]["val/loss"]), 4
    )
    facts = _block(proc.stdout)
    assert (
        facts["checkpoint"] == "runs/test/ckpt/last.ckpt"
        and facts["metrics"] == "runs/test/version_0/metrics.csv"
    )
    assert facts["config"] == "runs/test/version_0/config.yaml"
    assert all((work / facts[k]).is_file() for k in ("checkpoint", "metrics", "config"))
    assert "tensorboard" not in facts  # the test config logs no TensorBoard: no line rather than a wrong one
    assert facts["eval"] == "rlm eval --ckpt runs/test/ckpt/last.ckpt"
    assert facts["export"] == "rlm export --ckpt runs/test/ckpt/last.ckpt --out runs/test/export"
    assert facts["generate"].startswith("rlm generate --ckpt runs/test/ckpt/last.ckpt --prompt")
    # the printed resume command, run as printed, continues the run from its last checkpoint; its schedule ended
    # at step 2 and resuming keeps it (tests/train/test_resume.py), which the label says
    resume = facts["resume (on to step 4, lr at its floor from step 2)"]
    assert resume == "rlm fit --config runs/test/version_0/config.yaml --ckpt_path last --trainer.max_steps 4"
    again = run_rlm([*shlex.split(resume)[1:], "--trainer.enable_progress_bar=false"], work, rlm_cache)
    assert "resuming from" in again.stderr and "rlm fit: finished at step 4" in again.stdout


# slow: reads the real `rlm fit` subprocess of tiny_fit (its files, its output as a user sees it)
@pytest.mark.slow
def test_a_fit_prints_no_litlogger_tip_and_no_pytree_deprecation(tiny_fit):
    _, proc = tiny_fit
    out = proc.stdout + proc.stderr
    assert "Epoch 0" in out  # the progress bar ran, where the warning used to appear
    assert "litlogger" not in out.lower() and "LeafSpec" not in out
    # LMModule's hook (docs/SCALE.md section 11), overridden on purpose
    assert "transfer_batch_to_device" not in out


def test_the_noise_filters_are_precise():
    """Only those three messages go: the same logger's other lines and other warnings still show."""
    import logging
    import warnings

    from rlm.cli.support import LITLOGGER_TIP, quiet_known_noise

    quiet_known_noise()
    quiet_known_noise()  # idempotent
    log = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    record = lambda msg: logging.LogRecord(log.name, logging.INFO, __file__, 1, msg, None, None)  # noqa: E731
    assert not log.filter(record(LITLOGGER_TIP + " and experiment tracking, try installing [litlogger]"))
    assert log.filter(record("`Trainer(limit_val_batches=1)` was configured so 1 batch will be used."))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        quiet_known_noise()
        warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning,
                               "_pytree.py", 21, module="pytorch_lightning.utilities._pytree")  # fmt: skip
        warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning,
                               "mine.py", 1, module="mypackage.mine")  # fmt: skip
        warnings.warn_explicit("something else is deprecated", FutureWarning, "_pytree.py", 22,
                               module="pytorch_lightning.utilities._pytree")  # fmt: skip
        hook = "You have overridden `{}` in `LightningModule` but have passed in a `LightningDataModule`. It will ..."
        warnings.warn(hook.format("transfer_batch_to_device"), UserWarning, stacklevel=1)
        warnings.warn(hook.format("on_after_batch_transfer"), UserWarning, stacklevel=1)
    assert [str(w.message)[:20] for w in seen] == [
        "`isinstance(treespec",
        "something else is de",
        "You have overridden ",
    ]


def test_a_validation_loss_on_a_subset_of_the_split_says_so(tmp_path, monkeypatch):
    """limit_val_batches makes val/loss a subset's loss (5.479 where `rlm eval --split val` gave 5.008)."""
    from types import SimpleNamespace

    from rlm.cli.summary import fit_summary, val_subset

    assert [val_subset(x) for x in (None, 1.0, float("inf"), 25, 25.0, 1, 0.1)] == [
        "", "", "", "25 batches", "25 batches", "1 batch", "10% of the batches",
    ]  # fmt: skip
    assert val_subset(25, 300) == "25 of 300 batches" and val_subset(0.5, 300) == "150 of 300 batches"
    assert val_subset(25, 10) == "" and val_subset(10, 10) == ""  # the limit covers the whole split
    monkeypatch.chdir(tmp_path)
    trainer = SimpleNamespace(
        callback_metrics={"val/loss": 5.479, "train/loss": 5.2}, global_step=50, checkpoint_callbacks=[],
        loggers=[], num_val_batches=[25], val_dataloaders=range(300),  # a loader of 300 batches
    )  # fmt: skip
    title = fit_summary(trainer).splitlines()[0]
    assert title == "rlm fit: finished at step 50, val/loss 5.4790 on 25 of 300 batches, train/loss 5.2000"
    trainer.num_val_batches = [300]
    assert "val/loss 5.4790, train/loss" in fit_summary(trainer)  # the whole split: nothing to add


def test_eval_and_experiment_blocks_name_the_checkpoint_and_the_best_run(tmp_path, monkeypatch):
    from rlm.cli.summary import eval_summary, experiment_summary

    monkeypatch.chdir(tmp_path)
    text = eval_summary("runs/x/ckpt/last.ckpt", "out.json")
    assert "checkpoint  runs/x/ckpt/last.ckpt" in text and "results     out.json" in text
    assert "rlm generate --ckpt runs/x/ckpt/last.ckpt" in text
    assert "rlm export --ckpt runs/x/ckpt/last.ckpt --out runs/x/export" in text
    assert "rlm eval --ckpt" not in text  # it just ran
    out = tmp_path / "exp"
    runs = [("a/seed0", out / "a/seed0", out / "a/seed0/ckpt/last.ckpt", {"val_loss": 3.5, "test_loss": 3.6}),
            ("b/seed0", out / "b/seed0", out / "b/seed0/ckpt/last.ckpt", {"val_loss": 3.25, "test_loss": None})]  # fmt: skip
    text = experiment_summary(out, runs, [out / "results.md"])
    assert "exp/a/seed0  (val loss 3.5000, test loss 3.6000)" in text and "(val loss 3.2500)" in text
    runs[0][3]["val_batches"] = 25  # trainer.limit_val_batches: a subset of the split, said so
    assert "(val loss 3.5000 on 25 batches, test loss 3.6000)" in experiment_summary(out, runs, [])
    assert "rlm experiment report exp" in text and "exp/results.md" in text
    assert "rlm eval --ckpt exp/b/seed0/ckpt/last.ckpt" in text  # the lowest validation loss
