"""The suite's conventions (tests/conventions.py): an unmarked test that starts `rlm fit` in a subprocess fails."""

import pytest
from conventions import starts_rlm_fit

pytest_plugins = ["pytester"]


@pytest.mark.parametrize(
    ("args", "fit"),
    [
        (["/usr/bin/python3", "-m", "rlm", "fit", "--config", "a.yaml"], True),
        ("python -m rlm fit --help", True),
        (["/x/.venv/bin/rlm", "fit"], True),
        (["python", "-m", "rlm", "eval", "--ckpt", "fit"], False),
        (["python", "-m", "rlm.experiment", "fit"], False),
        (["rlm"], False),
    ],
)
def test_starts_rlm_fit_reads_the_command_line(args, fit):
    assert starts_rlm_fit(args) is fit


PROBE = """
import subprocess, pytest

def _start():
    # `true` ignores its arguments: the command line reads as `python -m rlm fit` and costs nothing
    subprocess.run(["true", "-m", "rlm", "fit"], check=True)

def test_unmarked():
    _start()

@pytest.mark.slow
def test_marked():
    _start()

def test_other_command():
    subprocess.run(["true", "-m", "rlm", "eval"], check=True)

@pytest.fixture
def trained():
    _start()

def test_unmarked_with_a_training_fixture(trained):
    pass
"""


def test_an_unmarked_test_that_starts_rlm_fit_fails(pytester):
    pytester.makeconftest("from conventions import pytest_runtest_call, pytest_runtest_setup  # noqa: F401")
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow")
    pytester.makepyfile(test_probe=PROBE)
    result = pytester.runpytest_inprocess("-q")
    result.assert_outcomes(passed=2, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*test_unmarked starts `rlm fit` in a subprocess*without @pytest.mark.slow*"]
    )
