"""The run's parallel layout, read from Lightning's strategy in this one place, so plugins never test strategy
classes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy

from rlm.distributed.parallel import CAN_REPLICATE

Kind = Literal["ddp", "fsdp2", "other"]


@dataclass(frozen=True)
class Layout:
    """How the processes of a run share the model."""

    kind: Kind  # ddp: DDPStrategy and subclasses; fsdp2: ModelParallelStrategy and subclasses
    world_size: int
    strategy: str  # its class name, for messages

    @property
    def distributed(self) -> bool:
        """Whether several processes train."""
        return self.world_size > 1

    @property
    def can_replicate(self) -> bool:
        """Whether a plugin may keep parameters whole on every rank and keep the copies equal itself."""
        return self.kind == "ddp" or (self.kind == "fsdp2" and CAN_REPLICATE)


def layout(trainer: Any) -> Layout:
    """The layout of ``trainer``'s run (a Lightning Trainer, or anything with ``strategy`` and ``world_size``)."""
    strategy = trainer.strategy
    kind: Kind = "other"
    if isinstance(strategy, DDPStrategy | ModelParallelStrategy):
        kind = "ddp" if isinstance(strategy, DDPStrategy) else "fsdp2"
    return Layout(kind, int(trainer.world_size), type(strategy).__name__)
