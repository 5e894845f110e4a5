"""The Lightning callback of row-wise Adam tables (host tables, PKM values), apart so that importing a plugin does
not import Lightning (``rlm plugins NAME`` stays light): plugins import it in ``callbacks()``."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

from rlm.plugins._pkm_rows import RowAdam


class HostTableCallback(pl.Callback):
    """Steps a row-wise Adam once per optimizer step and checkpoints its moments; for host tables, refuses what it
    cannot train (several processes, fp16 loss scaling). ``option`` names the plugin's option in errors."""

    def __init__(self, optimizer: RowAdam, option: str, key: str) -> None:
        self.optimizer, self.option, self.key = optimizer, option, key

    @property
    def state_key(self) -> str:
        return self.key

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size > 1:
            # Each process would update its own host copy from its own batch: the copies would drift apart.
            raise ValueError(
                f"{self.option} trains on one process (got {trainer.world_size}); set it false to train the table "
                "on the device under data parallelism"
            )
        self.refuse_fp16(trainer)

    def refuse_fp16(self, trainer: pl.Trainer, instead: str = "") -> None:
        """Raise under fp16 loss scaling: the recorded gradients would carry the GradScaler's scale, which only the
        main optimizer undoes."""
        if str(trainer.precision).startswith("16"):
            raise ValueError(
                f"{self.option} with precision={trainer.precision!r} (fp16 loss scaling) is not supported; "
                f"use precision bf16-mixed or 32{instead}"
            )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # After the (accumulated) backward, before the main step: the rows read since the last step.
        self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
