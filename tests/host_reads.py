"""Counting the host reads of one training step: each one is a host synchronisation on a GPU.

``HostReads`` is a Lightning callback (give it to ``rlm fit`` as ``--trainer.callbacks+=host_reads.HostReads``)
that records, during one training step (forward, backward, clipping, optimizer step and every callback around
them), each call that makes the host wait for the device's values: ``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool``/``int``/``float`` of a tensor, ``nonzero``, ``unique``, ``bincount``, ``masked_select``,
``repeat_interleave`` without an output size, and indexing with a boolean mask. It writes them to a JSON file.
On a CPU nothing waits, but the calls are the same ones that wait on a GPU. Reads of the batch's host copy
(``batch["host"]``, kept on the host when the batch moves to the device) are not counted: they wait for nothing.
"""

from __future__ import annotations

import json
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.overrides import TorchFunctionMode

from rlm.data.windows import HOST

READS = {
    "item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
    "unique", "unique_consecutive", "bincount", "masked_select",
}  # fmt: skip


def _is_read(func: Any, args: tuple, kwargs: dict) -> str | None:
    name = getattr(func, "__name__", "")
    if name in READS:
        return name
    if (
        name == "repeat_interleave"
        and "output_size" not in kwargs
        and len(args) > 1
        and torch.is_tensor(args[1])
    ):
        return name
    if name in ("__getitem__", "__setitem__"):
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        if any(torch.is_tensor(p) and p.dtype == torch.bool for p in parts):
            return f"{name}[bool]"
    return None


class _Count(TorchFunctionMode):
    def __init__(self, host: set[int]) -> None:
        super().__init__()
        self.host = host  # data pointers of the batch's host copy
        self.reads: Counter[str] = Counter()
        self.where: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _is_read(func, args, kwargs)
        on_host = bool(args) and torch.is_tensor(args[0]) and args[0].data_ptr() in self.host
        if name is not None and not on_host:
            self.reads[name] += 1
            frame = next(
                (f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename), None
            )
            if frame is not None:
                self.where[f"{name} {Path(frame.filename).name}:{frame.lineno}"] += 1
        return func(*args, **kwargs)


class HostReads(pl.Callback):
    """Counts the host reads of training step ``step`` (0-based) into ``out`` (JSON: total, by call, by line), from
    its start to the next step's (or the end of training)."""

    def __init__(self, step: int = 1, out: str = "host_reads.json") -> None:
        self.step, self.out = step, out
        self._mode: _Count | None = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        self._stop()
        if trainer.global_step == self.step:
            host = batch.get(HOST, {}) if isinstance(batch, dict) else {}
            self._mode = _Count({x.data_ptr() for x in host.values()})
            self._mode.__enter__()

    # Counting stops at the next step's start, not at this one's end: the progress bar and the loggers, which read
    # what the step logged, run their end-of-batch hooks after this callback's.
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._mode is None:
            return
        self._mode.__exit__(None, None, None)
        reads, where = self._mode.reads, self._mode.where
        self._mode = None
        result = {"total": sum(reads.values()), "reads": dict(reads), "where": dict(where.most_common())}
        Path(self.out).write_text(json.dumps(result, indent=1))


class CudaSyncs(pl.Callback):
    """On a GPU: the synchronising CUDA calls of training step ``step``, as torch itself reports them under
    ``torch.cuda.set_sync_debug_mode("warn")`` (a warning at each), counted into ``out`` (JSON: total, messages)."""

    def __init__(self, step: int = 1, out: str = "cuda_syncs.json") -> None:
        self.step, self.out = step, out
        self._catch: Any = None
        self._seen: list[Any] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        self._stop()
        if trainer.global_step == self.step:
            import warnings

            self._catch = warnings.catch_warnings(record=True)
            self._seen = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._catch is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(None, None, None)
        self._catch = None
        syncs = [str(w.message) for w in self._seen if "synchroniz" in str(w.message).lower()]
        Path(self.out).write_text(json.dumps({"total": len(syncs), "messages": syncs}, indent=1))
