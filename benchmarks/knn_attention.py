"""Training-step cost of the kNN attention plugin (plugins/knn_attention.py) against the same model without it.

Times forward + backward + AdamW of the default model (d=256, 4 layers, batch 8 x 256, vocab 4096) in a plain loop,
the base model measured in the same run, interleaved round by round, and prints each variant's median step time and
its ratio to the base. Queues (k > 0) are full (memory_tokens states of other documents) before timing starts. The ratio
is what "equal training time" rests on: N plugin steps cost about ratio * N base steps.

    python benchmarks/knn_attention.py                       # the shipped options and the queue variants
    python benchmarks/knn_attention.py --steps 2 --rounds 1  # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

from rlm.model import ModelConfig, Transformer  # noqa: E402
from rlm.plugin import Context  # noqa: E402

VARIANTS: dict[str, dict | None] = {
    "base (no plugin)": None,
    "knn_attention as shipped (own past, k 0)": {},
    "k 16, queue of 4,096": {"k": 16},
    "k 16, queue of 1,024": {"k": 16, "memory_tokens": 1024},
}


def step_fn(cfg: ModelConfig, options: dict | None, batch: int, seq: int):
    torch.manual_seed(0)
    plugins = None if options is None else {"knn_attention": options}
    model = Transformer(cfg, plugins).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    state = {"doc": 0}

    def step() -> None:
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        docs = torch.arange(state["doc"], state["doc"] + batch)
        state["doc"] += batch
        ctx = Context(tokens=tokens[:, :-1], doc_ids=docs, stage="train")
        logits = model(tokens[:, :-1], ctx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, variants interleaved in each")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    a = p.parse_args(argv)
    cfg = ModelConfig(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers, n_heads=4, max_seq_len=a.seq)
    steps = {name: step_fn(cfg, opts, a.batch, a.seq) for name, opts in VARIANTS.items()}
    for fn in steps.values():  # warm up; fills each queue (4096 states = 2 steps of 8 x 256)
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(a.rounds):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            for _ in range(a.steps):
                fn()
            times[name].append((time.perf_counter() - t0) / a.steps)
    base = statistics.median(times["base (no plugin)"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        ratios = [t / b for t, b in zip(ts, times["base (no plugin)"])]
        rows.append(
            [name, med * 1e3, a.batch * a.seq / med, med / base, f"{min(ratios):.2f}-{max(ratios):.2f}"]
        )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {a.batch} x {a.seq}, "
          f"d={a.d_model}, {a.layers} layers, vocab {a.vocab}; {a.rounds} rounds x {a.steps} steps")  # fmt: skip
    print(table(["variant", "ms / step", "tokens / s", "ratio to base", "ratio range (rounds)"], rows))


if __name__ == "__main__":
    main()
