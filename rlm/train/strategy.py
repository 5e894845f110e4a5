"""Checks and defaults for the trainer's strategy, applied to the parsed config before Lightning builds anything:
``devices: auto`` under a multi-process strategy starts CPU_PROCESSES on a CPU (Lightning's would start one),
strategies rlm cannot run are refused in one line, and Lightning's ModelParallelStrategy becomes rlm's.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from pytorch_lightning.strategies import ModelParallelStrategy as _LightningModelParallel

CPU_PROCESSES = 2  # what ``devices: auto`` starts on a CPU under a multi-process strategy
MULTI_PROCESS = ("ddp", "modelparallel", "fsdp", "deepspeed")  # name prefixes: one process per device


class ModelParallelStrategy(_LightningModelParallel):
    """Lightning's ModelParallelStrategy with evaluation data sharded over every rank.

    Lightning's hands its DistributedSampler the mesh's ``data_parallel`` dimension (the node count), assuming
    ``tensor_parallel`` splits each layer so a node's GPUs see the same batch. rlm has no tensor parallelism: both
    dimensions shard FSDP2 (:func:`rlm.distributed.parallel.fsdp_mesh`) and every rank is a replica, so each GPU
    of a node would evaluate the same data. Lightning reads these kwargs for every evaluation loader (a user's
    data module's too), so the fix lives here, not in the data module; training data is sharded by
    ``TrainLoader`` itself.
    """

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}


LIGHTNING_MODEL_PARALLEL = (
    "pytorch_lightning.strategies.ModelParallelStrategy",
    "pytorch_lightning.strategies.model_parallel.ModelParallelStrategy",
    "lightning.pytorch.strategies.ModelParallelStrategy",
    "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy",
)
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
    if path in LIGHTNING_MODEL_PARALLEL:
        strategy["class_path"] = RLM_MODEL_PARALLEL
    return strategy


def release_process_group() -> None:
    """Destroy the default process group, if one is up, while the interpreter is still whole.

    Lightning leaves it alive after fit/validate/test. A gloo worker thread freeing a finished collective's
    tensors during interpreter finalization cannot take the GIL, is ended with pthread_exit across ``noexcept``
    gloo code, and the finished run aborts (exit -6). Shutting the group down first joins those threads.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
