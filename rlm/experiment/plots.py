"""The experiment plots: validation loss against step and time, and final loss against added parameters.

Every variant stays visible: the baseline is drawn last, on top, black and dashed with hollow square
markers, so a variant with the same losses shows through it; each variant has its own marker; labels of the
parameter plot are placed where they overlap no other label or point; the parameter axis is symmetric-log
when the sizes span two decades or more.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlm.experiment.results import VariantResult, val_curves
from rlm.extras import require

MARKERS = "o^vD<>PX*hp"
LOG_SPAN = 100.0
"""Largest over smallest non-zero |parameters over the baseline| from which the axis is logarithmic."""


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


def _baseline_last(info: dict[str, Any], variants: list[VariantResult]) -> list[VariantResult]:
    return sorted(variants, key=lambda v: v.name == info["baseline"])  # stable: the others keep their order


def curve_figure(info: dict[str, Any], variants: list[VariantResult], index: int, xlabel: str) -> Any:
    """Validation loss against step (index 0) or training seconds (index 1), one line per run."""
    plt = _pyplot()
    style = styles(info, variants)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    handles = {}
    for v in _baseline_last(info, variants):
        for run in sorted(v.runs, key=lambda r: r["seed"]):
            curve = val_curves(run)
            (handles[v.name],) = ax.plot(curve[index], curve[2], **style[v.name])
    names = [v.name for v in variants if v.name in handles]  # the legend in the file's order
    labels = [f"{n} (baseline)" if n == info["baseline"] else n for n in names]
    ax.legend([handles[n] for n in names], labels, fontsize=8)
    ax.set(xlabel=xlabel, ylabel="validation loss",
           title=f"experiment {info['name']}: validation loss (one line per seed)")  # fmt: skip
    ax.grid(alpha=0.3)
    return fig


def params_figure(info: dict[str, Any], variants: list[VariantResult]) -> Any:
    """Final validation loss (mean ± sd over seeds) against parameters over the baseline, labelled points."""
    plt = _pyplot()
    style = styles(info, variants)
    # Parameters over the baseline's total: the plugins' added parameters, and also a change of model shape.
    base = next((v.mean("params_total") for v in variants if v.name == info["baseline"]), None)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points, errs, names = [], [], []
    for v in _baseline_last(info, variants):
        total = v.mean("params_total") or 0.0
        x = (total - base if base is not None else v.mean("params_added") or 0.0) / 1e6
        y, err = v.mean("val_loss"), v.sd("val_loss")
        if y is None:
            continue
        s = style[v.name]
        ax.errorbar(x, y, yerr=err, fmt=s["marker"], ms=s["ms"], mfc=s.get("mfc"), color=s["color"], capsize=3,
                    zorder=s["zorder"])  # fmt: skip
        points.append((x, y))
        errs.append(err or 0.0)
        names.append(v.name)
    xlabel = (
        f"parameters over the baseline {info['baseline']!r} (millions)"
        if base is not None
        else "added parameters (millions)"
    )
    sizes = [abs(x) for x, _ in points if x != 0]
    if sizes and max(sizes) / min(sizes) >= LOG_SPAN:
        # symlog: linear within the smallest size of zero (the baseline sits at 0; a smaller shape is < 0).
        ax.set_xscale("symlog", linthresh=min(sizes))
        xlabel += ", symmetric log scale"
    ax.set(xlabel=xlabel, ylabel="final validation loss",
           title=f"experiment {info['name']}: loss against added parameters (mean ± sd over seeds)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.margins(x=0.15, y=0.15)
    fig.tight_layout()
    place_labels(ax, points, names, errs)
    return fig


def place_labels(
    ax: Any, points: list[tuple[float, float]], labels: list[str], yerr: list[float] | None = None
) -> list[Any]:
    """Annotate each point, at the first of a ring of offsets where the label overlaps no label placed before
    it, no point or error bar, and stays inside the axes (greedy, adjustText-like; far offsets get a leader)."""
    renderer = ax.figure.canvas.get_renderer()
    pad = 5.0  # pixels around a point's marker
    taken = []
    for (x, y), err in zip(points, yerr or [0.0] * len(points)):
        px, low = ax.transData.transform((x, y - err))
        _, high = ax.transData.transform((x, y + err))
        taken.append(_box(px - pad, low - pad, px + pad, high + pad))
    directions = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))
    offsets = [(dx * r, dy * r) for r in (5, 14, 26, 40, 56, 75, 100) for dx, dy in directions]
    placed = []
    for (x, y), label in zip(points, labels):
        fallback = None
        for dx, dy in offsets:
            ann = _annotate(ax, label, (x, y), dx, dy)
            box = label_box(ann, renderer)
            free = not any(box.overlaps(t) for t in taken)
            if free and ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1):
                break
            ann.remove()
            if free and fallback is None:
                fallback = (dx, dy)
        else:  # nowhere free inside the axes: the first free place outside, else the nearest place
            ann = _annotate(ax, label, (x, y), *(fallback or offsets[0]))
            box = label_box(ann, renderer)
        taken.append(box)
        placed.append(ann)
    return placed


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


def _box(x0: float, y0: float, x1: float, y1: float) -> Any:
    from matplotlib.transforms import Bbox

    return Bbox([[x0, y0], [x1, y1]])


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def plot(out: Path, info: dict[str, Any], variants: list[VariantResult]) -> None:
    """val_loss_vs_step.png, val_loss_vs_time.png and loss_vs_added_params.png."""
    for name, xlabel, index in (
        ("val_loss_vs_step.png", "training step", 0),
        ("val_loss_vs_time.png", "training time (s)", 1),
    ):
        _save(curve_figure(info, variants, index, xlabel), out / name)
    _save(params_figure(info, variants), out / "loss_vs_added_params.png")
