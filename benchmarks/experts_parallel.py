"""Expert parallelism against replicated experts: bytes each rank sends per training step, and the step time.

    python benchmarks/experts_parallel.py                      # 2 gloo processes, d=256, 8 and 32 experts
    python benchmarks/experts_parallel.py --batch 2 --seq 32 --repeat 2      # a quick smoke run
    python benchmarks/experts_parallel.py --overlap-chunks 1 2 4       # blocking exchange against overlapped

Two processes (torch.multiprocessing, gloo, CPU) each run one MoE layer's forward and backward on their own
batch of --batch x --seq tokens, then exchange what data parallelism needs:

- replicated: every rank holds all N experts; their gradients are all-reduced (as DDP would; a ring
  all-reduce sends 2 (W-1)/W of the gradient bytes per rank);
- expert parallel (moe.expert_parallel): N/W experts per rank; the routing is all-gathered, token rows go to
  their experts' rank and back (all_to_all, forward and backward); the expert gradients are not reduced.
  One row per --overlap-chunks value (moe.overlap_chunks; default 1 and 2): 1 is the blocking exchange, more
  exchange a rank's experts in chunks, asynchronously, one chunk's tokens travelling while another computes.

Bytes are counted from the tensors each rank passes to the collectives (rows kept on the rank itself are not
counted). Times are the median wall-clock step over --repeat runs, rank 0; on a shared 2-core CPU with gloo
they measure little more than the machine's load (use them on GPUs with NCCL for speed). The router, the
other rank's share and everything else are the same in both rows.

Results: RESULTS.md, "Multi-GPU and scale". Chunks (--overlap-chunks) send the same bytes; the time they hide is
NCCL's, on GPUs: gloo on a shared CPU shows none of it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

from rlm.distributed.parallel import spawn_local
from rlm.model import ModelConfig  # noqa: E402
from rlm.plugin import Context  # noqa: E402
from rlm.plugins._expert_parallel import shard_experts  # noqa: E402
from rlm.plugins.moe import MoEConfig, MoELayer  # noqa: E402


class _Counter:
    """Wraps dist.all_to_all_single and dist.all_gather to add up the bytes this rank sends to other ranks."""

    def __init__(self) -> None:
        self.bytes = 0
        self._a2a, self._ag = dist.all_to_all_single, dist.all_gather

    def __enter__(self) -> _Counter:
        def a2a(out, inp, out_splits=None, in_splits=None, group=None, **kw):
            rank = dist.get_rank(group)
            row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
            self.bytes += (inp.shape[0] - (in_splits[rank] if in_splits else 0)) * row
            return self._a2a(out, inp, out_splits, in_splits, group=group, **kw)

        def ag(outs, t, group=None, **kw):
            self.bytes += t.numel() * t.element_size() * (dist.get_world_size(group) - 1)
            return self._ag(outs, t, group=group, **kw)

        dist.all_to_all_single, dist.all_gather = a2a, ag
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single, dist.all_gather = self._a2a, self._ag


def _layer(a: argparse.Namespace, experts: int, chunks: int = 1) -> MoELayer:
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=256, d_model=a.d, n_layers=2, n_heads=4)
    c = MoEConfig(
        layers=[0], num_experts=experts, top_k=a.top_k, capacity_factor=a.capacity_factor,
        overlap_chunks=chunks,
    )  # fmt: skip
    return MoELayer(c, mc, 0)


def _kinds(a: argparse.Namespace) -> list[tuple[str, int]]:
    """The rows of one expert count: (name, overlap_chunks), replicated first (0: no exchange)."""
    return [("replicated", 0)] + [
        (f"expert parallel, {c} chunk{'s' if c > 1 else ''}", c) for c in a.overlap_chunks
    ]


def _step(layer: MoELayer, x: torch.Tensor, ctx: Context, kind: str) -> int:
    """One forward and backward and the experts' data-parallel exchange; the bytes this rank sent."""
    params = [layer.experts.up, layer.experts.down]
    layer.zero_grad(set_to_none=True)
    with _Counter() as count:
        layer(x, ctx).square().mean().backward()
        if kind == "replicated":
            for p in params:  # what DDP does to the replicated experts' gradients
                dist.all_reduce(p.grad)
    sent = count.bytes
    if kind == "replicated":  # ring all-reduce: 2 (W-1)/W of the bytes leave each rank
        sent += sum(p.grad.numel() * p.grad.element_size() for p in params)
    return sent


def _worker(rank: int, port: int, a: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(a.batch, a.seq, a.d, generator=g)
        ctx = Context(tokens=torch.randint(0, 256, (a.batch, a.seq), generator=g))
        for experts in a.experts:
            for kind, chunks in _kinds(a):
                layer = _layer(a, experts, max(chunks, 1))
                if chunks:
                    shard_experts(layer.experts, rank, 2)
                    layer.expert_group = dist.group.WORLD
                _step(layer, x, ctx, kind)  # warm-up
                times, sent = [], 0
                for _ in range(a.repeat):
                    dist.barrier()
                    t0 = time.perf_counter()
                    sent = _step(layer, x, ctx, kind)
                    times.append(time.perf_counter() - t0)
                if rank == 0:
                    out[(experts, kind)] = (sent, statistics.median(times))
        # both ranks done with every collective before either tears gloo down (a rank that exits while
        # the other still has gloo work in flight aborted the benchmark once: "terminate called ...")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="rows per rank")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument(
        "--overlap-chunks", type=int, nargs="+", default=[1, 2],
        help="moe.overlap_chunks of the expert parallel rows (1: blocking exchange)",
    )  # fmt: skip
    a = p.parse_args(argv)
    got = spawn_local(_worker, a)
    hidden = ModelConfig(vocab_size=256, d_model=a.d, n_layers=2, n_heads=4).hidden
    print(
        f"MoE layer, 2 gloo processes on CPU (a shared machine), d={a.d}, experts {hidden} wide (swiglu), "
        f"top-{a.top_k}, capacity factor {a.capacity_factor}, {a.batch}x{a.seq} tokens per rank, "
        f"{a.threads} thread(s) per process"
    )
    rows = []
    for experts in a.experts:
        base_bytes, base_s = got[(experts, "replicated")]
        blocking = got.get((experts, "expert parallel, 1 chunk"), (0, 0.0))[1]  # the time overlap must beat
        for kind, chunks in _kinds(a):
            sent, seconds = got[(experts, kind)]
            vs_blocking = f"{seconds / blocking:.2f}x" if chunks and blocking else ""
            rows.append(
                [f"{experts} experts, {kind}", f"{sent:,}", f"{sent / base_bytes:.3f}", seconds * 1e3,
                 f"{seconds / base_s:.2f}x", vs_blocking]
            )  # fmt: skip
    head = ["layer", "bytes sent per step (rank 0)", "vs replicated", "step ms (wall)", "time", "vs 1 chunk"]
    print(table(head, rows))


if __name__ == "__main__":
    main()
