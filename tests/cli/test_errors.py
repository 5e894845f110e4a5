"""Bad input to ``rlm fit`` is an ``rlm fit: error: ...`` naming the value, file or path, never a traceback."""

from __future__ import annotations

import pytest
from cli_helpers import CONFIGS, TINY

from rlm.cli import main
from rlm.cli.check import check_writable

BASE = [a for p in TINY for a in ("--config", str(p))]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLM_DEBUG", raising=False)


def _fit_error(args, capsys) -> str:
    assert main(["fit", *BASE, *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_yaml_syntax_error_names_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  optim: {lr: 1\n")
    err = _fit_error(["--config", str(bad)], capsys)
    assert f"rlm fit: error: config file '{bad}' is not valid YAML" in err and "line 2" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.optim.lrr=1"], "model.optim: unknown key 'lrr'; accepted: ['lr', "),
        (["--model.model.d_modl=8"], "model.model: unknown key 'd_modl'; accepted: ['vocab_size', "),
        (["--model.optim.lr=abc"], "model.optim.lr: must be a number, got 'abc'"),
        (["--trainer.max_steps=0"], "--trainer.max_steps 0 trains nothing"),
        (["--trainer.max_steps=-5"], "--trainer.max_steps -5 trains nothing"),
        (["--trainer.max_epochs=0"], "--trainer.max_epochs 0 trains nothing"),
        (["--trainer.max_epochs=-3"], "--trainer.max_epochs -3 trains nothing"),
        (["--trainer.limit_train_batches=0"], "--trainer.limit_train_batches 0 trains nothing"),
        (["--trainer.limit_train_batches=0.0"], "--trainer.limit_train_batches 0 trains nothing"),
        (["--trainer.val_check_interval=0"], "--trainer.val_check_interval 0; accepted: a number of batches"),
        (
            ["--trainer.accumulate_grad_batches=0"],
            "--trainer.accumulate_grad_batches 0; accepted: an integer",
        ),
        (
            ["--model.plugins.moe.capacity_factor=big"],
            "model.plugins.moe.capacity_factor: must be a number, got 'big'",
        ),
        (["--model.plugins.nope.x=1"], "unknown plugin 'nope'; known plugins: ['altup', "),
        (
            [
                "--config",
                str(CONFIGS / "plugins/retrieval.yaml"),
                "--model.plugins.retrieval.target_recall=x",
            ],
            "target_recall",
        ),
    ],
)
def test_bad_values_name_the_key_and_what_is_accepted(args, message, capsys):
    assert message in _fit_error(args, capsys)


def test_unwritable_output_folder_is_named_before_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = _fit_error([f"--trainer.default_root_dir={blocker}/runs"], capsys)
    assert f"rlm fit: error: output folder '{blocker}/runs' is not writable" in err


def test_check_writable_creates_nothing_and_leaves_no_probe(tmp_path):
    check_writable(tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []


def test_no_merged_config_file_is_left_in_the_temp_folder(tmp_path, monkeypatch, capsys):
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    _fit_error(["--trainer.max_steps=0"], capsys)  # the config was merged and parsed, then refused
    assert list(scratch.iterdir()) == []


def test_truncated_checkpoint_is_named_by_generate_and_index_build(tmp_path, capsys):
    from rlm.train.checkpoint import atomic_save

    bad = tmp_path / "last.ckpt"
    atomic_save({"state_dict": {}, "pad": list(range(1000))}, bad)
    bad.write_bytes(bad.read_bytes()[:200])
    assert main(["generate", "--ckpt", str(bad)]) == 2
    assert f"rlm generate: error: checkpoint '{bad}' cannot be loaded" in capsys.readouterr().err
    assert main(["index", "build", "--ckpt", str(bad), "--out", str(tmp_path / "idx")]) == 2
    err = capsys.readouterr().err
    assert f"rlm index build: error: checkpoint '{bad}' cannot be loaded" in err and "Traceback" not in err


def test_damaged_or_foreign_checkpoints_are_named_by_eval_validate_test_and_fit(tmp_path, capsys):
    """rlm eval / validate / test on a truncated file, and rlm fit --ckpt_path on a plain torch.save dict: one
    error line naming the file, never a traceback (issue 24, defect 4)."""
    import torch

    from rlm.train.checkpoint import atomic_save

    bad = tmp_path / "cut.ckpt"
    atomic_save({"state_dict": {}, "pad": list(range(1000))}, bad)
    bad.write_bytes(bad.read_bytes()[:200])
    assert main(["eval", "--ckpt", str(bad)]) == 2
    assert f"rlm eval: error: checkpoint '{bad}' cannot be loaded" in capsys.readouterr().err
    for command in ("validate", "test"):
        assert main([command, "--ckpt_path", str(bad)]) == 2
        err = capsys.readouterr().err
        assert f"checkpoint '{bad}' cannot be loaded" in err and "Traceback" not in err
    plain = tmp_path / "plain.pt"
    torch.save({"weights": torch.zeros(2)}, plain)
    err = _fit_error(["--ckpt_path", str(plain)], capsys)
    assert f"--ckpt_path {plain} is not a checkpoint written by rlm fit" in err and "['weights']" in err


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [("--top-k", "-3", "--top-k -3"), ("--max-new-tokens", "-5", "--max-new-tokens -5"),
     ("--temperature", "-1", "--temperature -1.0"), ("--temperature", "nan", "--temperature: must be a number, got 'nan'"),
     ("--temperature", "inf", "--temperature: must be a number, got 'inf'"), ("--top-k", "x", "--top-k: must be an integer")],
)  # fmt: skip
def test_generate_refuses_bad_values_by_name(tmp_path, capsys, flag, value, says):
    assert main(["generate", "--ckpt", str(tmp_path / "x.ckpt"), flag, value]) == 2
    assert f"rlm generate: error: {says}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "flag", "says"),
    [("generate", "--top-k", "--top-k: must be an integer, got ''"),
     ("generate", "--top-p", "--top-p: must be a number, got ''"),
     ("eval", "--split", "--split: must be one of 'test', 'val', 'train', got ''")],
)  # fmt: skip
def test_a_flag_given_last_with_no_value_is_one_line(tmp_path, capsys, command, flag, says):
    assert main([command, "--ckpt_path", str(tmp_path / "x.ckpt"), flag]) == 2
    assert capsys.readouterr().err == f"rlm {command}: error: {says}\n"


def test_every_command_with_a_device_flag_checks_it(tmp_path, rlm_main, monkeypatch):
    """rlm eval and rlm knnlm build handed --device to torch unchecked (a traceback on cuda without a GPU or on
    foo) and rlm generate took meta: each names the value and this machine's devices, before the checkpoint."""
    import torch

    from rlm.eval.knnlm_cli import device_arg

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this test's machine: a CPU-only torch
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    ckpt = tmp_path / "never_read.ckpt"
    for command, args in (
        ("generate", ["generate", "--ckpt", ckpt]),
        ("eval", ["eval", "--ckpt", ckpt]),
        ("knnlm build", ["knnlm", "build", "--ckpt", ckpt, "--out", tmp_path / "ds"]),
    ):
        for device in ("cuda", "cuda:0", "foo", "meta"):
            proc = rlm_main([*args, "--device", device], tmp_path)
            assert proc.returncode == 2, proc.stderr
            says = f"rlm {command}: error: --device {device!r} is not usable here; accepted: cpu\n"
            assert proc.stderr.endswith(says), proc.stderr
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # two GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [device_arg(d) for d in ("cpu", "cuda", "cuda:1", None)] == ["cpu", "cuda", "cuda:1", "cuda"]
    with pytest.raises(
        ValueError, match=r"--device 'cuda:2' is not usable here; accepted: cpu, cuda, cuda:0, cuda:1$"
    ):
        device_arg("cuda:2")


@pytest.mark.parametrize(
    ("held", "setting"),
    [("shared", "--trainer.default_root_dir"), ("runs/test", "logger save_dir or name"),
     ("runs/test/ckpt", "ModelCheckpoint dirpath")],
)  # fmt: skip
def test_a_second_fit_in_the_same_root_is_refused_while_the_first_runs(tmp_path, capsys, held, setting):
    """Two rlm fit runs in one default_root_dir shared version_0 (one metrics.csv with both runs' rows, each
    overwriting the other's checkpoints): the second is now refused, naming the first's pid; once the first has
    ended, the folder is free again. The same for the folders tests/configs/fast.yaml gives its logger
    (runs/test) and its checkpoints (runs/test/ckpt), which two runs with their own default_root_dir share: the
    second run's CSV logger failed ('dict contains fields not in fieldnames') and the first's --ckpt_path last
    resumed the second's checkpoint."""
    import subprocess
    import sys

    from rlm.cli.check import hold_run_lock, release_run_locks

    folder = tmp_path / held
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from rlm.cli.check import "
         f"hold_run_lock; hold_run_lock(Path({str(folder)!r})); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        err = _fit_error([f"--trainer.default_root_dir={tmp_path / 'shared'}"], capsys)
        assert f"another rlm fit (pid {holder.pid}) is running in {folder}" in err
        assert f"give this run its own {setting}" in err
    finally:
        holder.kill()
        holder.wait()
    hold_run_lock(folder)  # free again: the lock went with the process
    release_run_locks()


def test_one_flag_style_with_the_other_spellings_as_aliases():
    from rlm.cli.commands import typed_argv
    from rlm.cli.support import canonical_flags
    from rlm.experiment.cli import cmd_run
    from rlm.index.cli import cmd_build, cmd_search

    def eval_like(*, ckpt: str, batch_size: int | None = None, knn_k: int | None = None) -> int:
        return 0

    assert typed_argv(eval_like, ["--ckpt_path", "c", "--batch_size=4", "--knn-k", "8", "--", "--x_y"]) == [
        "--ckpt", "c", "--batch_size=4", "--knn_k", "8", "--", "--x_y"
    ]  # fmt: skip
    assert typed_argv(cmd_run, ["f.yaml", "--set", "trainer.max_steps=3", "--no_reuse", "--seeds", "0", "1"]) == [
        "f.yaml", "--set+=trainer.max_steps=3", "--no_reuse=true", "--seeds+=0", "--seeds+=1"
    ]  # fmt: skip
    assert typed_argv(cmd_build, ["--no-gpu", "--quiet", "false", "--batch-size", "-1"]) == [
        "--gpu=False", "--quiet=false", "--batch_size", "-1"
    ]  # fmt: skip
    assert typed_argv(cmd_search, ["idx", "a query", "-k", "2"]) == ["idx", "--text=a query", "--k", "2"]
    assert canonical_flags("fit", ["--ckpt", "last", "--trainer.max_steps=3", "--ckpt_path=x", "--ckpt=y"]) == [
        "--ckpt_path", "last", "--trainer.max_steps=3", "--ckpt_path=x", "--ckpt_path=y"
    ]  # fmt: skip
