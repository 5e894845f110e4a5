"""The runner's rlm subprocesses: start one with a SIGTERM to the runner passed on to it, stop them all, and
tell whether one has ended without reaping it (rlm fit saves last.ckpt and exits 143 on SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Preempted(Exception):
    """The running rlm fit was stopped by SIGTERM: the experiment stops, its run stays unfinished."""


_LIVE: set[subprocess.Popen] = set()  # the rlm subprocesses running now: a SIGTERM to the runner goes to each
_THREAD = threading.local()  # .env: what a job thread adds to its subprocesses' environment


def _child_env() -> dict[str, str]:
    return {**os.environ, **getattr(_THREAD, "env", {}), "PYTHONUNBUFFERED": "1"}


@contextmanager
def _forwarding_sigterm() -> Iterator[None]:
    """While inside, a SIGTERM to this process is passed on to every live rlm subprocess, so a scheduler
    that signals only the runner still gets its training saved; off the main thread, which forwards, nothing."""
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop_children(signum, wait_s=0))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_children(signum: int = signal.SIGTERM, wait_s: float = 0) -> None:
    """Send ``signum`` to every live rlm subprocess and wait up to ``wait_s`` seconds for them to exit."""
    procs = list(_LIVE)
    for proc in procs:
        proc.send_signal(signum)
    deadline = time.monotonic() + wait_s
    while not all(exited(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)


def exited(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` has ended, without reaping it: a signal handler may run in the thread that waits for it
    (submitit's checkpoint does), holding Popen's wait lock, so Popen.wait and poll cannot tell."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def _ignore_usr2() -> None:  # pragma: no cover - runs in the child between fork and exec
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def _run_forwarding_sigterm(cmd: list[str], log: Any, env: dict[str, str]) -> int:
    """Run ``cmd`` and return its exit code, passing a SIGTERM to this process on to it. Under submitit
    the child ignores SLURM's warning signal (USR2), so that only the job's checkpoint stops it (with SIGTERM)."""
    preexec = _ignore_usr2 if os.environ.get("SUBMITIT_EXECUTOR") else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec)
    _LIVE.add(proc)
    try:
        with _forwarding_sigterm():
            return proc.wait()
    finally:
        _LIVE.discard(proc)
