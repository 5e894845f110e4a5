"""CUDA paths of the core: the model on GPU in float32 and bf16 autocast, and `rlm fit` with the GPU trainer."""

import pytest
import torch
from cli_helpers import CONFIGS, column, fit_args, read_metrics, run_rlm
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


def test_fit_on_gpu_in_bf16(tmp_path, rlm_cache):
    run_rlm(
        fit_args(CONFIGS / "trainer" / "gpu.yaml", CONFIGS / "plugins" / "tokenid.yaml"), tmp_path, rlm_cache
    )
    losses = column(read_metrics(tmp_path / "runs/test/version_0"), "train/loss")
    assert len(losses) == 6 and all(v == v for v in losses)
