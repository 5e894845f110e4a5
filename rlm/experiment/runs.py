"""An experiment's runs and their files: the Run record, the plan of (variant, seed) runs, metrics.csv read
back with earlier attempts stitched in front, and the finished runs collected for the report and the plots."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlm.experiment.spec import Experiment, merge, write_atomic

SUMMARY = "summary.json"  # a run's finished marker, written last
METRICS_CSV = Path("logs") / "version_0" / "metrics.csv"
LAST_CKPT = Path("ckpt") / "last.ckpt"
TEST_JSON = "test.json"  # rlm eval of the last checkpoint on the test split
FINGERPRINT = "fingerprint"  # Run.fingerprint, written when training starts
# Where a run executes and how it went (state: queued, running, done, failed, stopped; pid, host, job id, times,
# the log to read on failure), for `rlm experiment status`
JOB_JSON = "job.json"


@dataclass
class Run:
    """One (variant, seed) of an experiment."""

    variant: str
    seed: int
    dir: Path
    config: dict[str, Any]  # the merged config before the runner's own keys
    knnlm: dict[str, Any] | None = None  # the variant's kNN-LM stage (KNNLM_OPTIONS); not in the fingerprint

    @property
    def label(self) -> str:
        return f"{self.variant}/seed{self.seed}"

    @property
    def fingerprint(self) -> str:
        """A short hash of the config and seed, not of where the run lives."""
        text = json.dumps({"config": self.config, "seed": self.seed}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def summary(self) -> dict[str, Any] | None:
        """The run's summary.json, or None when it is missing or damaged (the run is then not finished)."""
        return read_json(self.dir / SUMMARY) or None

    def complete(self) -> bool:
        """Finished, with the kNN-LM stage too when the variant has one: nothing left to do."""
        summary = self.summary()
        return summary is not None and (self.knnlm is None or bool(summary.get("knnlm")))

    def check_dir(self) -> None:
        """ValueError when the run's folder holds files but neither a fingerprint nor a job.json: it is not one
        this runner wrote, and training there would delete them."""
        names = sorted(p.name for p in self.dir.iterdir()) if self.dir.is_dir() else []
        if names and not {FINGERPRINT, JOB_JSON} & set(names):
            shown = ", ".join(map(repr, names[:3])) + (", ..." if len(names) > 3 else "")
            raise ValueError(
                f"{self.dir} holds files that rlm experiment did not write ({shown}; its run folders hold a "
                f"{FINGERPRINT!r} or {JOB_JSON!r}), and training {self.label} there would delete them; choose "
                "another --out, or move them away"
            )


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; {} when it is missing, damaged or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def plan(exp: Experiment, out: Path, variants: list[str] | None = None) -> list[Run]:
    """Every run of the experiment (restricted to ``variants`` when given), in file order, seeds inner."""
    names = list(exp.variants)
    if variants:
        unknown = sorted(set(variants) - set(names))
        if unknown:
            raise ValueError(f"unknown variant(s) {unknown}; the experiment has {names}")
        names = [n for n in names if n in variants]
    runs = []
    for name in names:
        variant = exp.variants[name]
        config = merge([*exp.base, *variant.configs], exp.common, variant.set)
        runs += [Run(name, seed, out / name / f"seed{seed}", config, variant.knnlm) for seed in exp.seeds]
    return runs


def begin(exp: Experiment, out: Path, variants: list[str] | None) -> list[Run]:
    """Write the resolved file (experiment.json) into ``out``; the runs to execute, their folders checked before
    any run trains or job.json goes into a folder that is not a run's."""
    write_atomic(out / "experiment.json", json.dumps(exp.to_json(), indent=2) + "\n")
    runs = plan(exp, out, variants)
    for run in runs:
        run.check_dir()
    return runs


def read_info(out: Path) -> dict[str, Any]:
    """The experiment.json of an experiment's output directory."""
    if not (out / "experiment.json").is_file():
        raise ValueError(f"{str(out)!r} is not an experiment directory: it has no experiment.json")
    return json.loads((out / "experiment.json").read_text())


def series(rows: list[dict[str, float]], name: str) -> list[tuple[float, float]]:
    """(step, value) of one metric, in logging order."""
    return [(r.get("step", float("nan")), r[name]) for r in rows if name in r]


def run_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The run's metrics.csv rows with earlier attempts (``metrics.part-K.csv``, kept at each resume) stitched in
    front; rows of a part at or after the first step of the next one were trained again and are dropped."""
    current = run_dir / METRICS_CSV
    parts = sorted(current.parent.glob("metrics.part-*.csv"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    chunks = []
    for path in (p for p in [*parts, current] if p.is_file()):
        with open(path) as f:  # the non-empty cells as floats
            chunks.append(
                [{k: float(v) for k, v in row.items() if v not in (None, "")} for row in csv.DictReader(f)]
            )
    rows: list[dict[str, float]] = []
    for i, chunk in enumerate(chunks):
        cut = min((r["step"] for c in chunks[i + 1 :] for r in c if "step" in r), default=math.inf)
        rows += [r for r in chunk if r.get("step", -1) < cut]
    return rows


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a run's log, indented, for the messages that say where it failed."""
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(f"    {ln}" for ln in text[-lines:])


@dataclass
class VariantResult:
    """A variant's finished runs and their means."""

    name: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    def mean(self, key: str, group: str | None = None) -> float | None:
        """The mean over seeds of ``key``, or of ``key`` in each summary's ``group`` mapping (``metrics``)."""
        values = [v for r in self.runs if (v := (r[group] if group else r).get(key)) is not None]
        return statistics.fmean(values) if values else None

    def sd(self, key: str) -> float | None:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        return statistics.stdev(values) if len(values) > 1 else None


def collect(out: Path) -> tuple[dict[str, Any], list[VariantResult]]:
    """The experiment's description and its variants' finished runs, in the file's variant order."""
    info = read_info(out)
    results: dict[str, VariantResult] = {name: VariantResult(name) for name in info["variants"]}
    for path in sorted(out.glob(f"*/seed*/{SUMMARY}")):
        summary = json.loads(path.read_text())
        summary["dir"] = path.parent
        results.setdefault(summary["variant"], VariantResult(summary["variant"])).runs.append(summary)
    return info, [r for r in results.values() if r.runs]


def val_curves(run: dict[str, Any]) -> tuple[list[float], list[float], list[float]]:
    """Steps, training seconds and validation losses of a run's validations."""
    rows = run_metrics(run["dir"])
    clock, validations = series(rows, "time/train_s"), series(rows, "val/loss")
    # the training time at the last training step before each validation
    times = [next((t for s, t in reversed(clock) if s <= step), 0.0) for step, _ in validations]
    return [step + 1 for step, _ in validations], times, [loss for _, loss in validations]
