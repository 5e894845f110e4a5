"""MoE numerics against a naive reference that loops over choices, tokens and experts (Switch / top-k)."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import CONFIGS, DDP_2CPU, column, fit_args, read_metrics, run_rlm
from torch.testing import assert_close

from rlm.model import ModelConfig, Transformer
from rlm.plugin import Context, make_config
from rlm.plugins._lookup import balance_loss, z_loss
from rlm.plugins.moe import MoEConfig, MoELayer, MoEPlugin

D, V = 32, 64


def model_config(ffn: str = "gated") -> ModelConfig:
    return ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=2, ffn=ffn)


def naive_expert(layer: MoELayer, e: int, x: torch.Tensor) -> torch.Tensor:
    """E_e(x) for one token x (d,), from the stacked weights by hand."""
    up, down = layer.experts.up[e], layer.experts.down[e]
    h = x @ up
    if layer.experts.activation == "swiglu":
        gate, h = h.chunk(2)
        h = F.silu(gate) * h
    else:
        h = F.gelu(h)
    return h @ down


def naive_moe(layer: MoELayer, x: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, training: bool):
    """Reference on x (B, T, d): route every token, then fill the expert queues position by position (every
    sequence's token t before any token t + 1), each token's choices in order, up to capacity (training only)."""
    c = layer.config
    B, T, _ = x.shape
    if c.lookup == "softmax":
        probs = (x.float() @ layer.lookup.weight.t()).softmax(-1)  # (B, T, N)
        w, idx = probs.topk(c.top_k, dim=-1)
        if c.renormalize:
            w = w / w.sum(-1, keepdim=True)
    else:
        idx = layer.lookup(x.reshape(B * T, -1), tokens.reshape(-1), False).index.view(B, T, 1)
        w = torch.ones(idx.shape)
    cap = (layer.capacity(B * T) if training else None) or B * T * c.top_k
    load = [0] * c.num_experts
    y = torch.zeros_like(x)
    dropped = 0
    for t in range(T):
        for b in range(B):
            if not valid[b, t]:
                continue
            for j in range(c.top_k):
                e = int(idx[b, t, j])
                if load[e] < cap:
                    load[e] += 1
                    y[b, t] += w[b, t, j] * naive_expert(layer, e, x[b, t])
                else:
                    dropped += 1
    return y, dropped / (int(valid.sum()) * c.top_k)


CASES = [
    dict(top_k=1, capacity_factor=1.25),
    dict(top_k=1, capacity_factor=0.5),  # heavy dropping
    dict(top_k=1, capacity_factor=0.0),  # dropless
    dict(top_k=2, capacity_factor=1.0, renormalize=True),
    dict(top_k=2, capacity_factor=0.0, renormalize=False),
    dict(top_k=1, capacity_factor=1.0, lookup="token_id"),
    dict(top_k=1, capacity_factor=0.0, lookup="lsh"),
]


@pytest.mark.parametrize("stage", ["train", "val"])
@pytest.mark.parametrize("dispatch", ["grouped", "bmm"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_moe_matches_naive_reference(case, dispatch, stage):
    ffn = "plain" if case.get("lookup") == "lsh" else "gated"
    cfg = MoEConfig(layers=[0], num_experts=4, dispatch=dispatch, router_jitter=0.0, **case)
    layer = MoELayer(cfg, model_config(ffn), 0)
    B, T = 2, 12
    x = torch.randn(B, T, D)
    tokens = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, -3:] = False  # padding: takes no capacity, outputs zero
    ctx = Context(tokens=tokens, mask=mask, stage=stage)
    y = layer(x, ctx)
    ref, dropped = naive_moe(layer, x, tokens, mask, stage == "train")
    assert_close(y, ref, atol=1e-5, rtol=1e-4)
    assert_close(ctx.metrics["moe_dropped/l0"], torch.tensor(dropped), atol=1e-6, rtol=0)
    assert (y[1, -3:] == 0).all()
    if cfg.capacity_factor == 0 or stage != "train":
        assert dropped == 0  # dropless, and evaluation never drops


def test_dropped_tokens_pass_by_the_residual():
    cfg = MoEConfig(layers=[1], num_experts=4, capacity_factor=0.25, z_coef=0.0, balance_coef=0.0)
    model = Transformer(model_config(), {"moe": cfg.__dict__})
    layer = model.blocks[1].ffn
    x = torch.randn(1, 16, D)
    y = layer(x, Context(tokens=torch.zeros(1, 16, dtype=torch.long), stage="train"))
    zero_rows = (y[0].abs().sum(-1) == 0).sum().item()
    assert zero_rows >= 16 - 4  # capacity ceil(16/4*0.25) = 1 per expert: at most 4 tokens computed
    # The block adds the FFN output to the residual, so a dropped token leaves the block's FFN step unchanged.


def test_balance_loss_on_hand_made_probabilities():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    valid = torch.tensor([True, True, True, False])  # the last row is padding
    # f = (2/3, 1/3, 0); P = (1.4, 1.3, 0.3) / 3; loss = N * sum f_i P_i = 3 * (2.8 + 1.3) / 9
    got = balance_loss(probs, probs.argmax(-1), valid)
    assert_close(got, torch.tensor(4.1 / 3))
    # Uniform routing and probabilities give exactly 1 (the loss's minimum).
    uniform = torch.full((3, 3), 1 / 3)
    assert_close(balance_loss(uniform, torch.arange(3), torch.ones(3, dtype=torch.bool)), torch.tensor(1.0))


def test_z_loss_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    valid = torch.tensor([True, True, False])
    lse = [math.log(math.exp(1) + math.exp(2) + math.exp(3)), math.log(3.0)]
    assert_close(z_loss(logits, valid), torch.tensor((lse[0] ** 2 + lse[1] ** 2) / 2))


def test_losses_ignore_padding_and_are_named_apart():
    cfg = MoEConfig(layers=[0], num_experts=4, balance_coef=0.1, z_coef=0.01)
    layer = MoELayer(cfg, model_config(), 0)
    x = torch.randn(1, 10, D)
    tokens = torch.randint(0, V, (1, 10))
    full = Context(tokens=tokens[:, :6], stage="val")
    layer(x[:, :6], full)
    mask = torch.arange(10).unsqueeze(0) < 6
    padded = Context(tokens=tokens, mask=mask, stage="val")
    layer(torch.cat([x[:, :6], 100 * torch.randn(1, 4, D)], 1), padded)
    for name, weight in (("moe_balance", 0.1), ("moe_z", 0.01)):
        assert padded.aux_losses[name][1] == weight
        assert_close(padded.aux_losses[name][0], full.aux_losses[name][0])
    assert set(padded.metrics) >= {
        "moe_balance/l0",
        "moe_z/l0",
        "moe_load_max/l0",
        "moe_dropped/l0",
        "moe_load/l0_e3",
    }


def test_zero_coefficients_skip_the_losses_and_hash_lookups_have_none():
    for kw in (dict(balance_coef=0.0, z_coef=0.0), dict(lookup="token_id"), dict(lookup="lsh")):
        layer = MoELayer(MoEConfig(layers=[0], num_experts=4, **kw), model_config(), 0)
        ctx = Context(tokens=torch.randint(0, V, (2, 8)))
        layer(torch.randn(2, 8, D), ctx)
        assert ctx.aux_losses == {}


def test_jitter_only_in_training():
    layer = MoELayer(
        MoEConfig(layers=[0], num_experts=4, router_jitter=0.5, capacity_factor=0), model_config(), 0
    )
    x, tokens = torch.randn(2, 8, D), torch.randint(0, V, (2, 8))
    val1 = layer(x, Context(tokens=tokens, stage="val"))
    val2 = layer(x, Context(tokens=tokens, stage="val"))
    train = layer(x, Context(tokens=tokens, stage="train"))
    assert torch.equal(val1, val2)
    assert not torch.allclose(train, val1)
    layer.lookup.jitter = 0.0
    assert_close(layer(x, Context(tokens=tokens, stage="train")), val1)


def test_gradients_reach_router_and_experts():
    model = Transformer(model_config(), {"moe": {"layers": [1], "num_experts": 4, "top_k": 2}})
    tokens = torch.randint(0, V, (2, 16))
    ctx = Context(tokens=tokens)
    loss = F.cross_entropy(model(tokens, ctx).flatten(0, 1), tokens.flatten()) + ctx.total_aux_loss()
    loss.backward()
    layer = model.blocks[1].ffn
    for p in (layer.lookup.weight, layer.experts.up, layer.experts.down):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert layer.lookup.weight.dtype == torch.float32


def test_parameter_counts_and_active_parameters():
    mc = model_config()
    model = Transformer(mc, {"moe": {"layers": [0, 1], "num_experts": 8, "top_k": 2}})
    plugin = model.plugins["moe"]
    layer = model.blocks[0].ffn
    assert plugin.expert_parameters() == layer.experts.up.numel() + layer.experts.down.numel()
    assert plugin.inactive_parameters() == 2 * plugin.expert_parameters() * 6 // 8
    dense = Transformer(mc)
    per_layer_dense = sum(p.numel() for p in dense.blocks[0].ffn.parameters())
    # Top-2 of 8 experts as wide as the FFN: twice the dense FFN's weights are active per token, plus the router.
    router = 8 * D
    assert model.active_parameters() == dense.num_parameters() + 2 * (per_layer_dense + router)


def test_token_id_routing_is_deterministic():
    mc = model_config()
    a = MoELayer(MoEConfig(layers=[0], num_experts=4, lookup="token_id"), mc, 0)
    b = MoELayer(MoEConfig(layers=[0], num_experts=4, lookup="token_id"), mc, 0)
    tokens = torch.randint(0, V, (3, 7))
    ra = a.lookup(torch.randn(21, D), tokens.view(-1), True).index
    rb = b.lookup(torch.randn(21, D), tokens.view(-1), False).index
    assert torch.equal(ra, rb)
    assert torch.equal(ra.view(-1), a.lookup.table[tokens.view(-1)])


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(num_experts=0), "num_experts"),
        (dict(top_k=3, num_experts=2), "top_k"),
        (dict(capacity_factor=-1.0), "capacity_factor"),
        (dict(lookup="random"), "lookup"),
        (dict(lookup="lsh", top_k=2), "top_k"),
        (dict(renormalize=True), "renormalize"),
        (dict(dispatch="loop"), "dispatch"),
    ],
)
def test_bad_config_is_a_clear_error(kw, words):
    with pytest.raises(ValueError, match=words):
        make_config(MoEPlugin, kw)


def test_layer_list_is_checked():
    with pytest.raises(ValueError, match="out of range"):
        MoEPlugin(MoEConfig(layers=[5]), model_config())


# ---- the real `rlm fit` (tests/cli_helpers.py); the tiny model has 2 layers, so MoE goes to layer 1 only.

MOE_TINY = "model:\n  plugins:\n    moe:\n      layers: [1]\n      num_experts: 4\n"


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_fit_with_moe_logs_losses_and_routing(tmp_path, rlm_cache):
    (tmp_path / "moe_tiny.yaml").write_text(MOE_TINY)
    run_rlm(fit_args(CONFIGS / "plugins" / "moe.yaml", tmp_path / "moe_tiny.yaml"), tmp_path, rlm_cache)
    rows = read_metrics(tmp_path / "runs/test/version_0")
    for name in (
        "train/loss",
        "train/aux/moe_balance",
        "train/aux/moe_z",
        "train/moe_load_max/l1",
        "train/moe_dropped/l1",
        "train/moe_load/l1_e3",
        "val/loss",
        "val/aux/moe_balance",
    ):
        assert column(rows, name), f"{name} was not logged"
    assert all(0.0 <= v <= 1.0 for v in column(rows, "train/moe_dropped/l1"))


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_two_cpu_processes_with_moe(tmp_path, rlm_cache):
    (tmp_path / "moe_tiny.yaml").write_text(MOE_TINY)
    args = fit_args(CONFIGS / "plugins" / "moe.yaml", tmp_path / "moe_tiny.yaml") + DDP_2CPU
    proc = run_rlm(args, tmp_path, rlm_cache)
    rows = read_metrics(tmp_path / "runs/test/version_0")
    assert len(column(rows, "train/loss")) == 4
    assert column(rows, "train/aux/moe_balance") and column(rows, "val/loss")
    assert "distributed_backend=gloo" in proc.stdout + proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_moe_on_gpu_matches_cpu():
    layer = MoELayer(MoEConfig(layers=[0], num_experts=4, top_k=2, capacity_factor=1.0), model_config(), 0)
    x, tokens = torch.randn(2, 16, D), torch.randint(0, V, (2, 16))
    ref = layer(x, Context(tokens=tokens, stage="val"))
    gpu = layer.cuda()(x.cuda(), Context(tokens=tokens.cuda(), stage="val"))
    assert_close(gpu.cpu(), ref, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("dispatch", ["grouped", "bmm"])
def test_moe_under_bfloat16_autocast(dispatch):
    layer = MoELayer(
        MoEConfig(layers=[0], num_experts=4, capacity_factor=0, dispatch=dispatch), model_config(), 0
    )
    x, tokens = torch.randn(2, 8, D), torch.randint(0, V, (2, 8))
    ref = layer(x, Context(tokens=tokens, stage="val"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ctx = Context(tokens=tokens, stage="val")
        y = layer(x, ctx)
    assert ctx.aux_losses["moe_z"][0].dtype == torch.float32
    assert_close(y.float(), ref, atol=0.05, rtol=0.05)


def test_benchmark_script_smoke(capsys):
    """benchmarks/experts.py at toy sizes: every row runs and the ratio column is last."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "experts.py"
    spec = importlib.util.spec_from_file_location("benchmark_experts", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(
        [
            "--d",
            "32",
            "--batch",
            "1",
            "--seq",
            "16",
            "--experts",
            "2",
            "--vocab",
            "64",
            "--repeat",
            "1",
            "--ngram-rows",
            "8",
            "--no-model",
        ]
    )
    out = capsys.readouterr().out
    assert (
        "| dense FFN (against itself) |" in out
        and "moe N=2 top-1 lsh" in out
        and "FFN + tokenid rank 4" in out
        and "FFN + tokenid n-grams [2, 3] x 4 heads x 8 rows gated" in out
    )
    assert "x dense FFN |" in out.splitlines()[2]


@pytest.mark.parametrize(
    "fragments",
    [
        ["moe.yaml"],
        ["moe.yaml", "moe_top2.yaml"],
        ["moe_hash.yaml", "moe.yaml"],
        ["partial_experts.yaml"],
        ["tokenid.yaml", "moe.yaml", "partial_experts.yaml"],
    ],
    ids=lambda f: "+".join(f),
)
def test_config_fragments_build_the_default_model(fragments):
    """Every routed-memory fragment (stacked as `rlm fit` stacks them) is valid for the default 4-layer model."""
    from rlm.experiment.spec import merge
    from rlm.plugin.registry import validate_specs

    root = Path(__file__).resolve().parents[2] / "configs"
    specs = merge([root / "plugins" / f for f in fragments])["model"]["plugins"]
    assert validate_specs(specs) == []
    with torch.device("meta"):
        model = Transformer(ModelConfig(), specs)
    assert set(model.plugins) == set(specs)
