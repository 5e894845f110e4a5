"""CUDA paths of the core: the model on GPU in float32 and bf16 autocast, and `rlm fit` with the GPU trainer."""

import json

import pytest
import torch
from cli_helpers import CONFIGS, column, fit_args, read_metrics, run_rlm
from test_host_reads import LAYERS, PINNED
from torch.testing import assert_close

from rlm.model import ModelConfig, Transformer
from rlm.plugin import Context

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_on_gpu_matches_cpu(dtype):
    cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
    model = Transformer(cfg, {"tokenid": {"layers": [1], "rank": 2, "init_std": 0.02}}).eval()
    tokens = torch.randint(0, 128, (2, 32))
    ref = model(tokens, Context(tokens=tokens, stage="val"))
    gpu = model.cuda()
    t = tokens.cuda()
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out = gpu(t, Context(tokens=t, stage="val"))
    tol = {"rtol": 2e-2, "atol": 5e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    assert_close(out.float().cpu(), ref, **tol)


# slow: a real `rlm fit` on the GPU trainer config
@pytest.mark.slow
def test_fit_on_gpu_in_bf16(tmp_path, rlm_cache):
    run_rlm(
        fit_args(CONFIGS / "trainer" / "gpu.yaml", CONFIGS / "plugins" / "tokenid.yaml"), tmp_path, rlm_cache
    )
    losses = column(read_metrics(tmp_path / "runs/test/version_0"), "train/loss")
    assert len(losses) == 6 and all(v == v for v in losses)


def test_the_guard_and_the_token_count_do_not_sync_between_reads():
    # docs/SCALE.md section 11: between the guard's reads (every_n_steps), recording a loss and the gradients'
    # finiteness and counting a batch's target tokens never wait for the GPU (set_sync_debug_mode raises at a sync).
    from types import SimpleNamespace

    import pytorch_lightning as pl

    from rlm.train.guard import NonFiniteError, NonFiniteGuard

    module = pl.LightningModule()
    module.lin = torch.nn.Linear(4, 1)
    module = module.cuda()
    trainer = SimpleNamespace(world_size=1, global_step=0, precision_plugin=SimpleNamespace(), optimizers=[])
    trainer.checkpoint_callbacks, trainer.log_every_n_steps = [], 50
    guard = NonFiniteGuard(every_n_steps=4)
    targets = torch.randint(0, 8, (2, 16), device="cuda")
    targets[:, :5] = -100
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, scale in enumerate([1.0, float("nan"), 1.0]):  # steps 0-2: no read ((step + 1) % 4 != 0)
            trainer.global_step = step
            loss = module.lin(torch.ones(3, 4, device="cuda")).pow(2).mean() * scale
            guard.on_before_backward(trainer, module, loss)
            loss.backward()
            guard.on_before_optimizer_step(trainer, module, None)
            module.lin.zero_grad()
            n_tokens = (targets != -100).sum()  # as LMModule._loss keeps it
            _ = loss.detach().double() * n_tokens
    finally:
        torch.cuda.set_sync_debug_mode("default")
    trainer.global_step = 3
    with pytest.raises(NonFiniteError, match=r"non-finite loss \(nan\) at step 1"):
        guard.on_before_optimizer_step(trainer, module, None)  # the 4th step reads the record


# slow: an in-process `rlm fit` per plugin on the GPU (data, model, index where the plugin has one, 2 steps)
@pytest.mark.slow
@pytest.mark.parametrize("plugin", list(PINNED))
def test_a_training_step_syncs_the_gpu_no_more_than_its_documented_host_reads(
    plugin, tmp_path, rlm_cache, rlm_main
):
    """torch's own sync detector (set_sync_debug_mode) over the second step of `rlm fit` on the GPU trainer config
    (bf16-mixed, fused AdamW with clipping; eager): each plugin synchronises at most its pinned host reads
    (tests/train/test_host_reads.py), the documented few."""
    fragments = [CONFIGS / "trainer" / "gpu.yaml"]
    fragments += [] if plugin == "dense" else [CONFIGS / "plugins" / f"{plugin}.yaml"]
    out = tmp_path / "syncs.json"
    args = [*fit_args(*fragments), "--trainer.max_steps=2", "--model.compile=false",
            "--trainer.callbacks+=host_reads.CudaSyncs", f"--trainer.callbacks.out={out}",
            "--trainer.log_every_n_steps=5"]  # fmt: skip
    if plugin in LAYERS:
        args.append(f"--model.plugins.{plugin}.layers={LAYERS[plugin]}")
    proc = rlm_main(args, tmp_path, rlm_cache)
    assert proc.returncode == 0, proc.stderr
    syncs = json.loads(out.read_text())
    assert syncs["total"] <= PINNED[plugin], syncs["messages"]
