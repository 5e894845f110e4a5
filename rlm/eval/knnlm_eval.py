"""``rlm validate|test --datastore DIR``: the kNN-LM's loss beside the model's own, in Lightning's loops.

A callback, so the core loop stays as it is: it runs each evaluation batch's forward again
(rlm.eval.knnlm.scored_batch) and logs ``<stage>/knnlm/loss`` and, where tuned, the token memory's
``<stage>/joint/loss`` (summed over processes).
"""

from __future__ import annotations

from functools import partialmethod
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
        self._sums: dict[str, np.ndarray] = {}  # name -> (summed NLL, tokens)

    def _load(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open the datastore, at the loop's start: after Lightning restored the checkpoint's weights."""
        from rlm.eval.knnlm import open_datastore

        if self.ds is None:
            self.ds, self.lam, self.temperature, self.k = open_datastore(
                self.path, pl_module, self.lam, self.temperature, self.k
            )

    def _start(self, *_: Any) -> None:
        self._sums = {"knnlm": np.zeros(2), "joint": np.zeros(2)}

    on_validation_epoch_start = on_test_epoch_start = _start
    on_validation_start = on_test_start = _load

    @torch.no_grad()
    def _batch(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: dict, *_: Any, stage: str
    ) -> None:
        from rlm.eval.datastore import reading_keys
        from rlm.eval.knnlm import interpolate, joint_log_prob, scored_batch

        store = trainer.datamodule.store
        with reading_keys(pl_module, self.ds.meta["layer"]) as hooked:
            rows, _, _ = scored_batch(pl_module, batch, hooked, self.ds, store, self.k, stage)
        joint = (self.ds.meta.get("tuning") or {}).get("joint")
        for tgt, lm, logz, d, v in rows:
            n, match = len(tgt), v == tgt.numpy()[:, None]
            self._sums["knnlm"] += (-interpolate(lm, d, match, self.lam, self.temperature).sum(), n)
            if joint:
                nll = -joint_log_prob(lm, logz, d, match, joint["temperature"], joint["bias"])
                self._sums["joint"] += (nll.sum(), n)

    on_validation_batch_end = partialmethod(_batch, stage="val")
    on_test_batch_end = partialmethod(_batch, stage="test")

    def _end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for name in ("knnlm", "joint"):
            total = torch.tensor(self._sums[name], dtype=torch.float64)
            total = trainer.strategy.reduce(total, reduce_op="sum") if trainer.world_size > 1 else total
            if total[1] > 0:
                loss = float(total[0] / total[1])
                pl_module.log(f"{stage}/{name}/loss", loss, rank_zero_only=True)
                pl_module.log(f"{stage}/{name}/ppl", float(np.exp(min(loss, 20.0))), rank_zero_only=True)

    on_validation_epoch_end = partialmethod(_end, stage="val")
    on_test_epoch_end = partialmethod(_end, stage="test")
