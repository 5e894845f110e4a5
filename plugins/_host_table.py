"""A (rows, d) table in host memory whose rows are fetched to the device before their reader runs (Engram, DeepSeek
2026: a hashed n-gram table's addresses depend on the token ids alone, so they are known with the batch).

``fetch`` gathers the distinct rows on the host (page-locked for a GPU) and copies them on a side stream that the
reader's stream waits for (``Fetched.rows``). The fetched rows are a leaf: a hook hands their (U, d) gradient to a
host RowAdam, so the table gets no ``.grad`` and the main optimizer never sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


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
    """The rows of host ``table`` named by host ``ids`` (N, m), on ``device``, copied on ``stream`` if given; with a
    ``sink`` under autograd their gradient goes to ``sink.add_lookups(key, ...)``."""
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
    from the leaf."""
    grad = leaf.grad.to("cpu", torch.float32)  # a GPU: waits for the backward up to this table's reader
    sink.add_lookups(key, rows.view(-1, 1), torch.ones(rows.numel(), 1), grad)
    leaf.grad = None
