"""Expert parallelism for the routed experts (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021).

The P processes form P/W expert groups of W consecutive ranks (``moe.expert_group_size``; by default the
processes of one node, so the exchange stays on the node's links). In a group each rank keeps N/W of a layer's
N experts (group rank r: experts r*N/W .. (r+1)*N/W - 1) and tokens travel to their experts' rank and back
with two ``all_to_all_single`` calls (dispatch, combine) whose backward is the same exchange in reverse, so an
expert's gradient collects every group rank's tokens; the groups' copies of an expert are kept equal by an
all-reduce of their gradients over the replica group before each optimizer step (:func:`sync_replicas`).

Capacity is decided for the group's batch, exactly as one process would decide it: the routing (k expert ids
per token, padding as id N; one byte each below 256 experts) is all-gathered first and every rank runs the same
:func:`~rlm.plugins._experts.plan` over the ranks' sequences side by side (:func:`route_group`, vectorised: no
loop over positions or ranks). So with capacity or dropless, outputs and gradients equal the one-process layer
on the group's batch (with one group: the global batch); only the activations of kept assignments are
exchanged, in the experts' compute dtype (autocast's bf16 under bf16-mixed). Every rank knows the whole plan,
so the all_to_all split sizes come from one host read of a W x W matrix, with no exchange of counts.
rlm/train/SCALE.md has the costs at cluster scale.

Data-parallel conventions (Lightning DDP): the other parameters' gradients are averaged over the P ranks, so
each rank's local expert gradient, a sum over its group's losses, is scaled by 1/P by a hook and summed over
the groups; the expert parameters are registered for DDP to ignore (no all-reduce, no broadcast from rank 0;
checked once DDP has wrapped the module, :func:`check_ddp_ignores`); gradient-norm clipping uses the global
norm (the local norms differ between ranks, and different clip factors would split the replicas).
Checkpoints hold the full (N, ...) expert tensors and their optimizer moments, gathered from rank 0's group
to rank 0's host memory on save (one tensor at a time); loading slices this rank's experts, so a checkpoint
resumes under any W that divides N, or on one process.

On one process (torch.distributed not initialised or world 1) nothing here runs: the layer is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from torch import Tensor, nn

from rlm.plugins._experts import Experts, Plan, plan


def default_group() -> tuple[Any, int, int] | None:
    """(group, rank, world) of torch.distributed's default group, or None on one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.group.WORLD, dist.get_rank(), dist.get_world_size()


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; backward sends the gradients back along the reversed splits."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def all_to_all(x: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
    """Rows x[sum(send[:j]) : sum(send[:j+1])] go to rank j; returns the sum(recv) rows received, by source rank."""
    return _AllToAll.apply(x, send, recv, group)


def gather_sizes(n: int, group: Any, device: torch.device) -> list[int]:
    """Every rank's n as host ints: one small all_gather and one device-to-host read (a sync)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([n], dtype=torch.int64, device=device)  # NCCL: on the device
    counts = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(counts, mine, group=group)
    return torch.cat(counts).tolist()


def all_gather_rows(t: Tensor, group: Any) -> list[Tensor]:
    """Every rank's t (n_r, ...) with n_r varying by rank (counts first, then padded rows); no gradient."""
    world = dist.get_world_size(group)
    counts = gather_sizes(t.shape[0], group, t.device)
    pad = t.new_zeros(max(counts), *t.shape[1:])
    pad[: t.shape[0]] = t
    parts = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(parts, pad.contiguous(), group=group)
    return [p[:c] for p, c in zip(parts, counts)]


@dataclass
class GroupRoute:
    """One rank's share of the plan made for the whole expert group's batch (:func:`route_group`)."""

    plan: Plan
    """The plan of the group's batch, its rows position-major over every rank's sequences (global token ids)."""
    local: Plan
    """The assignments to this rank's experts, in plan order, with expert ids local to the rank."""
    token: Tensor
    """(A_r,) this rank's row of each of its kept assignments, in send order (grouped by destination rank)."""
    choice: Tensor
    """(A_r,) which of its token's k choices each sent assignment is."""
    perm: Tensor
    """(A_e,) arrival i (grouped by source rank, each group in plan order) is ``local``'s row perm[i]."""
    send: list[int]
    """Assignments this rank sends to each rank."""
    recv: list[int]
    """Assignments this rank receives from each rank."""


def route_group(
    routed: Tensor, sizes: list[int], seq_len: int, rank: int, n_local: int, capacity: int | None
) -> GroupRoute:
    """Plan the group's batch and this rank's part in it, with no loop over positions or ranks.

    ``routed`` (W, S_max, k) holds every rank's expert ids (the expert count N = n_local * W for padding), rows
    padded past ``sizes[r]``. Rank r's S_r = seq_len * B_r rows are position-major, and the group's batch is
    the ranks' sequences side by side, position-major too: global row t * sum(B) + (B_0 + ... + B_{r-1}) + b
    is rank r's row t * B_r + b. So queue places, and drops, are those of one process on that batch.
    """
    W, S_max, k = routed.shape
    n, device = n_local * W, routed.device
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
    dst = torch.div(p.expert, n_local, rounding_mode="floor")  # (A,) rank owning its expert
    # Split sizes need host ints: the W x W matrix of assignments from rank to rank, read once. Every rank
    # plans the whole group's batch, so it knows what it sends and receives without another exchange.
    counts = torch.bincount(src * W + dst, minlength=W * W).tolist()  # the one host read
    send = counts[rank * W : (rank + 1) * W]
    recv = counts[rank::W]
    # The plan is sorted by expert, hence by destination: this rank's experts own one contiguous range of it.
    first = sum(counts[r * W + d] for r in range(W) for d in range(rank))
    here = slice(first, first + sum(recv))
    # This rank's own assignments, kept in plan order (so grouped by destination) by a stable sort on a 0/1 key
    # (no boolean indexing: that would read the count back to the host once more).
    mine = torch.argsort((src != rank).to(torch.uint8), stable=True)[: sum(send)]  # (A_r,)
    local = Plan(
        assignment=p.assignment[here],
        token=p.token[here],
        expert=p.expert[here] - rank * n_local,
        position=p.position[here],
        counts=p.counts[rank * n_local : (rank + 1) * n_local],
        dropped=p.dropped,
    )
    perm = torch.argsort(src[here], stable=True)  # arrival i is plan row here[perm[i]]
    # plan flattens token-major: assignment = token * k + choice
    return GroupRoute(p, local, row[p.token[mine]], p.assignment[mine] % k, perm, send, recv)


def _id_dtype(n: int) -> torch.dtype:
    """The narrowest dtype both NCCL and gloo gather that holds expert ids 0..n (n: padding)."""
    return torch.uint8 if n < 256 else torch.int32


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
) -> tuple[Tensor, Plan]:
    """:func:`~rlm.plugins._experts.dispatch` with this rank's N/W experts: x (S, d), index/weight (S, k).

    Each rank's S = seq_len * B_r rows are position-major (all its sequences' token 0, then token 1, ...), as
    MoELayer orders them; the group's batch is the ranks' sequences side by side, planned position-major too, so
    queue places (and drops) equal the 1-process layer's on that batch. ``capacity(tokens)`` gives the
    per-expert capacity for the group's token count. Returns y (S, d) and the group's plan (its ``dropped`` is
    the group's fraction).

    Host syncs per call: two reads (every rank's row count, for the gather's padding and the capacity; the
    split matrix) and the plan's compaction of kept assignments, as in :func:`dispatch`; none in backward.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    S, k = index.shape
    n_local = experts.up.shape[0]
    n = n_local * world
    if S % seq_len:
        raise ValueError(
            f"parallel_dispatch: {S} rows are not a whole number of positions of seq_len={seq_len}"
        )
    # 1. Every rank plans the group's batch: k expert ids per token (padding as expert n), all-gathered.
    sizes = gather_sizes(S, group, index.device)  # host read 1
    ids = torch.where(valid.reshape(-1, 1), index, n).to(_id_dtype(n))  # (S, k)
    pad = ids.new_full((max(sizes), k), n)
    pad[:S] = ids
    parts = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(parts, pad, group=group)
    cap = capacity(sum(sizes))
    r = route_group(torch.stack(parts), sizes, seq_len, rank, n_local, cap)  # host read 2
    # 2. Dispatch in the dtype the experts compute in (autocast's), not the residual stream's float32.
    sent = x.index_select(0, r.token)  # (A_r, d)
    if torch.is_autocast_enabled(x.device.type):
        sent = sent.to(torch.get_autocast_dtype(x.device.type))
    arrived = all_to_all(sent, r.send, r.recv, group)  # (A_e, d) grouped by source rank
    inverse = torch.empty_like(r.perm)
    inverse[r.perm] = torch.arange(r.perm.numel(), device=r.perm.device)
    out = experts(arrived.index_select(0, inverse), r.local, cap, mode)  # (A_e, d) plan order
    # 3. Combine: results go back along the reversed splits, then the gate-weighted sum per token.
    back = all_to_all(out.index_select(0, r.perm), r.recv, r.send, group).to(x.dtype)  # (A_r, d)
    gate = weight[r.token, r.choice].to(x.dtype)  # (A_r,)
    y = x.new_zeros(x.shape).index_add(0, r.token, back * gate.unsqueeze(-1))  # (S, d)
    return y, r.plan


def sync_replicas(params: list[nn.Parameter], replicas: Any) -> None:
    """Sum the gradients of ``params`` over ``replicas`` (the ranks holding the same experts in other groups).

    Each group's gradient is its own ranks' share (already scaled by 1/P, see :func:`shard_experts`); the sum
    over the groups is the gradient of the mean loss over all P processes, as DDP gives the other parameters.
    Run once per optimizer step, after gradient accumulation (a sum is not idempotent).
    """
    for p in params:  # one tensor at a time: a flat copy of every expert gradient would double their memory
        if p.grad is not None:
            dist.all_reduce(p.grad, group=replicas)


class _ScaleGrad:
    """A gradient hook multiplying by a constant (picklable, unlike a lambda)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, grad: Tensor) -> Tensor:
        return grad * self.scale


def shard_experts(experts: Experts, rank: int, world: int, processes: int | None = None) -> None:
    """Keep experts rank*N/W .. (rank+1)*N/W - 1 of ``experts`` as its parameters (in place); W = ``world``,
    the expert group's size, and ``rank`` this process's rank in it.

    Gradients get the 1/P of data-parallel averaging over all P ``processes`` (default W), and loading a state
    dict with all N experts takes this rank's slice (checkpoints hold full tensors, see
    :class:`ExpertParallelCallback`).
    """
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
        shard.register_hook(_ScaleGrad(1.0 / (processes or world)))
        setattr(experts, name, shard)
    experts.shard = (rank, world, n)

    def take_slice(module, state_dict, prefix, *args) -> None:
        for name in ("up", "down"):
            t = state_dict.get(prefix + name)
            if t is not None and t.shape[0] == n and n != n_local:
                state_dict[prefix + name] = t[rows]

    experts.register_load_state_dict_pre_hook(take_slice)


def expert_groups(rank: int, world: int, size: int) -> tuple[Any, Any]:
    """(expert group, replica group) of ``rank`` when ``world`` processes form world/size expert groups of
    ``size`` consecutive ranks (a node's, with ranks numbered node by node): each group holds every expert
    once; the replica group joins the ranks holding the same experts (one per expert group), None if one.

    Every rank must call this with the same arguments (``dist.new_group`` is collective over all ranks).
    """
    if size < 1 or world % size:
        raise ValueError(
            f"moe.expert_group_size={size} must divide the {world} processes; accepted: a divisor of {world}"
        )
    groups = [list(range(g * size, (g + 1) * size)) for g in range(world // size)]
    replicas = [list(range(i, world, size)) for i in range(size)]
    made = [dist.group.WORLD if len(ranks) == world else dist.new_group(ranks) for ranks in groups]
    copies = [dist.new_group(ranks) for ranks in replicas] if len(groups) > 1 else [None] * size
    return made[rank // size], copies[rank % size]


def ignore_in_ddp(module: nn.Module, names: Iterable[str]) -> None:
    """Have DDP wrapping ``module`` (and Lightning's state sync outside fit) leave these parameters alone: no
    gradient all-reduce, no broadcast from rank 0.

    torch has no public API for it (pytorch/pytorch#43690). ``DistributedDataParallel``'s static
    ``_set_params_and_buffers_to_ignore_for_model`` is the one its own docstring prescribes: it sets the module
    attribute DDP's constructor and Lightning's ``_sync_module_states`` read, and marks the parameters
    ``_ddp_ignored`` for DDP's other readers (torch.compile's DDP bucketing among them). Names already listed
    there are kept. :func:`check_ddp_ignores` verifies the outcome once DDP has wrapped the module."""
    from torch.nn.parallel import DistributedDataParallel

    listed = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(listed | set(names)))


def check_ddp_ignores(wrapped: nn.Module, names: Iterable[str]) -> None:
    """Raise a RuntimeError unless ``wrapped`` (the strategy's model once fit has set it up), if a DDP wrapper,
    leaves out every one of ``names``: its ``parameters_to_ignore``, which torch 2.6 to 2.13 skip in both the
    reducer's parameters and the broadcast from rank 0."""
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


def _node_size(trainer: pl.Trainer, world: int) -> int:
    """The default expert group: the processes of one node (Lightning's devices per node), else all."""
    per_node = int(getattr(trainer, "num_devices", world) or world)
    return per_node if 0 < per_node <= world and world % per_node == 0 else world


class ExpertParallelCallback(pl.Callback):
    """Shards the experts of ``layers()`` at setup when torch.distributed runs with several processes.

    ``layers`` returns the modules holding an ``experts`` (:class:`Experts`) and an ``expert_group`` attribute,
    which is set to the expert group (the layer then dispatches with :func:`parallel_dispatch`). With P
    processes and an expert group of G (``group_size``; default a node's processes), each of the P/G groups
    holds every expert once, N/G per rank; tokens travel only within their group (NVLink, not the network,
    for a node), capacity is decided per group's batch, and the P/G copies of an expert are kept equal by an
    all-reduce of their gradients over the replica group before each optimizer step.
    """

    def __init__(self, layers: Callable[[], list[nn.Module]], group_size: int | None = None) -> None:
        self.layers = layers
        self.group_size = group_size
        self.params: dict[str, nn.Parameter] = {}  # state-dict name -> expert parameter
        self.world = 1  # processes the experts are sharded over: the expert group's size (1: not sharded)
        self.rank = 0  # this process's rank in its expert group
        self.group: Any = None  # the expert group
        self.replicas: Any = None  # the ranks holding the same experts in the other groups (None: one group)
        self.holds_file = True  # whether this rank's expert group gathers the checkpoint (rank 0's group)
        self.placed = False  # whether setup has sharded the experts (Lightning calls setup once per stage)
        self.clip: float | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        got = default_group()
        if got is not None and not self.placed:
            if not isinstance(trainer.strategy, DDPStrategy):
                raise ValueError(
                    f"moe.expert_parallel runs under the ddp strategy; got {type(trainer.strategy).__name__} "
                    "(use --trainer.strategy ddp, or expert_parallel: false)"
                )
            _, rank, processes = got
            size = self.group_size or _node_size(trainer, processes)
            self.placed = True
            if size > 1:  # 1: every rank holds every expert, which DDP averages as any parameter
                self.group, self.replicas = expert_groups(rank, processes, size)
                self.rank, self.world, self.holds_file = rank % size, size, rank < size
                for layer in self.layers():
                    shard_experts(layer.experts, self.rank, size, processes)
                    layer.expert_group = self.group
        ids = {id(p) for layer in self.layers() for p in (layer.experts.up, layer.experts.down)}
        self.params = {name: p for name, p in pl_module.named_parameters() if id(p) in ids}
        if self.world == 1:
            return
        ignore_in_ddp(pl_module, self.params)  # before the strategy wraps the module (after setup hooks)
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm"):
            # Clipped here with the global norm instead of by Lightning with each rank's own.
            self.clip, trainer.gradient_clip_val = float(trainer.gradient_clip_val), None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the first hook after DDPStrategy.setup has wrapped the module; before any step
        if self.world > 1:
            check_ddp_ignores(trainer.strategy.model, self.params)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self.replicas is not None and self.world > 1:
            sync_replicas(list(self.params.values()), self.replicas)
        if self.clip is None:
            return
        sharded = {id(p) for p in self.params.values()}
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        own = [p.grad for p in params if id(p) in sharded]
        same = [p.grad for p in params if id(p) not in sharded]
        sq = torch.zeros(2, dtype=torch.float64, device=pl_module.device)
        if own:
            sq[0] = torch.stack([g.double().pow(2).sum() for g in own]).sum()
        if same:
            sq[1] = torch.stack([g.double().pow(2).sum() for g in same]).sum()
        sq0 = sq[:1].clone()
        # the experts' squares summed over one expert group (the copies in other groups are equal now); the
        # replicated grads are equal on every rank
        dist.all_reduce(sq0, group=self.group if self.world > 1 else None)
        total = float((sq0[0] + sq[1]).sqrt())
        # torch.nn.utils.clip_grad_norm_'s factor, from the norm over every rank's experts and the shared rest.
        coef = min(1.0, self.clip / (total + 1e-6))
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in params], coef)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Every rank runs this (Lightning dumps the checkpoint on all ranks, rank 0 alone writes it). So the full
        # tensors are gathered to rank 0 only, one tensor at a time and straight to host memory: at OLMoE's size
        # an all-gather of every expert tensor and both Adam moments put 77 GB on every GPU (rlm/train/SCALE.md);
        # this peaks at one full tensor on rank 0's device. The other ranks keep their shards (never written).
        group, world, rank = self.group, self.world, self.rank

        def full(t: Tensor) -> Tensor:
            if world == 1 or not self.holds_file:  # rank 0's expert group alone gathers what rank 0 writes
                return t
            t = t.contiguous()
            parts = [torch.empty_like(t) for _ in range(world)] if rank == 0 else None
            dist.gather(t, parts, dst=0, group=group)
            return torch.cat([part.cpu() for part in parts]) if rank == 0 else t

        state = checkpoint.get("state_dict", {})
        for name in self.params:
            if name in state:
                state[name] = full(state[name])
        located = []
        ids = {id(p): name for name, p in self.params.items()}
        saved_states = checkpoint.get("optimizer_states", [])
        for o, (optimizer, saved) in enumerate(zip(trainer.optimizers, saved_states)):
            index = 0  # torch.optim numbers parameters across groups in order
            for group_ in optimizer.param_groups:
                for p in group_["params"]:
                    if id(p) in ids and index in saved["state"]:
                        # A new dict: torch's optimizer state_dict shares the live per-parameter state.
                        saved["state"][index] = {
                            key: full(t) if torch.is_tensor(t) and t.shape == p.shape else t
                            for key, t in saved["state"][index].items()
                        }
                        located.append([o, index, p.shape[0] * world])
                    index += 1
        checkpoint["expert_parallel"] = {"optimizer_params": located}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # The model's expert tensors are sliced by shard_experts' load hook; here the optimizer moments.
        if self.world == 1:
            return
        rank, world = self.rank, self.world
        for o, index, n in checkpoint.get("expert_parallel", {}).get("optimizer_params", []):
            moments = checkpoint["optimizer_states"][o]["state"].get(index, {})
            rows = slice(rank * n // world, (rank + 1) * n // world)
            for key, t in moments.items():
                if torch.is_tensor(t) and t.dim() > 0 and t.shape[0] == n:
                    moments[key] = t[rows].clone()
