"""Partial experts (Baykal et al.): looked-up V relu(U^T x) (or constant vectors) added to the dense FFN."""

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import CONFIGS, column, fit_args, read_metrics, run_rlm
from torch.testing import assert_close

from rlm.model import ModelConfig, Transformer
from rlm.plugin import Context
from rlm.plugins.partial_experts import PartialExpertsConfig, PartialExpertsLayer, PartialExpertsPlugin

D, V = 32, 64


def model_config() -> ModelConfig:
    return ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=2)


def naive_partial(layer: PartialExpertsLayer, x, tokens, valid) -> torch.Tensor:
    """Reference: loop over tokens and their k choices; f_i = b_i or V_i relu(U_i^T x)."""
    e = layer.entries
    route = layer.lookup(x, tokens, False)
    y = torch.zeros_like(x)
    for s in range(x.shape[0]):
        for j in range(route.index.shape[1]):
            i = int(route.index[s, j])
            if e.rank == 0:
                f = e.b.weight[i]
            else:
                U = e.u.weight[i].view(D, e.rank)
                Vt = e.v.weight[i].view(e.rank, D)
                f = F.relu(U.t() @ x[s]) @ Vt
            y[s] += route.weight[s, j] * f * valid[s]
    return y


@pytest.mark.parametrize(
    "kw",
    [
        dict(lookup="softmax", top_k=2, rank=0),
        dict(lookup="softmax", top_k=1, rank=3),
        dict(lookup="token_id", buckets=V, rank=2),
        dict(lookup="token_id", buckets=16, rank=0),
        dict(lookup="lsh", buckets=16, rank=4),
    ],
    ids=str,
)
def test_partial_experts_match_naive_reference(kw):
    kw = {"buckets": 8, **kw}
    layer = PartialExpertsLayer(PartialExpertsConfig(layers=[0], init_std=0.1, **kw), model_config())
    x, tokens = torch.randn(2, 9, D), torch.randint(0, V, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, -2:] = False
    y = layer(x, Context(tokens=tokens, mask=mask, stage="val"))
    ref = naive_partial(layer, x.view(-1, D), tokens.view(-1), mask.view(-1).float())
    assert_close(y.view(-1, D), ref, atol=1e-5, rtol=1e-4)


def test_dense_ffn_always_runs_and_tables_start_at_zero():
    mc = model_config()
    base = Transformer(mc)
    model = Transformer(mc, {"partial_experts": {"layers": [1], "buckets": 8, "rank": 2}})
    model.load_state_dict(base.state_dict(), strict=False)
    tokens = torch.randint(0, V, (2, 10))
    assert_close(model(tokens), base(tokens))  # V = 0 at init: the added experts output 0
    assert len(model.blocks[1].ffn_add) == 1


@pytest.mark.parametrize("rank", [0, 1, 4])
@pytest.mark.parametrize("lookup", ["softmax", "token_id", "lsh"])
def test_parameter_count(rank, lookup):
    buckets = 16
    plugin = PartialExpertsPlugin(
        PartialExpertsConfig(layers=[0, 1], buckets=buckets, rank=rank, lookup=lookup), model_config()
    )
    layer = plugin.build(plugin.claims()[0], 0, None)
    assert plugin.added_parameters() == layer.entries.num_parameters()
    if rank:
        assert plugin.added_parameters() == 2 * rank * buckets * D  # Baykal et al.: 2 * rank * buckets * d
    else:
        # A constant vector per bucket: buckets * d, half of 2 * max(rank, 1) * buckets * d (see the module doc).
        assert plugin.added_parameters() == buckets * D
    router = sum(p.numel() for p in layer.lookup.parameters())
    assert router == (buckets * D if lookup == "softmax" else 0)
    assert plugin.inactive_parameters() == 2 * plugin.added_parameters() * (buckets - 1) // buckets


def test_gradients_reach_router_and_looked_up_entries_only():
    layer = PartialExpertsLayer(
        PartialExpertsConfig(layers=[0], buckets=V, lookup="token_id", rank=2, init_std=0.1), model_config()
    )
    tokens = torch.tensor([[1, 2, 3, 2]])
    layer(torch.randn(1, 4, D), Context(tokens=tokens)).sum().backward()
    rows = layer.entries.v.weight.grad.abs().sum(-1).nonzero().view(-1).tolist()
    assert rows and set(rows) <= {1, 2, 3}  # a row whose relu(U^T x) is all zero gets no gradient at all
    soft = PartialExpertsLayer(
        PartialExpertsConfig(layers=[0], buckets=8, rank=1, init_std=0.1), model_config()
    )
    soft(torch.randn(1, 4, D), Context(tokens=tokens)).sum().backward()
    assert soft.lookup.weight.grad.abs().sum() > 0


def test_softmax_lookup_adds_its_balance_loss_and_hashes_add_none():
    mc = model_config()
    soft = PartialExpertsLayer(PartialExpertsConfig(buckets=8, balance_coef=0.1, z_coef=0.01), mc, layer=1)
    ctx = Context(tokens=torch.randint(0, V, (2, 5)))
    soft(torch.randn(2, 5, D), ctx)
    assert {k: w for k, (_, w) in ctx.aux_losses.items()} == {"pe_balance": 0.1, "pe_z": 0.01}
    assert "pe_balance/l1" in ctx.metrics
    for lookup in ("token_id", "lsh"):
        ctx = Context(tokens=torch.randint(0, V, (2, 5)))
        PartialExpertsLayer(PartialExpertsConfig(buckets=16, lookup=lookup), mc)(torch.randn(2, 5, D), ctx)
        assert ctx.aux_losses == {}


def test_bad_config():
    with pytest.raises(ValueError, match="rank"):
        PartialExpertsConfig(rank=-1)
    with pytest.raises(ValueError, match="buckets"):
        PartialExpertsConfig(buckets=0)
    with pytest.raises(ValueError, match="not a power"):
        PartialExpertsLayer(PartialExpertsConfig(lookup="lsh", buckets=10), model_config())


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_fit_with_partial_experts(tmp_path, rlm_cache):
    run_rlm(
        fit_args(CONFIGS / "plugins" / "partial_experts.yaml") + ["--trainer.max_steps=3"],
        tmp_path,
        rlm_cache,
    )
    rows = read_metrics(tmp_path / "runs/test/version_0")
    assert len(column(rows, "train/loss")) == 3 and column(rows, "val/loss")
