"""Numerical pieces of the product key memory (Lample et al. 2019, 'Large Memory Layers with Product Keys').

Kept apart from ``plugins/pkm.py`` so the plugin file reads as the model: here are the exact product-key
search, the batch norm that ignores padding (synced under torch.distributed), the sparse gradient tap of
the value table, the row-wise lazy Adam that updates only touched rows, and the usage/KL statistics.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


def product_key_topk(q1: Tensor, q2: Tensor, keys1: Tensor, keys2: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k of q.cat(c_i, c'_j) over all n^2 product keys; returns scores and slot ids i*n+j, (N, H, k).

    q1, q2: (N, H, dh) query halves; keys1, keys2: (H, n, dh) sub-key sets C and C'.
    Lample et al. Sec. 3.2: the best pair (i, j) has i in the top-k of C and j in the top-k of C' (else
    k better pairs exist), so the k*k candidates hold the exact top-k; nothing of size n^2 is built.
    """
    n = keys1.shape[1]
    s1 = torch.einsum("nhd,hkd->nhk", q1, keys1)  # (N, H, n)
    s2 = torch.einsum("nhd,hkd->nhk", q2, keys2)  # (N, H, n)
    t1, i1 = s1.topk(k, dim=-1)  # (N, H, k)
    t2, i2 = s2.topk(k, dim=-1)
    cand = (t1.unsqueeze(-1) + t2.unsqueeze(-2)).flatten(-2)  # (N, H, k*k)
    scores, j = cand.topk(k, dim=-1)  # (N, H, k), sorted descending
    slots = i1.gather(-1, j // k) * n + i2.gather(-1, j % k)
    return scores, slots


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


def coalesce_rows(slots: Tensor, weights: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """Gradient of sum-EmbeddingBag w.r.t. the value table, as (distinct rows (U,), row gradients (U, d)).

    Row r gets sum over lookups (t, j) with slots[t, j] == r of weights[t, j] * grad[t]. This is itself an
    EmbeddingBag over ``grad`` with one bag per distinct row, so nothing of size (N * m, d) is built.
    slots, weights: (N, m); grad: (N, d).
    """
    m = slots.shape[1]
    flat = slots.reshape(-1)
    sorted_slots, order = flat.sort()
    rows, counts = torch.unique_consecutive(sorted_slots, return_counts=True)  # (U,)
    offsets = counts.cumsum(0) - counts
    tokens = torch.div(order, m, rounding_mode="floor")  # the lookup's row in grad
    w = weights.reshape(-1)[order].to(grad.dtype)
    return rows, F.embedding_bag(tokens, grad, offsets, mode="sum", per_sample_weights=w)


class _SparseValueGrad(torch.autograd.Function):
    """Identity on the memory output whose backward sends the value table's row gradients to a sink."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, slots: Tensor, weights: Tensor, sink: RowAdam, key: str) -> Tensor:
        ctx.save_for_backward(slots, weights)
        ctx.sink, ctx.key = sink, key
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        slots, weights = ctx.saved_tensors
        ctx.sink.add_grad(ctx.key, *coalesce_rows(slots, weights, grad))
        return grad, None, None, None, None


def value_lookup(
    slots: Tensor, weights: Tensor, values: Tensor, sink: RowAdam | None = None, key: str = ""
) -> Tensor:
    """sum_j weights[t, j] * values[slots[t, j]], (N, d); with a sink, the values' gradient goes there sparsely.

    Without a sink the values get an ordinary dense gradient (what DDP/FSDP reduce); with one, the table is
    read detached and the touched rows' gradients are handed to ``sink.add_grad`` during backward.
    """
    if sink is None:
        return F.embedding_bag(slots, values, mode="sum", per_sample_weights=weights)
    out = F.embedding_bag(slots, values.detach(), mode="sum", per_sample_weights=weights)
    return _SparseValueGrad.apply(out, slots, weights.detach(), sink, key)


class RowAdam:
    """Lazy (row-wise) Adam for value tables: only rows with a gradient are read and written.

    Like torch.optim.SparseAdam: moments of untouched rows are left as they are and the bias correction
    uses the table's step count. Each step gathers the touched rows of (value, m, v) into reused buffers,
    runs PyTorch's fused Adam kernel on them (one pass, vectorised) and writes them back; the cost grows
    with the number of touched rows, not with the table size. Gradients accumulate between steps (several
    memory layers sharing a table, gradient accumulation) like ``.grad`` does, and are cleared by ``step``.
    """

    def __init__(
        self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
    ) -> None:
        self.lr, self.betas, self.eps = lr, betas, eps
        self.tables: dict[str, Tensor] = {}
        self.state: dict[str, dict[str, Tensor]] = {}
        self.grads: dict[str, list[tuple[Tensor, Tensor]]] = {}
        self._buffers: dict[str, list[Tensor]] = {}

    def add_table(self, key: str, table: Tensor) -> None:
        """Register a (rows, d) table under ``key``."""
        self.tables[key] = table

    def add_grad(self, key: str, rows: Tensor, grad: Tensor) -> None:
        """Accumulate the gradient (U, d) of distinct rows (U,) of table ``key``."""
        self.grads.setdefault(key, []).append((rows, grad))

    def zero_grad(self) -> None:
        """Drop pending row gradients."""
        self.grads.clear()

    def pending(self, key: str) -> tuple[Tensor, Tensor] | None:
        """The accumulated (distinct rows, gradient) of a table, or None."""
        parts = self.grads.get(key)
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        rows, inverse = torch.unique(torch.cat([r for r, _ in parts]), return_inverse=True)
        grad = torch.cat([g for _, g in parts])
        return rows, grad.new_zeros(rows.numel(), grad.shape[1]).index_add_(0, inverse, grad)

    def _state(self, key: str) -> dict[str, Tensor]:
        if key not in self.state:
            table = self.tables[key]
            self.state[key] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(table, memory_format=torch.contiguous_format),
                "exp_avg_sq": torch.zeros_like(table, memory_format=torch.contiguous_format),
            }
        return self.state[key]

    @torch.no_grad()
    def step(self) -> None:
        """Apply one Adam step to the touched rows of every table, then clear the gradients."""
        for key, table in self.tables.items():
            got = self.pending(key)
            if got is None:
                continue
            rows, grad = got
            st = self._state(key)
            st["step"] += 1
            # Reused gather buffers: fresh (U, d) allocations cost page faults on every step.
            bufs = self._buffers.setdefault(key, [table.new_empty(0) for _ in range(3)])
            full = (table, st["exp_avg"], st["exp_avg_sq"])
            # resize_(0) keeps the storage, so index_select refills it without a new allocation.
            p, m, v = (torch.index_select(t, 0, rows, out=b.resize_(0)) for t, b in zip(full, bufs))  # (U, d)
            torch._fused_adam_(
                [p], [grad.to(p.dtype)], [m], [v], [], [st["step"].to(p.device)],
                lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], weight_decay=0.0, eps=self.eps,
                amsgrad=False, maximize=False,
            )  # fmt: skip
            table.index_copy_(0, rows, p)
            st["exp_avg"].index_copy_(0, rows, m)
            st["exp_avg_sq"].index_copy_(0, rows, v)
        self.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """Moments and step counts, for checkpoints."""
        return {"state": {k: dict(v) for k, v in self.state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (moments are moved to each table's device)."""
        self.state = {
            k: {name: t.to(self.tables[k].device) if name != "step" else t.cpu() for name, t in v.items()}
            for k, v in state.get("state", {}).items()
            if k in self.tables
        }


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
