"""Numerical pieces of the product key memory (Lample et al. 2019, 'Large Memory Layers with Product Keys').

Kept apart from ``plugins/pkm.py`` so the plugin file reads as the model: here are the exact product-key
search (with a backward that touches only the selected sub-keys), the batch norm that ignores padding
(synced under torch.distributed), the value read (EmbeddingBag) whose backward is dense or hands the reads
to the row-wise lazy Adam that updates only touched rows, and the usage/KL statistics. Nothing here builds
a tensor of size n^2 (slots) except the dense value gradient that DDP/FSDP need.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from rlm.plugins import _pkm_native


def grouped_topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exact, sorted top-k over the last dim, reading most of a long row only once (for the amax).

    The row is cut into G >= 4k strided groups {j, j+G, j+2G, ...}; every top-k element lies in a group whose
    maximum is among the top-k group maxima (each such maximum is itself >= the k-th value), so the top-k of
    those k groups' elements is the top-k of the row. Plain topk when the row is too short to gain.
    """
    n = scores.shape[-1]
    g = n // (4 * k)  # elements per group
    if g < 2 or n % g:
        return scores.topk(k, dim=-1)
    G = n // g
    best = scores.unflatten(-1, (g, G)).amax(-2).topk(k, dim=-1, sorted=False)[1]  # (..., k) groups
    idx = (best.unsqueeze(-2) + torch.arange(g, device=scores.device).unsqueeze(-1) * G).flatten(
        -2
    )  # (..., g*k)
    top, j = scores.gather(-1, idx).topk(k, dim=-1)
    return top, idx.gather(-1, j)


@functools.cache
def _candidate_pairs(k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Pairs (a, b) of sorted half ranks with (a+1)(b+1) <= k: only they can reach the top-k (about k ln k)."""
    pairs = [(a, b) for a in range(k) for b in range(k // (a + 1))]
    return torch.tensor([a for a, _ in pairs], device=device), torch.tensor(
        [b for _, b in pairs], device=device
    )


def _search_torch(s1: Tensor, s2: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """product_search's result with torch ops, for devices and dtypes the native kernel does not take.

    Same scores; equal scores may come in another order (torch.topk does not order ties).
    """
    t1, i1 = grouped_topk(s1, k)  # (H, N, k), sorted descending
    t2, i2 = grouped_topk(s2, k)
    # With both halves sorted, the pair of ranks (a, b) is beaten by the (a+1)(b+1) pairs (<= a, <= b), so
    # only pairs with (a+1)(b+1) <= k are candidates: ~k ln k sums instead of k*k.
    a, b = _candidate_pairs(k, t1.device)
    scores, j = (t1[..., a] + t2[..., b]).topk(k, dim=-1)  # (H, N, k), sorted descending
    i, j = i1.gather(-1, a[j]), i2.gather(-1, b[j])
    return scores.transpose(0, 1).contiguous(), i.transpose(0, 1).contiguous(), j.transpose(0, 1).contiguous()


def _subkey_grads(
    q: Tensor, keys: Tensor, idx: Tensor, grad: Tensor, need_q: bool, need_keys: bool
) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of scores[t, h, e] = q[t, h] . keys[h, idx[t, h, e]] for q (N, H, dh) and keys (H, n, dh).

    The dense (N, H, n) score gradient has k non-zeros per row, so instead of two dense matmuls:
    dq = sum_e g_e C[i_e] (an EmbeddingBag over the sub-keys) and dC[i] = sum over selections of i of g q (the
    same reduction as the value rows'); nothing of size (N, H, n) is built.
    """
    (N, H, dh), n, k = q.shape, keys.shape[1], idx.shape[-1]
    rows = (idx + torch.arange(H, device=idx.device).view(1, H, 1) * n).reshape(N * H, k)  # in (H*n, dh)
    flat_keys = keys.reshape(H * n, dh)
    w = grad.reshape(N * H, k).to(keys.dtype)
    grad_q = grad_keys = None
    if need_q:
        grad_q = F.embedding_bag(rows, flat_keys, mode="sum", per_sample_weights=w).view(N, H, dh)
    if need_keys:
        touched, g = coalesce_rows(rows, w, q.reshape(N * H, dh).to(keys.dtype))
        grad_keys = torch.zeros_like(flat_keys).index_copy_(0, touched, g).view(H, n, dh)
    return grad_q, grad_keys


_ONEDNN_LINEAR: list[Any] = []  # [op] once resolved; [None] when unavailable or failed


def _onednn_linear() -> Any:
    """oneDNN's fp32 linear (torch.ops.mkldnn._linear_pointwise, the op Inductor's CPU backend uses), or None.

    A private op with no public equivalent at this speed: looking it up, like calling it (half_scores), falls
    back to torch.bmm on any exception.
    """
    if not _ONEDNN_LINEAR:
        try:
            op = torch.ops.mkldnn._linear_pointwise if torch.backends.mkldnn.is_available() else None
        except Exception:  # a build without the op, or a torch that renamed it
            op = None
        _ONEDNN_LINEAR.append(op)
    return _ONEDNN_LINEAR[0]


def half_scores(q: Tensor, keys: Tensor) -> list[Tensor]:
    """Per head h, the (N, n) scores q[h] @ keys[h].T of one half; q (H, N, dh) contiguous, keys (H, n, dh).

    On CPU float32 through oneDNN: the same fp32 arithmetic, but here ~2.5x faster than torch.bmm (whose
    MKL sgemm does not use the widest vector path on every CPU, e.g. AMD); torch.bmm elsewhere.
    """
    op = _onednn_linear() if q.device.type == "cpu" and q.dtype == keys.dtype == torch.float32 else None
    if op is not None:
        try:
            return [op(q[h], keys[h].contiguous(), None, "none", [], "") for h in range(q.shape[0])]
        except Exception:  # any failure of the private op (build, signature, CPU): bmm from now on
            _ONEDNN_LINEAR[0] = None
    return list(torch.bmm(q, keys.transpose(1, 2)).unbind(0))


class _ProductKeySearch(torch.autograd.Function):
    """Scores q1.C_i + q2.C'_j of the exact top-k pairs (i, j), with a backward that touches only those sub-keys.

    Forward: the (N, n) scores of each half and head, then the native selection (plugins/_pkm_native.py) or
    its torch equivalent. The selected score is s1[i] + s2[j], so its gradient reaches C_i and C'_j only.
    """

    @staticmethod
    def forward(ctx: Any, q1: Tensor, q2: Tensor, keys1: Tensor, keys2: Tensor, k: int) -> tuple[Tensor, ...]:
        # (H, N, dh) copies first: strided operands send the matmul down slower paths on CPU.
        s1 = half_scores(q1.transpose(0, 1).contiguous(), keys1)  # H x (N, n)
        s2 = half_scores(q2.transpose(0, 1).contiguous(), keys2)
        found = _pkm_native.product_search(s1, s2, k)
        if found is None:
            found = _search_torch(torch.stack(s1), torch.stack(s2), k)
        scores, i, j = found  # (N, H, k) each
        ctx.save_for_backward(q1, q2, keys1, keys2, i, j)
        ctx.mark_non_differentiable(i, j)
        return scores, i, j

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        q1, q2, keys1, keys2, i, j = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad_q1, grad_k1 = _subkey_grads(q1, keys1, i, grad, need[0], need[2])
        grad_q2, grad_k2 = _subkey_grads(q2, keys2, j, grad, need[1], need[3])
        return grad_q1, grad_q2, grad_k1, grad_k2, None


# Under torch.compile the two memory ops run eagerly behind a graph break each (torch.compiler.disable): the
# search calls the native kernels through ctypes and picks its path from the build at run time, and the value
# read's backward hands its gradient to the row optimizer (a Python side effect, not a graph op). Tracing
# into them would break the graph at many points inside (15 breaks for one layer on torch 2.13); this way a
# PKM layer has two break points, and the query network, batch norm, softmax and gating around them compile.
@torch.compiler.disable
def product_key_topk(q1: Tensor, q2: Tensor, keys1: Tensor, keys2: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k of q.cat(c_i, c'_j) over all n^2 product keys; returns scores and slot ids i*n+j, (N, H, k).

    q1, q2: (N, H, dh) query halves; keys1, keys2: (H, n, dh) sub-key sets C and C'.
    Lample et al. Sec. 3.2: the best pair (i, j) has i in the top-k of C and j in the top-k of C' (else
    k better pairs exist), so the k*k candidates hold the exact top-k; nothing of size n^2 is built.

    The search runs in at least float32 whatever autocast says: under bf16 autocast the key-score bmm would
    round the scores to bf16 (8 mantissa bits), enough to reorder close keys and change the slots read. So
    the inputs are cast up and autocast is off for the device around the search (its backward's ops take
    their dtypes from the saved fp32 tensors).
    """
    up = [t.to(torch.promote_types(t.dtype, torch.float32)) for t in (q1, q2, keys1, keys2)]
    with torch.autocast(q1.device.type, enabled=False):
        scores, i, j = _ProductKeySearch.apply(*up, k)
    return scores, i * keys1.shape[1] + j


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class MaskedBatchNorm(nn.Module):
    """BatchNorm1d over (N, C) rows where only rows with mask True count, synced across ranks when distributed.

    Statistics are per-feature sums over valid rows; under torch.distributed they are summed over ranks
    with the differentiable all_reduce, which gives torch.nn.SyncBatchNorm's semantics (global batch
    statistics, gradients through them) with padding left out. Eval uses running statistics.
    """

    def __init__(self, dim: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """Normalise x (N, C) with the statistics of x[mask] (training) or the running ones (eval)."""
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        if self.training:
            C = x.shape[1]
            m = mask.reshape(-1, 1).to(x32.dtype)  # (N, 1)
            stats = torch.cat([(x32 * m).sum(0), (x32 * x32 * m).sum(0), m.sum(0)])  # (2C + 1,)
            if _world() > 1:
                from torch.distributed.nn.functional import all_reduce

                stats = all_reduce(stats)
            count = stats[-1].clamp(min=1.0)
            mean = stats[:C] / count  # (C,)
            var = (stats[C : 2 * C] / count - mean * mean).clamp(min=0.0)  # biased, as BatchNorm normalises
            with torch.no_grad():
                unbiased = var * count / (count - 1).clamp(min=1.0)
                self.running_mean.lerp_(mean.detach(), self.momentum)
                self.running_var.lerp_(unbiased.detach(), self.momentum)
        else:
            mean, var = self.running_mean, self.running_var
        y = (x32 - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias
        return y.to(x.dtype)


def sort_lookups(
    slots: Tensor, weights: Tensor, tok: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Group lookups by value row: (distinct rows (U,), offsets (U+1,), source row in grad (E,), weight (E,)).

    slots, weights: (N, m), lookup (t, j) reads row slots[t, j] with weight weights[t, j] for grad row t; or
    flat (E,) with the grad row of each lookup in ``tok``. Lookups of row rows[u] are positions
    offsets[u]:offsets[u+1] of the returned (E,) tensors.
    """
    if tok is None:
        N, m = slots.shape
        tok = torch.arange(N, device=slots.device).repeat_interleave(m)  # (N * m,)
    flat = slots.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: a deterministic summation order per row
    rows, counts = torch.unique_consecutive(flat[order], return_counts=True)  # (U,)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return rows, offsets, tok[order], weights.reshape(-1)[order]


def row_gradients(offsets: Tensor, tok: Tensor, w: Tensor, grad: Tensor) -> Tensor:
    """Gradient of sum-EmbeddingBag w.r.t. each distinct row, (U, d): sum over its lookups of w * grad[tok].

    This is itself an EmbeddingBag over ``grad`` with one bag per row, so nothing of size (E, d) is built.
    """
    return F.embedding_bag(tok, grad, offsets[:-1], mode="sum", per_sample_weights=w.to(grad.dtype))


def coalesce_rows(slots: Tensor, weights: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """The value table's gradient as (distinct rows (U,), row gradients (U, d)); slots, weights (N, m), grad (N, d)."""
    rows, offsets, tok, w = sort_lookups(slots, weights)
    return rows, row_gradients(offsets, tok, w, grad)


def bag_dot(values: Tensor, slots: Tensor, grad: Tensor) -> Tensor:
    """values[slots[t, j]] . grad[t], (N, m): the gradient of a sum-EmbeddingBag w.r.t. its per-sample weights."""
    out = _pkm_native.bag_dot(values, slots, grad)
    if out is not None:
        return out
    N, m = slots.shape
    out = grad.new_empty(N, m)
    chunk = max(1, (1 << 22) // (m * values.shape[1]))  # gather ~16 MB of rows at a time, not all N*m rows
    for t in range(0, N, chunk):
        rows = values.index_select(0, slots[t : t + chunk].reshape(-1)).view(
            -1, m, values.shape[1]
        )  # (c, m, d)
        out[t : t + chunk] = torch.bmm(rows.to(grad.dtype), grad[t : t + chunk].unsqueeze(-1)).squeeze(-1)
    return out


class _ValueBag(torch.autograd.Function):
    """sum_j weights[t, j] * values[slots[t, j]] with a backward that never builds a dense (N*m, d) tensor.

    Weights get bag_dot; the values get either a dense gradient (for DDP/FSDP to reduce) or, with a sink,
    nothing: backward hands (slots, weights, output gradient) to the row optimizer instead.
    """

    @staticmethod
    def forward(
        ctx: Any, slots: Tensor, weights: Tensor, values: Tensor, sink: RowAdam | None, key: str
    ) -> Tensor:
        ctx.save_for_backward(slots, weights, values)
        ctx.sink, ctx.key = sink, key
        return F.embedding_bag(slots, values, mode="sum", per_sample_weights=weights)  # (N, d)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        slots, weights, values = ctx.saved_tensors
        grad = grad.contiguous()
        grad_w = bag_dot(values, slots, grad).to(weights.dtype) if ctx.needs_input_grad[1] else None
        grad_values = None
        if ctx.sink is not None:
            ctx.sink.add_lookups(ctx.key, slots, weights.detach(), grad)
        elif ctx.needs_input_grad[2]:
            rows, g = coalesce_rows(slots, weights, grad)
            grad_values = torch.zeros_like(values).index_copy_(0, rows, g.to(values.dtype))
        return None, grad_w, grad_values, None, None


@torch.compiler.disable  # see product_key_topk: runs eagerly under torch.compile (one graph break)
def value_lookup(
    slots: Tensor, weights: Tensor, values: Tensor, sink: RowAdam | None = None, key: str = ""
) -> Tensor:
    """sum_j weights[t, j] * values[slots[t, j]], (N, d); with a sink, the values' gradient goes there sparsely.

    Without a sink the values get an ordinary dense gradient (what DDP/FSDP reduce); with one, backward hands
    the reads and the output gradient to ``sink.add_lookups`` and the table gets no ``.grad``.
    """
    return _ValueBag.apply(slots, weights, values, sink, key)


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
                # Every rank takes part (a rank without reads sends no rows) and gets the same global rows.
                if got is not None:
                    rows, offsets, tok, w, grad = got
                    g = row_gradients(offsets, tok, w, grad)  # (U_r, d) for the rows (U_r,)
                else:
                    rows, g = table.new_empty(0, dtype=torch.int64), table.new_empty(0, table.shape[1])
                rows, g, sent = exchange_rows(
                    rows, g.to(table.dtype), table.shape[1], self.group, slots=table.shape[0]
                )
                self.sent_bytes += sent
                ids = torch.arange(rows.numel() + 1, device=rows.device)  # one lookup of weight 1 per row
                got = (rows, ids, ids[:-1], g.new_ones(rows.numel()), g)
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
    replicas equal.

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
        return union, dense[union, :d] / world, count.element_size() + dense.numel() * size
    # Padded to the largest count (all_gather wants equal sizes); pads are cut off below.
    pad_rows = rows.new_zeros(most)
    pad_rows[: rows.numel()] = rows
    pad_grads = grads.new_zeros(most, d)
    pad_grads[: rows.numel()] = grads
    all_rows = [torch.empty_like(pad_rows) for _ in range(world)]
    all_grads = [torch.empty_like(pad_grads) for _ in range(world)]
    dist.all_gather(all_rows, pad_rows, group=group)
    dist.all_gather(all_grads, pad_grads, group=group)
    flat_rows = torch.cat([r[:c] for r, c in zip(all_rows, counts)])  # (sum U_r,)
    flat_grads = torch.cat([g[:c] for g, c in zip(all_grads, counts)])  # (sum U_r, d)
    union, inverse = torch.unique(flat_rows, sorted=True, return_inverse=True)  # (U,)
    summed = flat_grads.new_zeros(union.numel(), d).index_add_(0, inverse, flat_grads)  # duplicates summed
    sent = count.element_size() + most * (pad_rows.element_size() + d * pad_grads.element_size())
    return union, summed / world, sent


def slot_stats(weights: Tensor) -> tuple[Tensor, Tensor]:
    """Memory usage (fraction of slots with non-zero summed weight) and KL(p || uniform) of p = weights / sum.

    Lample et al. Sec. 4.5: KL = sum_i p_i log(p_i * S) = log S + sum_i p_i log p_i (0 log 0 = 0).
    """
    w = weights.double()
    usage = (w > 0).double().mean()
    total = w.sum()
    if total <= 0:
        return usage, torch.zeros((), dtype=torch.float64)
    p = w / total
    kl = math.log(w.numel()) + torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p)).sum()
    return usage, kl
