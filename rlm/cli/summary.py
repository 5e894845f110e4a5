"""The block a run prints at its end: its final loss, where its files went, and the next commands with the real
paths. Imports neither torch nor Lightning."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any


def show(path: str | Path | None) -> str:
    """``path`` relative to the working directory when it lies under it, else absolute; quoted for a shell."""
    if path is None:
        return "-"
    path = Path(path).absolute()
    try:
        text = str(path.relative_to(Path.cwd()))
    except ValueError:
        text = str(path)
    return shlex.quote(text)


def fit_paths(trainer: Any, config: Path | None = None) -> dict[str, Path | None]:
    """Where a finished fit wrote its checkpoint, metrics CSV, TensorBoard logs and merged config (``config``, from
    the config callback: ``trainer.log_dir`` is a collective under DDP, and only rank 0 prints)."""
    # every Checkpoint callback, not only ModelCheckpoint (OnExceptionCheckpoint has neither path)
    paths = [
        getattr(cb, n, "")
        for cb in trainer.checkpoint_callbacks
        for n in ("last_model_path", "best_model_path")
    ]
    ckpt = next((Path(p) for p in paths if p and Path(p).is_file()), None)
    logs = {type(lg).__name__: Path(lg.log_dir) for lg in reversed(trainer.loggers) if lg.log_dir}
    csv, tb = logs.get("CSVLogger"), logs.get("TensorBoardLogger")
    return {
        "checkpoint": ckpt,
        "metrics": csv / "metrics.csv" if csv and (csv / "metrics.csv").is_file() else None,
        "tensorboard": tb if tb and tb.is_dir() else None,
        "config": config if config and config.is_file() else None,
    }


def next_commands(
    ckpt: Path | None, config: Path | None = None, step: int | None = None, horizon: int | None = None
) -> list[tuple[str, str]]:
    """(what, command) pairs that continue from a checkpoint (``horizon``: the step the learning-rate schedule ends
    at, which resuming keeps)."""
    if ckpt is None:
        return []
    c = show(ckpt)
    out = []
    if config is not None:
        more = f" --trainer.max_steps {2 * step}" if step else ""
        what = f"resume (on to step {2 * step})" if step else "resume"
        if step and horizon is not None and horizon < 2 * step:
            what = f"resume (on to step {2 * step}, lr at its floor from step {horizon})"
        out.append((what, f"rlm fit --config {show(config)} --ckpt_path last{more}"))
    export_dir = show(
        ckpt.parent.parent / "export" if ckpt.parent.name in ("checkpoints", "ckpt") else "export"
    )
    out += [
        ("eval", f"rlm eval --ckpt {c}"),
        ("generate", f"rlm generate --ckpt {c} --prompt 'def '"),
        ("export", f"rlm export --ckpt {c} --out {export_dir}"),
    ]
    return out


def block(title: str, facts: list[tuple[str, Any]], commands: list[tuple[str, str]]) -> str:
    """The printed block: a title line, aligned ``name  value`` lines, then the next commands."""

    def aligned(pairs: list[tuple[str, Any]]) -> list[str]:
        width = max((len(k) for k, _ in pairs), default=0)
        return [f"  {k:<{width}}  {v}" for k, v in pairs]

    lines = [title, *aligned(facts)]
    if commands:
        lines += ["next:", *aligned(commands)]
    return "\n".join(lines)


def val_subset(limit: float | None, total: int | None = None) -> str:
    """What a validation loss was computed over: '' for the whole split, else '25 batches', '25 of 300 batches' or
    '10% of the batches'. ``limit``: trainer.limit_val_batches (or the batches read), ``total``: the split's."""
    whole = limit is None or limit == float("inf") or (isinstance(limit, float) and limit == 1.0)
    if whole or (total is not None and limit >= total):
        return ""
    if isinstance(limit, float) and limit < 1:  # Lightning: a float up to 1.0 is a fraction, above it a count
        return f"{round(limit * total)} of {total} batches" if total else f"{limit:.0%} of the batches"
    n = int(limit)
    return f"{n} of {total} batches" if total else f"{n} batch{'es' * (n != 1)}"


def fit_summary(trainer: Any, config: Path | None = None, horizon: int | None = None) -> str:
    """The block ``rlm fit`` prints when training ended normally."""
    metrics = trainer.callback_metrics
    paths = fit_paths(trainer, config)
    step = int(trainer.global_step)
    losses = [
        f"{k} {float(metrics[k]):.4f}" for k in ("val/loss", "train/loss") if metrics.get(k) is not None
    ]
    # limit_val_batches: the loss of a subset, not of the whole split that `rlm eval --split val` reads
    loaders = trainer.val_dataloaders  # RLMDataModule's: a DataLoader, or [] without a validation split
    loaders = loaders if isinstance(loaders, list | tuple) else [] if loaders is None else [loaders]
    subset = val_subset(sum(trainer.num_val_batches or []) or None, sum(len(dl) for dl in loaders) or None)
    if losses and losses[0].startswith("val/loss") and subset:
        losses[0] += f" on {subset}"
    title = f"rlm fit: finished at step {step}" + (f", {', '.join(losses)}" if losses else "")
    facts = [(name, show(path)) for name, path in paths.items() if path is not None]
    return block(title, facts, next_commands(paths["checkpoint"], paths["config"], step, horizon))


def eval_summary(ckpt: str | Path, json_path: str | None) -> str:
    """The block ``rlm eval`` prints after its results."""
    facts = [("checkpoint", show(ckpt))] + ([("results", show(json_path))] if json_path else [])
    commands = [c for c in next_commands(Path(ckpt)) if c[0] != "eval"]
    return block("rlm eval: done", facts, commands)


def experiment_summary(
    out: Path, runs: list[tuple[str, Path, Path, dict[str, Any]]], report: list[Path]
) -> str:
    """The block ``rlm experiment run`` prints: each finished run's losses and folder (``runs``: label, folder,
    checkpoint, summary.json), the report, and next commands on the run of the lowest validation loss."""
    facts: list[tuple[str, Any]] = []
    for label, run_dir, _, s in runs:
        losses = [f"{k} loss {s[f'{k}_loss']:.4f}" for k in ("val", "test") if s.get(f"{k}_loss") is not None]
        if losses and losses[0].startswith("val") and (subset := val_subset(s.get("val_batches"))):
            losses[0] += f" on {subset}"
        facts.append((label, f"{show(run_dir)}  ({', '.join(losses) or 'no loss'})"))
    facts.append(("report", ", ".join(show(p) for p in report) or "-"))
    scored = [(s["val_loss"], label, ckpt) for label, _, ckpt, s in runs if s.get("val_loss") is not None]
    commands = [("report", f"rlm experiment report {show(out)}")]
    if scored:
        _, label, ckpt = min(scored)
        commands += [(f"{k} ({label})", v) for k, v in next_commands(ckpt)]
    return block(f"rlm experiment: {len(runs)} finished run(s) in {show(out)}", facts, commands)
