"""Stopping a run at its first non-finite loss or gradient, before a checkpoint takes it in.

Whether the loss and the gradients are finite is recorded on the device and read (one host sync) every
``every_n_steps`` optimizer steps, before every checkpoint and at the end of training, so every checkpoint written
is finite. On a GPU a read drains the CUDA queue, so it comes when logging reads the loss anyway.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from rlm.distributed.parallel import full_tensor


class NonFiniteError(ValueError):
    """Training met a non-finite loss, gradient or weight."""


def _all_finite(t: Tensor) -> Tensor:
    """Whether every value of ``t`` is finite, as a 0-d bool tensor on its device (no host sync)."""
    return torch.isfinite(t).all()


def _aux_losses(trainer: pl.Trainer) -> dict[str, float]:
    """The plugins' aux losses logged by the current training step (``train/aux/NAME``)."""
    out = {}
    # the values logged so far in this step; absent outside a fit loop
    results = getattr(trainer, "_results", None)
    for key, value in results.items() if results is not None else []:
        name = key.rsplit(".", 1)[-1]
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

    def __init__(self, every_n_steps: int | None = None) -> None:
        """``every_n_steps``: optimizer steps between reads of the record; None: 1 on a CPU, else the trainer's
        ``log_every_n_steps``."""
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps}; accepted: None or >= 1")
        self.every_n_steps = every_n_steps
        # (2,) int64 on the device: the first step of a non-finite loss, of non-finite gradients; -1: none yet
        self._first: Tensor | None = None
        self._loss: Tensor | None = None  # the first non-finite loss value, for the message

    def period(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        if self.every_n_steps is not None:
            return self.every_n_steps
        return 1 if pl_module.device.type == "cpu" else max(1, int(trainer.log_every_n_steps))

    def _record(self, pl_module: pl.LightningModule) -> tuple[Tensor, Tensor]:
        if self._first is None or self._first.device != pl_module.device:
            self._first = torch.full((2,), -1, dtype=torch.int64, device=pl_module.device)
            self._loss = torch.zeros((), device=pl_module.device)
        assert self._loss is not None
        return self._first, self._loss

    def _mark(self, pl_module: pl.LightningModule, which: int, finite: Tensor, step: int) -> Tensor:
        """Record ``step`` as the first bad one of kind ``which`` when ``finite`` is false (on the device)."""
        first, _ = self._record(pl_module)
        new = (first[which] < 0) & ~finite
        first[which] = torch.where(new, step, first[which])
        return new

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Read the record (one host sync) and fail if a step went non-finite."""
        if self._first is None:
            return
        loss_step, grad_step = self._first.tolist()
        if loss_step >= 0 and (grad_step < 0 or loss_step <= grad_step):
            assert self._loss is not None
            self._fail(trainer, pl_module, f"non-finite loss ({float(self._loss):g})", loss_step)
        if grad_step >= 0:
            grads = ((n, p.grad) for n, p in pl_module.named_parameters() if p.grad is not None)
            bad = [n for n, g in grads if not _all_finite(g)]
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            shown = f" in {', '.join(bad[:5])}{more}" if bad else ""
            self._fail(trainer, pl_module, f"non-finite gradients{shown}", grad_step)

    def _fail(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, what: str, step: int | None = None
    ) -> None:
        step = trainer.global_step if step is None else step
        optim = getattr(pl_module, "optim", None)
        lrs = [
            f"{g.get('name', i)}={g['lr']:.3g}"
            for o in trainer.optimizers
            for i, g in enumerate(o.param_groups)
        ]
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
        kept = "No checkpoint was written before it (lower the lr, or checkpoint more often)"
        if ckpt := last_checkpoint(trainer):
            kept = f"the last finite checkpoint is kept: {ckpt}"
        seen = ""
        if trainer.global_step != step:
            seen = f" (seen at step {trainer.global_step}: the guard reads its record every few steps)"
        raise NonFiniteError(
            f"{what} at step {step}; training stopped{seen}. Suspects: {'; '.join(suspects)}. {kept}"
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first = self._loss = None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        # Only on one process: the loss is per process, and one process raising alone would hang the others
        # in the all-reduce; under DDP the gradients (identical everywhere) carry the NaN to the next check.
        if trainer.world_size == 1:
            loss = loss.detach()
            new = self._mark(pl_module, 0, _all_finite(loss), trainer.global_step)
            _, value = self._record(pl_module)
            value.copy_(torch.where(new, loss.float().reshape(()), value))

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # fp16 loss scaling: inf gradients are expected now and then, and the scaler skips those steps
        if getattr(trainer.precision_plugin, "scaler", None) is None:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            # One fused norm pass: a norm is finite iff every value is, barring an overflow of finite values,
            # which the exact per-tensor check at the read sorts out.
            finite = torch.ones((), dtype=torch.bool, device=pl_module.device)
            # FSDP2's sharded gradients apart from plain ones (synced parameters): foreach refuses the mix
            for part in (
                [g for g in grads if isinstance(g, DTensor)],
                [g for g in grads if not isinstance(g, DTensor)],
            ):
                if part:
                    norms = torch.stack([n.float() for n in torch._foreach_norm(part)])
                    verdict = full_tensor(torch.isfinite(norms).all())  # FSDP2's shards: one verdict for all
                    finite = finite & verdict.to(finite.device)
            self._mark(pl_module, 1, finite, trainer.global_step)
        if (trainer.global_step + 1) % self.period(trainer, pl_module) == 0:
            self._check(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer, pl_module)  # what the last few steps recorded

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._check(trainer, pl_module)  # a checkpoint only after every step so far was finite
        state = checkpoint.get("state_dict", {})
        bad = [k for k, v in state.items() if torch.is_tensor(v) and not _all_finite(v)]
        if bad:
            self._fail(trainer, pl_module, f"non-finite weights in {', '.join(bad[:5])}")
