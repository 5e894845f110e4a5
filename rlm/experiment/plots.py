"""The experiment plots: validation loss against step and time (per variant the seeds' mean line and a mean ± sd
band), and final loss against added parameters. The baseline is drawn last, black, dashed and hollow, so a variant
with the same losses shows through it."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

from rlm.experiment.runs import VariantResult, val_curves
from rlm.extras import require

MARKERS = "o^vD<>PX*hp"
LOG_SPAN = 100.0  # largest over smallest non-zero |parameters over the baseline| for a log axis


def _pyplot() -> Any:
    require("matplotlib", "plots", "the experiment plots").use("Agg")
    import matplotlib.pyplot as plt

    return plt


def styles(info: dict[str, Any], variants: list[VariantResult]) -> dict[str, dict[str, Any]]:
    """Line and marker style of each variant: the baseline black, dashed, hollow squares, on top."""
    colors = _pyplot().get_cmap("tab10")
    out = {}
    for i, v in enumerate(variants):
        if v.name == info["baseline"]:
            out[v.name] = {"color": "black", "ls": "--", "marker": "s", "mfc": "none", "ms": 7, "mew": 1.5,
                           "lw": 1.2, "zorder": 4}  # fmt: skip
        else:
            out[v.name] = {"color": colors(i % 10), "ls": "-", "marker": MARKERS[i % len(MARKERS)], "ms": 4,
                           "lw": 2.2, "alpha": 0.85, "zorder": 2}  # fmt: skip
    return out


def legend_label(name: str, baseline: str) -> str:
    """A variant's legend entry: the baseline marked, unless its name already says it."""
    return f"{name} (baseline)" if name == baseline and "baseline" not in name else name


def seed_mean(curves: list[tuple[list[float], list[float]]]) -> tuple[Any, Any, Any]:
    """(x, mean, sd) over the seeds' (x, loss) curves: point by point when they have the same validations, else
    on the first curve's x (the others interpolated, within their own range); sd is 0 for one seed."""
    import numpy as np

    if len({len(x) for x, _ in curves}) == 1:
        x = np.array([x for x, _ in curves], dtype=float).mean(0)
        ys = np.array([y for _, y in curves], dtype=float)
    else:
        x = np.asarray(curves[0][0], dtype=float)
        ys = np.array([np.interp(x, cx, cy, left=np.nan, right=np.nan) for cx, cy in curves], dtype=float)
    sd = np.nanstd(ys, axis=0, ddof=1) if len(curves) > 1 else np.zeros(len(x))
    return x, np.nanmean(ys, axis=0), np.nan_to_num(sd)


def _baseline_last(info: dict[str, Any], variants: list[VariantResult]) -> list[VariantResult]:
    return sorted(variants, key=lambda v: v.name == info["baseline"])  # stable: the others keep their order


def curve_figure(info: dict[str, Any], variants: list[VariantResult], index: int, xlabel: str) -> Any:
    """Validation loss against step (index 0) or training seconds (index 1)."""
    plt = _pyplot()
    style = styles(info, variants)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    handles = {}
    seeds = 0
    for v in _baseline_last(info, variants):
        curves = [(c[index], c[2]) for c in (val_curves(r) for r in sorted(v.runs, key=lambda r: r["seed"]))]
        curves = [c for c in curves if len(c[0])]
        if not curves:
            continue
        seeds = max(seeds, len(curves))
        x, mean, sd = seed_mean(curves)
        s = style[v.name]
        (handles[v.name],) = ax.plot(x, mean, **s)
        if len(curves) > 1:
            ax.fill_between(
                x, mean - sd, mean + sd, color=s["color"], alpha=0.15, lw=0, zorder=s["zorder"] - 1
            )
    names = [v.name for v in variants if v.name in handles]  # the legend in the file's order
    ax.legend([handles[n] for n in names], [legend_label(n, info["baseline"]) for n in names], fontsize=8)
    ax.set(xlabel=xlabel, ylabel="validation loss")
    spread = f"mean of {seeds} seeds, band ± sd" if seeds > 1 else "one seed"
    ax.set_title(textwrap.fill(f"{info['name']}: validation loss ({spread})", 70), fontsize=10)
    ax.grid(alpha=0.3)
    return fig


def params_figure(info: dict[str, Any], variants: list[VariantResult]) -> Any:
    """Final validation loss (mean ± sd over seeds) against parameters over the baseline, labelled points; points
    that share an x are set apart sideways, and the axis is symmetric-log when the sizes span LOG_SPAN or more."""
    plt = _pyplot()
    from matplotlib.transforms import ScaledTranslation

    style = styles(info, variants)
    # Parameters over the baseline's total: the plugins' added parameters, and also a change of model shape.
    base = next((v.mean("params_total") for v in variants if v.name == info["baseline"]), None)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points, errs, names = [], [], []
    for v in _baseline_last(info, variants):
        total = v.mean("params_total") or 0.0
        x = (total - base if base is not None else v.mean("params_added") or 0.0) / 1e6
        y, err = v.mean("val_loss"), v.sd("val_loss")
        if y is not None:
            points.append((x, y))
            errs.append(err or 0.0)
            names.append(v.name)
    shifts = dodge([x for x, _ in points])
    for (x, y), err, name, shift in zip(points, errs, names, shifts):
        s = style[name]
        bars = ax.errorbar(x, y, yerr=err or None, fmt=s["marker"], ms=s["ms"], mfc=s.get("mfc"), color=s["color"],
                           capsize=3, zorder=s["zorder"])  # fmt: skip
        if shift:  # drawn at (x, y) so the axes' limits hold it, then moved sideways on screen
            moved = ScaledTranslation(shift / 72, 0, fig.dpi_scale_trans)
            for artist in bars.get_children():
                artist.set_transform(artist.get_transform() + moved)
    xlabel = "added parameters (millions)"
    if base is not None:
        xlabel = f"parameters over the baseline {info['baseline']!r} (millions)"
    sizes = [abs(x) for x, _ in points if x != 0]
    if sizes and max(sizes) / min(sizes) >= LOG_SPAN:
        # symlog: linear within the smallest size of zero (the baseline sits at 0; a smaller shape is < 0).
        ax.set_xscale("symlog", linthresh=min(sizes))
        xlabel += ", symmetric log scale"
    ax.set(xlabel=xlabel, ylabel="final validation loss")
    ax.set_title(textwrap.fill(f"{info['name']}: final loss against added parameters (mean ± sd over seeds)", 70),
                 fontsize=10)  # fmt: skip
    ax.grid(alpha=0.3)
    ax.margins(x=0.15, y=0.15)
    fig.tight_layout()
    place_labels(ax, points, names, errs, shifts)  # the baseline is the black square the x label names
    return fig


DODGE_POINTS = 9.0  # sideways distance, in points, between markers that share an x


def dodge(xs: list[float]) -> list[float]:
    """Sideways shifts (points) that set apart markers at the same x, centred on it: 0; -4.5, +4.5; -9, 0, +9 ..."""
    out = [0.0] * len(xs)
    groups: dict[float, list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault(round(x, 9), []).append(i)
    for members in groups.values():
        for j, i in enumerate(members):
            out[i] = (j - (len(members) - 1) / 2) * DODGE_POINTS
    return out


def place_labels(
    ax: Any, points: list[tuple[float, float]], labels: list[str], yerr: list[float], shifts: list[float]
) -> None:
    """Annotate each point, at the first of a ring of offsets where the label overlaps no label placed before
    it, no point or error bar, and stays inside the axes (greedy, adjustText-like; far offsets get a leader).
    ``shifts``: each marker's sideways shift in points (dodge), which its box and label follow."""
    from matplotlib.transforms import Bbox

    renderer = ax.figure.canvas.get_renderer()
    pad = 5.0  # pixels around a point's marker
    per_point = ax.figure.dpi / 72.0  # display pixels per point
    taken = []
    for (x, y), err, shift in zip(points, yerr, shifts):
        px, low = ax.transData.transform((x, y - err))
        _, high = ax.transData.transform((x, y + err))
        px += shift * per_point
        taken.append(Bbox([[px - pad, low - pad], [px + pad, high + pad]]))
    directions = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))
    offsets = [(dx * r, dy * r) for r in (5, 14, 26, 40, 56, 75, 100) for dx, dy in directions]
    for (x, y), label, shift in zip(points, labels, shifts):
        fallback = None
        for dx, dy in offsets:
            dx = dx + shift if dx else shift  # measured from the shifted marker
            ann = _annotate(ax, label, (x, y), dx, dy)
            box = label_box(ann, renderer)
            free = not any(box.overlaps(t) for t in taken)
            if free and ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1):
                break
            ann.remove()
            if free and fallback is None:
                fallback = (dx, dy)
        else:  # nowhere free inside the axes: the first free place outside, else the nearest place
            fx, fy = fallback or (offsets[0][0] + shift, offsets[0][1])
            ann = _annotate(ax, label, (x, y), fx, fy)
            box = label_box(ann, renderer)
        taken.append(box)


def label_box(ann: Any, renderer: Any) -> Any:
    """The display box of an annotation's text, without its leader line (which starts at its own point)."""
    from matplotlib.text import Text

    ann.update_positions(renderer)
    return Text.get_window_extent(ann, renderer)


def _annotate(ax: Any, label: str, xy: tuple[float, float], dx: float, dy: float) -> Any:
    """A label at (dx, dy) points from xy, aligned away from it; a grey leader line when it is not adjacent."""
    ann = ax.annotate(
        label, xy, xytext=(dx, dy), textcoords="offset points", fontsize=8,
        ha="left" if dx > 0 else "right" if dx < 0 else "center",
        va="bottom" if dy > 0 else "top" if dy < 0 else "center",
        arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5"} if max(abs(dx), abs(dy)) > 5 else None,
    )  # fmt: skip
    ann.set_in_layout(False)  # a later tight_layout must not move the axes under placed labels
    return ann


def _save(fig: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=120)
    _pyplot().close(fig)
    os.replace(tmp, path)


def plot(out: Path, info: dict[str, Any], variants: list[VariantResult]) -> None:
    """val_loss_vs_step.png, val_loss_vs_time.png and loss_vs_added_params.png."""
    _save(curve_figure(info, variants, 0, "training step"), out / "val_loss_vs_step.png")
    _save(curve_figure(info, variants, 1, "training time (s)"), out / "val_loss_vs_time.png")
    _save(params_figure(info, variants), out / "loss_vs_added_params.png")
