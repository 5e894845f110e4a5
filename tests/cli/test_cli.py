"""The real ``rlm`` command end to end: fit, resume, DDP on CPU, generate, validate, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_helpers import CONFIGS, DDP_2CPU, column, fit_args, read_metrics, run_rlm
from torch.testing import assert_close

from rlm.cli import main
from rlm.cli.commands import COMMANDS

RUN = Path("runs/test/version_0")


def test_command_table_is_pinned(capsys):
    assert list(COMMANDS) == [
        "fit",
        "validate",
        "test",
        "eval",
        "generate",
        "export",
        "index",
        "knnlm",
        "experiment",
        "plugins",
    ]
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'; known commands: fit, validate" in capsys.readouterr().err


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_fit_logs_checkpoints_and_generates(tmp_path, rlm_cache):
    run_rlm(fit_args(CONFIGS / "plugins" / "tokenid.yaml"), tmp_path, rlm_cache)
    rows = read_metrics(tmp_path / RUN)
    for name in ("train/loss", "train/ppl", "train/tokens_per_s", "val/loss", "val/ppl", "lr-AdamW/decay"):
        assert column(rows, name), f"{name} was not logged"
    assert len(column(rows, "train/loss")) == 6
    ckpt = tmp_path / "runs/test/ckpt/last.ckpt"
    assert ckpt.is_file()
    assert (tmp_path / RUN / "config.yaml").is_file() or (tmp_path / "runs/test/config.yaml").is_file()
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    saved = state["hyper_parameters"]["plugins"]
    assert list(saved) == ["tokenid"] and {k: saved["tokenid"][k] for k in ("layers", "rank")} == {
        "layers": [0],
        "rank": 0,
    }
    out = run_rlm(
        ["generate", "--ckpt", ckpt, "--prompt", "def ", "--max-new-tokens", "20", "--temperature", "0"],
        tmp_path,
        rlm_cache,
    )
    assert out.stdout.startswith("def ") and len(out.stdout) > 5
    # the other spellings (--ckpt_path, --max_new_tokens), and the full recompute: the same greedy text
    again = run_rlm(
        ["generate", "--ckpt_path", ckpt, "--prompt", "def ", "--max_new_tokens", "20", "--temperature", "0",
         "--no-cache"],
        tmp_path,
        rlm_cache,
    )  # fmt: skip
    assert again.stdout == out.stdout
    val = run_rlm(fit_args(command="validate") + ["--ckpt", ckpt], tmp_path, rlm_cache)
    assert "val/loss" in val.stdout


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_resume_gives_the_same_loss_curve(tmp_path, rlm_cache):
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight.mkdir(), split.mkdir()
    run_rlm(fit_args() + ["--trainer.max_steps=6"], straight, rlm_cache)
    run_rlm(fit_args() + ["--trainer.max_steps=3"], split, rlm_cache)
    first = column(read_metrics(split / RUN), "train/loss")  # the resumed run rewrites this log
    ckpt = split / "runs/test/ckpt/last.ckpt"
    run_rlm(fit_args() + ["--trainer.max_steps=6", "--ckpt_path", ckpt], split, rlm_cache)
    a = column(read_metrics(straight / RUN), "train/loss")
    b = first + column(read_metrics(split / RUN), "train/loss")
    assert len(a) == 6 and len(b) == 6
    assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-5)


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_two_cpu_processes(tmp_path, rlm_cache):
    args = fit_args() + DDP_2CPU
    proc = run_rlm(args, tmp_path, rlm_cache)
    rows = read_metrics(tmp_path / RUN)
    assert len(column(rows, "train/loss")) == 4
    assert column(rows, "val/loss")
    assert "distributed_backend=gloo" in proc.stdout + proc.stderr


def test_unknown_plugin_fails_before_training(tmp_path, rlm_cache, rlm_main):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  plugins:\n    mystery: {}\n")
    proc = rlm_main(fit_args(bad), tmp_path, rlm_cache)
    assert proc.returncode == 2
    assert "unknown plugin 'mystery'; known plugins: [" in proc.stderr
    assert not (tmp_path / "runs/test/ckpt").exists()


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_checkpoint_from_another_config_is_refused(tmp_path, rlm_cache):
    run_rlm(fit_args() + ["--trainer.max_steps=2"], tmp_path, rlm_cache)
    ckpt = tmp_path / "runs/test/ckpt/last.ckpt"
    proc = run_rlm(
        fit_args(CONFIGS / "plugins" / "tokenid.yaml") + ["--ckpt_path", ckpt],
        tmp_path,
        rlm_cache,
        check=False,
    )
    assert proc.returncode == 2
    assert "was written by a different config" in proc.stderr
    assert "plugins: checkpoint has {}" in proc.stderr
