"""``--model.compile true``: the model compiled in place with torch.compile, every plugin trainable under it."""

import pytest
import pytorch_lightning as pl
import torch
import yaml
from cli_helpers import fit_args, run_rlm
from torch.testing import assert_close

from rlm.train.module import LMModule

MODEL = dict(vocab_size=128, d_model=64, n_layers=2, n_heads=2, max_seq_len=64)
PLUGINS = {
    "moe": {"layers": [1], "num_experts": 4},
    "pkm": {"layers": [0], "n_keys": 16, "heads": 2, "topk": 4, "k_dim": 32},
    "altup": {"k": 2},
}


def _batches(n: int, B: int = 2, T: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, MODEL["vocab_size"], (B, T + 1), generator=g)
        out.append({"tokens": t[:, :-1], "targets": t[:, 1:], "mask": torch.ones(B, T, dtype=torch.bool)})
    return out


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _train(compile: bool, steps: int) -> tuple[LMModule, list[float]]:
    torch.manual_seed(0)
    module = LMModule(model=MODEL, plugins=PLUGINS, optim={"warmup_steps": 0}, compile=compile)
    cb = _Losses()
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    trainer.fit(module, torch.utils.data.DataLoader(_batches(steps), batch_size=None))
    return module, cb.losses


def test_compile_is_in_place_and_keeps_parameter_names():
    eager = LMModule(model=MODEL, plugins=PLUGINS)
    compiled = LMModule(model=MODEL, plugins=PLUGINS, compile=True)
    assert compiled.model._compiled_call_impl is not None and eager.model._compiled_call_impl is None
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints load either way
    assert "compile" not in compiled.hparams  # a run-time choice, not part of the model's identity


@pytest.mark.slow
def test_compiled_training_with_moe_pkm_and_altup_matches_eager():
    """Three optimizer steps (PKM's row-wise value updates included) compiled and eager give the same losses."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled, losses = _train(True, 3)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # Inductor compiled the model
    eager, ref = _train(False, 3)
    assert len(losses) == 3 and all(v == v for v in losses)
    assert_close(torch.tensor(losses), torch.tensor(ref), atol=1e-4, rtol=1e-4)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert_close(p, q, atol=1e-4, rtol=1e-3, msg=name)
    values = compiled.model.plugins["pkm"].values
    eager_values = eager.model.plugins["pkm"].values
    for key in values:  # updated sparsely by the row optimizer, outside the main optimizer
        assert_close(values[key], eager_values[key], atol=1e-4, rtol=1e-3)


def test_cli_option_reaches_the_module(tmp_path, rlm_cache):
    """``--model.compile true`` and ``--model.peak_flops`` parse as LMModule options (config printed, not run)."""
    proc = run_rlm(
        [*fit_args(), "--model.compile=true", "--model.peak_flops=1e12", "--print_config"],
        tmp_path,
        rlm_cache,
    )
    config = yaml.safe_load(proc.stdout)
    assert config["model"]["compile"] is True and config["model"]["peak_flops"] == 1e12
