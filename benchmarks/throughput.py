"""Training throughput of the default model: tokens/s, model-FLOPs utilisation against a large matmul
measured in the same run, and the Lightning loop against a plain PyTorch loop on the same model and data.

    python benchmarks/throughput.py [--steps 12] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import matmul_gflops, table  # noqa: E402

from rlm.model import ModelConfig  # noqa: E402
from rlm.train.module import LMModule, OptimConfig  # noqa: E402


def model_flops_per_token(cfg: ModelConfig, seq_len: int, n_params_matmul: int) -> float:
    """Training FLOPs per token: 6 N for the matmul weights plus 12 L T d for attention scores (PaLM, App. B)."""
    return 6 * n_params_matmul + 12 * cfg.n_layers * seq_len * cfg.d_model


def matmul_params(module: LMModule) -> int:
    """Parameters used in matmuls: everything but norms and the embedding lookup (the tied head counts once)."""
    m = module.model
    n = sum(p.numel() for p in m.parameters() if p.ndim >= 2)
    if not m.config.tie_embeddings:
        n -= m.embed.main.table.weight.numel()
    return n


def make_batches(cfg: ModelConfig, n: int, batch: int, seq: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        out.append(
            {
                "tokens": tokens[:, :-1],
                "targets": tokens[:, 1:],
                "mask": torch.ones(batch, seq, dtype=torch.bool),
            }
        )
    return out


def plain_loop(module: LMModule, batches, warmup: int) -> float:
    """Seconds per step of a hand-written loop: forward, backward, clip, AdamW step, schedule."""
    opt_cfg = module.configure_optimizers()
    opt, sched = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    times = []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        _, loss, _, _ = module._loss(batch, "train")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


class _StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self.t0)


def lightning_loop(module: LMModule, batches, warmup: int) -> float:
    """Seconds per step under pl.Trainer (same clipping, logging on)."""
    timer = _StepTimer()
    trainer = pl.Trainer(
        max_steps=len(batches),
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        callbacks=[timer],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    times = timer.times[warmup:]
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    a = p.parse_args()
    cfg = ModelConfig(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers, n_heads=4, max_seq_len=a.seq)
    batches = make_batches(cfg, a.steps + a.warmup, a.batch, a.seq)
    tokens = a.batch * a.seq
    rows = []
    for threads in a.threads:
        torch.set_num_threads(threads)
        roof = matmul_gflops()
        torch.manual_seed(0)
        module = LMModule(cfg, None, OptimConfig(warmup_steps=2))
        flops = model_flops_per_token(cfg, a.seq, matmul_params(module)) * tokens
        t_plain = plain_loop(module, batches, a.warmup)
        torch.manual_seed(0)
        t_pl = lightning_loop(LMModule(cfg, None, OptimConfig(warmup_steps=2)), batches, a.warmup)
        for name, t in (("plain PyTorch loop", t_plain), ("Lightning (LMModule + Trainer)", t_pl)):
            achieved = flops / t / 1e9
            rows.append([threads, name, tokens / t, achieved, roof, achieved / roof, t / t_plain])
    print(
        f"default model: d={a.d_model}, {a.layers} layers, vocab {a.vocab}, batch {a.batch}x{a.seq}; "
        f"median of {a.steps} steps after {a.warmup} warmup"
    )
    print(
        table(
            [
                "threads",
                "loop",
                "tokens/s",
                "model GFLOP/s",
                "matmul GFLOP/s",
                "MFU (x roof)",
                "time vs plain",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
