"""Experiment launchers: N runs at once on this machine, submitit jobs (its LocalExecutor runs them for real),
the sbatch script SLURM would get (a fake ``sbatch`` on PATH), the preemption checkpoint, ``rlm experiment
status``, and the errors of bad launcher options."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from test_experiment import write_experiment

from rlm.cli import main as rlm_main
from rlm.experiment.runner import _child_env
from rlm.experiment.spec import ExperimentError, load_experiment

submitit = pytest.importorskip("submitit")

# two steps, one validation batch, no test split (its rlm eval would be two more process start-ups)
TINY_STEPS = {
    "trainer": {"max_steps": 2, "val_check_interval": 2, "limit_val_batches": 1},
    "data": {"test_fraction": 0},
}


def _fake_runs(monkeypatch, runner, seconds: float, record: list[dict]) -> None:
    """Replace the rlm subprocesses of a run by a sleep that records when it ran and with which environment."""

    def fake_train(run):
        run.dir.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        time.sleep(seconds)
        record.append({"label": run.label, "start": start, "end": time.monotonic(), "env": _child_env()})
        return True, seconds

    monkeypatch.setattr(runner, "train", fake_train)
    monkeypatch.setattr(runner, "evaluate_test", lambda run: True)
    monkeypatch.setattr(
        runner, "summarize", lambda run, wall, jobs: {"fingerprint": run.fingerprint, "val_loss": 1.0}
    )


def test_two_jobs_run_at_once_each_with_half_the_cpu_threads(tmp_path, monkeypatch):
    from rlm.experiment import runner

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(runner.torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(runner, "_cpu_count", lambda: 8)
    record: list[dict] = []
    _fake_runs(monkeypatch, runner, 0.4, record)
    exp = load_experiment(
        write_experiment(
            tmp_path / "e.yaml", seeds=[0, 1], variants={"a": {}, "b": {"set": {"trainer": {"max_steps": 3}}}}
        )
    )
    assert runner.run_experiment(exp, tmp_path / "out", jobs=2) == []
    assert sorted(r["label"] for r in record) == ["a/seed0", "a/seed1", "b/seed0", "b/seed1"]
    # at most two at once, and two did overlap: the second started before the first ended
    events = sorted([(r["start"], 1) for r in record] + [(r["end"], -1) for r in record])
    running = [sum(d for _, d in events[: i + 1]) for i in range(len(events))]
    assert max(running) == 2
    assert all(r["env"]["OMP_NUM_THREADS"] == "4" for r in record)
    for label in ("a/seed0", "b/seed1"):
        job = json.loads((tmp_path / "out" / label / "job.json").read_text())
        assert job["state"] == "done" and job["pid"] == os.getpid() and job["started"] < job["ended"]


def test_each_concurrent_run_gets_its_own_gpu(tmp_path, monkeypatch):
    from rlm.experiment import runner

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert runner.local_slots(2) == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    with pytest.raises(ValueError, match=r"--jobs 3: only 2 GPU\(s\) visible \(3,5\).*use --jobs 2 or fewer"):
        runner.local_slots(3)
    record: list[dict] = []
    _fake_runs(monkeypatch, runner, 0.3, record)
    exp = load_experiment(write_experiment(tmp_path / "e.yaml", seeds=[0, 1, 2, 3]))
    runner.run_experiment(exp, tmp_path / "out", jobs=2)
    by_gpu = {gpu: [r for r in record if r["env"]["CUDA_VISIBLE_DEVICES"] == gpu] for gpu in ("3", "5")}
    assert sorted(len(v) for v in by_gpu.values()) != [0, 4]  # both GPUs were used
    for runs in by_gpu.values():  # never two runs on one GPU at the same time
        spans = sorted((r["start"], r["end"]) for r in runs)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_equal_runs_share_a_job_so_the_later_one_reuses_the_first(tmp_path):
    from rlm.experiment.runner import groups
    from rlm.experiment.runs import plan

    exp = load_experiment(
        write_experiment(
            tmp_path / "e.yaml",
            seeds=[0, 1],
            variants={
                "base": {},
                "base_knnlm": {"knnlm": True},
                "longer": {"set": {"trainer": {"max_steps": 9}}},
            },
        )
    )
    labels = [[r.label for r in g] for g in groups(plan(exp, tmp_path / "out"))]
    assert labels == [
        ["base/seed0", "base_knnlm/seed0"],
        ["base/seed1", "base_knnlm/seed1"],
        ["longer/seed0"],
        ["longer/seed1"],
    ]


# slow: a real experiment run: trains and evaluates each variant
@pytest.mark.slow
def test_submitit_local_executor_runs_and_collects_a_two_variant_grid(
    tmp_path, rlm_cache, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    for key, value in {"RLM_CACHE": str(rlm_cache), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}.items():
        monkeypatch.setenv(key, value)
    path = write_experiment(
        tmp_path / "exp.yaml",
        common=TINY_STEPS,
        variants={"baseline": {}, "narrow": {"set": {"model": {"model": {"d_ff": 96}}}}},
        launcher={"name": "submitit-local"},
    )
    out = tmp_path / "out"
    assert rlm_main(["experiment", "run", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("submitted as job") == 2
    for variant in ("baseline", "narrow"):
        summary = json.loads((out / variant / "seed0" / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["val_loss"] > 0
        job = json.loads((out / variant / "seed0" / "job.json").read_text())
        # written by the job's own process, which is not this one
        assert job["state"] == "done" and job["launcher"] == "submitit-local" and job["pid"] != os.getpid()
    base, narrow = (json.loads((out / v / "seed0/summary.json").read_text()) for v in ("baseline", "narrow"))
    assert narrow["params_total"] < base["params_total"]  # each job trained its own variant
    assert "| **baseline** |" in (out / "results.md").read_text()
    assert rlm_main(["experiment", "status", str(out)]) == 0
    status = capsys.readouterr().out
    assert [ln.split()[:2] for ln in status.splitlines()[1:3]] == [
        ["baseline/seed0", "done"],
        ["narrow/seed0", "done"],
    ]
    assert status.splitlines()[-1] == "2 done"
    # a second run finds everything finished and submits nothing
    assert rlm_main(["experiment", "run", str(path), "--out", str(out)]) == 0
    assert "submitted as job" not in capsys.readouterr().out


FAKE_SBATCH = """#!/bin/sh
# records the submitted script and answers as sbatch does
n=$(ls "{dir}" | grep -c '^script')
cp "$1" "{dir}/script$n.sh"
echo "$@" >> "{dir}/args"
echo "Submitted batch job $((100 + n))"
"""


def test_slurm_sbatch_script_asks_for_the_launcher_options_and_a_warning_signal(
    tmp_path, monkeypatch, capsys
):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(FAKE_SBATCH.format(dir=fake))
    (fake / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit looks for srun to know it is on SLURM
    for tool in ("sbatch", "srun"):
        (fake / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    path = write_experiment(
        tmp_path / "exp.yaml",
        seeds=[0],
        variants={"baseline": {}, "longer": {"set": {"trainer": {"max_steps": 9}}}},
        launcher={
            "name": "slurm",
            "partition": "cpu",
            "cpus_per_job": 8,
            "mem_gb": 32,
            "time": 30,
            "setup": ["module load cuda/12.4"],
        },  # fmt: skip
    )
    out = tmp_path / "out"
    argv = ["experiment", "run", str(path), "--out", str(out), "--partition", "gpu", "--gpus-per-job", "2"]
    assert rlm_main([*argv, "--time", "1:30:00", "--account", "lab", "--no-wait"]) == 0
    assert "submitted 2 job(s)" in capsys.readouterr().out
    scripts = [(fake / f"script{i}.sh").read_text() for i in range(2)]
    lines = set(scripts[0].splitlines())
    expected = {
        "#SBATCH --partition=gpu",  # the flag overrides the file's
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --mem=32GB",
        "#SBATCH --time=90",  # minutes
        "#SBATCH --account=lab",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR2@120",  # submitit checkpoints 120 s before the limit: rlm fit gets SIGTERM then
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "module load cuda/12.4",
    }
    assert expected <= lines, expected - lines
    assert "#SBATCH --job-name=rlm-tiny-baseline-seed0" in lines
    assert "#SBATCH --job-name=rlm-tiny-longer-seed0" in scripts[1]
    command = [ln for ln in scripts[0].splitlines() if ln.startswith("srun ")]
    assert (
        len(command) == 1
        and f"{sys.executable} -u -m submitit.core._submit {out / '.submitit'}" in command[0]
    )
    # the job submitted is the runner's own per-run work, checkpointable
    submitted = pickle.loads((out / ".submitit" / "100_submitted.pkl").read_bytes())
    job = submitted.function
    assert isinstance(job, submitit.helpers.Checkpointable) and [r.label for r in job.runs] == [
        "baseline/seed0"
    ]
    assert job.requeue and job.stop_wait_s == 105
    for label, job_id in (("baseline/seed0", "100"), ("longer/seed0", "101")):
        info = json.loads((out / label / "job.json").read_text())
        assert info["state"] == "queued" and info["job_id"] == job_id
    assert rlm_main(["experiment", "status", str(out)]) == 0
    status = capsys.readouterr().out.splitlines()
    assert status[1].split()[:2] == ["baseline/seed0", "queued"] and "(job 100)" in status[1]
    assert status[-1] == "2 queued"


CHILD = """
import signal, sys, time
from pathlib import Path
def stop(signum, frame):
    Path(sys.argv[1]).write_text("saved")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(60)
"""


def test_checkpoint_stops_rlm_fit_with_sigterm_and_requeues_the_same_call(tmp_path, monkeypatch):
    """SLURM's warning (USR2) reaches every process of the job: the child ignores it, and submitit's checkpoint,
    a signal handler in the thread that waits for the child, stops it with SIGTERM (rlm fit then saves
    last.ckpt and exits 143) and returns the same call to requeue, without waiting out its time."""
    from rlm.experiment import runner
    from rlm.experiment.runs import Run
    from rlm.experiment.submit import RunJob
    from rlm.train.checkpoint import PREEMPTED

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    saved, log = tmp_path / "saved", tmp_path / "child.log"
    job = RunJob([Run("v", 0, tmp_path / "v" / "seed0", {})], tmp_path, True, requeue=True, stop_wait_s=30)
    seen: dict = {}

    def submitit_signal(signum, frame):  # as submitit's handler of USR2 calls the job's checkpoint
        start = time.monotonic()
        seen["delayed"] = job.checkpoint()
        seen["took"] = time.monotonic() - start

    def scheduler():
        deadline = time.monotonic() + 30
        while "ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = runner._LIVE
        child.send_signal(signal.SIGUSR2)  # ignored: without that, the default action would kill it unsaved
        time.sleep(0.3)
        seen["alive after USR2"] = not runner.exited(child)
        os.kill(os.getpid(), signal.SIGUSR1)  # stands for the job process's USR2

    previous = signal.signal(signal.SIGUSR1, submitit_signal)
    try:
        with open(log, "w") as f:
            thread = threading.Thread(target=scheduler)
            thread.start()
            code = runner._run_forwarding_sigterm(
                [sys.executable, "-c", CHILD, str(saved)], f, dict(os.environ)
            )
            thread.join(timeout=30)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert (
        seen["alive after USR2"] and code == PREEMPTED and saved.read_text() == "saved" and not runner._LIVE
    )
    assert seen["took"] < 10  # it returned once the child had exited, not after stop_wait_s
    assert isinstance(seen["delayed"], submitit.helpers.DelayedSubmission) and seen["delayed"].function is job
    assert RunJob([], tmp_path, True, requeue=False, stop_wait_s=1).checkpoint() is None


def test_status_of_running_stopped_failed_and_pending_runs(tmp_path):
    from rlm.experiment.cli import experiment_states, format_states
    from rlm.experiment.runner import write_job

    exp = load_experiment(write_experiment(tmp_path / "e.yaml", seeds=[0, 1, 2, 3]))
    out = tmp_path / "out"
    out.mkdir()
    (out / "experiment.json").write_text(json.dumps(exp.to_json()))
    write_job(out / "baseline/seed0", state="running", pid=os.getpid(), host=socket.gethostname())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_job(out / "baseline/seed1", state="running", pid=dead.pid, host=socket.gethostname())
    write_job(out / "baseline/seed2", state="failed", step="rlm fit", log=str(out / "baseline/seed2/fit.log"))
    (out / "baseline/seed2/fit.log").write_text("step 1\nTraceback ...\nRuntimeError: out of memory\n")
    states = experiment_states(out)
    assert [s.state for s in states] == ["running", "stopped", "failed", "pending"]
    assert states[0].detail == f"pid {os.getpid()}"
    assert "RuntimeError: out of memory" in states[2].tail
    assert format_states(states).splitlines()[-1] == "1 running, 1 stopped, 1 failed, 1 pending"
    with pytest.raises(ValueError, match="not an experiment directory"):
        experiment_states(tmp_path)


def test_bad_launcher_options_are_named(tmp_path, monkeypatch, capsys):
    path = write_experiment(
        tmp_path / "e.yaml",
        launcher={
            "name": "pbs",
            "gpus_per_job": -1,
            "time": "forever",
            "colour": "red",
            "setup": "module load x",
        },
    )
    with pytest.raises(ExperimentError) as info:
        load_experiment(path)
    problems = info.value.problems
    assert len(problems) == 5, problems
    for text in (
        "launcher.name: got 'pbs'; accepted: one of ['local', 'slurm', 'submitit-local']",
        "launcher.gpus_per_job: got -1; accepted: an integer >= 0",
        "launcher.time: got 'forever'; accepted: SLURM's formats",
        "launcher: unknown option 'colour'; accepted: ['name', 'jobs',",
        "launcher.setup: got 'module load x'; accepted: a list of shell lines",
    ):
        assert sum(p.startswith(text) for p in problems) == 1, text
    good = write_experiment(tmp_path / "g.yaml")
    for flags, message in (
        (["--launcher", "slurm"], "--launcher slurm needs a time limit per job"),
        (["--launcher", "slurm", "--time", "10", "--jobs", "2"], "--jobs 2 applies to --launcher local"),
        (["--time", "25:99"], "--time: got '25:99'; accepted: SLURM's formats: minutes, MM:SS"),
        (["--jobs", "0"], "--jobs: got 0; accepted: a positive integer"),
        (["--no-wait"], "--no-wait applies to --launcher slurm, not local"),
        (["--launcher", "slurm", "--time", "10"], "--launcher slurm: no `sbatch` on PATH"),
    ):
        if "slurm" in flags and "--jobs" not in flags:
            monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM here
        assert rlm_main(["experiment", "run", str(good), "--out", str(tmp_path / "out"), *flags]) == 2
        assert message in capsys.readouterr().err, flags
    assert not list((tmp_path / "out").glob("*/seed0"))  # nothing ran


def test_time_limits_in_minutes():
    from rlm.experiment.spec import time_minutes

    cases = {90: 90, "90": 90, "90:00": 90, "90:30": 91, "1:30:00": 90, "1:30:01": 91, "2-00:00:00": 2880,
             "1-12": 2160, "1-12:30": 2190, "0:00": None, 0: None, "1:60": None, "1:60:00": None, "abc": None,
             "-5": None, "1-": None, True: None}  # fmt: skip
    assert {k: time_minutes(k) for k in cases} == cases


def test_base_flag_stacks_a_model_size_on_every_variant(tmp_path, monkeypatch):
    """``--base configs/model/X.yaml`` runs the same comparison at another size (docs/EXPERIMENTS.md: the seeds'
    files at 124M)."""
    from cli_helpers import CONFIGS

    from rlm.experiment.check import check_experiment

    monkeypatch.chdir(CONFIGS.parent)
    path = write_experiment(
        tmp_path / "e.yaml",
        variants={"baseline": {}, "deeper": {"set": {"model": {"model": {"n_layers": 3}}}}},
    )
    _, tiny = check_experiment(path)
    exp, small = check_experiment(path, base=["configs/model/small.yaml"])
    assert exp.base[-1] == CONFIGS / "model" / "small.yaml"
    assert small["baseline"].total > 10 * tiny["baseline"].total  # d=256 against d=64
    assert small["deeper"].total < small["baseline"].total  # the variant's set still wins: 3 layers, not 4
    with pytest.raises(ExperimentError, match=r"--base: config file 'nothere.yaml' does not exist"):
        check_experiment(path, base=["nothere.yaml"])
