"""Training FLOPs and model-FLOPs utilisation (MFU) in the logs.

FLOPs of one training token follow PaLM (Chowdhery et al. 2022, App. B): 6 N + 12 L T d, with N the active
parameters a token multiplies with (less norms and the untied input embedding, a lookup), L layers, T the sequence
length, d the width; 12 L T d is attention's QK^T and AV over the full T x T (the causal mask not credited).
"""

from __future__ import annotations

import time
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info

from rlm.model.transformer import Transformer

# Dense (not 2:4-sparse) tensor-core peaks, FLOP/s, from NVIDIA's data sheets; other GPUs: Lightning's table.
DENSE_PEAKS: dict[str, dict[torch.dtype, float]] = {
    "h100 sxm": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "h100 80gb hbm3": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "h100 pcie": {torch.bfloat16: 756e12, torch.float16: 756e12, torch.float32: 51e12},
    "h100 nvl": {torch.bfloat16: 835e12, torch.float16: 835e12, torch.float32: 60e12},
    "h200": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "a100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
}


def matmul_parameters(model: Transformer) -> int:
    """N of 6 N: active parameters less vectors (norms, biases) and the untied token-embedding lookup."""
    n = model.active_parameters() - sum(p.numel() for p in model.parameters() if p.ndim < 2)
    if not model.config.tie_embeddings:
        n -= model.token_embedding.weight.numel()
    return n


def train_flops_per_token(model: Transformer, seq_len: int) -> float:
    """6 N + 12 L T d: training FLOPs of one token in a sequence of seq_len (PaLM, App. B)."""
    c = model.config
    return 6 * matmul_parameters(model) + 12 * c.n_layers * seq_len * c.d_model


def gpu_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The dense peak FLOP/s of a known GPU in dtype, or None."""
    name = torch.cuda.get_device_name(device).lower()
    for chip, peaks in DENSE_PEAKS.items():
        if chip in name.replace("nvidia ", "") and dtype in peaks:
            return peaks[dtype]
    try:
        from lightning_fabric.utilities.throughput import get_available_flops

        peak = get_available_flops(device, dtype)
    except Exception:  # an unknown GPU or a Lightning without the table: no MFU, the rest is still logged
        return None
    return float(peak) if peak else None


def cpu_matmul_flops(n: int = 1024, repeat: int = 3) -> float:
    """The fastest of ``repeat`` fp32 (n x n) @ (n x n) matmuls on this CPU, in FLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up (allocations, thread pool)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _compute_dtype(trainer: pl.Trainer) -> torch.dtype:
    precision = str(trainer.precision)
    return {"bf": torch.bfloat16, "16": torch.float16}.get(precision[:2], torch.float32)


class Throughput(pl.Callback):
    """Logs train/tokens_per_s, flops_per_step, flops_per_s and mfu at the steps the loggers write, over the steps
    since the last write (data loading included, validation not) and the global batch."""

    def __init__(self, peak_flops: float | None = None) -> None:
        self.peak_flops = peak_flops
        self._start: float | None = None  # the window's start
        self._tokens = 0  # global tokens of the window's steps
        self._flops = 0.0
        self._validating: float | None = None  # when the validation inside the window began

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        source = "model.peak_flops"
        if self.peak_flops is None and pl_module.device.type == "cuda":
            self.peak_flops = gpu_peak_flops(pl_module.device, _compute_dtype(trainer))
            source = f"{torch.cuda.get_device_name(pl_module.device)} dense {_compute_dtype(trainer)}"
        elif self.peak_flops is None:
            self.peak_flops, source = cpu_matmul_flops(), "measured fp32 1024^3 matmul"
        if self.peak_flops:
            rank_zero_info(f"MFU against a peak of {self.peak_flops:.3g} FLOP/s per device ({source})")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validating = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # validation's time is left out of the window
        if self._start is not None and self._validating is not None:
            self._start += time.perf_counter() - self._validating
        self._validating = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if self._start is None:
            return
        B, T = batch["tokens"].shape
        tokens = B * T * trainer.world_size
        flops = train_flops_per_token(pl_module.model, T) * tokens
        self._tokens += tokens
        self._flops += flops
        if not trainer._logger_connector.should_update_logs:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        pl_module.log("train/tokens_per_s", self._tokens / elapsed)
        pl_module.log("train/flops_per_step", float(flops))
        pl_module.log("train/flops_per_s", self._flops / elapsed)
        if self.peak_flops:
            pl_module.log("train/mfu", self._flops / elapsed / (self.peak_flops * trainer.world_size))
        self._start, self._tokens, self._flops = now, 0, 0.0
