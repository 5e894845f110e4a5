"""A callback for parity tests (loaded by ``rlm fit`` through ``--trainer.callbacks+=loss_recorder.GlobalLoss``
with this folder on PYTHONPATH): the loss of the whole global batch at every step, whatever the world size."""

from __future__ import annotations

import json
from typing import Any

import pytorch_lightning as pl

from rlm.distributed.parallel import is_sharded


class GlobalLoss(pl.Callback):
    """Rank 0 appends each step's token-weighted mean loss over all ranks' batches to ``global_loss.jsonl``."""

    def __init__(self, path: str = "global_loss.jsonl") -> None:
        self.path = path

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        n = (batch["targets"] != -100).sum().double()
        # each rank's loss is the mean over its own tokens: weight by them, so the result is the global mean
        num = trainer.strategy.reduce(loss.detach().double() * n, reduce_op="sum")
        den = trainer.strategy.reduce(n.clone(), reduce_op="sum")
        if trainer.global_rank == 0:
            row = {
                "step": trainer.global_step,
                "loss": float(num / den),
                "tokens": int(den),
                "world": trainer.world_size,
                "sharded": is_sharded(pl_module.model),
            }
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
