"""A callback that logs the training wall-clock time, so runs can be compared on a time axis, and the machine's
load, so that a throughput measured on a shared machine says how shared it was."""

from __future__ import annotations

import os
import time
from typing import Any

import pytorch_lightning as pl


class TrainClock(pl.Callback):
    """Logs ``time/train_s``: seconds spent training so far, validation excluded, carried across resumes; and
    ``time/load``: the machine's 1-minute load average (runnable threads, this run's included)."""

    def __init__(self) -> None:
        super().__init__()
        self._offset = 0.0  # seconds trained before a resume, from the checkpoint
        self._start: float | None = None
        self._paused = 0.0  # validation seconds since _start
        self._val_start = 0.0

    def elapsed(self) -> float:
        """Training seconds so far."""
        if self._start is None:
            return self._offset
        return self._offset + time.perf_counter() - self._start - self._paused

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._paused = time.perf_counter(), 0.0

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the sanity check's validation comes before on_train_start, which zeroes _paused
        self._paused += time.perf_counter() - self._val_start

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pl_module.log("time/train_s", self.elapsed())
        if hasattr(os, "getloadavg"):  # Unix only
            pl_module.log("time/load", os.getloadavg()[0])

    def state_dict(self) -> dict[str, Any]:
        return {"elapsed": self.elapsed()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._offset = float(state_dict.get("elapsed", 0.0))
