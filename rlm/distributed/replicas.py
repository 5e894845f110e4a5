"""Parameters whole on every rank whose gradients rlm reduces itself, as DDP would: the replica all-reduce.

Two users. Expert parallelism keeps each expert on one rank of every expert group, and sums the copies' gradients
over the replica group (plugins/_expert_parallel.py). Under FSDP2, a plugin's ``synced_parameters`` (PKM's
sub-keys) stay out of ``fully_shard`` like its ``replicated_parameters`` (parallel.py here), but the main
optimizer trains them: :class:`SyncedGradients` averages their gradients over the data-parallel ranks with an
all-reduce each, started in the backward as soon as the gradient is accumulated (2 (W-1)/W of their bytes per
step, where FSDP2's two all-gathers and reduce-scatter move 3 (W-1)/W and copy them in and out).

Plain tensors beside FSDP2's DTensors break what takes both in one call: torch's ``clip_grad_norm_`` and foreach
or fused optimizer kernels refuse the mix. So :func:`clip_grad_norm_` computes one global norm from the two
parts, and the LM module gives synced parameters optimizer groups of their own (rlm/train/module.py).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def sync_replicas(params: list[nn.Parameter], group: Any, scale: float = 1.0) -> None:
    """All-reduce (sum) the gradients of ``params`` over ``group``, each multiplied by ``scale`` first (1/W: the
    mean over W ranks). Expert parallelism sums the groups' copies of an expert (each group's gradient is its own
    ranks' share, already scaled by 1/P, see ``shard_experts``): the gradient of the mean loss over all P
    processes, as DDP gives the other parameters. Run once per optimizer step, after gradient accumulation (a sum
    is not idempotent). One tensor at a time: a flat copy of every gradient would double their memory."""
    for p in params:
        if p.grad is not None:
            if scale != 1.0:
                p.grad.mul_(scale)
            dist.all_reduce(p.grad, group=group)


class ReplicaSync:
    """sync_replicas overlapped with the backward: each gradient's all-reduce over ``group`` starts as soon as the
    backward has accumulated it (a post-accumulate-grad hook), while the backward goes on through the layers below;
    ``finish`` waits for them all. ``scale`` multiplies each gradient before its all-reduce (see sync_replicas).

    Only while ``armed`` (the last micro-batch before an optimizer step: a sum is not idempotent, so partial
    accumulations must not be reduced). ``finish`` reduces, blocking, any gradient whose hook did not start one
    (a parameter outside this backward), so that afterwards every gradient is reduced exactly once. ``params``
    must be in the same order on every rank (the blocking reductions run in that order).
    """

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
    kinds = {isinstance(t, DTensor) for t in tensors}
    return len(kinds) == 2


def clip_grad_norm_(params: list[Tensor], max_norm: float) -> Tensor:
    """torch's ``clip_grad_norm_`` (2-norm) over gradients that are partly FSDP2's DTensors and partly plain
    tensors equal on every rank (synced parameters): the total norm is sqrt(|sharded|^2 + |plain|^2), the sharded
    part's norm taken over every rank's shards, so every rank gets the same factor. Returns the total norm. No
    host sync: the factor stays on the device."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    squares = []
    for part in (sharded, plain):
        if part:
            norm = torch.nn.utils.get_total_norm(part)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
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
    """Runs a :class:`ReplicaSync` (``self.sync``, set by the subclass) with Lightning's gradient accumulation: armed
    on the micro-batch that ends an accumulation (Lightning steps after every accumulate_grad_batches-th batch),
    finished after its backward, before anything reads the gradients (the guard, clipping, the optimizer); an
    epoch's last, partial window, never armed, is reduced blocking before its optimizer step."""

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
    """Under FSDP2, averages the gradients of the plugins' ``synced_parameters`` over the ranks before each
    optimizer step (see :class:`ArmedSync`). Does nothing on one process, under DDP (which reduces them as any
    parameter) or when no plugin names any."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the first hook after the strategy's setup: configure_model has sharded the model by now
        from rlm.distributed.parallel import is_sharded, synced_parameters

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
