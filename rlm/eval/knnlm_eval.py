"""``rlm validate|test --datastore DIR``: the kNN-LM's loss beside the model's own, in Lightning's loops.

A callback, so the core loop stays as it is: after each evaluation batch it runs the batch's forward again without
gradients, searches the datastore with each window's own document excluded (rlm.eval.knnlm.scored_batch) and sums
the NLLs of kNN-LM's interpolation and, where tuned, the token memory's joint rule; at the epoch's end it logs
``<stage>/knnlm/loss`` and ``<stage>/joint/loss`` (token-weighted, summed over processes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch


class DatastoreEval(pl.Callback):
    """Scores validation and test batches with a kNN-LM datastore (``rlm knnlm build``); ``lam``/``temperature``
    default to the ones tuned at build, ``k`` to the datastore's."""

    def __init__(
        self, datastore: str, k: int | None = None, lam: float | None = None, temperature: float | None = None
    ) -> None:
        super().__init__()
        self.path, self.k, self.lam, self.temperature = datastore, k, lam, temperature
        self.ds: Any = None
        self._sums: dict[str, list[float]] = {}

    def _load(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open the datastore, at the loop's start: after Lightning restored the checkpoint's weights."""
        from rlm.eval.datastore import Datastore
        from rlm.eval.knnlm import mixing

        if self.ds is None:
            self.ds = Datastore(self.path)
            self.ds.check_model(pl_module)  # keys are this model's own states, or nothing
            self.lam, self.temperature = mixing(self.ds, self.lam, self.temperature)
            if self.k is not None and self.k < 1:
                raise ValueError(f"k={self.k}; accepted: a positive integer")
            self.k = self.k or self.ds.meta["k"]

    def _start(self, *_: Any) -> None:
        self._sums = {"knnlm": [0.0, 0], "joint": [0.0, 0]}

    on_validation_epoch_start = on_test_epoch_start = _start
    on_validation_start = on_test_start = _load

    @torch.no_grad()
    def _batch(self, trainer: pl.Trainer, pl_module: Any, batch: dict[str, Any], stage: str) -> None:
        from rlm.eval.datastore import reading_keys
        from rlm.eval.knnlm import interpolate, joint_log_prob, scored_batch

        store = trainer.datamodule.store
        root = str(Path(store.root).resolve())
        with reading_keys(pl_module, self.ds.meta["layer"]) as hooked:
            rows, _, _ = scored_batch(pl_module, batch, hooked, self.ds, store, root, self.k, stage)
        joint = (self.ds.meta.get("tuning") or {}).get("joint")
        for tgt, lm, logz, d, v in rows:
            n, match = len(tgt), v == tgt.numpy()[:, None]
            self._add("knnlm", -interpolate(lm, d, match, self.lam, self.temperature).sum(), n)
            if joint:
                nll = -joint_log_prob(lm, logz, d, match, joint["temperature"], joint["bias"])
                self._add("joint", nll.sum(), n)

    def _add(self, name: str, nll: float, n: int) -> None:
        self._sums[name][0] += float(nll)
        self._sums[name][1] += n

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        """Score a validation batch."""
        self._batch(trainer, pl_module, batch, "val")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        """Score a test batch."""
        self._batch(trainer, pl_module, batch, "test")

    def _end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for name in ("knnlm", "joint"):
            total = torch.tensor(self._sums[name], dtype=torch.float64)
            total = trainer.strategy.reduce(total, reduce_op="sum") if trainer.world_size > 1 else total
            if total[1] > 0:
                loss = float(total[0] / total[1])
                pl_module.log(f"{stage}/{name}/loss", loss, rank_zero_only=True)
                pl_module.log(f"{stage}/{name}/ppl", float(np.exp(min(loss, 20.0))), rank_zero_only=True)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log the validation losses."""
        self._end(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log the test losses."""
        self._end(trainer, pl_module, "test")
