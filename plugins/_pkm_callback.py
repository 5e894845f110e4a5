"""PKM's Lightning callback, kept apart from plugins/pkm.py so that reading the plugin's options (``rlm plugins
pkm``, an experiment check) does not import Lightning: the plugin imports it in ``callbacks()``."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist

from rlm.distributed.layout import layout


class PKMCallback(pl.Callback):
    """Resolves sparse/dense at setup, steps the row-wise value optimizer, logs usage and KL at validation."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin  # the PKMPlugin (not imported here: plugins/pkm.py imports this module)

    @property
    def state_key(self) -> str:
        return f"PKMCallback[{self.plugin.label}]"

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        run = layout(trainer)
        if run.distributed and self.plugin.group is None:
            # The data-parallel ranks: all of them under DDP and under rlm's FSDP2 (its mesh spans every rank, and
            # the sparse values are whole on each). A group handed in before fit (set_group) is kept.
            self.plugin.set_group(dist.group.WORLD)
        # Under FSDP2, configure_model runs after this and keeps the sparse values out of fully_shard.
        sparse = self.plugin.resolve_sparse(run.distributed, row_exchange=run.can_replicate)
        if sparse and str(trainer.precision).startswith("16"):
            # The recorded output gradients would carry the GradScaler's scale, which only the main optimizer undoes.
            raise ValueError(
                f"pkm.sparse with precision={trainer.precision!r} (fp16 loss scaling) is not supported; "
                "use precision bf16-mixed or 32, or pkm.sparse: false"
            )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # Runs after the (accumulated) backward and before the main step, once per optimizer step.
        if self.plugin.sparse_active:
            self.plugin.row_optimizer.step()

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.plugin.start_stats()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(pl_module, "val")

    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.plugin.start_stats()

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(pl_module, "test")

    def _log(self, pl_module: pl.LightningModule, stage: str) -> None:
        for layer, (usage, kl) in self.plugin.stop_stats().items():
            prefix = f"{stage}/{self.plugin.label}/layer{layer}"
            pl_module.log(f"{prefix}/usage", usage.float(), rank_zero_only=True)
            pl_module.log(f"{prefix}/kl_uniform", kl.float(), rank_zero_only=True)

    def state_dict(self) -> dict[str, Any]:
        return self.plugin.row_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.plugin.row_optimizer.load_state_dict(state_dict)
