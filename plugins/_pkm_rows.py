"""A lazy row-wise Adam (RowAdam) over the reads value_lookup hands it, and their exchange between data-parallel
ranks (exchange_lookups)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlm.plugins import _pkm_native
from rlm.plugins._pkm_ops import gathers, group_slots, row_gradients, scatter_rows, sort_lookups


class RowAdam:
    """Lazy (row-wise) Adam for value tables, as torch.optim.SparseAdam: only rows with a gradient are read and
    written, bias-corrected by the table's step count. Backward records each read (slots, weights, output gradient);
    ``step`` groups them by row and runs the fused CPU kernel, else torch's Adam on the gathered rows."""

    betas, eps = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults

    def __init__(self, lr: float = 1e-3) -> None:
        self.lr = lr
        self.group: Any = None  # a process group: ``step`` then exchanges the reads
        self.sent_bytes = 0  # bytes this rank sent in the last step's row exchanges
        self.tables: dict[str, Tensor] = {}
        self.state: dict[str, dict[str, Tensor]] = {}
        self.reads: dict[str, list[tuple[Tensor, Tensor, Tensor]]] = {}
        self.native = True  # use the fused CPU kernel when it can be built
        self.fused = True  # torch._fused_adam_ on the gathered rows (False after it raised: plain tensor ops)
        self._buffers: dict[str, list[Tensor]] = {}

    def add_table(self, key: str, table: Tensor) -> None:
        self.tables[key] = table

    def add_lookups(self, key: str, slots: Tensor, weights: Tensor, grad: Tensor) -> None:
        """Record one read of table ``key``: slots, weights (N, m) and the gradient of its output (N, d)."""
        self.reads.setdefault(key, []).append(
            (slots.reshape(grad.shape[0], -1), weights.reshape(grad.shape[0], -1), grad)
        )

    def zero_grad(self) -> None:
        self.reads.clear()

    def _reads(self, key: str) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """Every pending read of a table, flat: (slots (E,), weights (E,), grad row of each (E,), grad (R, d))."""
        reads = self.reads.get(key)
        if not reads:
            return None
        # Several reads (layers sharing the table, micro-batches): one list of lookups into the joined gradients.
        tok, start = [], 0
        for sl, _, g in reads:
            tok.append((torch.arange(g.shape[0], device=sl.device) + start).repeat_interleave(sl.shape[1]))
            start += g.shape[0]
        slots = torch.cat([sl.reshape(-1) for sl, _, _ in reads])
        weights = torch.cat([w.reshape(-1) for _, w, _ in reads])
        grad = reads[0][2].contiguous() if len(reads) == 1 else torch.cat([g for _, _, g in reads])
        return slots, weights, torch.cat(tok), grad

    def _lookups(self, key: str, seen: dict[tuple, tuple]) -> tuple[Tensor, ...] | None:
        """Every pending read of a table grouped by row: rows, offsets, tok, w (see sort_lookups) and grad. ``seen``:
        group_slots of the tables grouped before in this step, by the storage of their reads' slots: PEER reads its
        down and up tables at one slots tensor, so one grouping serves both (keyed by storage, not by value: a
        device compare would sync the host)."""
        got = self._reads(key)
        if got is None:
            return None
        same = tuple((sl.data_ptr(), sl.shape, sl.stride()) for sl, _, _ in self.reads[key])
        if same not in seen:
            seen[same] = group_slots(got[0])
        return (*sort_lookups(*got[:3], grouped=seen[same]), got[3])

    def pending(self, key: str) -> tuple[Tensor, Tensor] | None:
        """A table's accumulated gradient as (distinct rows (U,), row gradients (U, d)), or None."""
        got = self._lookups(key, {})
        if got is None:
            return None
        rows, offsets, tok, w, grad = got
        return rows, row_gradients(offsets, tok, w, grad)

    def _moment(self, key: str, like: Tensor | None = None) -> Tensor:
        """A moment table for ``key``: zeros, or a copy of ``like``; on huge pages on CPU (random rows)."""
        table = self.tables[key]
        if table.device.type == "cpu":
            out = _pkm_native.huge_page_empty(tuple(table.shape), table.dtype)
        else:
            out = torch.empty_like(table, memory_format=torch.contiguous_format)
        return out.copy_(like) if like is not None else out.zero_()

    def _state(self, key: str) -> dict[str, Tensor]:
        table = self.tables[key]
        if key not in self.state:
            self.state[key] = {
                "step": torch.zeros((), dtype=torch.float32, device=table.device),
                "exp_avg": self._moment(key),
                "exp_avg_sq": self._moment(key),
            }
        st = self.state[key]
        if st["exp_avg"].device != table.device:  # restored before the model moved to its device
            st.update({k: t.to(table.device) if k == "step" else self._moment(key, t) for k, t in st.items()})
        return st

    @torch.no_grad()
    def step(self) -> None:
        """Apply one Adam step to the touched rows of every table, then clear the gradients."""
        self.sent_bytes = 0
        seen: dict[tuple, tuple] = {}  # see _lookups
        for key, table in self.tables.items():
            if self.group is None and gathers(table):
                got = self._reads(key)
                if got is not None and got[0].numel():
                    st = self._state(key)
                    st["step"] += 1
                    self._update(key, table, st, *touched_rows(*got, rows=table.shape[0]))
                continue
            if self.group is not None:
                # Every rank takes part (a rank without reads sends none) and gets the same global lookups.
                got = self._reads(key)
                if got is None:
                    empty = table.new_empty(0, dtype=torch.int64)
                    got = (empty, table.new_empty(0), empty, table.new_empty(0, table.shape[1]))
                slots, weights, tok, grad = got
                *got, sent = exchange_lookups(
                    slots, weights.to(table.dtype), tok, grad.to(table.dtype), self.group, rows=table.shape[0]
                )
                self.sent_bytes += sent
            else:
                got = self._lookups(key, seen)
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
            self._update(key, table, st, rows, row_gradients(offsets, tok, w, grad))
        self.zero_grad()

    def _update(self, key: str, table: Tensor, st: dict[str, Tensor], rows: Tensor, g: Tensor) -> None:
        """Adam on rows (U,) of table and its moments for their gradients g (U, d): gathered, updated, written back."""
        full = (table, st["exp_avg"], st["exp_avg_sq"])
        # Reused gather buffers: fresh (U, d) allocations cost page faults on every step.
        bufs = self._buffers.setdefault(key, [table.new_empty(0) for _ in range(3)])
        # resize_(0) keeps the storage, so index_select refills it without a new allocation.
        p, m, v = (torch.index_select(t, 0, rows, out=b.resize_(0)) for t, b in zip(full, bufs))  # (U, d)
        g, step = g.to(p.dtype), st["step"]
        if self.fused:  # the private torch._fused_adam_, until it raises once
            try:
                torch._fused_adam_(
                    [p], [g], [m], [v], [], [step.to(p.device)],
                    lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], weight_decay=0.0, eps=self.eps,
                    amsgrad=False, maximize=False,
                )  # fmt: skip
            except Exception:  # a torch without the op or its kernel for this device/dtype
                self.fused = False
        if not self.fused:  # torch.optim.Adam's single-tensor update
            b1, b2 = self.betas
            t = float(step)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / (1 - b1**t))
        for t, rows_t in zip(full, (p, m, v)):
            t.index_copy_(0, rows, rows_t)

    def state_dict(self) -> dict[str, Any]:
        return {"state": {k: dict(v) for k, v in self.state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s moments, copied to each table's device and layout."""
        self.state = {
            k: {
                name: self._moment(k, t) if name != "step" else t.to(self.tables[k].device)
                for name, t in v.items()
            }
            for k, v in state.get("state", {}).items()
            if k in self.tables
        }


def touched_rows(
    slots: Tensor, weights: Tensor, tok: Tensor, grad: Tensor, rows: int
) -> tuple[Tensor, Tensor]:
    """The distinct rows read and their gradients, (C,) and (C, d) for C = min(E, rows), with no host read: the
    count U <= C stays on the device, entries U..C-1 repeat row U-1 (index_copy_ rewrites the same numbers).
    slots, weights, tok (E,) and grad (R, d) as RowAdam._reads gives them."""
    s, order = slots.sort(stable=True)  # (E,) rows ascending, each row's lookups in read order
    new = torch.ones_like(s, dtype=torch.bool)
    new[1:] = s[1:] != s[:-1]
    seg = new.cumsum(0) - 1  # (E,) the rank of each sorted lookup's row among the distinct rows
    size = min(s.numel(), rows)
    distinct = s.new_empty(size).scatter_(0, seg, s)  # (C,) rows 0..U-1, then unset
    sorted_w, sorted_tok = weights.index_select(0, order), tok.index_select(0, order)
    g = scatter_rows(grad.new_zeros(size, grad.shape[1]), seg, sorted_w, sorted_tok, grad)  # (C, d)
    pick = torch.arange(size, device=s.device).clamp_(max=seg[-1])  # (C,) 0..U-1, then U-1 repeated
    return distinct.index_select(0, pick), g.index_select(0, pick)


# Choosing lookups over the dense all-reduce, a byte the reduction reads counts as 1/8 of a byte received:
# memory is several times faster than the link.
REDUCE_READS_PER_BYTE = 8


def _all_gather(out: Tensor, inp: Tensor, group: Any) -> None:
    """All-gather ``inp`` of every rank into ``out`` (rank-major), under either name torch gives the op."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def exchange_lookups(
    slots: Tensor, weights: Tensor, tok: Tensor, grad: Tensor, group: Any, rows: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """The data-parallel (mean) gradient of a (rows, d) table from each rank's reads (lookup e reads row slots[e]
    with weight weights[e] for grad[tok[e]]): (rows (U,), offsets (U+1,), tok, w, grad, bytes sent) as sort_lookups
    groups them, the same on every rank. The cheaper way by bytes: all-gather the lookups, W x (max E x (2 i + s) +
    max R x d x s) plus the reduction's reads (bitwise one process's sums for W a power of two), or all-reduce the
    dense (rows, d + 1) gradient, ~2 x rows x (d + 1) x s."""
    world = dist.get_world_size(group)
    d, size = grad.shape[1], grad.element_size()
    # (E, R) of this rank, on the device for NCCL
    count = torch.tensor([slots.numel(), grad.shape[0]], dtype=torch.int64, device=grad.device)
    counts = torch.empty(world, 2, dtype=torch.int64, device=grad.device)
    _all_gather(counts.view(-1), count, group)
    counts = counts.tolist()
    most_e, most_r = max(c[0] for c in counts), max(c[1] for c in counts)
    total_e = sum(c[0] for c in counts)
    if total_e == 0:  # no rank read the table this step: nothing to exchange
        none = torch.zeros(1, dtype=torch.int64, device=grad.device)
        empty = grad.new_empty(0, d)
        return none[:0], none, none[:0], empty[:, 0], empty, count.numel() * count.element_size()
    index = torch.int32 if rows < 2**31 else torch.int64
    w_rows = -(-most_e // d)  # the weights ride in the gradient buffer, d to a row
    per_rank = most_r + w_rows
    idx_size = torch.empty(0, dtype=index).element_size()
    as_lookups = world * (most_e * 2 * idx_size + per_rank * d * size)
    as_dense = 2 * rows * (d + 1) * size
    if as_dense < as_lookups + total_e * d * size / REDUCE_READS_PER_BYTE:
        # The row gradients all-reduced as a (rows, d + 1) table whose last column marks the rows any rank touched.
        mine, offsets, t, w = sort_lookups(slots, weights, tok)
        dense = grad.new_zeros(rows, d + 1)
        dense[mine, :d] = row_gradients(offsets, t, w, grad)
        dense[mine, d] = 1.0
        dist.all_reduce(dense, group=group)
        union = (dense[:, d] > 0).nonzero().squeeze(1)  # (U,) ascending, as torch.unique gives
        ids = torch.arange(union.numel() + 1, device=union.device)  # one lookup per row
        w = grad.new_full((union.numel(),), 1.0 / world)
        return union, ids, ids[:-1], w, dense[union, :d], 2 * 8 + dense.numel() * size
    # Padded to the largest rank (all-gather wants equal sizes); the pads are never looked up, so never written.
    ints = torch.empty(most_e, 2, dtype=index, device=grad.device)
    ints[: slots.numel(), 0] = slots
    ints[: slots.numel(), 1] = tok
    floats = grad.new_empty(per_rank, d)
    floats[: grad.shape[0]] = grad
    floats[most_r:].view(-1)[: slots.numel()] = weights
    all_ints = ints.new_empty(world, most_e, 2)
    all_floats = floats.new_empty(world * per_rank, d)  # rank r's token t at row r * per_rank + t
    _all_gather(all_ints.view(-1), ints.view(-1), group)
    _all_gather(all_floats, floats, group)
    sent = count.numel() * count.element_size() + ints.numel() * idx_size + floats.numel() * size
    ranks = torch.arange(world, device=grad.device)
    each = torch.tensor([c[0] for c in counts], dtype=torch.int64, device=grad.device)
    valid = torch.arange(most_e, device=grad.device) < each[:, None]  # (W, most_e): the lookups, not the pads
    g_slots = all_ints[..., 0][valid].long()
    g_tok = (all_ints[..., 1].long() + (ranks * per_rank)[:, None])[valid]
    g_w = all_floats.view(world, per_rank * d)[:, most_r * d : most_r * d + most_e][valid] * (1.0 / world)
    # sort_lookups' stable sort keeps each row's lookups in rank, then token order: the same on every rank.
    return (*sort_lookups(g_slots, g_w, g_tok), all_floats, sent)
