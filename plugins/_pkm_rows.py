"""PKM value rows under training: the lazy row-wise Adam that reads and writes only touched rows (RowAdam), and
the exchange of touched rows and their gradients between data-parallel ranks (exchange_rows), which falls back to
a dense all-reduce when that moves fewer bytes.

The lookups and their gradients come from the value read of _pkm_ops.py (value_lookup with a sink).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlm.plugins import _pkm_native
from rlm.plugins._pkm_ops import row_gradients, sort_lookups


class RowAdam:
    """Lazy (row-wise) Adam for value tables: only rows with a gradient are read and written.

    Like torch.optim.SparseAdam: moments of untouched rows are left as they are and the bias correction
    uses the table's step count. Backward only records each memory read's (slots, weights, output gradient),
    like ``.grad`` accumulates (several layers sharing a table, gradient accumulation); ``step`` groups the
    reads by row and, on CPU float32, runs a fused kernel that reduces each row's gradient and updates
    (value, m, v) in one pass (plugins/_pkm_native.py). Elsewhere it computes the row gradients with an
    EmbeddingBag, gathers the touched rows into reused buffers, runs torch's fused Adam and writes them back.
    """

    def __init__(
        self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
    ) -> None:
        self.lr, self.betas, self.eps = lr, betas, eps
        self.group: Any = None
        """A torch.distributed process group: ``step`` then exchanges the touched rows (see exchange_rows)."""
        self.sent_bytes = 0
        """Bytes this rank sent in the last step's row exchanges, all tables (0 on one process)."""
        self.tables: dict[str, Tensor] = {}
        self.state: dict[str, dict[str, Tensor]] = {}
        self.reads: dict[str, list[tuple[Tensor, Tensor, Tensor]]] = {}
        self.native = True
        """Use the fused CPU kernel when it can be built (False: always the PyTorch path)."""
        self.fused = True
        """PyTorch path: torch._fused_adam_ on the gathered rows (False after it raised: plain tensor ops)."""
        self._buffers: dict[str, list[Tensor]] = {}

    def add_table(self, key: str, table: Tensor) -> None:
        """Register a (rows, d) table under ``key``."""
        self.tables[key] = table

    def add_lookups(self, key: str, slots: Tensor, weights: Tensor, grad: Tensor) -> None:
        """Record one read of table ``key``: slots, weights (N, m) and the gradient of its output (N, d)."""
        self.reads.setdefault(key, []).append(
            (slots.reshape(grad.shape[0], -1), weights.reshape(grad.shape[0], -1), grad)
        )

    def zero_grad(self) -> None:
        """Drop pending gradients."""
        self.reads.clear()

    def _lookups(self, key: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None:
        """Every pending read of a table grouped by row: rows, offsets, tok, w (see sort_lookups) and grad."""
        reads = self.reads.get(key)
        if not reads:
            return None
        if len(reads) == 1:
            slots, weights, grad = reads[0]
            return (*sort_lookups(slots, weights), grad.contiguous())
        # Several reads (layers sharing the table, accumulated micro-batches): one list of lookups into the
        # concatenated output gradients.
        starts = [0]
        for _, _, g in reads:
            starts.append(starts[-1] + g.shape[0])
        tok = torch.cat(
            [
                (torch.arange(g.shape[0]) + s0).repeat_interleave(sl.shape[1])
                for (sl, _, g), s0 in zip(reads, starts)
            ]
        )
        slots = torch.cat([sl.reshape(-1) for sl, _, _ in reads])
        weights = torch.cat([w.reshape(-1) for _, w, _ in reads])
        grad = torch.cat([g for _, _, g in reads])
        return (*sort_lookups(slots, weights, tok.to(slots.device)), grad.contiguous())

    def pending(self, key: str) -> tuple[Tensor, Tensor] | None:
        """The accumulated gradient of a table as (distinct rows (U,), row gradients (U, d)), or None."""
        got = self._lookups(key)
        if got is None:
            return None
        rows, offsets, tok, w, grad = got
        return rows, row_gradients(offsets, tok, w, grad)

    def _moment(self, key: str, like: Tensor | None = None) -> Tensor:
        """A moment table for ``key``: zeros, or a copy of ``like``; on huge pages on CPU (random rows)."""
        table = self.tables[key]
        if table.device.type == "cpu":
            out = _pkm_native.huge_page_empty(tuple(table.shape), table.dtype)
            return out.copy_(like) if like is not None else out.zero_()
        out = torch.zeros_like(table, memory_format=torch.contiguous_format)
        return out.copy_(like) if like is not None else out

    def _state(self, key: str) -> dict[str, Tensor]:
        if key not in self.state:
            self.state[key] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": self._moment(key),
                "exp_avg_sq": self._moment(key),
            }
        return self.state[key]

    @torch.no_grad()
    def step(self) -> None:
        """Apply one Adam step to the touched rows of every table, then clear the gradients."""
        self.sent_bytes = 0
        for key, table in self.tables.items():
            got = self._lookups(key)
            if self.group is not None:
                # Every rank takes part (a rank without reads sends no rows) and gets the same global lookups.
                if got is not None:
                    rows, offsets, tok, w, grad = got
                    g = row_gradients(offsets, tok, w, grad)  # (U_r, d) for the rows (U_r,)
                else:
                    rows, g = table.new_empty(0, dtype=torch.int64), table.new_empty(0, table.shape[1])
                *got, sent = exchange_lookups(
                    rows, g.to(table.dtype), table.shape[1], self.group, slots=table.shape[0]
                )
                self.sent_bytes += sent
            if got is None or got[0].numel() == 0:
                continue
            rows, offsets, tok, w, grad = got
            st = self._state(key)
            st["step"] += 1
            full = (table, st["exp_avg"], st["exp_avg_sq"])
            args = (rows, offsets, tok, w.to(grad.dtype).contiguous(), grad)
            hyper = dict(lr=self.lr, betas=self.betas, eps=self.eps, step=int(st["step"]))
            if self.native and _pkm_native.row_adam(*full, *args, **hyper):
                continue
            g = row_gradients(offsets, tok, w, grad)  # (U, d)
            # Reused gather buffers: fresh (U, d) allocations cost page faults on every step.
            bufs = self._buffers.setdefault(key, [table.new_empty(0) for _ in range(3)])
            # resize_(0) keeps the storage, so index_select refills it without a new allocation.
            p, m, v = (torch.index_select(t, 0, rows, out=b.resize_(0)) for t, b in zip(full, bufs))  # (U, d)
            self._adam_rows(p, g.to(p.dtype), m, v, st["step"])
            for t, rows_t in zip(full, (p, m, v)):
                t.index_copy_(0, rows, rows_t)
        self.zero_grad()

    def _adam_rows(self, p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor) -> None:
        """One Adam step in place on gathered rows p, m, v (U, d) with gradient g (U, d).

        torch._fused_adam_ (private: one kernel for the whole update) where it runs; on any exception the same
        update as torch.optim.Adam's single-tensor path, from public ops, for this table from then on.
        """
        if self.fused:
            try:
                torch._fused_adam_(
                    [p], [g], [m], [v], [], [step.to(p.device)],
                    lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], weight_decay=0.0, eps=self.eps,
                    amsgrad=False, maximize=False,
                )  # fmt: skip
                return
            except Exception:  # a torch without the op or its kernel for this device/dtype
                self.fused = False
        b1, b2 = self.betas
        t = float(step)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(self.eps)
        p.addcdiv_(m, denom, value=-self.lr / (1 - b1**t))

    def state_dict(self) -> dict[str, Any]:
        """Moments and step counts, for checkpoints."""
        return {"state": {k: dict(v) for k, v in self.state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (moments are copied to each table's device and layout)."""
        self.state = {
            k: {name: self._moment(k, t) if name != "step" else t.cpu() for name, t in v.items()}
            for k, v in state.get("state", {}).items()
            if k in self.tables
        }


def exchange_rows(
    rows: Tensor, grads: Tensor, d: int, group: Any, slots: int | None = None
) -> tuple[Tensor, Tensor, int]:
    """The data-parallel gradient of a table from each rank's (distinct rows (U_r,), row gradients (U_r, d)).

    Returns (rows (U,), gradients (U, d), bytes this rank put into the collective): the union of every rank's
    rows (ascending), each row's gradient summed over ranks and divided by the world size W. That is what
    DDP's mean all-reduce of the dense (slots, d) gradient gives, and the gradient of the mean loss over the
    global batch. Every rank gets the same tensors in the same order, so the same row-wise Adam keeps the
    replicas equal. RowAdam takes the same exchange as lookups (exchange_lookups), which skips building the
    (U, d) sums: its update reduces each row's lookups itself.
    """
    rows, offsets, tok, w, grad, sent = exchange_lookups(rows, grads, d, group, slots)
    return rows, row_gradients(offsets, tok, w, grad), sent


def exchange_lookups(
    rows: Tensor, grads: Tensor, d: int, group: Any, slots: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """exchange_rows's result as lookups (see sort_lookups) into the received gradients, and the bytes sent.

    Returns (rows (U,), offsets (U+1,), tok (E,), w (E,), grad (R, d), bytes): the gradient of rows[u] is
    sum over e in offsets[u]:offsets[u+1] of w[e] * grad[tok[e]], with w = 1/W (the mean over ranks). The row
    update (RowAdam: the fused kernel, or an EmbeddingBag) does that sum while it reads each row, so the
    received (sum U_r, d) gradients are not copied, summed into a (U, d) tensor and divided again: at 1M slots
    those three passes over ~32k rows of the union were a share of the step that grows with the rows touched.
    For W a power of two the sums are bitwise those of summing first and dividing after (x / 2^j is exact).

    Two ways, chosen by the bytes each moves (both need the W row counts first, one small all-gather):
    - rows: an all-gather of max_r U_r row ids (int64) and gradients from every rank, W * max_r U_r * (8 + 4d)
      bytes received; scales with the rows touched, never with the table;
    - dense (when ``slots``, the table's row count, is given and it is cheaper): one all-reduce of the
      (slots, d + 1) gradient with a touched-row column, ~2 * slots * (d + 1) * 4 bytes on a ring.
    With many tokens per rank the rows are most of the table and the all-gather moves ~W/2 times the dense
    bytes (rlm/train/SCALE.md: 476 GB against 17 GB per rank at 1M slots, 16k tokens, 64 ranks).
    """
    world = dist.get_world_size(group)
    grads = grads.reshape(-1, d)
    count = torch.tensor([rows.numel()], dtype=torch.int64, device=rows.device)  # NCCL: on the device
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    counts = [int(c) for c in counts]
    most = max(counts)
    size = grads.element_size()
    if slots is not None and 2 * slots * (d + 1) * size < world * most * (8 + d * size):
        dense = grads.new_zeros(slots, d + 1)
        dense[rows, :d] = grads
        dense[rows, d] = 1.0  # touched here: a row touched by any rank is in the union, even at zero gradient
        dist.all_reduce(dense, group=group)
        union = (dense[:, d] > 0).nonzero().squeeze(1)  # (U,) ascending, as torch.unique gives
        ids = torch.arange(union.numel() + 1, device=union.device)  # one lookup per row
        w = grads.new_full((union.numel(),), 1.0 / world)
        return union, ids, ids[:-1], w, dense[union, :d], count.element_size() + dense.numel() * size
    # Padded to the largest count (all_gather wants equal sizes); the pads are never looked up, so they are
    # left unwritten. Received into one (W * most) buffer each: rank r's rows at r * most.
    pad_rows = rows.new_empty(most)
    pad_rows[: rows.numel()] = rows
    pad_grads = grads.new_empty(most, d)
    pad_grads[: rows.numel()] = grads
    all_rows = pad_rows.new_empty(world * most)
    all_grads = pad_grads.new_empty(world * most, d)
    dist.all_gather_into_tensor(all_rows, pad_rows, group=group)
    dist.all_gather_into_tensor(all_grads, pad_grads, group=group)
    valid = torch.cat(
        [torch.arange(c, device=rows.device) + r * most for r, c in enumerate(counts)]
    )  # (sum U_r,) positions that hold a row, in rank order
    flat = all_rows[valid]
    order = torch.argsort(
        flat, stable=True
    )  # stable: each row's ranks in rank order, a fixed summation order
    union, per_row = torch.unique_consecutive(flat[order], return_counts=True)  # (U,) ascending
    offsets = torch.cat([per_row.new_zeros(1), per_row.cumsum(0)])
    w = grads.new_full((valid.numel(),), 1.0 / world)
    sent = count.element_size() + most * (pad_rows.element_size() + d * pad_grads.element_size())
    return union, offsets, valid[order], w, all_grads, sent
