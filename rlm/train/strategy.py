"""Checks and defaults for the trainer's strategy, applied to the parsed config before Lightning builds anything.

- ``devices: auto`` under a multi-process strategy means every GPU on a GPU machine (Lightning's own rule) and
  2 processes on a CPU, where Lightning's ``auto`` would start one (no data parallelism at all).
- Strategies rlm cannot run are refused with one clear line (``rlm fit: error: ...``) instead of a traceback
  from deep inside Lightning: DeepSpeed when its package is missing, and Lightning's FSDP1 strategy (rlm's FSDP is
  FSDP2 through ModelParallelStrategy, configs/trainer/fsdp.yaml).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

CPU_PROCESSES = 2
"""Processes that ``devices: auto`` starts on a CPU under a multi-process strategy."""
MULTI_PROCESS = ("ddp", "modelparallel", "fsdp", "deepspeed")
"""Strategy names (lowercased, underscores dropped, by prefix) that start one process per device."""


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
    trainer.devices = resolve_devices(trainer.strategy, trainer.accelerator, trainer.devices)


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
