"""Checks and defaults for the trainer's strategy, applied to the parsed config before Lightning builds anything."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning.strategies import ModelParallelStrategy as _LightningModelParallel

CPU_PROCESSES = 2  # what ``devices: auto`` starts on a CPU under a multi-process strategy
MULTI_PROCESS = ("ddp", "modelparallel", "fsdp", "deepspeed")  # name prefixes: one process per device


class ModelParallelStrategy(_LightningModelParallel):
    """Lightning's ModelParallelStrategy with evaluation data sharded over every rank: Lightning's shards it over
    the mesh's ``data_parallel`` dimension (nodes) only, assuming tensor parallelism within a node, which rlm has
    not (both dimensions shard FSDP2), so each GPU of a node would evaluate the same data."""

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}


RLM_MODEL_PARALLEL = f"{__name__}.ModelParallelStrategy"


def strategy_name(strategy: Any) -> str:
    """A strategy (registry name, class path, ``{class_path: ...}`` or object) as a lowercased name without
    underscores or 'strategy': 'ddp', 'modelparallel', 'deepspeedstage2', ..."""
    if strategy is None:
        return "auto"
    if not isinstance(strategy, str):
        path = strategy.get("class_path") if hasattr(strategy, "get") else None
        strategy = path if isinstance(path, str) else type(strategy).__name__
    name = strategy.rsplit(".", 1)[-1].lower().replace("_", "")
    return name.removesuffix("strategy") or name


def check_strategy(strategy: Any) -> None:
    """Raise ValueError, naming the way out, for a strategy rlm cannot run here."""
    name = strategy_name(strategy)
    if name.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        raise ValueError(
            f"--trainer.strategy {name!r} needs the deepspeed package, which is not installed (and rlm has not "
            "been tested under DeepSpeed); use configs/trainer/ddp.yaml (DDP) or configs/trainer/fsdp.yaml (FSDP2)"
        )
    if name.startswith("fsdp"):
        raise ValueError(
            f"--trainer.strategy {name!r} is Lightning's FSDP1 wrapper, which rlm does not use; rlm shards with "
            "FSDP2 through ModelParallelStrategy: --config configs/trainer/fsdp.yaml"
        )


def resolve_devices(strategy: Any, accelerator: Any, devices: Any) -> Any:
    """``devices`` with 'auto' resolved to CPU_PROCESSES on a CPU under a multi-process strategy, else unchanged."""
    if not strategy_name(strategy).startswith(MULTI_PROCESS) or str(devices).lower() != "auto":
        return devices
    accelerator = str(accelerator or "auto").lower()
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    return CPU_PROCESSES if on_cpu else devices


def prepare_trainer(trainer: Any) -> None:
    """Check the strategy and resolve ``devices`` in a parsed ``trainer`` config (a jsonargparse Namespace)."""
    check_strategy(trainer.strategy)
    trainer.strategy = use_rlm_model_parallel(trainer.strategy)
    trainer.devices = resolve_devices(trainer.strategy, trainer.accelerator, trainer.devices)


def use_rlm_model_parallel(strategy: Any) -> Any:
    """``strategy`` with Lightning's ModelParallelStrategy class path replaced by rlm's (same init_args)."""
    path = strategy.get("class_path") if hasattr(strategy, "get") and not isinstance(strategy, str) else None
    lightning = ("pytorch_lightning.strategies.", "lightning.pytorch.strategies.")
    if path in [f"{p}{m}ModelParallelStrategy" for p in lightning for m in ("", "model_parallel.")]:
        strategy["class_path"] = RLM_MODEL_PARALLEL
    return strategy


def release_process_group() -> None:
    """Destroy the default process group Lightning leaves up, while the interpreter is still whole: a gloo thread
    freeing a collective's tensors during finalization cannot take the GIL and aborts the finished run (exit -6)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
