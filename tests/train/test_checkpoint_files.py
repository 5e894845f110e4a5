"""Checkpoint files under kill -9 and resume: never truncated under a real name, no debris left behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_resume import _Toy, _toy_fit

from rlm.train.checkpoint import remove_tmp_files


def test_resume_removes_partial_files_and_checkpoints_past_the_resumed_step(tmp_path):
    _toy_fit(tmp_path, _Toy(nan_at=-1), max_steps=3, save_top_k=1)
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    # What a kill leaves: a partial temp file, and a top-k file written after the checkpoint resumed from
    (ckpt / ".last.ckpt.tmp-999").write_bytes(b"partial")
    shutil.copy(ckpt / "epoch=0-step=3.ckpt", ckpt / "epoch=0-step=5.ckpt")
    _toy_fit(tmp_path, _Toy(nan_at=-1), max_steps=4, save_top_k=1, ckpt_path=ckpt / "last.ckpt")
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]


def test_last_checkpoint_holds_the_final_step_between_periodic_saves(tmp_path):
    """Saves every 2 steps, 5 steps trained: last.ckpt is step 5 (ModelCheckpoint alone leaves step 4), and a
    resume from it trains nothing again."""
    module = _Toy(nan_at=-1)
    _toy_fit(tmp_path, module, max_steps=5, every_n=2)
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 5
    torch.testing.assert_close(last["state_dict"]["lin.weight"], module.lin.weight.detach())
    again = _toy_fit(
        tmp_path, _Toy(nan_at=-1), max_steps=5, every_n=2, ckpt_path=tmp_path / "ckpt" / "last.ckpt"
    )
    assert again.global_step == 5


def test_partial_files_of_dead_runs_in_older_versions_are_removed(tmp_path):
    """A killed run's .last.ckpt.tmp-PID in version_0/checkpoints survived seven resumes, each logging to a new
    version_N (issue 24, defect 6): the start of training clears dead writers' files anywhere under
    default_root_dir, and leaves a live writer's alone."""
    dead = 2**22 + 4321  # above the default pid_max: no live process has it
    old = tmp_path / "version_0" / "checkpoints" / f".last.ckpt.tmp-{dead}"
    live = tmp_path / "version_1" / "checkpoints" / f".last.ckpt.tmp-{os.getpid()}"
    for p in (old, live):
        p.parent.mkdir(parents=True)
        p.write_bytes(b"partial")
    _toy_fit(tmp_path, _Toy(nan_at=-1), max_steps=1)
    assert not old.exists() and live.exists()


@pytest.mark.parametrize(("max_steps", "every_n"), [(5, 10), (5, 2), (4, 2)])
def test_the_final_checkpoint_is_written_once(tmp_path, max_steps, every_n):
    """One last.ckpt holding the final step, whether or not a periodic save came before the end; never a
    second copy named last-v1.ckpt (Lightning 2.6 saves last.ckpt itself when no periodic save happened)."""
    _toy_fit(tmp_path, _Toy(nan_at=-1), max_steps=max_steps, every_n=every_n)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "last.ckpt" in names and not [n for n in names if n.startswith("last-")], names
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == max_steps


CHILD = """
import sys, torch
from rlm.train.checkpoint import atomic_save
t = torch.arange(3_000_000, dtype=torch.float32)
atomic_save({"i": -1, "t": t}, sys.argv[1])
print("ready", flush=True)
i = 0
while True:
    atomic_save({"i": i, "t": t}, sys.argv[1])
    i += 1
"""


# slow: signals and restarts real training processes
@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.07, 0.2])
def test_kill_during_checkpoint_writes_never_leaves_a_truncated_file(tmp_path, delay):
    target = tmp_path / "last.ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(target)], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    state = torch.load(target, weights_only=True)  # complete, whatever the moment of the kill
    torch.testing.assert_close(state["t"], torch.arange(3_000_000, dtype=torch.float32))
    leftovers = {p.name for p in tmp_path.iterdir()} - {"last.ckpt"}
    assert leftovers <= {f".last.ckpt.tmp-{proc.pid}"}
    remove_tmp_files(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
