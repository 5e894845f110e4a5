"""``rlm experiment run|check|report``: a small table of subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from rlm.cli.summary import experiment_summary
from rlm.experiment.check import ParamCounts, check_experiment
from rlm.experiment.report import write_report
from rlm.experiment.runner import LAST_CKPT, PREEMPTED, SUMMARY, Preempted, plan, run_experiment
from rlm.experiment.spec import Experiment
from rlm.extras import MissingExtra


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
    exp, counts = check_experiment(a.file, a.set, a.seeds)
    out = exp.out_dir(a.out)
    _print_plan(exp, out, len(plan(exp, out, a.variants)), counts)
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    """Validate, train every unfinished run, then write the report."""
    exp, counts = check_experiment(a.file, a.set, a.seeds)
    out = exp.out_dir(a.out)
    _print_plan(exp, out, len(plan(exp, out, a.variants)), counts)
    try:
        failed = run_experiment(exp, out, a.variants, reuse_equal=not a.no_reuse)
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


def cmd_report(a: argparse.Namespace) -> int:
    """Regenerate the tables and plots from the finished runs of an experiment directory."""
    paths = write_report(Path(a.dir))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


SUBCOMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "run": (cmd_run, "train every unfinished (variant, seed) run, then write the report"),
    "check": (cmd_check, "validate an experiment file and print its plan; trains nothing"),
    "report": (cmd_report, "regenerate results.csv, results.md and the plots from finished runs"),
}


def parser() -> argparse.ArgumentParser:
    """The ``rlm experiment`` argument parser."""
    p = argparse.ArgumentParser(prog="rlm experiment", description="Compare plugin variants over seeds.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (fn, help_) in SUBCOMMANDS.items():
        s = sub.add_parser(name, help=help_, description=help_)
        s.set_defaults(fn=fn)
        if name == "report":
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
        s.add_argument(
            "--seeds",
            nargs="+",
            type=int,
            default=None,
            metavar="K",
            help="these seeds instead of the file's",
        )
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
