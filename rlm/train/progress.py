"""``rlm fit``'s progress bar: optimizer steps against ``trainer.max_steps`` (Lightning's counts the epoch's
batches, whose total prints as -2 with ``max_steps`` set)."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import TQDMProgressBar


class StepProgressBar(TQDMProgressBar):
    """TQDMProgressBar whose training bar reads ``Epoch E, step: N/max_steps``; a run bounded by ``max_epochs``
    alone keeps Lightning's."""

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        bar = self.train_progress_bar
        if trainer.max_steps > 0 and not bar.disable:
            bar.reset(total=trainer.max_steps)
            bar.n = bar.initial = trainer.global_step  # initial: the rate counts this run's steps only
            bar.unit = "step"
            bar.set_description(f"Epoch {trainer.current_epoch}, step")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Lightning's hook shows batch_idx + 1 of the epoch's batches; steps to max_steps are global_step.
        shown = trainer.global_step - 1 if trainer.max_steps > 0 else batch_idx
        super().on_train_batch_end(trainer, pl_module, outputs, batch, shown)
