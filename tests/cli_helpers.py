"""Running the real ``rlm`` command in a subprocess, for smoke tests of any plugin.

Use ``fit_args(*fragments)`` to stack plugin fragments on the tiny test configuration, and ``run_rlm`` to
run it in a scratch directory with a token cache shared by the whole test session.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
TINY = [
    CONFIGS / "default.yaml",
    CONFIGS / "data" / "tiny.yaml",
    CONFIGS / "model" / "tiny.yaml",
    REPO / "tests" / "configs" / "fast.yaml",
]
# Two gloo processes on the CPU for a few steps: the DDP smoke runs of the core and of every plugin.
DDP_2CPU = [
    "--trainer.strategy=ddp",
    "--trainer.devices=2",
    "--trainer.accelerator=cpu",
    "--trainer.max_steps=4",
]


def fit_args(*fragments: str | Path, command: str = "fit") -> list[str]:
    """``fit --config ...`` for the tiny test setup with extra config files stacked on top."""
    args = [command]
    for path in [*TINY, *fragments]:
        path = Path(path)
        args += ["--config", str(path if path.is_absolute() else REPO / path)]
    return args


def run_rlm(
    args: list[str], cwd: Path, cache: Path, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess:
    """Run ``python -m rlm ARGS`` in ``cwd``; raise with its output if it fails and ``check`` is set."""
    env = {**os.environ, "RLM_CACHE": str(cache), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlm", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"rlm {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    """Rows of the CSV logger's metrics.csv under ``run_dir`` (runs/test/version_0 by default)."""
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], name: str) -> list[float]:
    """The non-empty values of one metrics.csv column, in order."""
    return [float(r[name]) for r in rows if r.get(name) not in (None, "")]


def fit_in_process(plugins: dict, steps: int = 2, vocab: int = 64, seq: int = 16) -> tuple[list[float], Any]:
    """Train a tiny LMModule with ``plugins`` for ``steps`` steps on random tokens with pl.Trainer in this
    process (no CLI, no corpus); the training loss of each step and the trained module."""
    import pytorch_lightning as pl
    import torch

    from rlm.train.module import LMModule

    torch.manual_seed(0)
    model = {"vocab_size": vocab, "d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": seq}
    module = LMModule(model=model, plugins=plugins)
    tokens = torch.randint(0, vocab, (steps * 2, seq + 1))
    batches = [{"tokens": t[:, :-1], "targets": t[:, 1:]} for t in tokens.split(2)]
    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Record()],
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return losses, module
