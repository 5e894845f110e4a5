"""Numerics of the product key memory (Lample et al. 2019): exact product-key search, padding-aware batch norm,
the value read and its sparse or dense backward, usage/KL statistics. Nothing here builds a tensor of n^2 (slots)
except the dense value gradient of ``pkm.sparse: false``."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from rlm.plugins import _pkm_native

VALUE_READ: Literal["auto", "bag", "gather"] = "auto"
"""How table rows are read and their gradients reduced: 'bag' (EmbeddingBag, deterministic on CPU), 'gather'
(index_select, index_add_) or 'auto' (gather on CUDA, where EmbeddingBag serialises a hot row's lookups)."""


def gathers(t: Tensor) -> bool:
    """Whether tables on t's device are read by gathers and index_add_ (see VALUE_READ)."""
    return VALUE_READ == "gather" or (VALUE_READ == "auto" and t.device.type == "cuda")


def _block(t: Tensor) -> int:
    """Elements of one transient gathered block: small on a CPU (cache), large on a GPU (kernel launches)."""
    return 1 << 26 if t.is_cuda else 1 << 22


def grouped_topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exact, sorted top-k over the last dim, reading most of a long row only once (for the amax): every top-k
    element lies in one of G >= 4k strided groups {j, j+G, ...} whose maximum is among the top-k group maxima, so
    the top-k of those k groups is the row's. Plain topk when the row is too short to gain."""
    n = scores.shape[-1]
    g = n // (4 * k)  # elements per group
    if g < 2 or n % g:
        return scores.topk(k, dim=-1)
    G = n // g
    best = scores.unflatten(-1, (g, G)).amax(-2).topk(k, dim=-1, sorted=False)[1]  # (..., k) groups
    offsets = torch.arange(g, device=scores.device).unsqueeze(-1) * G  # (g, 1): a group's elements
    idx = (best.unsqueeze(-2) + offsets).flatten(-2)  # (..., g*k)
    top, j = scores.gather(-1, idx).topk(k, dim=-1)
    return top, idx.gather(-1, j)


@functools.cache
def _candidate_pairs(k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Pairs (a, b) of sorted half ranks with (a+1)(b+1) <= k: only they can reach the top-k (about k ln k)."""
    pairs = [(a, b) for a in range(k) for b in range(k // (a + 1))]
    return torch.tensor(pairs, device=device).unbind(1)


def _search_torch(s1: Tensor, s2: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """product_search with torch ops, where the native kernel does not run; ties may come in another order."""
    t1, i1 = grouped_topk(s1, k)  # (H, N, k), sorted descending
    t2, i2 = grouped_topk(s2, k)
    a, b = _candidate_pairs(k, t1.device)
    scores, j = (t1[..., a] + t2[..., b]).topk(k, dim=-1)  # (H, N, k), sorted descending
    i, j = i1.gather(-1, a[j]), i2.gather(-1, b[j])
    return scores.transpose(0, 1).contiguous(), i.transpose(0, 1).contiguous(), j.transpose(0, 1).contiguous()


_ONEDNN_LINEAR: list[Any] = []  # [op] once resolved; [None] when unavailable or failed


def _onednn_linear() -> Any:
    """oneDNN's fp32 linear (torch.ops.mkldnn._linear_pointwise, Inductor's CPU op, private), or None."""
    if not _ONEDNN_LINEAR:
        try:
            op = torch.ops.mkldnn._linear_pointwise if torch.backends.mkldnn.is_available() else None
        except Exception:  # a build without the op, or a torch that renamed it
            op = None
        _ONEDNN_LINEAR.append(op)
    return _ONEDNN_LINEAR[0]


def half_scores(q: Tensor, keys: Tensor) -> list[Tensor]:
    """Per head h, the (N, n) scores q[h] @ keys[h].T of one half; q (H, N, dh) contiguous, keys (H, n, dh). CPU
    float32 goes through oneDNN (MKL's sgemm behind bmm misses the widest vector path on some CPUs)."""
    op = _onednn_linear() if q.device.type == "cpu" and q.dtype == keys.dtype == torch.float32 else None
    if op is not None:
        try:
            return [op(q[h], keys[h].contiguous(), None, "none", [], "") for h in range(q.shape[0])]
        except Exception:  # any failure of the private op (build, signature, CPU): bmm from now on
            _ONEDNN_LINEAR[0] = None
    return list(torch.bmm(q, keys.transpose(1, 2)).unbind(0))


class _ProductKeySearch(torch.autograd.Function):
    """Scores q1.C_i + q2.C'_j of the exact top-k pairs (i, j), (N, H, k) each, for q (N, H, 2, dh) and keys
    (H, 2, n, dh); the backward touches only C_i and C'_j."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, keys: Tensor, k: int) -> tuple[Tensor, ...]:
        # (H, N, dh) copies first: strided operands send the matmul down slower paths on CPU.
        s1 = half_scores(q[:, :, 0].transpose(0, 1).contiguous(), keys[:, 0])  # H x (N, n)
        s2 = half_scores(q[:, :, 1].transpose(0, 1).contiguous(), keys[:, 1])
        found = _pkm_native.product_search(s1, s2, k)
        if found is None:
            found = _search_torch(torch.stack(s1), torch.stack(s2), k)
        scores, i, j = found  # (N, H, k) each
        ctx.save_for_backward(q, keys, i, j)
        ctx.mark_non_differentiable(i, j)
        return scores, i, j

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        # The score gradient has k non-zeros a row: bag_sum and table_grad in place of dense matmuls, both halves
        # in one tensor (slices would make autograd zero-fill one per half).
        q, keys, i, j = ctx.saved_tensors
        (N, H, _, dh), n, k = q.shape, keys.shape[2], i.shape[-1]
        # sub-key s of half c of head h is row (2h + c) n + s of the flat (H * 2 * n, dh) keys
        base = torch.arange(2 * H, device=i.device).view(1, H, 2, 1) * n
        rows = (torch.stack([i, j], dim=2) + base).reshape(N * H * 2, k)
        flat_keys = keys.reshape(2 * H * n, dh)
        # each score's gradient, once for each half
        w = grad.unsqueeze(2).expand(N, H, 2, k).reshape(N * H * 2, k).to(keys.dtype)
        grad_q = grad_keys = None
        if ctx.needs_input_grad[0]:
            grad_q = bag_sum(flat_keys, rows, w).view(N, H, 2, dh)
        if ctx.needs_input_grad[1]:
            q_rows = q.reshape(N * H * 2, dh).to(keys.dtype)
            grad_keys = table_grad(flat_keys, rows, w, q_rows).view(H, 2, n, dh)
        return grad_q, grad_keys, None


# Under torch.compile the memory ops run eagerly behind one graph break each (ctypes kernels; the row
# optimizer's side effect), so the query network, norm, softmax and gating around them compile.
@torch.compiler.disable
def product_key_topk(q: Tensor, keys: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k of q.cat(c_i, c'_j) over all n^2 product keys: scores and slot ids i*n+j, (N, H, k), for the
    query's halves q (N, H, 2, dh) and the sub-key sets C, C' (H, 2, n, dh). Lample et al. Sec. 3.2: the best pairs
    come from the top-k of each half. At least float32 whatever autocast says: bf16 scores would reorder close keys."""
    up = [t.to(torch.promote_types(t.dtype, torch.float32)) for t in (q, keys)]
    with torch.autocast(q.device.type, enabled=False):
        scores, i, j = _ProductKeySearch.apply(*up, k)
    return scores, i * keys.shape[2] + j


def group_size(group: Any = None) -> int:
    """Processes in ``group`` (None: the default group) when torch.distributed is initialised, else 1."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class MaskedBatchNorm(nn.Module):
    """BatchNorm1d over the (N, C) rows with mask True; distributed, SyncBatchNorm's semantics over ``group``
    (None: default) by a differentiable all_reduce of the sums. Eval uses running statistics."""

    def __init__(self, dim: int, eps: float = 1e-5, momentum: float = 0.1, group: Any = None) -> None:
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.group = group
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
            if group_size(self.group) > 1:
                from torch.distributed.nn.functional import all_reduce

                stats = all_reduce(stats, group=self.group if self.group is not None else dist.group.WORLD)
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


def group_slots(slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Lookups grouped by value row: (distinct rows (U,), offsets (U+1,), order (E,)); row rows[u]'s lookups are
    order[offsets[u]:offsets[u+1]] of the flat slots (E,), in their original order."""
    flat = slots.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: a deterministic summation order per row
    # index_select, not flat[order]: advanced indexing is several times slower on CPU
    rows, counts = torch.unique_consecutive(flat.index_select(0, order), return_counts=True)  # (U,)
    return rows, torch.cat([counts.new_zeros(1), counts.cumsum(0)]), order


def sort_lookups(
    slots: Tensor,
    weights: Tensor,
    tok: Tensor | None = None,
    grouped: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Group lookups by value row: (distinct rows (U,), offsets (U+1,), source row in grad (E,), weight (E,)); row
    rows[u]'s lookups are offsets[u]:offsets[u+1] of the (E,) tensors. slots, weights (N, m): lookup (t, j) reads
    row slots[t, j] for grad row t; or flat (E,) with grad rows ``tok``. ``grouped``: group_slots(slots) if known."""
    if tok is None:
        N, m = slots.shape
        tok = torch.arange(N, device=slots.device).repeat_interleave(m)  # (N * m,)
    rows, offsets, order = grouped or group_slots(slots)
    return rows, offsets, tok.index_select(0, order), weights.reshape(-1).index_select(0, order)


def row_gradients(offsets: Tensor, tok: Tensor, w: Tensor, grad: Tensor) -> Tensor:
    """Gradient of sum-EmbeddingBag w.r.t. each distinct row, (U, d): sum over its lookups of w * grad[tok]. An
    EmbeddingBag on every device: the row exchange needs one summation order (index_add_'s atomics have none)."""
    return F.embedding_bag(tok, grad, offsets[:-1], mode="sum", per_sample_weights=w.to(grad.dtype))


def coalesce_rows(slots: Tensor, weights: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """The value table's gradient as (distinct rows (U,), row gradients (U, d)); slots, weights (N, m), grad (N, d)."""
    rows, offsets, tok, w = sort_lookups(slots, weights)
    return rows, row_gradients(offsets, tok, w, grad)


def scatter_rows(out: Tensor, index: Tensor, weights: Tensor, tok: Tensor, grad: Tensor) -> Tensor:
    """out[index[e]] += weights[e] * grad[tok[e]] for every lookup e (index, weights, tok (E,), grad (R, d))."""
    block = max(1, _block(grad) // grad.shape[1])
    for e in range(0, index.numel(), block):
        part = slice(e, e + block)
        src = grad.index_select(0, tok[part]) * weights[part, None].to(grad.dtype)  # (c, d)
        out.index_add_(0, index[part], src.to(out.dtype))
    return out


def table_grad(table: Tensor, slots: Tensor, weights: Tensor, grad: Tensor) -> Tensor:
    """The dense gradient of bag_sum(table, slots, weights) for output gradient grad (N, d); slots, weights (N, m)."""
    if gathers(table):
        N, m = slots.shape
        tok = torch.arange(N, device=slots.device).repeat_interleave(m)  # (N * m,)
        return scatter_rows(torch.zeros_like(table), slots.reshape(-1), weights.reshape(-1), tok, grad)
    rows, g = coalesce_rows(slots, weights, grad)
    return torch.zeros_like(table).index_copy_(0, rows, g.to(table.dtype))


def _gathered(table: Tensor, slots: Tensor, dtype: torch.dtype) -> Iterator[tuple[slice, Tensor]]:
    """Blocks of tokens with their rows, (t:t+c, table[slots[t:t+c]] (c, m, d) in dtype), ~_block elements each."""
    (N, m), d = slots.shape, table.shape[1]
    block = max(1, _block(table) // (m * d))
    for t in range(0, N, block):
        part = slice(t, t + block)
        yield part, table.index_select(0, slots[part].reshape(-1)).view(-1, m, d).to(dtype)


def bag_sum(table: Tensor, slots: Tensor, weights: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """sum_j weights[t, j] * table[slots[t, j]], (N, d) in table's dtype, for slots and weights (N, m); the gather
    path multiplies in ``dtype`` (default: the table's), e.g. autocast's."""
    if not gathers(table):
        return F.embedding_bag(slots, table, mode="sum", per_sample_weights=weights)
    dtype = dtype or table.dtype
    out = table.new_empty(slots.shape[0], table.shape[1])
    for part, rows in _gathered(table, slots, dtype):
        out[part] = torch.bmm(weights[part].unsqueeze(1).to(dtype), rows).squeeze(1)  # (c, 1, m) @ (c, m, d)
    return out


def bag_dot(values: Tensor, slots: Tensor, grad: Tensor) -> Tensor:
    """values[slots[t, j]] . grad[t], (N, m): the gradient of a sum-EmbeddingBag w.r.t. its per-sample weights."""
    out = _pkm_native.bag_dot(values, slots, grad)
    if out is not None:
        return out
    out = grad.new_empty(slots.shape)
    for part, rows in _gathered(values, slots, grad.dtype):
        out[part] = torch.bmm(rows, grad[part].unsqueeze(-1)).squeeze(-1)  # (c, m, d) @ (c, d, 1)
    return out


class LookupSink(Protocol):
    """Where value_lookup's backward hands a table's reads (RowAdam)."""

    def add_lookups(self, key: str, slots: Tensor, weights: Tensor, grad: Tensor) -> None: ...


class _ValueRead(torch.autograd.Function):
    """A read of a value table: the bag sum_j a[t, j] * values[slots[t, j]], (N, d), for weights a (N, m), or with
    ``dot`` values[slots[t, j]] . a[t], (N, m), for inputs a (N, d) (PEER's down projections). Each one's input
    gradient is the other; the table's is the bag's for (weights, output gradient) = (a, grad), or (grad, a) with
    ``dot``: a dense gradient or, with a sink, none (the reads go to the row optimizer). No (N*m, d) tensor."""

    @staticmethod
    def forward(
        ctx: Any, slots: Tensor, a: Tensor, values: Tensor, sink: LookupSink | None, key: str, dot: bool
    ) -> Tensor:
        ctx.save_for_backward(slots, a, values)
        ctx.sink, ctx.key, ctx.dot = sink, key, dot
        if dot:
            return bag_dot(values, slots, a)  # (N, m)
        device = values.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else values.dtype
        return bag_sum(values, slots, a, dtype)  # (N, d)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        slots, a, values = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = grad_values = None
        if ctx.needs_input_grad[1] and ctx.dot:
            grad_a = bag_sum(values, slots, grad.to(values.dtype))
        elif ctx.needs_input_grad[1]:
            grad_a = bag_dot(values, slots, grad).to(a.dtype)
        w, g = (grad, a) if ctx.dot else (a, grad)
        if ctx.sink is not None:
            ctx.sink.add_lookups(ctx.key, slots, w.detach(), g.detach())
        elif ctx.needs_input_grad[2]:
            grad_values = table_grad(values, slots, w, g)
        return None, grad_a, grad_values, None, None, None


@torch.compiler.disable  # see product_key_topk: runs eagerly under torch.compile (one graph break)
def value_lookup(
    slots: Tensor, weights: Tensor, values: Tensor, sink: LookupSink | None = None, key: str = ""
) -> Tensor:
    """sum_j weights[t, j] * values[slots[t, j]], (N, d); with a sink the values get no ``.grad``: their reads and
    output gradient go to ``sink.add_lookups``."""
    return _ValueRead.apply(slots, weights, values, sink, key, False)


@torch.compiler.disable  # as value_lookup
def value_dot(
    slots: Tensor, x: Tensor, values: Tensor, sink: LookupSink | None = None, key: str = ""
) -> Tensor:
    """values[slots[t, j]] . x[t], (N, m), for slots (N, m) and x (N, d); the table's gradient as in value_lookup."""
    return _ValueRead.apply(slots, x, values, sink, key, True)


def slot_stats(weights: Tensor) -> tuple[Tensor, Tensor]:
    """Usage (fraction of slots read) and KL(p || uniform) = log S + sum_i p_i log p_i of p = weights / sum
    (Lample et al. Sec. 4.5)."""
    w = weights.double()
    usage = (w > 0).double().mean()
    total = w.sum()
    if total <= 0:
        return usage, torch.zeros((), dtype=torch.float64)
    p = w / total
    kl = math.log(w.numel()) + torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p)).sum()
    return usage, kl
