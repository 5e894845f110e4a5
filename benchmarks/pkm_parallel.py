"""PKM values under DDP and FSDP2: the step and the bytes each rank sends with the exchange of reads against the
dense path, at 16k and 1M slots.

    python benchmarks/pkm_parallel.py                          # DDP: 16k and 1M slots, d=64, 2 x 64 tokens per rank
    python benchmarks/pkm_parallel.py --strategy fsdp2          # the FSDP2 table: the same sizes, and the ratio
    python benchmarks/pkm_parallel.py --strategy fsdp2 --repeat 10   # the same, more steps for a steadier median
    python benchmarks/pkm_parallel.py --strategy all --repeat 20   # one process, DDP and FSDP2: the ratios side by side
    python benchmarks/pkm_parallel.py --strategy both --n 16 32 --repeat 1 --batch 1 --seq 16 --k-dim 32  # smoke

Two processes (torch.multiprocessing, gloo, CPU) wrap one memory layer (with its plugin's value table) in
torch's DistributedDataParallel (``--strategy ddp``) and train it for a few steps, each rank on its own tokens:

- dense (pkm.sparse: false, the old path): the values get a dense (slots, d) gradient that DDP all-reduces
  with the other parameters;
- rows (pkm.sparse: auto under DDP): DDP reduces the other parameters only; the plugin's row-wise Adam
  all-gathers each rank's reads of the table (plugins/_pkm_rows.py exchange_lookups: per lookup its row, token
  and weight, per token its output gradient) and updates the rows they touched.

DDP bytes are the sizes of the gradient buckets DDP hands its communication hook (counted by a hook that then
runs the default all-reduce; a ring all-reduce sends 2 (W-1)/W of them per rank, = 1x for W=2); row bytes are
what the rank passes to the all-gathers. The exchange scales with the tokens a step reads for (heads x topk
lookups of 8 bytes and d gradient values each), the dense path with the table; "rows touched" is the number of
distinct rows the rank's reads touch. Times are the median wall-clock step of rank 0 on a shared 2-core CPU
with gloo: indicative only.

``--strategy fsdp2`` shards the same module with FSDP2 (``fully_shard`` on the layer, as on a block, then on the
root, as rlm/distributed/parallel.py does) and runs a whole optimizer step: forward, backward, the row-wise Adam
(rows), and torch's Adam over what has a gradient (fused, as rlm's AdamW is where torch has the kernel):

- dense (pkm.sparse: false, FSDP2's own path for the values): the values are sharded with the rest, their
  dense (slots, d) gradient is reduce-scattered and each rank's Adam updates every row of its (slots / 2, d)
  shard;
- rows (pkm.sparse: auto): the values stay out of fully_shard (``Plugin.replicated_parameters`` as
  ``ignored_params``), whole on each rank, and take the row exchange and row-wise Adam of DDP's rows; so do the
  sub-keys (``Plugin.synced_parameters``), whose gradients are averaged by an all-reduce started in the backward
  (rlm/distributed/replicas.py, as rlm's trainer does); FSDP2 shards and reduces the rest (query, norm).

``--strategy one`` is the reference for both: the same layer and step as FSDP2's (forward, backward, the row-wise
Adam without an exchange, torch's Adam) in rank 0 alone on the same tokens, while rank 1 waits. Its 1M / 16k
ratio is what the layer's own work grows by (the search over 8x the sub-keys, their gradient and Adam, the row
update over a larger table); a parallel path's ratio adds its collectives' share, fixed and table-dependent.

The optimizer step is in the FSDP2 step because the dense path's cost is mostly its Adam over the table (the
DDP rows above leave the main optimizer out). "FSDP-managed" is the unsharded size of the parameters FSDP2
all-gathers and reduce-scatters (each collective moves (W-1)/W of it per rank). The table ends with the step of
the largest table over the smallest, per path (the goal for rows: 1M slots within 1.5x of 16k).

Results: RESULTS.md, "PKM".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

from rlm.distributed.parallel import replicated_parameters, spawn_local, synced_parameters  # noqa: E402
from rlm.distributed.replicas import ReplicaSync  # noqa: E402
from rlm.model import ModelConfig  # noqa: E402
from rlm.plugin import Context  # noqa: E402
from rlm.plugins.pkm import PKMConfig, PKMPlugin  # noqa: E402
from rlm.train.module import fused_adamw  # noqa: E402

KINDS = ("dense", "rows")


class _Net(nn.Module):
    """The memory layer and the plugin that owns its value table, as one module for DDP or FSDP2."""

    def __init__(self, a: argparse.Namespace, n: int, sparse: bool, distributed: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        mc = ModelConfig(vocab_size=256, d_model=a.d, n_layers=2, n_heads=4)
        # distributed: auto, and row_exchange picks the path; one process: rows are the row-wise Adam alone
        # (auto), dense is pkm.sparse: false
        mode = "auto" if distributed or sparse else False
        c = PKMConfig(layers=[0], n_keys=n, heads=a.heads, topk=a.topk, k_dim=a.k_dim, sparse=mode)
        self.plugin = PKMPlugin(c, mc)
        self.layer = self.plugin.build(self.plugin.claims()[0], 0, None)
        self.plugin.resolve_sparse(distributed=distributed, row_exchange=sparse)

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        return self.layer(x, ctx)


def _adam(net: nn.Module) -> torch.optim.Optimizer:
    """torch's Adam over what has a gradient, fused where rlm's trainer fuses its AdamW (OptimConfig.fused); the
    synced parameters (the sub-keys under rows) in a group of their own, as rlm's groups have them."""
    params = [p for p in net.parameters() if p.requires_grad]
    synced = {id(p) for p in synced_parameters(net)}
    groups = [[p for p in params if id(p) not in synced], [p for p in params if id(p) in synced]]
    return torch.optim.Adam([{"params": g} for g in groups if g], lr=1e-3, fused=fused_adamw(None, params))


def _count_hook(state: list, bucket):  # a DDP communication hook
    state[0] += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(None, bucket)


class _Run:
    """One (strategy, table size, kind) set up for stepping: ``step()`` runs and times one training step of rank 0
    (after a barrier); ``first``, ``rows`` and the row optimizer's ``sent_bytes`` describe its traffic."""

    def __init__(self, a: argparse.Namespace, strategy: str, n: int, kind: str) -> None:
        self.kind, self.rows, self.first = kind, 0, 0
        self.alone = strategy == "one"  # rank 0 steps by itself: no barrier
        self.net = net = _Net(a, n, sparse=kind == "rows", distributed=not self.alone)
        self.ddp_bytes: list[int] | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.sync: ReplicaSync | None = None
        if strategy == "ddp":  # forward + backward (+ the row-wise Adam for rows)
            self.model: nn.Module = DistributedDataParallel(net)
            self.ddp_bytes = [0]
            self.model.register_comm_hook(self.ddp_bytes, _count_hook)
        elif self.alone:  # FSDP2's step on one process
            self.model = net
            self.optimizer = _adam(net)
        else:  # FSDP2: forward + backward + row-wise Adam (rows) + Adam over the parameters with a gradient
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            # rows: the value table (row exchange) and the sub-keys (all-reduced); dense: nothing
            synced = synced_parameters(net)
            ignored = replicated_parameters(net) | set(synced)
            keyword = {"ignored_params": ignored} if ignored else {}  # torch >= 2.7
            fully_shard(net.layer, mesh=mesh, **keyword)
            fully_shard(net, mesh=mesh, **keyword)
            # the sub-keys' gradients averaged over the ranks, started in the backward (rlm's SyncedGradients)
            if synced:
                self.sync = ReplicaSync(synced, dist.group.WORLD, 1.0 / dist.get_world_size())
            self.first = sum(p.numel() * p.element_size() for p in net.parameters() if p not in ignored)
            self.model = net
            self.optimizer = _adam(net)

    def step(self, x: torch.Tensor, ctx: Context, count_rows: bool = False) -> float:
        """One step; its wall-clock seconds. ``count_rows``: also count the distinct rows read (not timed)."""
        if self.ddp_bytes is not None:
            self.ddp_bytes[0] = 0
        if not self.alone:
            dist.barrier()
        t0 = time.perf_counter()
        if self.sync is not None:
            self.sync.armed = True
        self.model(x, ctx).square().mean().backward()
        if self.sync is not None:
            self.sync.finish()
        if self.kind == "rows":
            if count_rows:  # sorts the reads: left out of the time
                pause = time.perf_counter()
                self.rows = int(self.net.plugin.row_optimizer.pending("shared")[0].numel())
                t0 += time.perf_counter() - pause
            self.net.plugin.row_optimizer.step()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.net.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        if self.ddp_bytes is not None:
            self.first = self.ddp_bytes[0]
        return seconds


def _worker(rank: int, port: int, a: argparse.Namespace, out: dict) -> None:
    import warnings

    # the layer (a unit here, inside a block in the model) returns a view; nothing here writes into it in place
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(a.batch, a.seq, a.d, generator=g)
        ctx = Context(tokens=torch.zeros(a.batch, a.seq, dtype=torch.long))
        for strategy in _strategies(a):
            if strategy == "one" and rank:
                continue  # rank 0 runs it alone; this rank waits at the barrier below
            for kind in a.kinds:
                # Every table size of a kind is built first and their steps interleave (the order reversed every
                # other round), so a change in the shared machine's load falls on each size alike.
                runs = {n: _Run(a, strategy, n, kind) for n in a.n}
                times: dict[int, list[float]] = {n: [] for n in a.n}
                for i in range(a.repeat + 1):  # the first round warms up (and allocates Adam's moments)
                    for n in a.n if i % 2 else a.n[::-1]:
                        seconds = runs[n].step(x, ctx, count_rows=i == 0)
                        if i:
                            times[n].append(seconds)
                if rank == 0:
                    for n, run in runs.items():
                        sent = run.net.plugin.row_optimizer.sent_bytes
                        out[(strategy, n, kind)] = (run.first, sent, run.rows, statistics.median(times[n]))
                del runs
        # both ranks done with every collective before either tears gloo down (a rank that exits while
        # the other still has gloo work in flight aborted the benchmark once: "terminate called ...")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _strategies(a: argparse.Namespace) -> list[str]:
    return {"both": ["ddp", "fsdp2"], "all": ["one", "ddp", "fsdp2"]}.get(a.strategy, [a.strategy])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[128, 1024], help="sub-keys per half: n^2 slots")
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--k-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="rows per rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        default=list(KINDS),
        help="value paths to run (rows alone: quicker A/B)",
    )
    p.add_argument(
        "--strategy",
        choices=("ddp", "fsdp2", "both", "one", "all"),
        default="ddp",
        help="ddp: DistributedDataParallel (the default); fsdp2: fully_shard, with an optimizer step; both: the two; "
        "one: FSDP2's step on one process (the reference); all: one, ddp and fsdp2",
    )
    a = p.parse_args(argv)
    got = spawn_local(_worker, a)
    for strategy in _strategies(a):
        if strategy == "one":
            print(
                f"PKM layer on one process (rank 0 alone; FSDP2's step), d={a.d}, {a.heads} heads x top-{a.topk}, "
                f"{a.batch}x{a.seq} tokens, {a.threads} thread(s)"
            )
            rows = [
                [f"{n * n:,} slots, {kind}", got[("one", n, kind)][3] * 1e3] for n in a.n for kind in a.kinds
            ]
            print(table(["values", "step ms (wall)"], rows))
            print(f"ONE step at {_ratios(a, got, strategy)}\n")
            continue
        print(
            f"PKM layer under {strategy.upper()}, 2 gloo processes on CPU (a shared machine), d={a.d}, {a.heads} "
            f"heads x top-{a.topk}, {a.batch}x{a.seq} tokens per rank, {a.threads} thread(s) per process; bytes "
            "sent by rank 0"
        )
        rows = []
        for n in a.n:
            for kind in a.kinds:
                first, row_bytes, touched, seconds = got[(strategy, n, kind)]
                rows.append(
                    [f"{n * n:,} slots, {kind}", f"{first:,}", f"{row_bytes:,}" if kind == "rows" else "-",
                     f"{touched:,}" if kind == "rows" else "-",
                     f"{first + row_bytes:,}" if strategy == "ddp" else "-", seconds * 1e3]
                )  # fmt: skip
        first = "DDP buckets" if strategy == "ddp" else "FSDP-managed"
        headers = ["values", first, "row exchange", "rows touched", "total bytes", "step ms (wall)"]
        print(table(headers, rows))
        print(f"{strategy.upper()} step at {_ratios(a, got, strategy)}\n")


def _ratios(a: argparse.Namespace, got: dict, strategy: str) -> str:
    """'<large> slots over <small>: dense <r>x, rows <r>x' for ``strategy``."""
    small, large = min(a.n), max(a.n)
    ratios = ", ".join(
        f"{kind} {got[(strategy, large, kind)][3] / got[(strategy, small, kind)][3]:.2f}x" for kind in a.kinds
    )
    return f"{large * large:,} slots over {small * small:,}: {ratios}"


if __name__ == "__main__":
    main()
