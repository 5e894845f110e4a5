"""rlm/distributed/layout.py: the layout read from each kind of Lightning strategy, and what plugins ask of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pytorch_lightning.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)

from rlm.distributed.layout import Layout, layout
from rlm.distributed.parallel import CAN_REPLICATE
from rlm.train.strategy import ModelParallelStrategy as RLMModelParallel


def _trainer(cls: type, world_size: int = 2) -> SimpleNamespace:
    # layout reads the strategy's class only: an instance without __init__ stands for a configured one
    return SimpleNamespace(strategy=cls.__new__(cls), world_size=world_size)


@pytest.mark.parametrize(
    "cls, kind, can_replicate",
    [
        (DDPStrategy, "ddp", True),
        (DeepSpeedStrategy, "ddp", True),  # a DDPStrategy subclass, hence ddp
        (ModelParallelStrategy, "fsdp2", CAN_REPLICATE),
        (RLMModelParallel, "fsdp2", CAN_REPLICATE),
        (FSDPStrategy, "other", False),
        (SingleDeviceStrategy, "other", False),
    ],
)
def test_layout_reads_the_kind_from_the_strategy_class(cls, kind, can_replicate):
    got = layout(_trainer(cls))
    assert got == Layout(kind, 2, cls.__name__)
    assert got.can_replicate is can_replicate and got.distributed


def test_one_process_is_not_distributed_and_the_layout_is_frozen():
    got = layout(_trainer(DDPStrategy, world_size=1))
    assert not got.distributed and got.kind == "ddp"
    with pytest.raises(AttributeError):
        got.world_size = 2  # type: ignore[misc]


def test_expert_parallel_names_the_strategy_it_refuses(monkeypatch):
    from rlm.plugins import _expert_parallel_callback as callback

    monkeypatch.setattr(callback, "default_group", lambda: (None, 0, 2))  # as if two processes ran
    cb = callback.ExpertParallelCallback(lambda: [])
    with pytest.raises(ValueError, match="runs under the ddp strategy; got ModelParallelStrategy"):
        cb.setup(_trainer(ModelParallelStrategy), None, "fit")
