"""Training step time of AltUp (K=2, K=4) against the base model, measured in the same run.

One step = forward + backward + AdamW step on random tokens. Models are timed in interleaved rounds
(so a noisy neighbour slows them all alike) and the median step time is reported. The paper reports
1.2x-1.4x slower training for K=2; the goal here is at most 1.10x.

    python benchmarks/altup.py                       # default model shape: d=256, 4 layers, seq 256, batch 8
    python benchmarks/altup.py --threads 1 --clock cpu    # on a shared, oversubscribed CPU: CPU time per step
    python benchmarks/altup.py --d 32 --layers 2 --seq 16 --batch 2 --steps 2 --rounds 1   # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rlm.model import ModelConfig, Transformer
from rlm.plugin import Context

VARIANTS: dict[str, dict[str, Any] | None] = {
    "base": None,
    "AltUp K=2": {"k": 2},
    "Recycled-AltUp K=2": {"k": 2, "embedding": "recycled"},
    "AltUp K=4": {"k": 4},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options: model shape, timing effort, device."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=256, help="model width d")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds over the models")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model before timing")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="autocast dtype")
    p.add_argument("--compile", action="store_true", help="torch.compile every model")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time (steadier on a shared CPU, use with --threads 1)",
    )
    return p.parse_args(argv)


def make_step(model: Transformer, args: argparse.Namespace):
    """A closure running one training step on fixed random tokens."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=args.device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    forward = torch.compile(model) if args.compile else model
    autocast = torch.autocast(
        args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"
    )

    def step() -> None:
        with autocast:
            logits = forward(inputs, Context(tokens=inputs))  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def sync(device: str) -> None:
    """Wait for queued device work, so wall-clock time covers it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> list[tuple[str, int, float, float]]:
    """Time every variant and print the markdown table; returns its rows."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    config = ModelConfig(
        vocab_size=args.vocab, d_model=args.d, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq
    )
    torch.manual_seed(0)
    models = {
        name: Transformer(config, {"altup": spec} if spec else None).to(args.device)
        for name, spec in VARIANTS.items()
    }
    steps = {name: make_step(m, args) for name, m in models.items()}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    sync(args.device)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in tqdm(range(args.rounds), desc="rounds", leave=False):
        for name, step in steps.items():
            for _ in range(args.steps):
                t0 = clock()
                step()
                sync(args.device)
                times[name].append(clock() - t0)
    base = statistics.median(times["base"])
    rows = []
    print(
        f"\nTraining step (fwd+bwd+AdamW), d={args.d}, layers={args.layers}, heads={args.heads}, seq={args.seq}, "
        f"batch={args.batch}, vocab={args.vocab}, {args.device}, {args.dtype}"
        f"{', compiled' if args.compile else ''}, {torch.get_num_threads()} threads, {args.clock} clock, "
        f"median of {args.rounds * args.steps} steps\n"
    )
    print("| model | parameters | added | ms / step | ratio to base |")
    print("|---|---:|---:|---:|---:|")
    for name, m in models.items():
        ms = statistics.median(times[name]) * 1e3
        rows.append((name, m.num_parameters(), ms, ms / (base * 1e3)))
        print(
            f"| {name} | {m.num_parameters():,} | {m.added_parameters():,} | {ms:.1f} | {ms / (base * 1e3):.3f} |"
        )
    return rows


if __name__ == "__main__":
    main()
