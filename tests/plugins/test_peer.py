"""PKM's PEER values (He 2024) and L2-normalised sub-keys (Berges et al. 2025) against naive references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml
from cli_helpers import CONFIGS, fit_args, fit_in_process
from torch.testing import assert_close

from rlm.model import ModelConfig, Transformer
from rlm.model.memory import estimate
from rlm.plugin import Context, make_config
from rlm.plugins.pkm import PKMConfig, PKMLayer, PKMPlugin

D = 32


def peer_layer(**kw) -> tuple[PKMPlugin, PKMLayer]:
    """A PEER memory at layer 0 of a tiny model (d=32, n=8 -> 64 experts, 2 heads x top-4) in float64."""
    args = dict(layers=[0], n_keys=8, heads=2, topk=4, k_dim=12, sparse=False, values="peer") | kw
    plugin = PKMPlugin(PKMConfig(**args), ModelConfig(vocab_size=50, d_model=D, n_layers=2, n_heads=2))
    layer = plugin.build(plugin.claims()[0], 0, None)
    return plugin.double(), layer.double()


def naive_peer(layer: PKMLayer, u: torch.Tensor, v: torch.Tensor, x: torch.Tensor, act) -> torch.Tensor:
    """Token by token: the query, top-k by brute force over all n^2 product keys, then a loop over the experts."""
    q = layer.query(x).view(len(x), layer.heads, 2, -1)  # (N, H, 2, k_dim/2)
    q = layer.norm(q.flatten(2)).view_as(q) if layer.norm is not None else q
    keys = layer.keys
    if layer.key_norm:
        q, keys = F.normalize(q, dim=-1), F.normalize(keys, dim=-1)
    n = keys.shape[2]
    out = []
    for t in range(len(x)):
        acc = torch.zeros(D, dtype=x.dtype)
        for h in range(layer.heads):
            # every slot s = i*n + j scores q1 . C_i + q2 . C'_j
            scores = torch.stack(
                [q[t, h, 0] @ keys[h, 0, s // n] + q[t, h, 1] @ keys[h, 1, s % n] for s in range(n * n)]
            )
            top, slots = scores.topk(layer.topk)
            for w, s in zip(top.softmax(0), slots):
                acc = acc + w * act(u[s] @ x[t]) * v[s]
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("key_norm", [False, True])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_peer_output_equals_a_loop_over_the_selected_experts(key_norm, activation):
    plugin, layer = peer_layer(key_norm=key_norm, activation=activation)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    y = layer(x, Context(tokens=torch.zeros(2, 5, dtype=torch.long)))
    act = {"gelu": F.gelu, "relu": F.relu}[activation]
    ref = naive_peer(layer, plugin.values["shared_down"], plugin.values["shared"], x.view(10, D), act)
    assert_close(y.view(10, D), ref)


def test_key_norm_scores_are_sums_of_two_cosines():
    _, layer = peer_layer(key_norm=True, values="embedding")
    layer.keys.data.mul_(100.0)  # the keys' scale no longer matters
    x = torch.randn(6, D, dtype=torch.float64)
    _, weights = layer.lookup(x, torch.ones(6, dtype=torch.bool))  # (6, H, k) softmax of the selected scores
    # scores within [-2, 2]: the weights of one head differ by at most e^4
    assert float((weights.amax(-1) / weights.amin(-1)).max().detach()) <= torch.e**4 + 1e-9
    layer.key_norm = False
    _, raw = layer.lookup(x, torch.ones(6, dtype=torch.bool))
    assert float((raw.amax(-1) / raw.amin(-1)).max().detach()) > torch.e**4  # unnormalised, the scale shows


@pytest.mark.parametrize("sparse", [False, True])
def test_peer_gradients_reach_u_v_and_the_sub_keys(sparse):
    plugin, layer = peer_layer(sparse=sparse, key_norm=True)
    plugin.resolve_sparse(distributed=False)
    u, v = plugin.values["shared_down"], plugin.values["shared"]
    x = torch.randn(2, 4, D, dtype=torch.float64, requires_grad=True)
    target = torch.randn(2, 4, D, dtype=torch.float64)
    (layer(x, Context(tokens=torch.zeros(2, 4, dtype=torch.long))) * target).sum().backward()
    if sparse:
        assert u.grad is None and v.grad is None
        got = {}
        for key, table in (("shared_down", u), ("shared", v)):
            rows, g = plugin.row_optimizer.pending(key)
            got[key] = torch.zeros_like(table).index_copy_(0, rows, g)
    else:
        got = {"shared_down": u.grad, "shared": v.grad}
    got_x, got_keys, got_query = x.grad, layer.keys.grad, layer.query.weight.grad
    # Reference: autograd through the naive loop on fresh leaves.
    x2, u2, v2 = (t.detach().clone().requires_grad_(True) for t in (x, u, v))
    layer.keys.grad = layer.query.weight.grad = None
    (naive_peer(layer, u2, v2, x2.view(8, D), F.gelu).view(2, 4, D) * target).sum().backward()
    assert_close(got["shared_down"], u2.grad)
    assert_close(got["shared"], v2.grad)
    assert_close(got_x, x2.grad)
    assert_close(got_keys, layer.keys.grad)
    assert_close(got_query, layer.query.weight.grad)
    assert got_keys.abs().sum() > 0 and 0 < int((u2.grad.abs().sum(1) > 0).sum()) < u.shape[0]


def test_peer_tables_are_row_adam_tables_and_counted_twice():
    plugins = {"pkm": {"layers": [1], "n_keys": 8, "heads": 2, "topk": 4, "k_dim": 12, "values": "peer"}}
    model = Transformer(ModelConfig(vocab_size=50, d_model=D, n_layers=2, n_heads=2), plugins)
    plugin = model.plugins["pkm"]
    assert sorted(plugin.row_optimizer.tables) == ["shared", "shared_down"]
    assert plugin.resolve_sparse(distributed=False) and plugin.param_groups() == []
    base = {"model": {"model": {"vocab_size": 50, "d_model": D, "n_layers": 2, "n_heads": 2}}}
    plain = estimate(
        base | {"model": base["model"] | {"plugins": {"pkm": plugins["pkm"] | {"values": "embedding"}}}}
    )
    peer = estimate(base | {"model": base["model"] | {"plugins": plugins}})
    assert peer["row_adam_params"] == 2 * plain["row_adam_params"] == 2 * 64 * D
    assert (
        peer["params"] - plain["params"]
        == 64 * D
        == sum(p.numel() for p in model.parameters()) - (plain["params"])
    )


def test_peer_is_causal_through_a_transformer():
    torch.manual_seed(0)
    plugins = {"pkm": {"layers": [0, 1], "n_keys": 8, "heads": 2, "topk": 4, "k_dim": 12, "values": "peer",
                       "key_norm": True, "shared_values": False}}  # fmt: skip
    model = Transformer(ModelConfig(vocab_size=50, d_model=D, n_layers=2, n_heads=2), plugins).train()
    tokens = torch.randint(0, 50, (2, 10))
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 50
    with torch.no_grad():
        a, b = model(tokens, Context(tokens=tokens)), model(changed, Context(tokens=changed))
    assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_bad_peer_options_are_clear_errors():
    with pytest.raises(ValueError, match=r"option values must be one of \('embedding', 'peer'\), got 'moe'"):
        make_config(PKMPlugin, {"values": "moe"})
    with pytest.raises(ValueError, match=r"option activation must be one of \('gelu', .* got 'tanh'"):
        make_config(PKMPlugin, {"activation": "tanh"})


def test_two_step_fit_with_peer_values_trains():
    plugins = {"pkm": {"layers": [1], "n_keys": 8, "heads": 2, "topk": 4, "k_dim": 12, "values": "peer",
                       "key_norm": True}}  # fmt: skip
    losses, module = fit_in_process(plugins)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    plugin = module.model.plugins["pkm"]
    for key in ("shared", "shared_down"):  # both tables stepped twice by the row-wise Adam, and finite
        assert int(plugin.row_optimizer.state[key]["step"]) == 2 and plugin.values[key].isfinite().all()


def test_config_fragment_parses_and_builds_peer(rlm_main, tmp_path):
    fragment = CONFIGS / "plugins" / "pkm_peer.yaml"
    done = rlm_main(fit_args(fragment) + ["--print_config"], tmp_path)
    assert done.returncode == 0, done.stderr
    spec = yaml.safe_load(done.stdout)["model"]["plugins"]["pkm"]
    assert spec["values"] == "peer" and spec["key_norm"] is True
    with torch.device("meta"):
        model = Transformer(
            ModelConfig(), {"pkm": yaml.safe_load(fragment.read_text())["model"]["plugins"]["pkm"]}
        )
    assert model.plugins["pkm"].values["shared_down"].shape == model.plugins["pkm"].values["shared"].shape


def test_down_rows_train_below_a_frozen_network():
    """An input without a gradient (the layers below are frozen) still sends the down rows' reads to the row Adam."""
    plugin, layer = peer_layer(sparse=True)
    plugin.resolve_sparse(distributed=False)
    x = torch.randn(2, 4, D, dtype=torch.float64)  # requires no gradient
    layer(x, Context(tokens=torch.zeros(2, 4, dtype=torch.long))).sum().backward()
    assert plugin.row_optimizer.pending("shared_down") is not None
    assert plugin.row_optimizer.pending("shared") is not None
