"""The experiment plots show every variant: the baseline on top, labels apart, a log axis over decades."""

from __future__ import annotations

import json
from itertools import combinations

import numpy as np
import pytest
from test_experiment import fake_run

pytest.importorskip("matplotlib")

from rlm.experiment.plots import curve_figure, label_box, legend_label, params_figure, styles  # noqa: E402
from rlm.experiment.runs import collect, val_curves  # noqa: E402


def _experiment(tmp_path, runs: dict[str, tuple[float, int]], seeds=(0,), spread: float = 0.0):
    """Fake finished runs; seed s of a variant ends at loss + spread * s."""
    info = {"name": "fake", "base": ["default.yaml"], "baseline": "base", "report_metrics": [],
            "variants": {name: {"description": ""} for name in runs}}  # fmt: skip
    (tmp_path / "experiment.json").write_text(json.dumps(info))
    for name, (loss, added) in runs.items():
        for seed in seeds:
            fake_run(tmp_path, name, seed, loss + spread * seed, added, 100.0)
    return collect(tmp_path)


def _pixels(fig) -> np.ndarray:
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)


def test_baseline_stays_visible_over_a_variant_with_the_same_losses(tmp_path):
    info, variants = _experiment(tmp_path, {"base": (3.0, 0), "twin": (3.0, 0), "other": (2.5, 10)})
    fig = curve_figure(info, variants, 0, "training step")
    ax = fig.axes[0]
    base, *others = sorted(ax.lines, key=lambda line: line.get_color() != "black")
    assert ax.lines[-1] is base  # drawn last, so on top
    assert all(base.get_zorder() > line.get_zorder() for line in others)
    assert base.get_linestyle() == "--" and base.get_marker() == "s" and base.get_markerfacecolor() == "none"
    assert len({line.get_marker() for line in ax.lines}) == 3  # each variant its own marker
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["base (baseline)", "twin", "other"]
    # On the rendered image both lines show: the baseline whole, the twin beside and between its dashes.
    ax.get_legend().remove()
    twin = styles(info, variants)["twin"]
    twin_rgb = np.array(
        [255 * (twin["alpha"] * c + 1 - twin["alpha"]) for c in twin["color"][:3]]
    )  # over white

    def counts() -> tuple[int, int]:
        img = _pixels(fig)
        return int((np.abs(img - twin_rgb).sum(-1) < 30).sum()), int((img.sum(-1) < 60).sum())

    twin_line = next(line for line in others if line.get_marker() == twin["marker"])
    base.set_visible(False)
    twin_alone = counts()[0]
    base.set_visible(True), twin_line.set_visible(False)
    base_alone = counts()[1]
    twin_line.set_visible(True)
    twin_both, base_both = counts()
    assert twin_alone > 100 and twin_both > 0.15 * twin_alone, (twin_both, twin_alone)
    assert base_alone > 100 and base_both > 0.9 * base_alone, (base_both, base_alone)


def test_labels_do_not_overlap(tmp_path):
    # Eight variants on nearly the same point: labels placed naively would print over each other.
    runs = {"base": (3.0, 0), **{f"variant_{i}": (2.9 + 0.001 * i, 1_000_000 + 1000 * i) for i in range(8)}}
    info, variants = _experiment(tmp_path, runs)
    fig = params_figure(info, variants)
    fig.canvas.draw()
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    boxes = {t.get_text(): label_box(t, renderer) for t in ax.texts}
    assert set(boxes) == set(runs)
    overlapping = [(a, b) for a, b in combinations(boxes, 2) if boxes[a].overlaps(boxes[b])]
    assert not overlapping, overlapping
    assert all(ax.bbox.contains(b.x0, b.y0) and ax.bbox.contains(b.x1, b.y1) for b in boxes.values())


@pytest.mark.parametrize(
    ("added", "scale"),
    [((20_000, 2_000_000, 40_000_000), "symlog"), ((1_000_000, 2_000_000, 4_000_000), "linear")],
)
def test_parameter_axis_is_logarithmic_over_decades(tmp_path, added, scale):
    runs = {"base": (3.0, 0), **{f"v{i}": (2.9, n) for i, n in enumerate(added)}}
    info, variants = _experiment(tmp_path, runs)
    ax = params_figure(info, variants).axes[0]
    assert ax.get_xscale() == scale
    assert ("symmetric log scale" in ax.get_xlabel()) == (scale == "symlog")


def test_one_line_and_band_per_variant_are_the_seeds_mean_and_spread(tmp_path):
    """With three seeds a variant is one line, the seeds' mean at each validation, inside a band of mean ± sd;
    the title stays inside the figure."""
    info, variants = _experiment(
        tmp_path, {"base": (3.0, 0), "other": (2.5, 10)}, seeds=(0, 1, 2), spread=0.1
    )
    fig = curve_figure(info, variants, 0, "training step")
    ax = fig.axes[0]
    assert len(ax.lines) == 2 and len(ax.collections) == 2  # one mean line and one band per variant
    other = next(v for v in variants if v.name == "other")
    curves = [val_curves(r) for r in other.runs]
    want = np.mean([c[2] for c in curves], axis=0)
    line = next(line for line in ax.lines if line.get_color() != "black")
    np.testing.assert_allclose(line.get_ydata(), want)
    band = next(c for c in ax.collections if np.allclose(c.get_facecolor()[0][:3], line.get_color()[:3]))
    low, high = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
    sd = np.std([c[2] for c in curves], axis=0, ddof=1)
    np.testing.assert_allclose([low, high], [(want - sd).min(), (want + sd).max()], rtol=1e-6)
    fig.canvas.draw()
    title = ax.title.get_window_extent(fig.canvas.get_renderer())
    assert fig.bbox.contains(title.x0, title.y0) and fig.bbox.contains(title.x1, title.y1)


def test_points_at_the_same_x_are_set_apart_and_a_baseline_named_baseline_is_not_marked_twice(tmp_path):
    """baseline and baseline_335 both add nothing (x = 0): their markers and error bars sit apart, and the
    labels read 'baseline', not 'baseline (baseline)'."""
    info, variants = _experiment(
        tmp_path, {"base": (3.0, 0), "base_335": (2.95, 0), "big": (2.9, 10)}, seeds=(0, 1), spread=0.05
    )
    info["baseline"] = "base"
    fig = params_figure(info, variants)
    fig.canvas.draw()
    ax = fig.axes[0]
    markers = [line for line in ax.lines if line.get_marker() not in ("_", "None", "", None)]
    xs = sorted(float(line.get_transform().transform(line.get_xydata())[0][0]) for line in markers)
    assert len(xs) == 3 and min(b - a for a, b in zip(xs, xs[1:])) > 5, xs  # apart on screen, two share x = 0
    bars = [c for c in ax.collections if len(c.get_segments())]  # each point's error bar, beside its marker
    bar_x = sorted(
        float(seg[0][0]) for c in bars for seg in (c.get_transform().transform(s) for s in c.get_segments())
    )
    np.testing.assert_allclose(bar_x, xs, atol=0.5)
    assert {t.get_text() for t in ax.texts} == {"base", "base_335", "big"}
    assert legend_label("baseline", "baseline") == "baseline"
    assert legend_label("base", "base") == "base (baseline)"
