"""Helpers shared by the benchmark scripts: timing and markdown tables."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def time_fn(fn: Callable[[], object], repeat: int = 10, warmup: int = 2) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_gflops(n: int = 2048, repeat: int = 5, device: str = "cpu", dtype=torch.float32) -> float:
    """Achieved GFLOP/s of an (n x n) @ (n x n) matmul: the roof the model's utilisation is measured against."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = time_fn(lambda: a @ b, repeat=repeat)
    return 2 * n**3 / seconds / 1e9


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; floats are shown with 3 significant digits."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def plugin_specs(names: Sequence[str]) -> dict:
    """model.plugins of configs/plugins/NAME.yaml for each name, merged in order."""
    specs: dict = {}
    for name in names:
        path = CONFIGS / "plugins" / f"{name}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in (CONFIGS / "plugins").glob("*.yaml"))
            raise SystemExit(f"--plugin {name!r}: no {path}; known: {known}")
        specs.update(yaml.safe_load(path.read_text())["model"]["plugins"])
    return specs
