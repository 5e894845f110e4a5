"""Training step time of the default model compiled (torch.compile, Inductor) against eager, both in this run.

    python benchmarks/compile.py [--steps 10] [--threads 1] [--clock cpu] [--plugin moe --plugin pkm]

Each row is a plain training loop on the same seeded model and batches: forward, backward, clipping, AdamW,
schedule (as benchmarks/throughput.py). The compiled row reports the first step apart (it compiles) and the
median of the steps after --warmup. ``--clock cpu`` measures the process's CPU time (all its threads), which a
busy shared machine does not inflate; use it with --threads 1. ``--plugin NAME`` stacks
configs/plugins/NAME.yaml on the model (repeatable).

Results: RESULTS.md, "Speed on CPU".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import plugin_specs, table  # noqa: E402

from rlm.model import ModelConfig  # noqa: E402
from rlm.train.module import LMModule, OptimConfig  # noqa: E402


def make_batches(vocab: int, n: int, batch: int, seq: int) -> list[dict[str, torch.Tensor]]:
    """n seeded batches of random tokens with their next-token targets."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append(
            {
                "tokens": tokens[:, :-1],
                "targets": tokens[:, 1:],
                "mask": torch.ones(batch, seq, dtype=torch.bool),
            }
        )
    return out


def run(module: LMModule, batches, warmup: int, clock) -> tuple[float, float, list[float]]:
    """(first step s, median step s after warmup, losses) of a plain training loop."""
    opt_cfg = module.configure_optimizers()
    opt, sched = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    callbacks = module.configure_callbacks()  # plugins' hooks, e.g. PKM's row-wise value optimizer
    times, losses = [], []
    for batch in batches:
        t0 = clock()
        _, loss, _, _ = module._loss(batch, "train")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        for cb in callbacks:
            cb.on_before_optimizer_step(None, module, opt)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(clock() - t0)
        losses.append(float(loss))
    return times[0], statistics.median(times[warmup:]), losses


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed steps after warmup")
    p.add_argument("--warmup", type=int, default=3, help="steps not timed (the first compiles)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--plugin", action="append", default=[], help="configs/plugins/NAME.yaml (repeatable)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall-clock or process CPU time")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    cfg = ModelConfig(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers, n_heads=4, max_seq_len=a.seq)
    specs = plugin_specs(a.plugin)
    batches = make_batches(a.vocab, a.warmup + a.steps, a.batch, a.seq)
    tokens = a.batch * a.seq
    results = {}
    for name, compile in (("eager", False), ("compiled", True)):
        torch.manual_seed(0)
        torch._dynamo.reset()
        module = LMModule(cfg, specs, OptimConfig(warmup_steps=2), compile=compile)
        module.configure_model()  # as the trainer does: compiles each block (rlm/train/compile.py)
        results[name] = run(module, batches, a.warmup, clock)
    eager = results["eager"][1]
    rows = [
        [name, first * 1e3, t * 1e3, tokens / t, eager / t, abs(losses[-1] - results["eager"][2][-1])]
        for name, (first, t, losses) in results.items()
    ]
    print(
        f"model d={a.d_model}, {a.layers} layers, vocab {a.vocab}, batch {a.batch}x{a.seq}, plugins "
        f"{a.plugin or 'none'}; torch {torch.__version__}, {a.threads} thread(s), clock {a.clock}; median of "
        f"{a.steps} steps after {a.warmup} warmup"
    )
    print(
        table(
            ["mode", "first step ms", "step ms", "tokens/s", "speed-up vs eager", "|last loss - eager's|"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
