"""``rlm experiment run|check|report|status``: typed functions, their parsers built from the signatures by
rlm.cli.commands."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlm.cli.summary import experiment_summary, val_subset
from rlm.experiment.report import write_report
from rlm.experiment.runs import JOB_JSON, LAST_CKPT, SUMMARY, log_tail, plan, read_info, read_json
from rlm.experiment.spec import Experiment, parse_experiment, resolve_launcher
from rlm.extras import MissingExtra

if TYPE_CHECKING:
    from rlm.experiment.check import ParamCounts

# check and runner import torch and Lightning: inside the commands that need them, so `status`, `report` and
# --help start without them.


def _print_plan(exp: Experiment, out: Path, runs: int, counts: dict[str, ParamCounts]) -> None:
    print(f"experiment {exp.name}: {len(counts)} variants, {runs} runs, output {out}")
    print(f"  {'variant':<24} {'params':>12} {'added':>12} {'active/token':>13}  then")
    for name, c in counts.items():
        mark = " (baseline)" if name == exp.baseline else ""
        knn = exp.variants[name].knnlm
        then = "" if knn is None else "kNN-LM datastore " + " ".join(f"{k}={v}" for k, v in knn.items())
        print(f"  {name + mark:<24} {c.total:>12,} {c.added:>12,} {c.active:>13,}  {then}".rstrip())


def cmd_check(
    file: str,
    *,
    out: str | None = None,
    variants: list[str] | None = None,
    seeds: list[int] | None = None,
    base: list[str] | None = None,
    set: list[str] | None = None,
) -> int:
    """Validate an experiment file and print its plan; trains nothing.

    Args:
        file: experiment file, e.g. configs/experiments/lookups.yaml
        out: output directory (default: the file's, or runs/experiments/NAME)
        variants: only these variants
        seeds: these seeds instead of the file's
        base: config files stacked after the file's base (before the variants' configs), e.g.
            configs/model/gpt2_small.yaml to run the same comparison at another model size; use --out too
        set: KEY=VALUE merged into the file's common mapping (VALUE is YAML), e.g. --set trainer.max_steps=100;
            use --out too, so runs of another budget do not mix with the file's
    """
    first, _ = parse_experiment(file)  # the structure pass: instant, what the slow part then checks
    if first is not None:
        print(f"rlm experiment check: {len(first.variants)} variants ({', '.join(first.variants)}); parsing each "
              "with the rlm fit parser and building its model on the meta device", file=sys.stderr, flush=True)  # fmt: skip
    from rlm.experiment.check import check_experiment

    exp, counts = check_experiment(file, set, seeds, base)
    where = exp.out_dir(out)
    _print_plan(exp, where, len(plan(exp, where, variants)), counts)
    return 0


def cmd_run(
    file: str,
    *,
    out: str | None = None,
    variants: list[str] | None = None,
    no_reuse: bool = False,
    seeds: list[int] | None = None,
    base: list[str] | None = None,
    set: list[str] | None = None,
    launcher: str | None = None,
    jobs: int | None = None,
    partition: str | None = None,
    gpus_per_job: int | None = None,
    cpus_per_job: int | None = None,
    mem_gb: float | None = None,
    time: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    no_wait: bool = False,
) -> int:
    """Train every unfinished (variant, seed) run, then write the report.

    The launcher options (--launcher to --no-wait) each override the experiment file's launcher: mapping.

    Args:
        file: experiment file, e.g. configs/experiments/lookups.yaml
        out: output directory (default: the file's, or runs/experiments/NAME)
        variants: only these variants
        no_reuse: train every run, even one whose config and seed equal a finished run of a sibling experiment
            directory (by default that run is reused)
        seeds: these seeds instead of the file's
        base: config files stacked after the file's base (before the variants' configs), e.g.
            configs/model/gpt2_small.yaml to run the same comparison at another model size; use --out too
        set: KEY=VALUE merged into the file's common mapping (VALUE is YAML), e.g. --set trainer.max_steps=100;
            use --out too, so runs of another budget do not mix with the file's
        launcher: local (default), slurm (a submitit job per run), or submitit-local (those jobs on this machine)
        jobs: local: runs at once, one GPU each when there are GPUs (default 1: one after another)
        partition: SLURM partition
        gpus_per_job: GPUs per run (slurm default 1)
        cpus_per_job: CPU cores per run
        mem_gb: memory per run
        time: time limit per job: minutes, HH:MM:SS or D-HH:MM:SS (SLURM's formats); a run that needs longer is
            stopped, requeued and resumed
        account: SLURM account
        qos: SLURM quality of service
        no_wait: slurm: return once the jobs are submitted (then `rlm experiment status DIR` and `rlm experiment
            report DIR`)
    """
    from rlm.experiment.check import check_experiment
    from rlm.experiment.runner import Preempted, run_experiment
    from rlm.extras import require
    from rlm.train.checkpoint import PREEMPTED

    exp, counts = check_experiment(file, set, seeds, base)
    where = exp.out_dir(out)
    runs = plan(exp, where, variants)
    _print_plan(exp, where, len(runs), counts)
    flags = {"name": launcher, "jobs": jobs, "partition": partition, "gpus_per_job": gpus_per_job,
             "cpus_per_job": cpus_per_job, "mem_gb": mem_gb, "time": time, "account": account, "qos": qos}  # fmt: skip
    options = resolve_launcher(exp.launcher, flags)
    name = options["name"]
    if no_wait and name != "slurm":
        raise ValueError(
            f"--no-wait applies to --launcher slurm, not {name} (its jobs end with this process)"
        )
    try:
        if name == "local":
            failed = run_experiment(exp, where, variants, reuse_equal=not no_reuse, jobs=options["jobs"])
        else:
            require("submitit", "slurm", f"--launcher {name}")
            from rlm.experiment.submit import submit

            ids, failed = submit(exp, where, options, variants, not no_reuse, wait=not no_wait)
    except Preempted as stop:
        print(f"experiment stopped: {stop}", file=sys.stderr)
        return PREEMPTED
    if no_wait:
        print(f"submitted {len(ids)} job(s); follow them with `rlm experiment status {where}`, "
              f"and write the report with `rlm experiment report {where}` once they are done")  # fmt: skip
        return 0
    paths: list[Path] = []
    try:
        paths = write_report(where)
        print("wrote " + ", ".join(str(p) for p in paths))
    except (ValueError, MissingExtra) as err:
        print(f"no report: {err}")
    summaries = [(r.label, r.dir, r.dir / LAST_CKPT, r.summary()) for r in runs if r.summary()]
    print(experiment_summary(where, summaries, paths))
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)} (see their fit.log); rerun to retry them")
        return 1
    return 0


STATES = ("done", "running", "queued", "stopped", "failed", "pending")


@dataclass
class RunState:
    """One run's state and a line (and, for a failed run, the end of its log) saying more."""

    label: str
    state: str
    detail: str = ""
    tail: str = ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def run_state(run_dir: Path, label: str, knnlm: bool) -> RunState:
    """The state of the run in ``run_dir`` from its summary.json and job.json."""
    summary = read_json(run_dir / SUMMARY)
    if summary and (not knnlm or summary.get("knnlm")):
        loss, test = summary.get("val_loss"), summary.get("test_loss")
        subset = val_subset(summary.get("val_batches"))
        parts = [
            f"val loss {loss:.4f}" + (f" on {subset}" if subset else "") if loss is not None else "",
            f"test loss {test:.4f}" if test is not None else "",
            f"reused from {summary['reused_from']}" if summary.get("reused_from") else "",
        ]
        return RunState(label, "done", ", ".join(p for p in parts if p))
    job = read_json(run_dir / JOB_JSON)
    state, job_id = job.get("state"), job.get("job_id")
    where = f" (job {job_id})" if job_id else ""
    resumes = "; resumes from ckpt/last.ckpt" if (run_dir / LAST_CKPT).is_file() else ""
    if state == "failed":
        log = Path(job.get("log") or run_dir / "fit.log")
        return RunState(
            label, "failed", f"{job.get('step', 'the run')} failed{where}; end of {log}:", log_tail(log)
        )
    if state == "running":
        host, pid = job.get("host"), job.get("pid")
        if host and host != socket.gethostname():
            return RunState(label, "running", f"on {host}{where}")
        if isinstance(pid, int) and _alive(pid):
            return RunState(label, "running", f"pid {pid}{where}")
        return RunState(label, "stopped", f"pid {pid} is gone without finishing{resumes}")
    if state == "queued":
        return RunState(label, "queued", f"submitted through {job.get('launcher')}{where}")
    if state == "stopped":
        return RunState(label, "stopped", f"{job.get('reason', 'interrupted')}{resumes}")
    return RunState(label, "pending", resumes.removeprefix("; "))


def experiment_states(out: Path) -> list[RunState]:
    """Every run of the experiment whose resolved file (experiment.json) is in ``out``, in file order."""
    info = read_info(out)
    return [
        run_state(out / name / f"seed{seed}", f"{name}/seed{seed}", variant.get("knnlm") is not None)
        for name, variant in info["variants"].items()
        for seed in info["seeds"]
    ]


def format_states(states: list[RunState]) -> str:
    """A table of the runs' states, a line of counts under it."""
    width = max((len(s.label) for s in states), default=5)
    lines = [f"{'run':<{width}}  {'state':<8} detail"]
    for s in states:
        lines.append(f"{s.label:<{width}}  {s.state:<8} {s.detail}".rstrip())
        if s.tail:
            lines.append(s.tail)
    counts = {name: sum(s.state == name for s in states) for name in STATES}
    lines.append(", ".join(f"{n} {name}" for name, n in counts.items() if n))
    return "\n".join(lines)


def cmd_status(dir: str) -> int:
    """Show each run's state: pending, queued, running, done, stopped or failed (read from its files).

    Args:
        dir: an experiment's output directory (holds experiment.json)
    """
    print(format_states(experiment_states(Path(dir))))
    return 0


def cmd_report(dir: str) -> int:
    """Regenerate results.csv, results.md and the plots from the finished runs of an experiment directory.

    Args:
        dir: an experiment's output directory (holds experiment.json)
    """
    paths = write_report(Path(dir))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


COMMANDS = {"run": cmd_run, "check": cmd_check, "report": cmd_report, "status": cmd_status}
"""``rlm experiment``'s subcommands (rlm.cli.commands builds their parsers from the signatures)."""
