"""``rlm experiment run|check|report|status``: a small table of subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rlm.cli.summary import experiment_summary
from rlm.experiment.children import Preempted
from rlm.experiment.report import write_report
from rlm.experiment.runs import LAST_CKPT, SUMMARY, plan
from rlm.experiment.spec import Experiment
from rlm.extras import MissingExtra

if TYPE_CHECKING:
    from rlm.experiment.check import ParamCounts

# check and runner import torch and Lightning: inside the commands that need them, so `status`, `report` and
# --help start without them.

LAUNCHER_FLAGS = (
    "launcher",
    "jobs",
    "partition",
    "gpus_per_job",
    "cpus_per_job",
    "mem_gb",
    "time",
    "account",
    "qos",
)
"""``rlm experiment run`` flags that override the file's ``launcher`` mapping (``--launcher`` is its ``name``)."""


def _print_plan(exp: Experiment, out: Path, runs: int, counts: dict[str, ParamCounts]) -> None:
    print(f"experiment {exp.name}: {len(counts)} variants, {runs} runs, output {out}")
    print(f"  {'variant':<24} {'params':>12} {'added':>12} {'active/token':>13}  then")
    for name, c in counts.items():
        mark = " (baseline)" if name == exp.baseline else ""
        knn = exp.variants[name].knnlm
        then = "" if knn is None else "kNN-LM datastore " + " ".join(f"{k}={v}" for k, v in knn.items())
        print(f"  {name + mark:<24} {c.total:>12,} {c.added:>12,} {c.active:>13,}  {then}".rstrip())


def cmd_check(a: argparse.Namespace) -> int:
    """Validate the file and print the plan with each variant's parameter counts; train nothing."""
    from rlm.experiment.spec import parse_experiment

    first, _ = parse_experiment(a.file)  # the structure pass: instant, what the slow part then checks
    if first is not None:
        print(f"rlm experiment check: {len(first.variants)} variants ({', '.join(first.variants)}); parsing each "
              "with the rlm fit parser and building its model on the meta device", file=sys.stderr, flush=True)  # fmt: skip
    from rlm.experiment.check import check_experiment

    exp, counts = check_experiment(a.file, a.set, a.seeds, a.base)
    out = exp.out_dir(a.out)
    _print_plan(exp, out, len(plan(exp, out, a.variants)), counts)
    return 0


def _launch(exp: Experiment, out: Path, a: argparse.Namespace) -> list[str] | None:
    """Execute the runs where the launcher options (the file's, then the flags) say; the labels of the runs
    that failed, or None when the jobs were only submitted (--no-wait)."""
    from rlm.experiment.launcher import resolve_launcher
    from rlm.experiment.runner import run_experiment
    from rlm.extras import require

    launcher = resolve_launcher(
        exp.launcher, {"name" if k == "launcher" else k: getattr(a, k) for k in LAUNCHER_FLAGS}
    )
    if a.no_wait and launcher["name"] != "slurm":
        raise ValueError(
            f"--no-wait applies to --launcher slurm, not {launcher['name']} (its jobs end with this process)"
        )
    if launcher["name"] == "local":
        return run_experiment(exp, out, a.variants, reuse_equal=not a.no_reuse, jobs=launcher["jobs"])
    require("submitit", "slurm", f"--launcher {launcher['name']}")
    from rlm.experiment.submit import submit

    ids, failed = submit(exp, out, launcher, a.variants, not a.no_reuse, wait=not a.no_wait)
    if a.no_wait:
        print(f"submitted {len(ids)} job(s); follow them with `rlm experiment status {out}`, "
              f"and write the report with `rlm experiment report {out}` once they are done")  # fmt: skip
        return None
    return failed


def cmd_run(a: argparse.Namespace) -> int:
    """Validate, train every unfinished run, then write the report."""
    from rlm.experiment.check import check_experiment
    from rlm.train.checkpoint import PREEMPTED

    exp, counts = check_experiment(a.file, a.set, a.seeds, a.base)
    out = exp.out_dir(a.out)
    _print_plan(exp, out, len(plan(exp, out, a.variants)), counts)
    try:
        failed = _launch(exp, out, a)
        if failed is None:  # submitted, not waited for
            return 0
    except Preempted as stop:
        print(f"experiment stopped: {stop}", file=sys.stderr)
        return PREEMPTED
    paths: list[Path] = []
    try:
        paths = write_report(out)
        print("wrote " + ", ".join(str(p) for p in paths))
    except (ValueError, MissingExtra) as err:
        print(f"no report: {err}")
    finished = [r for r in plan(exp, out, a.variants) if r.finished()]
    summaries = [
        (r.label, r.dir, r.dir / LAST_CKPT, json.loads((r.dir / SUMMARY).read_text())) for r in finished
    ]
    print(experiment_summary(out, summaries, paths))
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)} (see their fit.log); rerun to retry them")
        return 1
    return 0


def cmd_status(a: argparse.Namespace) -> int:
    """Print each run's state (pending, queued, running, done, stopped, failed) from its directory's files."""
    from rlm.experiment.status import experiment_states, format_states

    print(format_states(experiment_states(Path(a.dir))))
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    """Regenerate the tables and plots from the finished runs of an experiment directory."""
    paths = write_report(Path(a.dir))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


SUBCOMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "run": (cmd_run, "train every unfinished (variant, seed) run, then write the report"),
    "check": (cmd_check, "validate an experiment file and print its plan; trains nothing"),
    "report": (cmd_report, "regenerate results.csv, results.md and the plots from finished runs"),
    "status": (cmd_status, "show each run's state: pending, queued, running, done, stopped or failed"),
}


def _launcher_flags(s: argparse.ArgumentParser) -> None:
    """Where the runs execute; each flag overrides the experiment file's ``launcher`` mapping."""
    g = s.add_argument_group("launcher (each overrides the file's launcher: mapping)")
    g.add_argument("--launcher", default=None, help="local (default), slurm (a submitit job per run), or "
                   "submitit-local (those jobs on this machine)")  # fmt: skip
    g.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="local: runs at once, one GPU each when there are GPUs (default 1: one after another)")  # fmt: skip
    g.add_argument("--partition", default=None, help="SLURM partition")
    g.add_argument(
        "--gpus-per-job", type=int, default=None, metavar="N", help="GPUs per run (slurm default 1)"
    )
    g.add_argument("--cpus-per-job", type=int, default=None, metavar="N", help="CPU cores per run")
    g.add_argument("--mem-gb", type=float, default=None, metavar="GB", help="memory per run")
    g.add_argument("--time", default=None, help="time limit per job: minutes, HH:MM:SS or D-HH:MM:SS (SLURM's formats); a run that needs "
                   "longer is stopped, requeued and resumed")  # fmt: skip
    g.add_argument("--account", default=None, help="SLURM account")
    g.add_argument("--qos", default=None, help="SLURM quality of service")
    g.add_argument("--no-wait", action="store_true", help="slurm: return once the jobs are submitted "
                   "(then `rlm experiment status DIR` and `rlm experiment report DIR`)")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    """The ``rlm experiment`` argument parser."""
    p = argparse.ArgumentParser(prog="rlm experiment", description="Compare plugin variants over seeds.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (fn, help_) in SUBCOMMANDS.items():
        s = sub.add_parser(name, help=help_, description=help_)
        s.set_defaults(fn=fn)
        if name in ("report", "status"):
            s.add_argument("dir", help="an experiment's output directory (holds experiment.json)")
            continue
        s.add_argument("file", help="experiment file, e.g. configs/experiments/lookups.yaml")
        s.add_argument(
            "--out", default=None, help="output directory (default: the file's, or runs/experiments/NAME)"
        )
        s.add_argument("--variants", nargs="+", default=None, metavar="NAME", help="only these variants")
        if name == "run":
            s.add_argument(
                "--no-reuse",
                action="store_true",
                help="train every run, even one whose config and seed equal a finished run of a sibling "
                "experiment directory (by default that run is reused)",
            )
            _launcher_flags(s)
        s.add_argument(
            "--seeds",
            nargs="+",
            type=int,
            default=None,
            metavar="K",
            help="these seeds instead of the file's",
        )
        s.add_argument(
            "--base", nargs="+", default=None, metavar="FILE",
            help="config files stacked after the file's base (before the variants' configs), e.g. "
            "configs/model/gpt2_small.yaml to run the same comparison at another model size; use --out too",
        )  # fmt: skip
        s.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE",
            help="merged into the file's common mapping (VALUE is YAML), e.g. --set trainer.max_steps=100; "
            "use --out too, so runs of another budget do not mix with the file's",
        )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``rlm experiment``; errors (ValueError) are printed by ``rlm``'s own main."""
    a = parser().parse_args(argv)
    return a.fn(a)
