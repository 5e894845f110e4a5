"""Helpers shared by the benchmark scripts: timing and markdown tables."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytorch_lightning as pl
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


class StepTimer(pl.Callback):
    """A Lightning callback: the training step of ``rlm fit`` as the device ran it, written as JSON to ``out`` when
    fit ends. Events are recorded at each batch's start (CUDA events on a GPU, the host clock on a CPU) and read
    once at the end, so timing adds no synchronisation inside the loop; a step is the interval from one batch's
    start to the next one's (forward, backward, clipping, optimizer, plugins' hooks, and the next batch's
    loading when the device waited for it). The first ``skip`` steps (compilation, the first index) are left out.
    Use: ``--trainer.callbacks+='{"class_path": "_common.StepTimer", "init_args": {"out": "t.json"}}'``."""

    def __init__(self, out: str, skip: int = 3) -> None:
        self.out, self.skip = Path(out), skip
        self.marks: list[object] = []
        self.tokens = 0
        self.flops_per_token = 0.0
        self.params = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if not self.marks:
            from rlm.train.throughput import train_flops_per_token

            tokens = batch["tokens"]  # (B, T)
            self.tokens = tokens.numel() * trainer.world_size
            self.flops_per_token = train_flops_per_token(pl_module.model, tokens.shape[1])
            self.params = sum(p.numel() for p in pl_module.parameters())
        if pl_module.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        marks = self.marks[self.skip :]
        if len(marks) < 2:
            raise ValueError(f"StepTimer: {len(self.marks)} steps ran, fewer than skip={self.skip} + 2")
        if isinstance(marks[0], float):
            steps = [b - a for a, b in zip(marks, marks[1:])]
        else:
            torch.cuda.synchronize()
            steps = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        stats = {"step_s": statistics.median(steps), "steps_s": steps, "tokens": self.tokens,
                 "flops_per_token": self.flops_per_token, "params": self.params}  # fmt: skip
        if pl_module.device.type == "cuda":
            stats["peak_bytes"] = torch.cuda.max_memory_allocated()
        self.out.write_text(json.dumps(stats))
