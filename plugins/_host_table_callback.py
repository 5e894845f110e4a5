"""Lightning callbacks of the row-wise Adam tables (tokenid's host tables, PKM's values), apart so that importing
a plugin does not import Lightning."""

from __future__ import annotations

from functools import partialmethod
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist

from rlm.distributed.layout import layout
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


class PKMCallback(HostTableCallback):
    """Resolves sparse/dense at setup, steps the row-wise value optimizer, logs usage and KL at validation."""

    def __init__(self, plugin: Any) -> None:
        super().__init__(plugin.row_optimizer, "pkm.sparse", f"PKMCallback[{plugin.label}]")
        self.plugin = plugin  # the PKMPlugin (not imported here: plugins/pkm.py imports this module)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        run = layout(trainer)
        if run.distributed and self.plugin.group is None:
            # The data-parallel ranks: all of them under DDP and under rlm's FSDP2 (its mesh spans every rank, and
            # the sparse values are whole on each). A group handed in before fit (set_group) is kept.
            self.plugin.set_group(dist.group.WORLD)
        # Under FSDP2, configure_model runs after this and keeps the sparse values out of fully_shard.
        if self.plugin.resolve_sparse(run.distributed, row_exchange=run.can_replicate):
            self.refuse_fp16(trainer, ", or pkm.sparse: false")

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self.plugin.sparse_active:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.plugin.start_stats()

    on_test_epoch_start = on_validation_epoch_start

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for layer, (usage, kl) in self.plugin.stop_stats().items():
            prefix = f"{stage}/{self.plugin.label}/layer{layer}"
            pl_module.log(f"{prefix}/usage", usage.float(), rank_zero_only=True)
            pl_module.log(f"{prefix}/kl_uniform", kl.float(), rank_zero_only=True)

    on_validation_epoch_end = partialmethod(_log, stage="val")
    on_test_epoch_end = partialmethod(_log, stage="test")
