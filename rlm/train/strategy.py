"""Checks and defaults for the trainer's strategy, applied to the parsed config before Lightning builds anything.

- ``devices: auto`` under a multi-process strategy means every GPU on a GPU machine (Lightning's own rule) and
  2 processes on a CPU, where Lightning's ``auto`` would start one (no data parallelism at all).
- Strategies rlm cannot run are refused with one clear line (``rlm fit: error: ...``) instead of a traceback
  from deep inside Lightning: DeepSpeed when its package is missing, and Lightning's FSDP1 strategy (rlm's FSDP is
  FSDP2 through ModelParallelStrategy, configs/trainer/fsdp.yaml).
- Lightning's ModelParallelStrategy becomes rlm's subclass of it (:class:`ModelParallelStrategy` here), which
  shards evaluation data over every rank (Lightning's splits it over the mesh's data-parallel dimension only, the
  node count, so the GPUs of a node evaluated the same part).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from pytorch_lightning.strategies import ModelParallelStrategy as _LightningModelParallel

CPU_PROCESSES = 2
"""Processes that ``devices: auto`` starts on a CPU under a multi-process strategy."""
MULTI_PROCESS = ("ddp", "modelparallel", "fsdp", "deepspeed")
"""Strategy names (lowercased, underscores dropped, by prefix) that start one process per device."""


class ModelParallelStrategy(_LightningModelParallel):
    """Lightning's ModelParallelStrategy with evaluation data sharded over every rank (global rank, world size).

    Lightning's strategy hands its DistributedSampler the mesh's ``data_parallel`` dimension, which is the node
    count in its default (nodes, devices per node) mesh: it assumes the ``tensor_parallel`` dimension splits
    each layer, so the GPUs of a node must see the same batch. rlm has no tensor parallelism; both dimensions
    shard FSDP2 (:func:`rlm.distributed.parallel.fsdp_mesh`) and every rank is a data-parallel replica. So under
    Lightning's rule every GPU of a node evaluated the same 1/nodes of the validation set (on one node, the whole
    of it on every GPU: W times the evaluation work, and on 8 nodes of 8, 8 times). Training was unaffected:
    ``TrainLoader`` shards by global rank itself.

    Why here and not in the data module: the strategy is what states how data split over ranks, and Lightning
    reads ``distributed_sampler_kwargs`` for every evaluation loader it is given (val, test, predict, a user's
    own data module), so one override fixes them all, with the DistributedSampler and its padding that DDP
    already uses (an uneven last share is padded with repeated windows, as under DDP). Sharding in the data
    module would fix only rlm's loaders and fight Lightning, which replaces a plain loader's sampler. The
    epoch metrics need no change: ``LMModule._eval_epoch_end`` sums token-weighted totals with
    ``strategy.reduce``, over the default group of all ranks.
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
"""Class paths of Lightning's own ModelParallelStrategy, which :func:`prepare_trainer` swaps for rlm's."""
RLM_MODEL_PARALLEL = f"{__name__}.ModelParallelStrategy"


def strategy_name(strategy: Any) -> str:
    """A strategy given as a registry name, a class path, a ``{class_path: ...}`` mapping or an object, as a
    lowercased name without underscores or 'strategy' ('ddp', 'modelparallel', 'deepspeedstage2', ...)."""
    if strategy is None:
        return "auto"
    if not isinstance(strategy, str):
        # a dict or a jsonargparse Namespace
        path = strategy.get("class_path") if hasattr(strategy, "get") else None
        strategy = path if isinstance(path, str) else type(strategy).__name__
    name = strategy.rsplit(".", 1)[-1].lower().replace("_", "")
    return name.removesuffix("strategy") or name


def on_cpu(accelerator: Any) -> bool:
    """Whether the trainer will run on the CPU ('cpu', or 'auto' with no CUDA device)."""
    name = str(accelerator or "auto").lower()
    return name == "cpu" or (name == "auto" and not torch.cuda.is_available())


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
    multi = strategy_name(strategy).startswith(MULTI_PROCESS)
    if multi and str(devices).lower() == "auto" and on_cpu(accelerator):
        return CPU_PROCESSES
    return devices


def prepare_trainer(trainer: Any) -> None:
    """Check the strategy and resolve ``devices`` in a parsed ``trainer`` config (a jsonargparse Namespace)."""
    check_strategy(trainer.strategy)
    trainer.strategy = use_rlm_model_parallel(trainer.strategy)
    trainer.devices = resolve_devices(trainer.strategy, trainer.accelerator, trainer.devices)


def use_rlm_model_parallel(strategy: Any) -> Any:
    """``strategy`` with Lightning's ModelParallelStrategy class path replaced by rlm's (same init_args), so a
    config written for Lightning's class evaluates each window on one rank only; anything else unchanged."""
    path = strategy.get("class_path") if hasattr(strategy, "get") and not isinstance(strategy, str) else None
    if path in LIGHTNING_MODEL_PARALLEL:
        strategy["class_path"] = RLM_MODEL_PARALLEL
    return strategy


def release_process_group() -> None:
    """Destroy the default process group, if one is up, while the interpreter is still whole.

    Lightning leaves it alive after fit/validate/test. A gloo worker thread then drops the last reference to a
    finished collective's tensors at any moment; if that happens while Python finalizes, the thread cannot take
    the GIL to free them, CPython ends the thread with pthread_exit, the forced unwind crosses ``noexcept``
    gloo code and the process aborts (``terminate called without an active exception``, exit -6) after a run
    that had finished. Shutting the group down here joins those threads first (core dump of the CI failure:
    ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` ->
    ``pthread_exit`` under ``Py_FinalizeEx``).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
