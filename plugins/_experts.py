"""Expert computations of the routed plugins (moe, partial_experts, tokenid).

:func:`dispatch` sorts the assignments by expert once and runs the stacked :class:`Experts` in one grouped GEMM or
one bmm over (N, C, d) capacity buffers: no loop over experts, no per-expert weight slices (each slice's gradient
would be full-size). :class:`PartialEntries`: partial experts V relu(U^T x) or vectors (Baykal et al. 2023).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# (device type, dtype) pairs where the grouped GEMM raised: 'auto' and 'grouped' use bmm there from then on.
_GROUPED_FAILED: set[tuple[str, torch.dtype]] = set()


def grouped_mm_op() -> Callable[..., Tensor] | None:
    """``F.grouped_mm``, else the private ``torch._grouped_mm`` of older torch, else None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@dataclass
class Plan:
    """The kept (token, choice) assignments sorted by expert (row order within one), each (A,): its index s * k + j
    in the (S, k) routing, token, expert and place in the expert's queue; the kept count per expert (N,), and the
    fraction of valid assignments dropped over capacity (0-d)."""

    assignment: Tensor
    token: Tensor
    expert: Tensor
    position: Tensor
    counts: Tensor
    dropped: Tensor


def plan(index: Tensor, valid: Tensor, n: int, capacity: int | None) -> Plan:
    """Group the assignments index (S, k) by expert; padding (valid False) and assignments past capacity drop out.
    Queue places are claimed row by row, a row's k choices together, so row s's places depend on rows <= s only
    (causal when rows are position-major; GShard's first-choices-first order is not)."""
    S, k = index.shape
    expert = index.reshape(-1)  # (A0,) with A0 = S * k, token-major: a = s * k + j
    valid = valid.reshape(-1).repeat_interleave(k)  # (A0,)
    expert = torch.where(valid, expert, n)  # padding goes to a sentinel expert n, never computed
    order = torch.argsort(expert, stable=True)  # (A0,) stable: row order within each expert's queue
    # (N + 1,): bincount would read the largest id back to size its output, a host sync on a GPU
    counts = torch.zeros(n + 1, dtype=torch.long, device=index.device).scatter_add_(
        0, expert, torch.ones_like(expert)
    )
    start = torch.cumsum(counts, 0) - counts
    e_sorted = expert[order]
    position = torch.arange(order.numel(), device=index.device) - start[e_sorted]
    keep = e_sorted < n
    if capacity is not None:
        keep &= position < capacity
    kept = keep.nonzero().squeeze(1)  # the one host sync of the plan: the number of kept assignments
    order, e_sorted, position = order[kept], e_sorted[kept], position[kept]
    counts = counts[:n] if capacity is None else counts[:n].clamp(max=capacity)
    n_valid = valid.sum().clamp(min=1)
    dropped = 1.0 - order.numel() / n_valid.float()
    return Plan(order, order // k, e_sorted, position, counts, dropped)


def _activation(name: str, h: Tensor) -> Tensor:
    if name == "swiglu":
        gate, h = h.chunk(2, dim=-1)
        return F.silu(gate) * h
    return F.gelu(h)


class Experts(nn.Module):
    """N FFN experts with stacked weights: up (N, d, [2]h) and down (N, h, d); activation 'swiglu' or 'gelu'."""

    def __init__(self, n: int, d: int, hidden: int, activation: str, init_std: float, out_std: float) -> None:
        super().__init__()
        self.activation, self.hidden = activation, hidden
        width = 2 * hidden if activation == "swiglu" else hidden
        self.up = nn.Parameter(torch.randn(n, d, width) * init_std)
        self.down = nn.Parameter(torch.randn(n, hidden, d) * out_std)

    def grouped_ok(self, x: Tensor) -> bool:
        """Whether 'auto' takes the grouped GEMM for x: 16-byte aligned rows, and CPU or CUDA bf16 on sm80+."""
        if grouped_mm_op() is None or (x.device.type, x.dtype) in _GROUPED_FAILED:
            return False
        align = 16 // x.element_size()
        if x.shape[-1] % align or self.hidden % align:
            return False
        if x.device.type == "cuda":
            return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
        return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)

    def to_compute_dtype(self, x: Tensor) -> Tensor:
        """x in autocast's matmul dtype, made explicit for the grouped GEMM's choice and kernel."""
        if torch.is_autocast_enabled(x.device.type):
            return x.to(torch.get_autocast_dtype(x.device.type))
        return x

    def resolve(self, x: Tensor, mode: str) -> str:
        """The kernel ``mode`` takes for x in its compute dtype: 'grouped' or 'bmm'."""
        if mode == "auto":
            mode = "grouped" if self.grouped_ok(x) else "bmm"
        return "bmm" if (x.device.type, x.dtype) in _GROUPED_FAILED else mode

    def forward(
        self,
        x: Tensor,
        p: Plan,
        capacity: int | None,
        mode: str,
        weights: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Expert outputs for the planned assignments: x (A, d) sorted by expert -> (A, d). ``weights``: the (up,
        down) of the experts p numbers (an expert parallel chunk; default all); ``capacity`` sizes bmm's buffers."""
        up, down = weights if weights is not None else (self.up, self.down)
        x = self.to_compute_dtype(x)
        mode = self.resolve(x, mode)
        if x.shape[0] == 0:
            return x.new_zeros(x.shape) + 0 * (up.sum() + down.sum())  # keep the weights in the graph
        op = grouped_mm_op() if mode == "grouped" else None
        if op is not None:
            offs = torch.cumsum(p.counts, 0).to(torch.int32)  # (N,) end of each expert's rows
            try:
                h = op(x, up.to(x.dtype), offs=offs)  # (A, [2]h)
                return op(_activation(self.activation, h), down.to(x.dtype), offs=offs)  # (A, d)
            except Exception as err:  # any failure of the kernel (device, dtype, layout, build): bmm
                _GROUPED_FAILED.add((x.device.type, x.dtype))
                warnings.warn(
                    f"moe: grouped GEMM failed on {x.device.type} {x.dtype} ({type(err).__name__}: {err}); "
                    "using bmm there",
                    stacklevel=2,
                )
        # Capacity buffers: slot e*C + position holds the assignment; empty slots compute zeros.
        n, d = up.shape[0], x.shape[-1]
        C = capacity if capacity is not None else int(p.counts.max())  # dropless: the largest queue
        slot = p.expert * C + p.position  # (A,)
        buf = x.new_zeros(n * C, d).index_copy(0, slot, x).view(n, C, d)  # (N, C, d)
        h = _activation(self.activation, torch.bmm(buf, up.to(x.dtype)))  # (N, C, h)
        out = torch.bmm(h, down.to(x.dtype)).view(n * C, d)  # (N*C, d)
        return out.index_select(0, slot)  # (A, d)


# An eager island under torch.compile: the plan's data-dependent shapes would split the graph and recompile.
@torch.compiler.disable
def dispatch(
    x: Tensor, index: Tensor, weight: Tensor, valid: Tensor, experts: Experts, capacity: int | None, mode: str
) -> tuple[Tensor, Plan]:
    """sum_{i in top-k} w_i(x) E_i(x) for x (S, d), index/weight (S, k); dropped and padding tokens get 0."""
    p = plan(index, valid, experts.up.shape[0], capacity)
    out = experts(x.index_select(0, p.token), p, capacity, mode).to(x.dtype)  # (A, d); autocast may give bf16
    gate = weight.reshape(-1).index_select(0, p.assignment).to(x.dtype)  # (A,)
    y = x.new_zeros(x.shape).index_add(0, p.token, out * gate.unsqueeze(-1))  # (S, d)
    return y, p


class PartialEntries(nn.Module):
    """A table of n partial experts: rank 0 a vector b_i (n, d); rank r U_i, V_i of shape d x r (Baykal et al.)."""

    def __init__(self, n: int, d: int, rank: int, init_std: float) -> None:
        super().__init__()
        self.rank, self.d = rank, d
        if rank == 0:
            self.b = nn.Embedding(n, d)
            nn.init.normal_(self.b.weight, 0.0, init_std) if init_std else nn.init.zeros_(self.b.weight)
        else:
            self.u = nn.Embedding(n, d * rank)  # row i is U_i flattened, (d, r)
            self.v = nn.Embedding(n, rank * d)  # row i is V_i^T flattened, (r, d)
            nn.init.normal_(self.u.weight, 0.0, init_std or d**-0.5)
            # V at zero (by default) makes the added entries start at 0: training starts from the base model.
            nn.init.normal_(self.v.weight, 0.0, init_std) if init_std else nn.init.zeros_(self.v.weight)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, x: Tensor, index: Tensor, weight: Tensor | None = None) -> Tensor:
        """sum_j w_j f_{index_j}(x) for x (..., d) and index/weight (..., k) (weight None means 1)."""
        if self.rank == 0:
            f = self.b(index).to(x.dtype)  # (..., k, d)
        else:
            u = self.u(index).unflatten(-1, (self.d, self.rank)).to(x.dtype)  # (..., k, d, r)
            v = self.v(index).unflatten(-1, (self.rank, self.d)).to(x.dtype)  # (..., k, r, d)
            h = F.relu(torch.einsum("...d,...kdr->...kr", x, u))  # (..., k, r)
            f = torch.einsum("...kr,...krd->...kd", h, v)  # (..., k, d)
        if weight is not None:
            f = f * weight.to(x.dtype).unsqueeze(-1)
        return f.sum(dim=-2)  # (..., d)
