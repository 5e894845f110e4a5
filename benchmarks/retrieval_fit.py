"""Wall-clock of whole `rlm fit` runs with retrieval against the same run without, interleaved.

benchmarks/retrieval.py times single steps; a real run adds the data pipeline, Lightning, logging and the
blocking index build. This runs `rlm fit` for --steps steps, with one index built (blocking) at step
--index-at, once per variant in each of --rounds rounds (base, retrieval as shipped, retrieval with
continuations, in that order), and prints each variant's median wall-clock and its ratio to the base run of
the same round (median over rounds, with the range). The ratio is what "equal training time" in
configs/experiments/retrieval.yaml rests on: N retrieval steps cost about ratio * N base steps.

    python benchmarks/retrieval_fit.py                                    # default corpus, 160 steps, 3 rounds
    python benchmarks/retrieval_fit.py --steps 4 --index-at 2 --rounds 1 \\
        --config configs/default.yaml configs/data/tiny.yaml configs/model/tiny.yaml   # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RETRIEVAL = REPO / "configs" / "plugins" / "retrieval.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", nargs="+", default=[str(REPO / "configs" / "default.yaml")], help="base configs"
    )
    p.add_argument("--steps", type=int, default=160, help="training steps of every run")
    p.add_argument("--index-at", type=int, default=20, help="the step of the one blocking index build")
    p.add_argument("--rounds", type=int, default=3, help="rounds of interleaved runs")
    a = p.parse_args(argv)
    if not 0 < a.index_at < a.steps:
        p.error(f"--index-at {a.index_at} must lie between 0 and --steps {a.steps} (exclusive)")
    return a


def variants(a: argparse.Namespace) -> dict[str, list[str]]:
    """Extra `rlm fit` arguments of each variant over the base configs."""
    retrieval = [
        "--config",
        str(RETRIEVAL),
        "--model.plugins.retrieval.progress=false",
        "--model.plugins.retrieval.mode=blocking",
        # one build: 'a-b:N' rebuilds every N steps while a <= step < b
        f"--model.plugins.retrieval.schedule=0-{a.index_at + 1}:{a.index_at}",
    ]
    return {
        "no retrieval": [],
        "retrieval as shipped (k=2, no continuations)": retrieval,
        "retrieval with continuations": [*retrieval, "--model.plugins.retrieval.continuation=true"],
    }


def fit_seconds(a: argparse.Namespace, extra: list[str], root: Path) -> float:
    """Wall-clock seconds of one `rlm fit` run (start-up, the data's cached preparation and the final checkpoint
    included)."""
    args = [sys.executable, "-m", "rlm", "fit"]
    for config in a.config:
        args += ["--config", str(Path(config).resolve())]
    args += extra + [
        f"--trainer.max_steps={a.steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=root, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return seconds


def main(argv: list[str] | None = None) -> str:
    a = parse_args(argv)
    runs = variants(a)
    times: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory(prefix="rlm-fit-bench-") as tmp:
        for r in range(a.rounds):
            for i, (name, extra) in enumerate(runs.items()):
                root = Path(tmp) / f"round{r}-{i}"
                root.mkdir()
                times[name].append(fit_seconds(a, extra, root))
                built = sorted((root / "retrieval_index").glob("step-*")) if extra else []
                if (
                    extra and len(built) != 1
                ):  # the run must have paid for exactly the one build it is charged
                    raise RuntimeError(f"{name}: expected one index build, found {[b.name for b in built]}")
                print(
                    f"round {r + 1}/{a.rounds}: {name} {times[name][-1]:.1f} s", file=sys.stderr, flush=True
                )
    base = times["no retrieval"]
    rows = []
    for name, t in times.items():
        ratios = [x / b for x, b in zip(t, base)]
        rows.append(
            [
                name,
                f"{statistics.median(t):.1f}",
                f"{min(ratios):.2f}-{max(ratios):.2f}",
                statistics.median(ratios),
            ]
        )
    out = table(["rlm fit run", "s (median)", "ratio range", "ratio (median)"], rows)
    out += (
        f"\n{a.steps} steps, one blocking index build at step {a.index_at}, {a.rounds} interleaved round(s); "
        f"configs: {' '.join(Path(c).name for c in a.config)}"
    )
    print(out)
    return out


if __name__ == "__main__":
    main()
