"""Token-ID tables: the token's own vocabulary id picks a rank-0 vector or a rank-r partial expert."""

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import CONFIGS, column, fit_args, read_metrics, run_rlm
from torch.testing import assert_close

from rlm.model import ModelConfig, Transformer
from rlm.plugin import Context
from rlm.plugins.tokenid import TokenIDConfig, TokenIDPlugin

D, V = 32, 64


def model_config() -> ModelConfig:
    return ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=2)


@pytest.mark.parametrize("rank", [0, 3])
def test_table_matches_naive_reference(rank):
    plugin = TokenIDPlugin(TokenIDConfig(layers=[1], rank=rank, init_std=0.1), model_config())
    table = plugin.build(plugin.claims()[0], 1, None)
    x, tokens = torch.randn(2, 5, D), torch.randint(0, V, (2, 5))
    y = table(x, Context(tokens=tokens))
    e = table.entries
    for b in range(2):
        for t in range(5):
            i = int(tokens[b, t])
            if rank == 0:
                ref = e.b.weight[i]
            else:
                ref = F.relu(e.u.weight[i].view(D, rank).t() @ x[b, t]) @ e.v.weight[i].view(rank, D)
            assert_close(y[b, t], ref, atol=1e-5, rtol=1e-4)


def test_lookup_is_a_gather_touching_only_the_batch_rows():
    plugin = TokenIDPlugin(TokenIDConfig(layers=[0], rank=0, init_std=0.1), model_config())
    table = plugin.build(plugin.claims()[0], 0, None)
    table(torch.randn(1, 3, D), Context(tokens=torch.tensor([[5, 9, 5]]))).sum().backward()
    assert table.entries.b.weight.grad.abs().sum(-1).nonzero().view(-1).tolist() == [5, 9]


@pytest.mark.parametrize("rank", [0, 2])
def test_parameter_counts(rank):
    model = Transformer(model_config(), {"tokenid": {"layers": [0, 1], "rank": rank}})
    plugin = model.plugins["tokenid"]
    assert model.added_parameters() == 2 * plugin.added_parameters() == 2 * V * D * (2 * rank if rank else 1)
    assert plugin.inactive_parameters() == 2 * plugin.added_parameters() * (V - 1) // V


def test_starts_from_the_base_model():
    base = Transformer(model_config())
    model = Transformer(model_config(), {"tokenid": {"layers": [0], "rank": 2}})
    model.load_state_dict(base.state_dict(), strict=False)
    tokens = torch.randint(0, V, (2, 6))
    assert_close(model(tokens), base(tokens))


def test_bad_config():
    with pytest.raises(ValueError, match="rank"):
        TokenIDConfig(rank=-2)


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_fit_with_tokenid_partial_experts_and_moe_stacked(tmp_path, rlm_cache):
    """Three routed plugins at once, fragments listed in an order unlike their build order."""
    (tmp_path / "moe_tiny.yaml").write_text(
        "model:\n  plugins:\n    moe:\n      layers: [1]\n      num_experts: 4\n"
    )
    plugins = CONFIGS / "plugins"
    args = fit_args(
        plugins / "tokenid.yaml",
        plugins / "partial_experts.yaml",
        plugins / "moe.yaml",
        tmp_path / "moe_tiny.yaml",
    )
    run_rlm(args + ["--trainer.max_steps=3"], tmp_path, rlm_cache)
    rows = read_metrics(tmp_path / "runs/test/version_0")
    assert len(column(rows, "train/loss")) == 3
    assert column(rows, "train/aux/moe_balance") and column(rows, "val/loss")
    state = torch.load(tmp_path / "runs/test/ckpt/last.ckpt", map_location="cpu", weights_only=False)
    assert set(state["hyper_parameters"]["plugins"]) == {"tokenid", "partial_experts", "moe"}
