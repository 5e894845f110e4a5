"""PKM values under DDP: bytes each rank sends per step with the touched-row exchange against the dense all-reduce.

    python benchmarks/pkm_parallel.py                          # 16k and 1M slots, d=64, 2 x 64 tokens per rank
    python benchmarks/pkm_parallel.py --n 32 64 --repeat 1      # a quick smoke run

Two processes (torch.multiprocessing, gloo, CPU) wrap one memory layer (with its plugin's value table) in
torch's DistributedDataParallel and train it for a few steps, each rank on its own tokens:

- dense (pkm.sparse: false, the old path): the values get a dense (slots, d) gradient that DDP all-reduces
  with the other parameters;
- rows (pkm.sparse: auto under DDP): DDP reduces the other parameters only; the plugin's row-wise Adam
  all-gathers each rank's touched rows and row gradients (plugins/_pkm_rows.py exchange_rows).

DDP bytes are the sizes of the gradient buckets DDP hands its communication hook (counted by a hook that then
runs the default all-reduce; a ring all-reduce sends 2 (W-1)/W of them per rank, = 1x for W=2); row bytes are
what the rank passes to the all-gathers. The row exchange scales with the rows a step touches (at most
heads x topk x tokens, fewer on a small table where they repeat), the dense path with the table. Times are
the median wall-clock step of rank 0 on a shared 2-core CPU with gloo: indicative only.

Measured 2026-11-22 (defaults; gloo, 2 processes on a shared 2-core CPU): bytes sent per step by rank 0,
16,384 slots: dense 4.59 MB (all DDP buckets), rows 2.99 MB (0.40 MB DDP + 2.59 MB rows, 9,829 rows touched);
1,048,576 slots: dense 270.7 MB, rows 6.49 MB (2.23 MB DDP, the sub-keys, + 4.26 MB rows, 16,146 rows
touched); at most 2 x 64 x 4 x 32 = 16,384 rows per rank whatever the table size. Step 513 ms dense vs
58 ms rows at 1M slots.
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
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

from rlm.model import ModelConfig  # noqa: E402
from rlm.plugin import Context  # noqa: E402
from rlm.plugins.pkm import PKMConfig, PKMPlugin  # noqa: E402
from rlm.train.parallel import spawn_local


class _Net(nn.Module):
    """The memory layer and the plugin that owns its value table, as one module for DDP."""

    def __init__(self, a: argparse.Namespace, n: int, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        mc = ModelConfig(vocab_size=256, d_model=a.d, n_layers=2, n_heads=4)
        c = PKMConfig(layers=[0], n_keys=n, heads=a.heads, topk=a.topk, k_dim=a.k_dim, sparse="auto")
        self.plugin = PKMPlugin(c, mc)
        self.layer = self.plugin.build(self.plugin.claims()[0], 0, None)
        self.plugin.resolve_sparse(distributed=True, row_exchange=sparse)

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        return self.layer(x, ctx)


def _count_hook(state: list, bucket):  # a DDP communication hook
    state[0] += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(None, bucket)


def _worker(rank: int, port: int, a: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(a.batch, a.seq, a.d, generator=g)
        ctx = Context(tokens=torch.zeros(a.batch, a.seq, dtype=torch.long))
        for n in a.n:
            for kind in ("dense", "rows"):
                net = _Net(a, n, sparse=kind == "rows")
                ddp = DistributedDataParallel(net)
                ddp_bytes = [0]
                ddp.register_comm_hook(ddp_bytes, _count_hook)
                times, rows = [], 0
                for i in range(a.repeat + 1):  # the first step warms up
                    ddp_bytes[0] = 0
                    dist.barrier()
                    t0 = time.perf_counter()
                    ddp(x, ctx).square().mean().backward()
                    if kind == "rows":
                        rows = int(net.plugin.row_optimizer.pending("shared")[0].numel())
                        net.plugin.row_optimizer.step()
                    if i:
                        times.append(time.perf_counter() - t0)
                    net.zero_grad(set_to_none=True)
                if rank == 0:
                    sent = net.plugin.row_optimizer.sent_bytes
                    out[(n, kind)] = (ddp_bytes[0], sent, rows, statistics.median(times))
                del ddp, net
        # both ranks done with every collective before either tears gloo down (a rank that exits while
        # the other still has gloo work in flight aborted the benchmark once: "terminate called ...")
        dist.barrier()
    finally:
        dist.destroy_process_group()


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
    a = p.parse_args(argv)
    got = spawn_local(_worker, a)
    print(
        f"PKM layer under DDP, 2 gloo processes on CPU (a shared machine), d={a.d}, {a.heads} heads x top-"
        f"{a.topk}, {a.batch}x{a.seq} tokens per rank, {a.threads} thread(s) per process; bytes sent by rank 0"
    )
    rows = []
    for n in a.n:
        for kind in ("dense", "rows"):
            ddp_bytes, row_bytes, touched, seconds = got[(n, kind)]
            rows.append(
                [f"{n * n:,} slots, {kind}", f"{ddp_bytes:,}", f"{row_bytes:,}" if kind == "rows" else "-",
                 f"{touched:,}" if kind == "rows" else "-", f"{ddp_bytes + row_bytes:,}", seconds * 1e3]
            )  # fmt: skip
    headers = ["values", "DDP buckets", "row exchange", "rows touched", "total bytes", "step ms (wall)"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
