"""Expert parallelism (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021).

P processes form P/W expert groups of W consecutive ranks; group rank r keeps experts r*N/W .. (r+1)*N/W - 1,
and tokens travel to them and back by all_to_all (its backward: the exchange reversed), in chunks so one chunk's
tokens travel while another computes. Every rank plans the all-gathered routing of the group's batch
(:func:`route_group`), so outputs and gradients equal one process's. Expert gradients are scaled by 1/P and kept
out of DDP; the groups' copies are kept equal by an all-reduce over the replica group. Costs: docs/SCALE.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlm.plugins._experts import Experts, Plan, plan


def default_group() -> tuple[Any, int, int] | None:
    """(group, rank, world) of torch.distributed's default group, or None on one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.group.WORLD, dist.get_rank(), dist.get_world_size()


class Exchange:
    """One all_to_all_single in flight between :class:`_Launch` and :class:`_Wait` (forward, then backward)."""

    def __init__(self, send: list[int], recv: list[int], group: Any) -> None:
        self.send, self.recv, self.group = send, recv, group
        self.work: Any = None  # the async work handle while in flight
        # kept alive until the wait: the collective reads and writes them
        self.tensors: tuple[Tensor, ...] = ()

    def start(self, x: Tensor, send: list[int], recv: list[int]) -> Tensor:
        """Start sending x's rows by ``send`` sizes; returns the sum(recv) rows' buffer, valid after finish()."""
        x = x.contiguous()
        out = x.new_empty(sum(recv), *x.shape[1:])
        self.work = dist.all_to_all_single(out, x, recv, send, group=self.group, async_op=True)
        self.tensors = (x, out)
        return out

    def finish(self) -> None:
        """Wait for the exchange in flight (on a GPU: the current stream waits, not the host)."""
        self.work.wait()
        self.work, self.tensors = None, ()


class _Launch(torch.autograd.Function):
    """Starts the exchange (forward) / finishes the reverse exchange of the gradient (backward)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, ex: Exchange) -> Tensor:
        ctx.ex = ex
        return ex.start(x, ex.send, ex.recv)  # not valid before _Wait

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        ex = ctx.ex
        back = ex.tensors[1]
        ex.finish()  # the reverse exchange _Wait.backward started
        return back, None


class _Wait(torch.autograd.Function):
    """Finishes the exchange (forward) / starts the reverse exchange of the gradient (backward)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, ex: Exchange) -> Tensor:
        ctx.ex = ex
        ex.finish()
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        ctx.ex.start(grad, ctx.ex.recv, ctx.ex.send)  # along the reversed splits; _Launch.backward waits
        return grad, None  # unused by _Launch.backward, which returns the exchanged buffer


def launch(x: Tensor, send: list[int], recv: list[int], group: Any) -> tuple[Tensor, Exchange]:
    """Start sending x[sum(send[:j]) : sum(send[:j+1])] to rank j; the received rows (by source rank) are valid
    after ``_Wait.apply``, whose backward starts the reverse exchange that this one's finishes."""
    ex = Exchange(send, recv, group)
    return _Launch.apply(x, ex), ex


@dataclass
class Chunk:
    """One run of this rank's experts (``experts``) and its plan (expert ids from 0), its rows of
    ``GroupRoute.token`` / ``choice`` (``sent``) and of ``perm`` / ``local`` (``arrived``), and the assignments
    to its experts this rank sends to (``send``) and receives from (``recv``) each rank."""

    experts: slice
    plan: Plan
    sent: slice
    arrived: slice
    send: list[int]
    recv: list[int]


@dataclass
class GroupRoute:
    """One rank's share of the plan of the expert group's batch (:func:`route_group`)."""

    plan: Plan
    """The plan of the group's batch, rows position-major over every rank's sequences."""
    local: Plan
    """The assignments to this rank's experts, in plan order, with expert ids local to the rank."""
    token: Tensor
    """(A_r,) this rank's row of each of its kept assignments, in send order (by chunk, then destination rank)."""
    choice: Tensor
    """(A_r,) which of its token's k choices each sent assignment is."""
    perm: Tensor
    """(A_e,) arrival i (by chunk, then source rank, then plan order) is ``local``'s row perm[i]."""
    send: list[int]
    """Assignments this rank sends to, and receives from, each rank."""
    recv: list[int]
    chunks: list[Chunk]


def _sub_plan(p: Plan, rows: slice, experts: slice) -> Plan:
    """The plan's rows ``rows`` (the assignments to a run of ``experts``), expert ids from experts.start."""
    return Plan(
        assignment=p.assignment[rows],
        token=p.token[rows],
        expert=p.expert[rows] - experts.start,
        position=p.position[rows],
        counts=p.counts[experts],
        dropped=p.dropped,
    )


def route_group(
    routed: Tensor,
    sizes: list[int],
    seq_len: int,
    rank: int,
    n_local: int,
    capacity: int | None,
    chunks: int = 1,
) -> GroupRoute:
    """Plan the group's batch and this rank's part in it, with no loop over positions or ranks. ``routed``
    (W, S_max, k): every rank's expert ids (N = n_local * W for padding), padded past ``sizes[r]``. Rank r's
    S_r = seq_len * B_r rows are position-major, and so is the group's batch: global row
    t * sum(B) + (B_0 + ... + B_{r-1}) + b is rank r's row t * B_r + b, so queue places are one process's.
    ``chunks`` divides n_local."""
    W, S_max, k = routed.shape
    n, device = n_local * W, routed.device
    per_chunk = n_local // chunks
    B = torch.tensor(sizes, device=device) // seq_len  # (W,) sequences per rank
    total, per_position = sum(sizes), sum(sizes) // seq_len
    i = torch.arange(total, device=device)
    t, j = i // per_position, i % per_position  # position, and column among the group's sequences
    ends = torch.cumsum(B, 0)
    owner = torch.searchsorted(ends, j, right=True)  # (total,) rank holding each global row
    row = t * B[owner] + j - (ends - B)[owner]  # (total,) its row on that rank
    ids = routed.reshape(W * S_max, k)[owner * S_max + row].long()  # (total, k)
    p = plan(ids, ids[:, 0] < n, n, capacity)
    src = owner[p.token]  # (A,) rank owning each kept assignment's token
    part = torch.div(p.expert, per_chunk, rounding_mode="floor")  # (A,) dst * chunks + chunk, non-decreasing
    chunk = part % chunks  # (A,) its expert's chunk on the destination rank
    # Split sizes need host ints: the W x W x chunks counts from rank to rank's chunk, read once; every rank plans
    # the whole batch, so it knows what it sends and receives without another exchange.
    flat = torch.bincount(src * (W * chunks) + part, minlength=W * W * chunks).tolist()  # the one host read
    counts = [[flat[(s * W + d) * chunks : (s * W + d + 1) * chunks] for d in range(W)] for s in range(W)]
    send = [sum(counts[rank][d]) for d in range(W)]
    recv = [sum(counts[s][rank]) for s in range(W)]
    # Sorted by expert, so by destination and chunk: this rank's experts own one contiguous range, each chunk one.
    first = sum(sum(counts[s][d]) for s in range(W) for d in range(rank))
    here = slice(first, first + sum(recv))
    # This rank's own assignments by chunk, in plan order (so by destination): a stable sort, not a boolean
    # index (that would read the count back to the host).
    key = torch.where(src == rank, chunk, chunks)
    mine = torch.argsort(key, stable=True)[: sum(send)]  # (A_r,)
    local = _sub_plan(p, here, slice(rank * n_local, (rank + 1) * n_local))
    # arrival i (by chunk, then source rank, plan order within) is plan row here[perm[i]]
    perm = torch.argsort(chunk[here] * W + src[here], stable=True)
    parts, sent, arrived = [], 0, 0
    for c in range(chunks):  # host ints and views only
        c_send = [counts[rank][d][c] for d in range(W)]
        c_recv = [counts[s][rank][c] for s in range(W)]
        experts = slice(c * per_chunk, (c + 1) * per_chunk)
        rows = slice(arrived, arrived + sum(c_recv))
        plan_c = _sub_plan(local, rows, experts)
        parts.append(Chunk(experts, plan_c, slice(sent, sent + sum(c_send)), rows, c_send, c_recv))
        sent, arrived = sent + sum(c_send), arrived + sum(c_recv)
    # plan flattens token-major: assignment = token * k + choice
    return GroupRoute(p, local, row[p.token[mine]], p.assignment[mine] % k, perm, send, recv, parts)


def overlap_chunks(n_local: int, wanted: int) -> int:
    """The chunks a rank's n_local experts are exchanged in: the largest divisor of n_local not above ``wanted``."""
    return max(c for c in range(1, min(wanted, n_local) + 1) if n_local % c == 0)


# An eager island under torch.compile, as dispatch is (plugins/_experts.py): the plan's shapes depend on data,
# and the all_to_all split sizes are host ints.
@torch.compiler.disable
def parallel_dispatch(
    x: Tensor,
    index: Tensor,
    weight: Tensor,
    valid: Tensor,
    experts: Experts,
    capacity: Callable[[int], int | None],
    mode: str,
    group: Any,
    seq_len: int = 1,
    chunks: int = 1,
) -> tuple[Tensor, Plan]:
    """``dispatch`` (plugins/_experts.py) with this rank's N/W experts: x (S, d) position-major (S = seq_len * B_r),
    index/weight (S, k); ``capacity(tokens)`` for the group's token count. Returns y (S, d) and the group's plan.
    Chunk c's experts compute while other chunks' tokens and results are in flight; backward mirrors it. Host
    syncs: the ranks' row counts, the split sizes and the plan's compaction; none in backward."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    S, k = index.shape
    n_local = experts.up.shape[0]
    n = n_local * world
    chunks = overlap_chunks(n_local, chunks)
    if S % seq_len:
        raise ValueError(f"parallel_dispatch: {S} rows are not whole positions of seq_len={seq_len}")
    # 1. Every rank plans the group's batch: k expert ids per token (padding as expert n), all-gathered.
    mine = torch.tensor([S], dtype=torch.int64, device=index.device)  # NCCL: on the device
    counts = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(counts, mine, group=group)
    sizes = torch.cat(counts).tolist()  # host read 1
    # the narrowest dtype NCCL and gloo gather that holds ids 0..n
    ids = torch.where(valid.reshape(-1, 1), index, n).to(torch.uint8 if n < 256 else torch.int32)  # (S, k)
    pad = ids.new_full((max(sizes), k), n)
    pad[:S] = ids
    parts = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(parts, pad, group=group)
    cap = capacity(sum(sizes))
    r = route_group(torch.stack(parts), sizes, seq_len, rank, n_local, cap, chunks)  # host read 2
    # 2. Dispatch in the experts' compute dtype (autocast's); every chunk's tokens leave at once, split (not sliced)
    # so that their gradients are joined in one tensor.
    sent = experts.to_compute_dtype(x.index_select(0, r.token))  # (A_r, d) by chunk, then destination
    pieces = sent.split([c.sent.stop - c.sent.start for c in r.chunks])
    flights = [launch(piece, c.send, c.recv, group) for piece, c in zip(pieces, r.chunks)]
    inverse = torch.empty_like(r.perm)
    inverse[r.perm] = torch.arange(r.perm.numel(), device=r.perm.device)  # plan row -> arrival
    if cap is None and len(r.chunks) > 1 and experts.resolve(sent, mode) == "bmm":
        # bmm's buffers, dropless: the largest queue over all the rank's experts, read once (not once per chunk)
        cap = int(r.local.counts.max())
    per_chunk = n_local // len(r.chunks)
    ups, downs = experts.up.split(per_chunk), experts.down.split(per_chunk)
    # 3. Per chunk: its tokens arrive, its experts run, its results leave while the next chunk computes.
    results = []
    for c, (arrived, ex), up, down in zip(r.chunks, flights, ups, downs):
        arrived = _Wait.apply(arrived, ex)  # (A_c, d) by source rank
        rows = inverse[c.arrived] - c.arrived.start  # the chunk's plan rows' arrivals
        out = experts(arrived.index_select(0, rows), c.plan, cap, mode, (up, down))  # (A_c, d) plan order
        results.append(
            launch(out.index_select(0, r.perm[c.arrived] - c.arrived.start), c.recv, c.send, group)
        )
    # 4. Combine: the gate-weighted sum per token, once every chunk's results are back.
    back = torch.cat([_Wait.apply(out, ex) for out, ex in results]).to(x.dtype)  # (A_r, d) send order
    gate = weight[r.token, r.choice].to(x.dtype)  # (A_r,)
    y = x.new_zeros(x.shape).index_add(0, r.token, back * gate.unsqueeze(-1))  # (S, d)
    return y, r.plan


def shard_experts(experts: Experts, rank: int, world: int, processes: int | None = None) -> None:
    """Keep experts rank*N/W .. (rank+1)*N/W - 1 in place (W = ``world``, the expert group's size); gradients get
    the 1/P of averaging over P ``processes`` (default W); a state dict of all N experts loads this rank's slice."""
    n = experts.up.shape[0]
    if n % world:
        raise ValueError(
            f"moe.expert_parallel needs num_experts divisible by the number of processes; got num_experts={n} "
            f"on {world} processes"
        )
    n_local = n // world
    rows = slice(rank * n_local, (rank + 1) * n_local)
    for name in ("up", "down"):
        full = getattr(experts, name)
        shard = nn.Parameter(full.detach()[rows].clone(), requires_grad=full.requires_grad)
        shard.register_hook(functools.partial(torch.mul, other=1.0 / (processes or world)))  # picklable
        setattr(experts, name, shard)

    def take_slice(module, state_dict, prefix, *args) -> None:
        for name in ("up", "down"):
            t = state_dict.get(prefix + name)
            if t is not None and t.shape[0] == n and n != n_local:
                state_dict[prefix + name] = t[rows]

    experts.register_load_state_dict_pre_hook(take_slice)


def expert_groups(rank: int, world: int, size: int) -> tuple[Any, Any]:
    """(expert group, replica group) of ``rank``: world/size groups of ``size`` consecutive ranks, and the ranks
    holding the same experts (None: one group). Collective: every rank calls it with the same arguments."""
    if size < 1 or world % size:
        raise ValueError(f"moe.expert_group_size={size} must divide the {world} processes (a divisor of it)")
    groups = [list(range(g * size, (g + 1) * size)) for g in range(world // size)]
    replicas = [list(range(i, world, size)) for i in range(size)]
    made = [dist.group.WORLD if len(ranks) == world else dist.new_group(ranks) for ranks in groups]
    copies = [dist.new_group(ranks) for ranks in replicas] if len(groups) > 1 else [None] * size
    return made[rank // size], copies[rank % size]


def ignore_in_ddp(module: nn.Module, names: Iterable[str]) -> None:
    """Have DDP (and Lightning's state sync) neither all-reduce nor broadcast these parameters: the private API
    DDP's docstring prescribes, its outcome verified by :func:`check_ddp_ignores`."""
    from torch.nn.parallel import DistributedDataParallel

    listed = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(listed | set(names)))


def check_ddp_ignores(wrapped: nn.Module, names: Iterable[str]) -> None:
    """Raise a RuntimeError unless ``wrapped``, if a DDP wrapper, leaves out every one of ``names``."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(wrapped, DistributedDataParallel):
        return
    missing = sorted(set(names) - set(getattr(wrapped, "parameters_to_ignore", ())))
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__}: DistributedDataParallel did not leave out {len(missing)} expert "
            f"shard(s) ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): it would all-reduce them "
            "(and has broadcast rank 0's), as if every rank held the same experts. moe.expert_parallel asks DDP "
            "to ignore them with DistributedDataParallel._set_params_and_buffers_to_ignore_for_model, which "
            "torch 2.6 to 2.13 honour (the wrapper's parameters_to_ignore). Accepted: such a torch, or "
            "moe.expert_parallel: false (every rank holds every expert)"
        )
