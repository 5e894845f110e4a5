"""Parameters whole on every rank whose gradients rlm reduces itself, as DDP would: the replica all-reduce (expert
parallelism's copies of an expert; under FSDP2, the plugins' ``synced_parameters``), and a gradient clip over such
plain tensors beside DTensors, which torch's refuses.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from rlm.distributed.parallel import full_tensor, is_sharded, synced_parameters


def sync_replicas(params: list[nn.Parameter], group: Any, scale: float = 1.0) -> None:
    """All-reduce (sum) the gradients of ``params`` over ``group``, each times ``scale`` first (1/W: the mean).
    Once per optimizer step, after accumulation; one tensor at a time: a flat copy would double their memory."""
    for p in params:
        if p.grad is not None:
            if scale != 1.0:
                p.grad.mul_(scale)
            dist.all_reduce(p.grad, group=group)


class ReplicaSync:
    """sync_replicas overlapped with the backward: each gradient's all-reduce starts once accumulated (while
    ``armed``: the last micro-batch before a step), ``finish`` waits for them and reduces those no hook started.
    ``params`` in the same order on every rank."""

    def __init__(self, params: list[nn.Parameter], group: Any, scale: float = 1.0) -> None:
        self.params, self.group, self.scale = params, group, scale
        self.armed = False
        self.works: dict[int, Any] = {}  # id(param) -> the all-reduce in flight
        self.handles = [p.register_post_accumulate_grad_hook(self._launch) for p in params]

    def _launch(self, p: Tensor) -> None:
        if self.armed and p.grad is not None:
            if self.scale != 1.0:
                p.grad.mul_(self.scale)
            self.works[id(p)] = dist.all_reduce(p.grad, group=self.group, async_op=True)

    def finish(self) -> bool:
        """Wait for the started all-reduces and run the missing ones; False (nothing done) when not armed."""
        if not self.armed:
            return False
        missing = [p for p in self.params if id(p) not in self.works]
        for work in self.works.values():
            work.wait()
        self.works.clear()
        sync_replicas(missing, self.group, self.scale)
        self.armed = False
        return True

    def remove(self) -> None:
        """Drop the hooks."""
        for h in self.handles:
            h.remove()


def mixes_dtensors(tensors: list[Tensor]) -> bool:
    """Whether ``tensors`` holds both DTensors and plain tensors (which foreach kernels refuse in one call)."""
    return len({isinstance(t, DTensor) for t in tensors}) == 2


def clip_grad_norm_(params: list[Tensor], max_norm: float) -> Tensor:
    """torch's ``clip_grad_norm_`` (2-norm) over gradients partly FSDP2 DTensors, partly plain tensors equal
    on every rank: total = sqrt(|sharded|^2 + |plain|^2), the same factor on every rank, no host sync."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    squares = []
    for part in (sharded, plain):
        if part:
            norm = full_tensor(torch.nn.utils.get_total_norm(part))
            squares.append(norm.double().square())
    total = torch.stack(squares).sum().sqrt()
    # torch's factor: max_norm / (norm + 1e-6), never above 1
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    for device in {g.device for g in local}:
        same = [g for g in local if g.device == device]
        torch._foreach_mul_(same, coef.to(device=device, dtype=same[0].dtype))
    return total.to(grads[0].dtype)


class ArmedSync(pl.Callback):
    """Runs a :class:`ReplicaSync` (``self.sync``, set by the subclass) with Lightning's gradient accumulation:
    armed on the micro-batch that ends one, finished after its backward; an epoch's last, partial window is
    reduced blocking before its optimizer step."""

    sync: ReplicaSync | None = None
    synced = False  # whether this step's gradients have been reduced

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.sync is not None:
            self.sync.armed = (batch_idx + 1) % trainer.accumulate_grad_batches == 0

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sync is not None and self.sync.finish():
            self.synced = True

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self.sync is not None and not self.synced:
            sync_replicas(self.sync.params, self.sync.group, self.sync.scale)
        self.synced = False


class SyncedGradients(ArmedSync):
    """Under FSDP2, averages the plugins' ``synced_parameters`` gradients over the ranks before each
    optimizer step; nothing on one process, under DDP, or with none."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the first hook after the strategy's setup: configure_model has sharded the model by now
        model = getattr(pl_module, "model", None)
        if self.sync is None and model is not None and is_sharded(model) and trainer.world_size > 1:
            params = synced_parameters(model)
            if params:
                # rlm's FSDP2 mesh spans every rank (the values' row exchange uses the same group)
                self.sync = ReplicaSync(params, dist.group.WORLD, 1.0 / trainer.world_size)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.sync is not None:
            self.sync.remove()
            self.sync = None
