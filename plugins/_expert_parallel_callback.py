"""Expert parallelism's Lightning callback, apart so that importing moe does not import Lightning."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlm.distributed.layout import layout
from rlm.distributed.replicas import ArmedSync, ReplicaSync
from rlm.plugins._expert_parallel import (
    check_ddp_ignores,
    default_group,
    expert_groups,
    ignore_in_ddp,
    shard_experts,
)


def _node_size(trainer: pl.Trainer, world: int) -> int:
    """The default expert group: the processes of one node (Lightning's devices per node), else all."""
    per_node = int(getattr(trainer, "num_devices", world) or world)
    return per_node if 0 < per_node <= world and world % per_node == 0 else world


class ExpertParallelCallback(ArmedSync):
    """Shards the experts of ``layers()`` (modules with ``experts`` and ``expert_group``) over expert groups of
    ``group_size`` processes (default a node's) at setup when several processes run; the groups' copies of an expert
    are kept equal by an all-reduce of each gradient as backward has it (:class:`ReplicaSync`). Clips by the global
    norm (per-rank factors would split the replicas); checkpoints hold full expert tensors, so a run resumes under
    any W that divides N."""

    def __init__(self, layers: Callable[[], list[nn.Module]], group_size: int | None = None) -> None:
        self.layers = layers
        self.group_size = group_size
        self.params: dict[str, nn.Parameter] = {}  # state-dict name -> expert parameter
        self.world, self.rank = 1, 0  # the expert group's size (1: not sharded) and this process's rank in it
        self.group: Any = None  # the expert group
        self.replicas: Any = None  # the ranks holding the same experts in the other groups (None: one group)
        self.holds_file = True  # whether this rank's expert group gathers the checkpoint (rank 0's group)
        self.placed = False  # whether setup has sharded the experts (Lightning calls setup once per stage)
        self.clip: float | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        got = default_group()
        if got is not None and not self.placed:
            run = layout(trainer)
            if run.kind != "ddp":
                raise ValueError(
                    f"moe.expert_parallel runs under the ddp strategy; got {run.strategy} "
                    "(use --trainer.strategy ddp, or expert_parallel: false)"
                )
            _, rank, processes = got
            size = self.group_size or _node_size(trainer, processes)
            self.placed = True
            if size > 1:  # 1: every rank holds every expert, which DDP averages as any parameter
                self.group, self.replicas = expert_groups(rank, processes, size)
                self.rank, self.world, self.holds_file = rank % size, size, rank < size
                for layer in self.layers():
                    shard_experts(layer.experts, self.rank, size, processes)
                    layer.expert_group = self.group
        ids = {id(p) for layer in self.layers() for p in (layer.experts.up, layer.experts.down)}
        self.params = {name: p for name, p in pl_module.named_parameters() if id(p) in ids}
        if self.world == 1:
            return
        ignore_in_ddp(pl_module, self.params)  # before the strategy wraps the module (after setup hooks)
        if self.replicas is not None and self.sync is None:
            self.sync = ReplicaSync(list(self.params.values()), self.replicas)
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm"):
            # Clipped here with the global norm instead of by Lightning with each rank's own.
            self.clip, trainer.gradient_clip_val = float(trainer.gradient_clip_val), None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the first hook after DDPStrategy.setup has wrapped the module; before any step
        if self.world > 1:
            check_ddp_ignores(trainer.strategy.model, self.params)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)  # the replicas' gradients summed
        if self.clip is None:
            return
        sharded = {id(p) for p in self.params.values()}
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        own = [p.grad for p in params if id(p) in sharded]
        same = [p.grad for p in params if id(p) not in sharded]
        sq = torch.zeros(2, dtype=torch.float64, device=pl_module.device)
        if own:
            sq[0] = torch.stack([g.double().pow(2).sum() for g in own]).sum()
        if same:
            sq[1] = torch.stack([g.double().pow(2).sum() for g in same]).sum()
        sq0 = sq[:1].clone()
        # the experts' squares summed over one expert group (the other groups' copies are equal now)
        dist.all_reduce(sq0, group=self.group if self.world > 1 else None)
        total = float((sq0[0] + sq[1]).sqrt())
        # torch.nn.utils.clip_grad_norm_'s factor, from the norm over every rank's experts and the shared rest.
        coef = min(1.0, self.clip / (total + 1e-6))
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in params], coef)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Rank 0 alone writes: each full tensor is gathered to it alone, one at a time, straight to host memory.
        group, world, rank = self.group, self.world, self.rank

        def full(t: Tensor) -> Tensor:
            if world == 1 or not self.holds_file:  # rank 0's expert group alone gathers what rank 0 writes
                return t
            t = t.contiguous()
            parts = [torch.empty_like(t) for _ in range(world)] if rank == 0 else None
            dist.gather(t, parts, dst=0, group=group)
            return torch.cat([part.cpu() for part in parts]) if rank == 0 else t

        state = checkpoint.get("state_dict", {})
        for name in self.params:
            if name in state:
                state[name] = full(state[name])
        located = []
        ids = {id(p): name for name, p in self.params.items()}
        saved_states = checkpoint.get("optimizer_states", [])
        for o, (optimizer, saved) in enumerate(zip(trainer.optimizers, saved_states)):
            index = 0  # torch.optim numbers parameters across groups in order
            for group_ in optimizer.param_groups:
                for p in group_["params"]:
                    if id(p) in ids and index in saved["state"]:
                        # A new dict: torch's optimizer state_dict shares the live per-parameter state.
                        saved["state"][index] = {
                            key: full(t) if torch.is_tensor(t) and t.shape == p.shape else t
                            for key, t in saved["state"][index].items()
                        }
                        located.append([o, index, p.shape[0] * world])
                    index += 1
        checkpoint["expert_parallel"] = {"optimizer_params": located}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # The model's expert tensors are sliced by shard_experts' load hook; here the optimizer moments.
        if self.world == 1:
            return
        rank, world = self.rank, self.world
        for o, index, n in checkpoint.get("expert_parallel", {}).get("optimizer_params", []):
            moments = checkpoint["optimizer_states"][o]["state"].get(index, {})
            rows = slice(rank * n // world, (rank + 1) * n // world)
            for key, t in moments.items():
                if torch.is_tensor(t) and t.dim() > 0 and t.shape[0] == n:
                    moments[key] = t[rows].clone()
