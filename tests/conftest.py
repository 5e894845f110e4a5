"""Shared test fixtures: a small deterministic torch setup and a token cache shared by the session."""

import os
from pathlib import Path

# One thread per process, set before torch (and faiss, numpy) start their pools. The suite's models are tiny, and
# on the 2-core CI machine any pool wider than one thread fights the other process of a 2-process test, or the
# subprocess a test waits on; OpenMP's spinning workers then turn milliseconds into seconds. Subprocesses inherit
# these.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from conventions import pytest_runtest_call, pytest_runtest_setup  # noqa: E402, F401 (`rlm fit` is slow)

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def rlm_cache(tmp_path_factory):
    """One RLM_CACHE for every CLI smoke test, so the tiny corpus is tokenized once per session."""
    return tmp_path_factory.mktemp("rlm_cache")


@pytest.fixture
def rlm_main(monkeypatch, capsys):
    """``rlm ARGS`` in this process, as ``run_rlm`` runs it in a subprocess: in ``cwd`` with RLM_CACHE=``cache``,
    returning a CompletedProcess with the exit code and what it printed. For the commands that stop before any
    training (parse errors, ``--print_config``, refusals), where a subprocess would only add its start-up."""
    import subprocess

    from rlm.cli import main

    def run(args: list, cwd, cache=None) -> subprocess.CompletedProcess:
        monkeypatch.chdir(cwd)
        monkeypatch.setenv("RLM_CACHE", str(cache or cwd))
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as stop:  # the parser's --help, --print_config and its errors
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


@pytest.fixture(scope="session")
def trained(tmp_path_factory, rlm_cache):
    """``trained(*fragments, steps=2)``: the last.ckpt of a tiny ``rlm fit`` with those config fragments stacked,
    trained in this process once per session and shared by every test that asks for the same one (eval, export,
    generation, kNN-LM and the harness read checkpoints; none needs its own training)."""
    from cli_helpers import fit_args

    from rlm.cli import main

    done: dict[tuple, Path] = {}

    def get(*fragments, steps: int = 2) -> Path:
        key = (tuple(map(str, fragments)), steps)
        if key not in done:
            work = tmp_path_factory.mktemp("trained")
            with pytest.MonkeyPatch.context() as mp:
                mp.chdir(work)
                mp.setenv("RLM_CACHE", str(rlm_cache))
                code = main([str(a) for a in fit_args(*fragments)] + [f"--trainer.max_steps={steps}"])
            assert code == 0, f"the tiny fit with {fragments} failed ({code})"
            done[key] = work / "runs" / "test" / "ckpt" / "last.ckpt"
        return done[key]

    return get
