"""A (rows, d) table kept in host memory, its rows fetched to the device before the layer that reads them runs
(Engram, DeepSeek 2026: a hashed n-gram table's addresses depend only on the token ids, so they are known as soon
as the batch is, and the table can be far larger than the device's memory).

``fetch`` gathers the distinct rows a batch names on the host, into page-locked memory when the device is a GPU,
and copies them to the device on a side CUDA stream, so the copy overlaps whatever the default stream runs before
the reader asks for them (``Fetched.rows`` makes the reader's stream wait). In training the fetched rows are a leaf
tensor; autograd sums each row's gradient over its reads, and a hook hands that (U, d) gradient to a row-wise
optimizer on the host (``RowAdam.add_lookups``, one lookup per row): the table gets no ``.grad`` and the main
optimizer never sees it. ``HostTableCallback`` steps that optimizer in training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor

from rlm.plugins._pkm_rows import RowAdam


@dataclass
class Fetched:
    """The rows one forward reads: ``index`` (N, m) on the device, each id's position in the fetched rows (U, d)."""

    index: Tensor
    fetched: Tensor
    ready: Any = None
    """The side stream's CUDA event after the copy (None: the copy was synchronous)."""

    def rows(self) -> Tensor:
        """The fetched rows (U, d), after making the current stream wait for their copy."""
        if self.ready is not None:
            torch.cuda.current_stream(self.fetched.device).wait_event(self.ready)
        return self.fetched


def fetch(
    table: Tensor, ids: Tensor, device: torch.device, stream: Any = None, sink: Any = None, key: str = ""
) -> Fetched:
    """The rows of host ``table`` named by host ``ids`` (N, m), on ``device``; copied on ``stream`` (a CUDA stream)
    when given. With ``sink`` and gradients enabled, the rows' gradient goes to ``sink.add_lookups(key, ...)``."""
    rows, index = torch.unique(ids, return_inverse=True)  # (U,) ascending, (N, m)
    pinned = stream is not None
    buf = torch.empty(rows.numel(), table.shape[1], dtype=table.dtype, pin_memory=pinned)
    torch.index_select(table.detach(), 0, rows, out=buf)  # (U, d), the host's gather
    ready = None
    if pinned:
        main = torch.cuda.current_stream(device)
        with torch.cuda.stream(stream):
            # Page-locked sources: the copies are asynchronous, and the host allocator keeps buf until they end.
            fetched = buf.to(device, non_blocking=True)
            index = index.pin_memory().to(device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        # Allocated on the side stream, used on the main one: not reused before the main stream is done with them.
        fetched.record_stream(main)
        index.record_stream(main)
    else:
        fetched, index = buf.to(device), index.to(device)
    if sink is not None and torch.is_grad_enabled():
        fetched.requires_grad_(True)
        fetched.register_post_accumulate_grad_hook(lambda leaf: _to_sink(leaf, sink, key, rows))
    return Fetched(index, fetched, ready)


def _to_sink(leaf: Tensor, sink: Any, key: str, rows: Tensor) -> None:
    """Hand the fetched rows' gradient (U, d) to the host optimizer as one unit-weight lookup per row, and drop it
    from the leaf (a copy on the host is all the update needs)."""
    grad = leaf.grad.to("cpu", torch.float32)  # a GPU: waits for the backward up to this table's reader
    sink.add_lookups(key, rows.view(-1, 1), torch.ones(rows.numel(), 1), grad)
    leaf.grad = None


class HostTableCallback(pl.Callback):
    """Steps the row-wise Adam of host tables once per optimizer step and checkpoints its moments; refuses what it
    cannot train (several processes, fp16 loss scaling). ``option`` names the plugin's option in errors."""

    def __init__(self, optimizer: RowAdam, option: str, key: str) -> None:
        self.optimizer, self.option, self.key = optimizer, option, key

    @property
    def state_key(self) -> str:
        return self.key

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size > 1:
            # Each process would update its own host copy from its own batch: the copies would drift apart.
            raise ValueError(
                f"{self.option} trains on one process (got {trainer.world_size}); set it false to train the table "
                "on the device under data parallelism"
            )
        if str(trainer.precision).startswith("16"):
            # The recorded gradients would carry the GradScaler's scale, which only the main optimizer undoes.
            raise ValueError(
                f"{self.option} with precision={trainer.precision!r} (fp16 loss scaling) is not supported; "
                "use precision bf16-mixed or 32"
            )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # After the (accumulated) backward, before the main step: the rows read since the last step.
        self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
