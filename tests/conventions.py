"""The suite's own conventions, enforced while it runs (imported by conftest.py).

A test that starts ``rlm fit`` in a subprocess, itself or through the code it calls (the experiment runner's
children), takes seconds to minutes on the 2-core CI machine: it must carry the ``slow`` mark, so that
``pytest -m "not slow"`` stays the quick tier.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest


def starts_rlm_fit(args: str | Sequence[object]) -> bool:
    """Whether a subprocess command line runs ``rlm fit`` (``python -m rlm fit ...`` or the ``rlm`` script)."""
    argv = shlex.split(args) if isinstance(args, str) else [str(a) for a in args]
    for i, word in enumerate(argv[:-1]):
        module = word == "rlm" and i > 0 and argv[i - 1] == "-m"
        script = i == 0 and Path(word).name == "rlm"
        if (module or script) and argv[i + 1] == "fit":
            return True
    return False


_REAL_POPEN = subprocess.Popen
_recording: list[
    list[str]
] = []  # one list per running test; nested runs (pytester) record into the innermost


class _Recording(_REAL_POPEN):  # subprocess.run and check_output go through subprocess.Popen
    def __init__(self, args, *rest, **kwargs):
        if _recording and starts_rlm_fit(args):
            _recording[-1].append(args if isinstance(args, str) else shlex.join(map(str, args)))
        super().__init__(args, *rest, **kwargs)


def _recorded(item: pytest.Item):
    """Run one phase of ``item`` (a generator hook's body) recording the ``rlm fit`` subprocesses it starts; fail
    the test if it has no ``slow`` mark."""
    started: list[str] = []
    _recording.append(started)
    subprocess.Popen = _Recording
    try:
        result = yield
    finally:
        _recording.pop()
        if not _recording:
            subprocess.Popen = _REAL_POPEN
    if started and item.get_closest_marker("slow") is None:
        pytest.fail(
            f"{item.nodeid} starts `rlm fit` in a subprocess ({started[0][:120]}) without @pytest.mark.slow: "
            "mark it slow with a comment saying why it must be, or run the Trainer in-process",
            pytrace=False,
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    """Fixtures count: a fixture that trains makes every test that uses it slow (the first to set it up is caught)."""
    return (yield from _recorded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _recorded(item))
