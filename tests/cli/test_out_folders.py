"""Every command that writes an output folder follows rlm.outdir's rule: it never replaces a folder holding
files it did not write unless --force, never the run it reads from nor the current folder even with --force,
and leaves no temporary sibling behind. `rlm knnlm build --out runs/X` replaced the run, checkpoint included."""

from __future__ import annotations

import pytest
from cli_helpers import fit_args, run_rlm

from rlm.cli import main

COMMANDS = {
    "index": ["index", "build", "--factory", "Flat", "--layer", "0", "--split", "val", "--quiet"],
    "knnlm": [
        "knnlm",
        "build",
        "--factory",
        "SQfp16",
        "--k",
        "8",
        "--max-documents",
        "2",
        "--tune-tokens",
        "0",
    ],
    "export": ["export"],
}
WRITES = {"index": "meta.json", "knnlm": "meta.json", "export": "config.json"}
REPLACES_OWN = {"index": True, "knnlm": True, "export": False}
"""Whether the command replaces its own earlier output without --force (index and datastore builds always did)."""


def _run(name: str, ckpt, out, *extra: str) -> int:
    return main([*COMMANDS[name], "--ckpt", str(ckpt), "--out", str(out), *extra])


def _error(capsys, name: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.startswith(f"rlm {name}") and ": error: " in err, err
    return err


@pytest.fixture
def ckpt(tmp_path):
    """Bytes at a run's checkpoint path: every refusal comes before the checkpoint is read."""
    path = tmp_path / "runs" / "X" / "version_0" / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"weights")
    return path


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_folder_of_other_files_is_refused_without_force(name, ckpt, tmp_path, capsys):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert _run(name, ckpt, out) == 2
    err = _error(capsys, name)
    assert "exists and is not empty ('notes.txt')" in err and "--force" in err
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("name", list(COMMANDS))
@pytest.mark.parametrize("level", ["runs/X", "runs/X/version_0", "runs/X/version_0/checkpoints"])
def test_the_run_holding_the_checkpoint_is_refused_even_with_force(name, level, ckpt, tmp_path, capsys):
    assert _run(name, ckpt, tmp_path / level, "--force") == 2
    err = _error(capsys, name)
    assert f"holds {ckpt}, which this command reads" in err and "choose a new --out folder" in err
    assert ckpt.read_bytes() == b"weights"


@pytest.mark.parametrize("name", list(COMMANDS))
@pytest.mark.parametrize("out", [".", ".."])
def test_the_current_folder_is_refused_even_with_force(name, out, ckpt, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("keep me")
    monkeypatch.chdir(work)
    assert _run(name, ckpt, out, "--force") == 2
    assert f"{'is' if out == '.' else 'holds'} the current folder" in _error(capsys, name)
    assert (work / "notes.txt").read_text() == "keep me" and ckpt.read_bytes() == b"weights"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, rlm_cache):
    """A 2-step tiny checkpoint (runs/test/ckpt/last.ckpt under the returned folder)."""
    work = tmp_path_factory.mktemp("outdir")
    run_rlm(fit_args() + ["--trainer.max_steps=2"], work, rlm_cache)
    return work / "runs" / "test" / "ckpt" / "last.ckpt"


# slow: reads what its module fixture trains (and builds) with real `rlm` subprocesses
@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_new_folder_inside_the_run_is_written_whole(name, trained, rlm_cache, monkeypatch, capsys):
    monkeypatch.setenv("RLM_CACHE", str(rlm_cache))
    run = trained.parents[1]
    out = run / name
    assert _run(name, trained, out) == 0
    assert (out / WRITES[name]).is_file() and trained.is_file()
    assert not [p.name for p in run.iterdir() if p.name.startswith(f".{name}.")]  # no temporary sibling
    capsys.readouterr()
    assert _run(name, trained, out) == (0 if REPLACES_OWN[name] else 2)  # a second run over its own output
    if not REPLACES_OWN[name]:
        assert "exists and is not empty" in _error(capsys, name)
    assert (out / WRITES[name]).is_file() and not [p for p in run.iterdir() if p.name.startswith(f".{name}.")]
