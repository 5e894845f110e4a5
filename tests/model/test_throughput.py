"""Tokens/s, FLOPs per step and MFU in the training logs, against an analytic count; FLOPs in the summary."""

import pytest
import pytorch_lightning as pl
import torch
from cli_helpers import column, read_metrics
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.utilities.model_summary import ModelSummary
from torch.utils.flop_counter import FlopCounterMode

from rlm.model import ModelConfig
from rlm.train.module import LMModule
from rlm.train.throughput import gpu_peak_flops, matmul_parameters, train_flops_per_token

MODEL = dict(vocab_size=128, d_model=64, n_layers=2, n_heads=2, max_seq_len=64)
B, T = 2, 32


def analytic_params(c: ModelConfig) -> int:
    """Matmul parameters of the base model by hand: per layer qkv, proj, SwiGLU up and down; the tied head."""
    hs = c.d_model // c.n_heads
    per_layer = c.d_model * (c.n_heads + 2 * c.kv_heads) * hs + c.d_model**2 + 3 * c.d_model * c.hidden
    return c.n_layers * per_layer + c.vocab_size * c.d_model


def analytic_flops_per_step(c: ModelConfig, batch: int, seq: int) -> float:
    """6 N tokens + the attention term 12 L T d per token (PaLM, App. B)."""
    tokens = batch * seq
    return 6 * analytic_params(c) * tokens + 12 * c.n_layers * seq * c.d_model * tokens


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, MODEL["vocab_size"], (B, T + 1), generator=g)
        out.append({"tokens": t[:, :-1], "targets": t[:, 1:], "mask": torch.ones(B, T, dtype=torch.bool)})
    return out


@pytest.mark.parametrize(("every", "rows"), [(1, 3), (2, 1)])  # rates over the window between log steps
def test_logged_flops_tokens_and_mfu_match_the_analytic_count(tmp_path, every, rows):
    module = LMModule(model=MODEL, peak_flops=1e12)
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=CSVLogger(tmp_path, name="t"),
        log_every_n_steps=every,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(_batches(3), batch_size=None))
    n_rows = rows
    rows = read_metrics(tmp_path / "t" / "version_0")
    want = analytic_flops_per_step(ModelConfig(**MODEL), B, T)
    flops = column(rows, "train/flops_per_step")
    assert len(flops) == n_rows and all(f == pytest.approx(want, rel=1e-9) for f in flops)
    per_s, tokens_per_s, mfu = (column(rows, f"train/{k}") for k in ("flops_per_s", "tokens_per_s", "mfu"))
    for f, tok, u in zip(per_s, tokens_per_s, mfu):
        assert f == pytest.approx(tok * want / (B * T), rel=1e-5)  # the same step time behind both
        assert u == pytest.approx(f / 1e12, rel=1e-5)


def test_matmul_parameters_and_a_flop_counter_agree_with_the_analytic_count():
    module = LMModule(model=MODEL)
    c = ModelConfig(**MODEL)
    assert matmul_parameters(module.model) == analytic_params(c)
    tokens = torch.randint(0, c.vocab_size, (B, T))
    with FlopCounterMode(display=False) as counter:
        module(tokens).float().sum().backward()
    counted = counter.get_total_flops()
    dense = 6 * analytic_params(c) * B * T
    # torch's counter credits SDPA in full on some backends and not at all on others (CPU, torch 2.13).
    assert counted in (dense, analytic_flops_per_step(c, B, T))
    assert train_flops_per_token(module.model, T) * B * T == analytic_flops_per_step(c, B, T)


def test_untied_embedding_is_a_lookup_not_a_matmul():
    tied = LMModule(model=MODEL).model
    untied = LMModule(model={**MODEL, "tie_embeddings": False}).model
    # The untied model has a second (V, d) table; only the head multiplies.
    assert matmul_parameters(untied) == matmul_parameters(tied)


def test_model_summary_counts_forward_flops():
    module = LMModule(model=MODEL)
    module.setup("fit")  # no trainer: one sequence of max_seq_len
    summary = ModelSummary(module)
    T0 = MODEL["max_seq_len"]
    forward = 2 * analytic_params(ModelConfig(**MODEL)) * T0
    assert summary.total_flops in (forward, forward + 4 * MODEL["n_layers"] * T0 * T0 * MODEL["d_model"])


def test_known_gpu_peaks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert gpu_peak_flops(torch.device("cuda"), torch.bfloat16) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert gpu_peak_flops(torch.device("cuda"), torch.bfloat16) == 989e12
