"""A finished experiment run with one file damaged or gone: the rerun rebuilds what that file held (re-evaluates,
or trains the 2 steps again) and ends with the undamaged run's results, instead of failing on every rerun."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import yaml
from cli_helpers import TINY

from rlm.cli import main
from rlm.experiment.runs import LAST_CKPT, SUMMARY, TEST_JSON
from rlm.train.checkpoint import load_checkpoint_file

RUN = Path("out/baseline/seed0")
STEPS = [Path("ckpt/epoch=0-step=1.ckpt"), Path("ckpt/epoch=0-step=2.ckpt")]
METRICS = Path("logs/version_0/metrics.csv")
RESULTS = (
    "val_loss",
    "best_val_loss",
    "val_step",
    "test_loss",
    "test_ppl",
    "test_bpb",
    "steps",
    "params_total",
)


def _experiment(work: Path) -> None:
    spec = {
        "name": "tiny",
        "base": [str(p) for p in TINY],
        "seeds": [0],
        "common": {"trainer": {
            "max_steps": 2, "val_check_interval": 2, "limit_val_batches": 1,
            # a checkpoint at every step: the rerun has one of the last step besides last.ckpt
            "callbacks": [{"class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
                           "init_args": {"every_n_train_steps": 1, "save_top_k": -1}}],
        }},
        "variants": {"baseline": {}},
    }  # fmt: skip
    (work / "exp.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def _run(work: Path, cache: Path) -> tuple[int, str]:
    """``rlm experiment run exp.yaml --out out`` in ``work`` (in-process; its rlm fit and eval are subprocesses):
    the exit code and what it printed."""
    text = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(text):
        mp.chdir(work)
        mp.setenv("RLM_CACHE", str(cache))
        mp.setenv("PYTHONUNBUFFERED", "1")
        code = main(["experiment", "run", "exp.yaml", "--out", "out"])
    return code, text.getvalue()


def _table(out: str) -> str:
    """The end of the output: each finished run with its losses, the report and the next commands."""
    return out[out.index("rlm experiment: 1 finished run(s)") :]


# slow: trains the tiny experiment (a real `rlm fit` and `rlm eval` subprocess) once for the module
@pytest.fixture(scope="module")
def finished(tmp_path_factory, rlm_cache):
    work = tmp_path_factory.mktemp("finished")
    _experiment(work)
    code, out = _run(work, rlm_cache)
    assert code == 0, out
    summary = json.loads((work / RUN / SUMMARY).read_text())
    return work, _table(out), summary


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _delete(path: Path) -> None:
    path.unlink()


# Each file of a finished run, damaged alone (the summary's results stand, unless it is the summary or the
# model they were measured on), then the cases where the summary is gone as well and the run is rebuilt from
# what is left: the rerun resumes nothing, re-evaluates the last step's weights, or trains the 2 steps again.
ALONE = [".rlm-fit.lock", "config.yaml", "fingerprint", "fit.log", "job.json", "wall_s", SUMMARY, TEST_JSON,
         "ckpt/.rlm-fit.lock", *map(str, STEPS), str(LAST_CKPT), "logs/.rlm-fit.lock",
         "logs/version_0/config.yaml", "logs/version_0/hparams.yaml", str(METRICS)]  # fmt: skip
CASES = {
    **{f"{name} truncated": [(name, _truncate)] for name in ALONE},
    "summary.json deleted": [(SUMMARY, _delete)],
    "last.ckpt deleted": [(str(LAST_CKPT), _delete)],
    # the rerun resumed step 2 of 2, trained nothing, wrote no last.ckpt, and its evaluation failed every time
    "summary, test.json deleted, last.ckpt truncated": [(SUMMARY, _delete), (TEST_JSON, _delete),
                                                         (str(LAST_CKPT), _truncate)],
    "summary deleted, every checkpoint truncated": [(SUMMARY, _delete), *((str(p), _truncate) for p in STEPS),
                                                    (str(LAST_CKPT), _truncate)],
    "summary, metrics.csv deleted": [(SUMMARY, _delete), (str(METRICS), _delete)],
    "summary, fingerprint deleted": [(SUMMARY, _delete), ("fingerprint", _delete)],
}  # fmt: skip


# slow: a real experiment run (module fixture), and reruns that evaluate or train again in subprocesses
@pytest.mark.slow
def test_the_cases_cover_every_file_of_a_finished_run(finished):
    work, _, _ = finished
    held = sorted(str(p.relative_to(work / RUN)) for p in (work / RUN).rglob("*") if p.is_file())
    assert held == sorted(ALONE)


# slow: a real experiment run (module fixture), and reruns that evaluate or train again in subprocesses
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_rerun_rebuilds_a_damaged_run(finished, tmp_path, rlm_cache, case):
    work, table, summary = finished
    shutil.copytree(work / "out", tmp_path / "out")
    shutil.copy2(work / "exp.yaml", tmp_path / "exp.yaml")
    for name, damage in CASES[case]:
        damage(tmp_path / RUN / name)
    code, out = _run(tmp_path, rlm_cache)
    assert code == 0, out
    assert _table(out) == table
    run = tmp_path / RUN
    again = json.loads((run / SUMMARY).read_text())
    assert {k: again[k] for k in RESULTS} == {k: summary[k] for k in RESULTS}
    load_checkpoint_file(run / LAST_CKPT)
    if "skipped" not in out:  # it did some work: once is enough
        code, out = _run(tmp_path, rlm_cache)
        assert code == 0 and "finished earlier, skipped" in out, out
