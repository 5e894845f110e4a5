"""Stopping a run at its first non-finite loss or gradient, before the weights or a checkpoint take it in.

A diverged run used to go on to ``max_steps`` and exit 0 with NaN in every checkpoint. The guard checks the
loss before ``backward`` (one process), the gradients before each optimizer step (after DDP's all-reduce, so
every process stops at the same step) and the weights before each checkpoint is written. It raises
:class:`NonFiniteError` naming the step, the suspects (the learning rates, the plugins' aux losses) and the
last checkpoint written, which is finite because nothing non-finite ever reached the weights.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor


class NonFiniteError(ValueError):
    """Training met a non-finite loss, gradient or weight."""


def _finite(t: Tensor) -> bool:
    if t.is_sparse:
        t = t.coalesce().values()
    return bool(torch.isfinite(t).all())


def _aux_losses(trainer: pl.Trainer) -> dict[str, float]:
    """The plugins' aux losses logged by the current training step (``train/aux/NAME``)."""
    out = {}
    try:
        results = trainer._results  # the values logged so far in this step; absent outside a fit loop
        items = results.items() if results is not None else []
    except AttributeError:
        items = []
    for key, value in items:
        name = key.rsplit(".", 1)[-1] if "." in key else key
        if "/aux/" in name:
            try:
                out[name] = float(value.value)
            except (AttributeError, TypeError, ValueError, RuntimeError):
                continue
    return out


def last_checkpoint(trainer: pl.Trainer) -> str | None:
    """The newest checkpoint file this run has written, if any."""
    paths = [
        p
        for cb in trainer.checkpoint_callbacks
        for p in (getattr(cb, "last_model_path", ""), getattr(cb, "_last_checkpoint_saved", ""))
        if p and os.path.isfile(p)
    ]
    return max(paths, key=os.path.getmtime, default=None)


class NonFiniteGuard(pl.Callback):
    """Raise :class:`NonFiniteError` at the first non-finite loss or gradient (see the module docstring)."""

    def _fail(self, trainer: pl.Trainer, pl_module: pl.LightningModule, what: str) -> None:
        step = trainer.global_step
        optim = getattr(pl_module, "optim", None)
        lrs = []
        for opt in trainer.optimizers:
            for i, g in enumerate(opt.param_groups):
                lrs.append(f"{g.get('name', i)}={g['lr']:.3g}")
        suspects = [
            f"the learning rate (model.optim.lr={getattr(optim, 'lr', '?')}; at this step: {', '.join(lrs)})"
        ]
        aux = _aux_losses(trainer)
        plugins = list(getattr(getattr(pl_module, "model", None), "plugins", {}) or {})
        if aux:
            shown = ", ".join(f"{k}={v:.4g}" for k, v in aux.items())
            bad = [k for k, v in aux.items() if not math.isfinite(v)]
            suspects.append(f"the plugins' aux losses ({shown}" + (f"; non-finite: {bad})" if bad else ")"))
        elif plugins:
            suspects.append(f"the plugins {plugins} (their aux losses and parameter groups)")
        ckpt = last_checkpoint(trainer)
        kept = (
            f"the last finite checkpoint is kept: {ckpt}"
            if ckpt
            else "No checkpoint was written before it (lower the lr, or checkpoint more often)"
        )
        raise NonFiniteError(
            f"{what} at step {step}; training stopped. Suspects: {'; '.join(suspects)}. {kept}"
        )

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        # Only on one process: the loss is per process, and one process raising alone would hang the others
        # in the all-reduce; under DDP the gradients (identical everywhere) carry the NaN to the next check.
        if trainer.world_size == 1 and not _finite(loss.detach()):
            self._fail(trainer, pl_module, f"non-finite loss ({float(loss.detach()):g})")

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            return  # fp16 loss scaling: inf gradients are expected now and then, and the scaler skips those steps
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        dense = [g for g in grads if not g.is_sparse]
        # One fused pass for the common case; an overflowing norm of finite values falls through to the exact
        # per-tensor check, which names the parameters.
        if dense and bool(torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(dense)])).all()):
            if all(_finite(g) for g in grads if g.is_sparse):
                return
        bad = [n for n, p in pl_module.named_parameters() if p.grad is not None and not _finite(p.grad)]
        if bad:
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            self._fail(trainer, pl_module, f"non-finite gradients in {shown}")

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        bad = [
            k for k, v in checkpoint.get("state_dict", {}).items() if torch.is_tensor(v) and not _finite(v)
        ]
        if bad:
            self._fail(trainer, pl_module, f"non-finite weights in {', '.join(bad[:5])}")
