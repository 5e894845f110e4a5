"""An experiment's runs as submitit jobs (``--launcher slurm`` or ``submitit-local``), each calling
:func:`rlm.experiment.runner.execute`; preemption and requeueing: docs/EXPERIMENTS.md."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import submitit
from tqdm import tqdm

from rlm.experiment.runner import execute, groups, stop_children, write_job
from rlm.experiment.runs import JOB_JSON, Run, begin, read_json
from rlm.experiment.spec import Experiment

FOLDER = ".submitit"  # submitit's folder in the experiment directory: pickles, batch scripts, logs


class RunJob(submitit.helpers.Checkpointable):
    """The work of one job: its runs one after another; returns the labels of those that failed."""

    def __init__(
        self, runs: list[Run], out: Path, reuse_equal: bool, requeue: bool, stop_wait_s: float
    ) -> None:
        self.runs, self.out, self.reuse_equal = runs, out, reuse_equal
        self.requeue, self.stop_wait_s = requeue, stop_wait_s

    def __call__(self) -> list[str]:
        return [run.label for run in self.runs if execute(run, self.out, self.reuse_equal) is None]

    def checkpoint(self) -> submitit.helpers.DelayedSubmission | None:
        """Preempted or near the time limit: stop ``rlm fit`` so that it saves last.ckpt, then requeue this
        call (without ``requeue`` the job ends, and the next ``rlm experiment run`` resumes the run)."""
        stop_children(wait_s=self.stop_wait_s)
        return submitit.helpers.DelayedSubmission(self) if self.requeue else None


def executor(options: dict[str, Any], folder: Path) -> submitit.AutoExecutor:
    """A submitit executor for the resolved launcher options (rlm.experiment.spec.resolve_launcher)."""
    slurm = options["name"] == "slurm"
    if slurm and shutil.which("sbatch") is None:
        raise ValueError(
            "--launcher slurm: no `sbatch` on PATH; run on a SLURM login node, or use --launcher local"
        )
    ex = submitit.AutoExecutor(
        folder=folder,
        cluster="slurm" if slurm else "local",
        slurm_max_num_timeout=100 if options["requeue"] else 0,
    )
    gpus = options.get("gpus_per_job", 1 if slurm else 0)
    # submitit's LocalExecutor stops a job after 2 minutes unless told otherwise
    timeout_min = options.get("time_min") or 7 * 24 * 60
    params: dict[str, Any] = dict(nodes=1, tasks_per_node=1, gpus_per_node=gpus, timeout_min=timeout_min)
    names = {"cpus_per_job": "cpus_per_task", "mem_gb": "mem_gb"}
    if slurm:
        names.update({key: f"slurm_{key}" for key in ("partition", "account", "qos", "constraint", "setup")})
        params["slurm_signal_delay_s"] = options["signal_delay_s"]
        if options["requeue"]:
            params["slurm_additional_parameters"] = {"requeue": True}
    params.update({name: options[key] for key, name in names.items() if key in options})
    ex.update_parameters(**params)
    return ex


def submit(
    exp: Experiment,
    out: Path,
    options: dict[str, Any],
    variants: list[str] | None = None,
    reuse_equal: bool = True,
    wait: bool = True,
) -> tuple[list[str], list[str]]:
    """Submit a job for every group of unfinished runs; with ``wait``, wait for them all. Returns (job ids,
    labels of the runs that failed; empty without ``wait``)."""
    runs = begin(exp, out, variants)
    ex = executor(options, out / FOLDER)
    # SLURM's warning comes signal_delay_s before the kill: leave rlm fit most of it to save last.ckpt
    stop_wait_s = max(5.0, options["signal_delay_s"] - 15.0)
    todo = [g for g in groups(runs) if not all(r.complete() for r in g)]
    jobs = []
    for group in todo:
        ex.update_parameters(name=f"rlm-{exp.name}-{group[0].variant}-seed{group[0].seed}")
        job = ex.submit(RunJob(group, out, reuse_equal, options["requeue"], stop_wait_s))
        for run in (r for r in group if not r.complete()):
            write_job(run.dir, state="queued", launcher=options["name"], job_id=str(job.job_id),
                      submitted=time.time(), log=str(job.paths.stderr))  # fmt: skip
        jobs.append((job, group))
        tqdm.write(f"{', '.join(r.label for r in group)}: submitted as job {job.job_id}")
    ids = [str(job.job_id) for job, _ in jobs]
    if not wait:
        return ids, []
    failed: set[str] = set()
    for job, group in tqdm(jobs, desc=f"experiment {exp.name}", unit="job"):
        try:
            failed.update(job.result())
        except Exception as err:  # stopped by SIGTERM, or died outside execute (killed, an import error)
            for run in group:
                if not run.complete():
                    failed.add(run.label)
                    # a stopped run keeps its state: the next run resumes it
                    if read_json(run.dir / JOB_JSON).get("state") != "stopped":
                        write_job(run.dir, state="failed", step="job", log=str(job.paths.stderr), ended=time.time())  # fmt: skip
            last = str(err).strip().splitlines()[-1:] or [type(err).__name__]
            tqdm.write(f"job {job.job_id} failed: {last[0]}; see {job.paths.stderr}")
    return ids, [run.label for run in runs if run.label in failed]
