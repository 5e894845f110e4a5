"""An experiment's finished runs read back from its directory, for the report and the plots."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlm.experiment.runs import SUMMARY, run_metrics, series


@dataclass
class VariantResult:
    """A variant's finished runs and their means."""

    name: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    def mean(self, key: str) -> float | None:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        return statistics.fmean(values) if values else None

    def sd(self, key: str) -> float | None:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        return statistics.stdev(values) if len(values) > 1 else None

    def metric(self, name: str) -> float | None:
        values = [r["metrics"][name] for r in self.runs if r["metrics"].get(name) is not None]
        return statistics.fmean(values) if values else None


def collect(out: Path) -> tuple[dict[str, Any], list[VariantResult]]:
    """The experiment's description and its variants' finished runs, in the file's variant order."""
    info_path = out / "experiment.json"
    if not info_path.is_file():
        raise FileNotFoundError(
            f"{str(info_path)!r} does not exist: is {str(out)!r} an experiment directory?"
        )
    info = json.loads(info_path.read_text())
    results: dict[str, VariantResult] = {name: VariantResult(name) for name in info["variants"]}
    for path in sorted(out.glob(f"*/seed*/{SUMMARY}")):
        summary = json.loads(path.read_text())
        summary["dir"] = path.parent
        results.setdefault(summary["variant"], VariantResult(summary["variant"])).runs.append(summary)
    return info, [r for r in results.values() if r.runs]


def val_curves(run: dict[str, Any]) -> tuple[list[float], list[float], list[float]]:
    """Steps, training seconds and validation losses of a run's validations."""
    rows = run_metrics(run["dir"])
    clock = series(rows, "time/train_s")
    steps, times, losses = [], [], []
    for step, loss in series(rows, "val/loss"):
        # The training time at the last training step before this validation.
        before = [t for s, t in clock if s <= step]
        steps.append(step + 1)
        times.append(before[-1] if before else 0.0)
        losses.append(loss)
    return steps, times, losses
