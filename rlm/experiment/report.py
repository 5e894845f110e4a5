"""Tables and plots of an experiment's finished runs: results.csv, results.md and three PNG plots."""

from __future__ import annotations

import csv
import fnmatch
import io
import json
import math
import statistics
from pathlib import Path
from typing import Any

from rlm.cli.summary import val_subset
from rlm.experiment.plots import plot
from rlm.experiment.runs import SUMMARY, VariantResult, collect, val_curves
from rlm.experiment.spec import flatten, write_atomic

RUN_COLUMNS = [
    "variant", "seed", "baseline", "val_loss", "val_ppl", "best_val_loss", "val_step", "test_loss", "test_ppl",
    "test_bpb", "steps", "params_total",
    "params_added", "params_active", "tokens_per_s", "load", "cores", "jobs", "train_s", "wall_s",
]  # fmt: skip
PLOTS = ("val_loss_vs_step.png", "val_loss_vs_time.png", "loss_vs_added_params.png")
MAX_METRIC_COLUMNS = 12


def _short(path: str) -> str:
    """A config path relative to the working directory when it lies below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def _fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _count(n: float | None) -> str:
    """Parameter counts the way papers print them: 3.21M, 524k."""
    if n is None:
        return "—"
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _seconds(s: float | None) -> str:
    return "—" if s is None else f"{s:.0f}s" if s < 600 else f"{s / 60:.1f}min"


def write_csv(out: Path, info: dict[str, Any], variants: list[VariantResult]) -> None:
    """results.csv: one row per run, every plugin metric as a column."""
    metric_names = sorted({k for v in variants for r in v.runs for k in r["metrics"]})
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(RUN_COLUMNS + metric_names)
    for v in variants:
        for r in sorted(v.runs, key=lambda r: r["seed"]):
            row = {**r, "baseline": v.name == info["baseline"]}
            writer.writerow([row.get(c) for c in RUN_COLUMNS] + [r["metrics"].get(m) for m in metric_names])
    write_atomic(out / "results.csv", buf.getvalue())


def _without_zero_seconds(header: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """The table without columns of durations that all round to 0 s (small runs): they say nothing."""
    keep = [i for i, column in enumerate(zip(*rows)) if "0s" not in column or set(column) - {"0s", "—"}]
    return [header[i] for i in keep], [[r[i] for i in keep] for r in rows]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def markdown(info: dict[str, Any], variants: list[VariantResult]) -> str:
    """results.md: variants sorted by mean validation loss, the baseline marked, deltas against it."""
    base = next((v for v in variants if v.name == info["baseline"]), None)
    ordered = sorted(variants, key=lambda v: (v.mean("val_loss") is None, v.mean("val_loss") or 0.0))
    b_loss, b_ppl, b_speed = (base.mean(k) if base else None for k in ("val_loss", "val_ppl", "tokens_per_s"))
    seeds = sorted({r["seed"] for v in variants for r in v.runs})
    # Validation reads trainer.limit_val_batches batches, not the whole split (`rlm eval --split val` does).
    subsets = sorted({val_subset(r.get("val_batches")) for v in variants for r in v.runs} - {""})
    val_name = f"val loss ({' / '.join(subsets)})" if subsets else "val loss"
    over = ""
    if subsets:
        over = (f", over the first {' / '.join(subsets)} of the validation split (trainer.limit_val_batches; "
                "`rlm eval --split val` reads the whole split), as are val ppl and the loss at equal time")  # fmt: skip
    steps = sorted({r["steps"] for v in variants for r in v.runs})
    lines = [f"# Experiment `{info['name']}`", ""]
    lines += [
        f"{len(variants)} variant{'s' * (len(variants) != 1)} x seeds {seeds}, {'/'.join(map(str, steps))} training steps per run; "
        f"base config: {', '.join(_short(p) for p in info['base'])}. Validation loss is the last "
        f"validation of each run (mean ± sample sd over seeds){over}; test loss and bits per byte are `rlm eval` of "
        "each run's last checkpoint on the whole test split; Δ against the baseline "
        f"`{info['baseline']}`{'' if base else ' (not finished: no deltas)'}; tokens/s is the median "
        "training throughput of the second half of each run, load the machine's 1-minute load average at the same "
        "steps against its cores, jobs the runs trained at once (--jobs): on a shared machine throughput and "
        "times follow them; train time excludes validation; the loss at equal "
        "time is read off each run's validation curve (linear between validations) at the training time of the "
        "shortest run.",
        "",
    ]
    common = flatten(info.get("common") or {})
    if common:
        lines += ["Set in every run: " + ", ".join(f"`{k}={json.dumps(v)}`" for k, v in common) + ".", ""]
    t_equal, at_t = equal_time_losses(variants)
    at_header = f"val loss at {_seconds(t_equal)} train" if t_equal is not None else "val loss at equal time"
    header = ["variant", val_name, "Δ loss", at_header, "val ppl", "Δ ppl", "test loss", "test bits/byte",
              "params", "added", "active/token",
              "tokens/s", "load / cores", "jobs", "train time", "runs", "tokens/s vs baseline"]  # fmt: skip
    rows = []
    for v in ordered:
        loss, sd, ppl, speed = v.mean("val_loss"), v.sd("val_loss"), v.mean("val_ppl"), v.mean("tokens_per_s")
        is_base = v is base
        rows.append([
            (f"**{v.name}**" + ("" if "baseline" in v.name else " (baseline)")) if is_base else v.name,
            _fmt(loss) + (f" ± {_fmt(sd)}" if sd is not None else ""),
            "—" if is_base or None in (loss, b_loss) else f"{loss - b_loss:+.3f}",
            _fmt(at_t.get(v.name)),
            _fmt(ppl, 2),
            "—" if is_base or None in (ppl, b_ppl) else f"{100 * (ppl / b_ppl - 1):+.1f}%",
            _fmt(v.mean("test_loss")) + (f" ± {_fmt(v.sd('test_loss'))}" if v.sd("test_loss") is not None else ""),
            _fmt(v.mean("test_bpb")),
            *(_count(v.mean(k)) for k in ("params_total", "params_added", "params_active")),
            _fmt(speed, 0),
            "—" if v.mean("load") is None else f"{v.mean('load'):.1f} / {v.mean('cores'):.0f}",
            "—" if v.mean("jobs") is None else str(max(r.get("jobs") or 1 for r in v.runs)),
            _seconds(v.mean("train_s")),
            str(len(v.runs)),
            "—" if None in (speed, b_speed) else f"{speed / b_speed:.2f}x",
        ])  # fmt: skip
    lines += _table(*_without_zero_seconds(header, rows))
    lines += _overload_note(variants)
    stale = sorted(
        f"{v.name}/seed{r['seed']}"
        for v in variants
        for r in v.runs
        if r.get("val_step", r["steps"]) != r["steps"]
    )
    if stale:
        lines += ["", f"Warning: the last validation of {', '.join(stale)} came before the last training step "
                  "(make trainer.max_steps a multiple of trainer.val_check_interval)."]  # fmt: skip
    described = [v for v in ordered if info["variants"].get(v.name, {}).get("description")]
    if described:
        lines += ["", *[f"- `{v.name}`: {info['variants'][v.name]['description']}" for v in described]]
    lines += _knnlm_table(ordered)
    lines += _metrics_table(info, ordered)
    lines += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in PLOTS) + ".", ""]
    return "\n".join(lines)


def _overload_note(variants: list[VariantResult]) -> list[str]:
    """A warning naming the runs whose machine had more runnable threads than cores while they were timed."""
    busy = [
        f"{v.name}/seed{r['seed']} ({r['load']:.1f} on {r['cores']} cores)"
        for v in variants
        for r in sorted(v.runs, key=lambda r: r["seed"])
        if r.get("load") is not None and r.get("cores") and r["load"] > r["cores"]
    ]
    if not busy:
        return []
    return ["", f"Warning: the load average exceeded the core count during {', '.join(busy)}: their tokens/s, "
            "MFU, train time and loss at equal time measure the machine's other work as much as the variant "
            "(the scripts in benchmarks/ time against a baseline measured in the same run)."]  # fmt: skip


def _knnlm_table(variants: list[VariantResult]) -> list[str]:
    """Variants with a kNN-LM stage: the model's test loss alone and with its datastore, paired by seed."""
    rows = []
    for v in variants:
        runs = [r for r in v.runs if r.get("knnlm")]
        if not runs:
            continue
        lm = [r["lm_test"]["loss"] for r in runs]
        gains = [r["test_loss"] - r["lm_test"]["loss"] for r in runs]
        sd = f" ± {statistics.stdev(gains):.3f}" if len(gains) > 1 else ""
        k = runs[0]["knnlm"]
        # the loss change from real to random neighbours, by seed
        costs = [
            r["knnlm"]["random_loss"] - r["test_loss"]
            for r in runs
            if r["knnlm"].get("random_loss") is not None
        ]
        rows.append([
            v.name, _fmt(statistics.fmean(lm)), _fmt(v.mean("test_loss")), f"{statistics.fmean(gains):+.3f}{sd}",
            ", ".join(f"{g:+.3f}" for g in gains), k.get("rule", "interpolate"),
            "/".join("-" if r["knnlm"].get("lam") is None else f"{r['knnlm']['lam']:g}" for r in runs),
            "/".join(f"{r['knnlm']['temperature']:.3g}" for r in runs), _count(k.get("keys")),
            f"{k.get('factory')}" + (", cache" if k.get("cache") else ""),
            _seconds(statistics.fmean(r["knnlm"]["build_s"] or 0.0 for r in runs)),
            ", ".join(f"{c:+.3f}" for c in costs) or "—",
        ])  # fmt: skip
    if not rows:
        return []
    header = ["variant", "LM test loss", "with datastore", "gain (mean ± sd)", "gain by seed", "rule", "lam",
              "temperature", "keys", "index", "build time", "random neighbours (Δ by seed)"]  # fmt: skip
    intro = ("A datastore of each run's own states over its training split: 'interpolate' is kNN-LM (Khandelwal "
             "et al. 2020, lam and the temperature tuned on the validation split), 'joint' the token memory's "
             "mixture (its temperature and bias tuned there); the table above shows these variants' test loss with "
             "the datastore. Random neighbours: the same distances with random values of the datastore, the loss "
             "change against the real neighbours.")  # fmt: skip
    return ["", intro, "", *_table(header, rows)]


def _metrics_table(info: dict[str, Any], variants: list[VariantResult]) -> list[str]:
    """Plugin metrics matching the experiment's report_metrics patterns (final values, mean over seeds)."""
    names = sorted({k for v in variants for r in v.runs for k in r["metrics"]})
    chosen = [n for n in names if any(fnmatch.fnmatch(n, p) for p in info.get("report_metrics", ["val/*"]))]
    if not chosen:
        return []
    note = ""
    if len(chosen) > MAX_METRIC_COLUMNS:
        note = f" The first {MAX_METRIC_COLUMNS} of {len(chosen)} are shown; results.csv has them all."
        chosen = chosen[:MAX_METRIC_COLUMNS]
    rows = [[v.name] + [_fmt(v.mean(n, "metrics"), 4) for n in chosen] for v in variants]
    return [
        "",
        f"Plugin metrics (last logged value, mean over seeds).{note}",
        "",
        *_table(["variant", *chosen], rows),
    ]


def _loss_at_time(times: list[float], losses: list[float], t: float) -> float | None:
    """Validation loss at training time t, linear between the two validations around it."""
    if not times or not times[0] <= t <= times[-1]:
        return None
    for t0, l0, t1, l1 in zip(times, losses, times[1:], losses[1:]):
        if t0 <= t <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (t - t0) / (t1 - t0)
    return losses[-1]  # a single validation, at t


def equal_time_losses(variants: list[VariantResult]) -> tuple[float | None, dict[str, float | None]]:
    """The shortest run's training time T, and each variant's validation loss at T (mean over seeds)."""
    curves = {id(r): val_curves(r)[1:] for v in variants for r in v.runs}
    ends = [times[-1] for times, _ in curves.values() if times]
    if not ends:
        return None, {}
    t = min(ends)
    out = {}
    for v in variants:
        values = [_loss_at_time(*curves[id(r)], t) for r in v.runs]
        values = [x for x in values if x is not None]
        out[v.name] = statistics.fmean(values) if values else None
    return t, out


def write_report(out: Path) -> list[Path]:
    """Regenerate results.csv, results.md and the plots from the finished runs in ``out``."""
    info, variants = collect(out)
    if not variants:
        raise ValueError(f"no finished runs in {str(out)!r} (a finished run has VARIANT/seedK/{SUMMARY})")
    write_csv(out, info, variants)
    write_atomic(out / "results.md", markdown(info, variants))
    plot(out, info, variants)
    return [out / "results.csv", out / "results.md", *(out / p for p in PLOTS)]
