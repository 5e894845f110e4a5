"""`rlm fit` in mixed precision with gradient clipping and the fused AdamW, under every shipped trainer config.

Lightning refuses to clip for an optimizer that unscales inside its step (the fused AdamW), even under bf16, which
has no scaler; LMModule.configure_gradient_clipping clips for it (unscaling first under fp16).
"""

import math
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import CONFIGS, TINY, column, read_metrics, run_rlm
from pytorch_lightning.plugins.precision import MixedPrecision
from torch.testing import assert_close

from rlm.train.module import LMModule

# Per trainer config, the flags that make it run on this CPU. The gpu config's compile is left out: inductor on a
# CPU builds C++ for minutes, and the clipping path does not depend on it.
TRAINERS = {
    "cpu": [],
    "gpu": ["--trainer.accelerator=cpu", "--model.compile=false"],
    "ddp": ["--trainer.accelerator=cpu", "--trainer.devices=2"],
    "fsdp": ["--trainer.accelerator=cpu", "--trainer.devices=2"],
}
STEPS = ["--trainer.max_steps=2", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1"]


# slow: each case is a real `rlm fit` (two gloo processes for ddp and fsdp), the path that broke on the GPU
@pytest.mark.slow
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_fit_in_bf16_mixed_clips_with_the_fused_adamw(trainer, tmp_path, rlm_cache):
    # the trainer config stacked on the tiny setup, with the test's logs and checkpoints (fast.yaml) on top
    args = ["fit"]
    for path in [*TINY[:-1], CONFIGS / "trainer" / f"{trainer}.yaml", TINY[-1]]:
        args += ["--config", path]
    extra = ["--trainer.precision=bf16-mixed", "--trainer.gradient_clip_val=1.0", "--model.optim.fused=true"]
    run_rlm([*args, *TRAINERS[trainer], *STEPS, *extra], tmp_path, rlm_cache)
    losses = column(read_metrics(tmp_path / "runs/test/version_0"), "train/loss")
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


def _clip_and_step(scaler: torch.amp.GradScaler | None) -> list[torch.Tensor]:
    """One AdamW step on fixed weights and gradients (scaled when ``scaler``), clipped by LMModule's hook."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    loss = sum((p * torch.randn_like(p)).sum() for p in params)
    (scaler.scale(loss) if scaler else loss).backward()
    optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
    plugin = (
        MixedPrecision("16-mixed", "cpu", scaler=scaler) if scaler else MixedPrecision("bf16-mixed", "cpu")
    )
    module = SimpleNamespace(trainer=SimpleNamespace(precision_plugin=plugin))
    module.clip_gradients = lambda *a: pytest.fail("Lightning's own clipping refuses the fused AdamW")
    LMModule.configure_gradient_clipping(module, optimizer, 0.5, "norm")
    scaler.step(optimizer) if scaler else optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_the_fused_adamw_clips_as_the_for_loop_adamw(precision):
    """Lightning refuses to clip for the fused AdamW, which unscales fp16 gradients inside its step: the hook
    unscales them first (a step on gradients clipped while scaled by 65536 would reach Adam 65536x too small, below
    its eps), and clips. The step then equals the for-loop AdamW's on unscaled, clipped gradients."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if precision == "16-mixed" else None
    fused = _clip_and_step(scaler)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    sum((p * torch.randn_like(p)).sum() for p in params).backward()
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    torch.optim.AdamW(params, lr=1e-2, foreach=False).step()
    for got, want in zip(fused, params, strict=True):
        assert_close(got, want.detach())
