"""AltUp: the base model at K=1 / identity, predict-compute-correct against a hand-written Algorithm 1,
block selection, embedding variants and their parameter counts, the sum baseline, the router, composition."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import CONFIGS, DDP_2CPU, column, fit_args, read_metrics, run_rlm
from torch.testing import assert_close

from rlm.model import ModelConfig, Transformer
from rlm.plugin import Context, make_config
from rlm.plugins.altup import AltUpConfig, AltUpPlugin, AltUpStack

V, D, L = 61, 32, 4


def config(layers: int = L) -> ModelConfig:
    return ModelConfig(vocab_size=V, d_model=D, n_layers=layers, n_heads=2, max_seq_len=32)


def build(layers: int = L, **altup) -> tuple[Transformer, Transformer]:
    """A base model and the same model with AltUp, sharing every base weight."""
    base = Transformer(config(layers))
    model = Transformer(config(layers), {"altup": altup})
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(
        k.startswith(("stack.", "embed.add.")) and "blocks" not in k for k in missing
    )
    return base.eval(), model.eval()


def tokens(B: int = 2, T: int = 12) -> torch.Tensor:
    return torch.randint(0, V, (B, T))


def randomize(stack: AltUpStack) -> None:
    """Coefficients away from their identity initialisation, so every term of the equations matters."""
    with torch.no_grad():
        stack.p.add_(0.3 * torch.randn_like(stack.p))
        stack.g.add_(0.3 * torch.randn_like(stack.g))
        for router in (stack.p_router, stack.g_router):
            if router is not None:
                router.weight.normal_(0.0, 0.2)


def reference_logits(model: Transformer, tok: torch.Tensor) -> torch.Tensor:
    """The paper's Algorithm 1 with explicit loops over blocks: predict, compute, correct; then reduce, norm, head."""
    stack: AltUpStack = model.stack
    K, cfg = stack.k, stack.cfg
    ctx = Context(tokens=tok, stage="val")
    emb = model.embed(tok, ctx)  # (B, T, d)
    if cfg.embedding == "recycled":
        xs = [emb] * K
    else:
        table = stack.extra.table(tok)  # (B, T, width)
        if cfg.embedding == "wide":
            extra = list(table.split(D, dim=-1))
        else:  # divide-and-project, piece by piece
            extra = [
                piece @ stack.extra.proj[c, : piece.shape[-1]]
                for c, piece in enumerate(table.split(stack.extra.pieces, -1))
            ]
        xs = [emb, *extra]
    rms = lambda x: F.rms_norm(x, (x.shape[-1],))  # noqa: E731
    for layer, block in enumerate(model.blocks):
        j = layer % K if cfg.selection == "alternating" else 0
        p = stack.p[layer].expand(*tok.shape, K, K)  # (B, T, K, K)
        if stack.p_router is not None:
            p = p + torch.tanh(rms(xs[j]) @ stack.p_router.weight[layer].T).view(*tok.shape, K, K)
        x_hat = [sum(p[..., i, jj, None] * xs[jj] for jj in range(K)) for i in range(K)]
        x_tilde = block(x_hat[j], ctx)
        g = stack.g[layer].expand(*tok.shape, K)  # (B, T, K)
        if stack.g_router is not None:
            g = g + torch.tanh(rms(x_tilde) @ stack.g_router.weight[layer].T)
        xs = [x_hat[i] + g[..., i, None] * (x_tilde - x_hat[j]) for i in range(K)]
    if cfg.reduce == "first":
        out = xs[0]
    elif cfg.reduce == "mean":
        out = sum(xs) / K
    else:
        out = sum(x @ stack.out_proj[i] for i, x in enumerate(xs))
    return model.head(model.norm(out))


# --- the base model comes back -------------------------------------------------------------------------


@pytest.mark.parametrize("selection", ["alternating", "same"])
@pytest.mark.parametrize("reduce", ["mean", "first", "project"])
def test_k1_is_the_base_model(selection, reduce):
    # Fused predict/correct with p = 1, g = 1 gives (1 - 1*1) x + 1 x_tilde = x_tilde: equal bit for bit.
    base, model = build(k=1, selection=selection, reduce=reduce)
    tok = tokens()
    assert_close(model(tok), base(tok), rtol=0, atol=0)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("reduce", ["mean", "first", "project"])
def test_recycled_identity_init_is_the_base_model(k, reduce):
    # p = identity and g = 1: every block receives the layer's residual update, so K copies of the same
    # embedding stay equal to the base model's residual stream.
    base, model = build(k=k, embedding="recycled", reduce=reduce)
    tok = tokens()
    exact = {"rtol": 0, "atol": 0} if reduce != "project" else {}  # K terms of x / K may round
    assert_close(model(tok), base(tok), **exact)


def test_router_starts_at_the_static_coefficients():
    torch.manual_seed(1)
    _, static = build(k=3)
    routed = Transformer(config(), {"altup": {"k": 3, "router": True}}).eval()
    routed.load_state_dict(static.state_dict(), strict=False)
    tok = tokens()
    assert_close(routed(tok), static(tok))


# --- Algorithm 1 by hand -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(k=2),
        dict(k=3, selection="same"),
        dict(k=3, reduce="first"),
        dict(k=2, embedding="recycled", reduce="project"),
        dict(k=3, embedding="project", extra_width=45),  # uneven pieces 23 + 22
        dict(k=2, embedding="project", extra_width=80),  # one piece wider than d, projected down
        dict(k=3, router=True),
        dict(k=2, router=True, selection="same", reduce="project"),
    ],
    ids=str,
)
def test_predict_compute_correct_matches_algorithm_1(options):
    model = Transformer(config(), {"altup": options}).eval()
    randomize(model.stack)
    if model.stack.out_proj is not None:
        with torch.no_grad():
            model.stack.out_proj.add_(0.1 * torch.randn_like(model.stack.out_proj))
    tok = tokens()
    assert_close(model(tok), reference_logits(model, tok))


@pytest.mark.parametrize(
    ("selection", "k", "expected"),
    [("alternating", 2, [0, 1, 0, 1]), ("alternating", 3, [0, 1, 2, 0]), ("same", 3, [0, 0, 0, 0])],
)
def test_selection_picks_the_right_block(selection, k, expected):
    # With p = identity and g = 0 the blocks never change, so layer l's block must see embedding block j*(l).
    model = Transformer(config(), {"altup": {"k": k, "selection": selection}}).eval()
    with torch.no_grad():
        model.stack.g.zero_()
    assert model.stack.selected == expected
    seen = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    tok = tokens()
    model(tok)
    ctx = Context(tokens=tok)
    embedded = [model.embed(tok, ctx), *model.stack.extra(tok)]  # the K blocks as embedded
    for layer, j in enumerate(expected):
        assert_close(seen[layer], embedded[j])


@pytest.mark.parametrize("router", [False, True])
def test_gradients_match_algorithm_1(router):
    model = Transformer(config(), {"altup": {"k": 3, "router": router}})
    randomize(model.stack)
    tok = tokens()
    params = [p for p in model.parameters() if p.requires_grad]
    fused = torch.autograd.grad(model(tok).logsumexp(-1).mean(), params)
    naive = torch.autograd.grad(reference_logits(model, tok).logsumexp(-1).mean(), params)
    for (name, _), a, b in zip(model.named_parameters(), fused, naive):
        assert_close(a, b, msg=name)


def test_residual_stream_stays_float32_under_autocast():
    # bf16 autocast rounds the blocks' matmuls, not the K-block stream: recycled AltUp is still the base model.
    base, model = build(k=2, embedding="recycled")
    tok = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_close(model(tok), base(tok), rtol=0, atol=0)


def test_gradients_reach_coefficients_and_extra_embedding():
    model = Transformer(config(), {"altup": {"k": 2, "router": True}})
    model(tokens()).logsumexp(-1).mean().backward()
    stack = model.stack
    for name, p in [
        ("p", stack.p),
        ("g", stack.g),
        ("table", stack.extra.table.weight),
        ("router", stack.p_router.weight),
    ]:
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# --- embeddings, the sum baseline, parameter counts ----------------------------------------------------


def coefficients(k: int) -> int:
    return L * (k * k + k)


@pytest.mark.parametrize("k", [2, 4])
def test_recycled_adds_no_embedding_parameters(k):
    model = Transformer(config(), {"altup": {"k": k, "embedding": "recycled"}})
    assert model.added_parameters() == coefficients(k)
    assert model.stack.extra is None
    assert sum(isinstance(m, torch.nn.Embedding) for m in model.modules()) == 1


@pytest.mark.parametrize("k", [2, 4])
def test_wide_adds_v_times_k_minus_1_times_d(k):
    model = Transformer(config(), {"altup": {"k": k}})
    assert model.added_parameters() == V * (k - 1) * D + coefficients(k)
    assert model.stack.extra.table.weight.shape == (V, (k - 1) * D)
    assert model.plugins["altup"].inactive_parameters() == (V - 1) * (k - 1) * D


def test_divide_and_project_parameters():
    model = Transformer(config(), {"altup": {"k": 3, "embedding": "project", "extra_width": 45}})
    assert model.stack.extra.pieces == [23, 22]
    # A (V, e) table plus one (w_c, d) map per piece (stored padded to (K-1, 23, d); the padding row stays 0).
    assert model.added_parameters() == V * 45 + 2 * 23 * D + coefficients(3)
    assert model.stack.extra.proj[1, 22:].abs().sum() == 0


def test_sum_baseline_adds_the_extra_embedding_to_the_token_embedding():
    base, model = build(k=3, update="sum")
    assert type(model.stack) is type(base.stack)  # the plain stack, not AltUp's
    assert model.added_parameters() == V * 2 * D
    tok = tokens()
    extra = model.embed.add[0].extra.table(tok)  # (B, T, 2d)
    x = base.embed(tok, Context(tokens=tok)) + extra[..., :D] + extra[..., D:]
    for block in base.blocks:
        x = block(x, Context(tokens=tok))
    assert_close(model(tok), base.head(base.norm(x)))


def test_param_groups_exempt_coefficients_and_table_from_weight_decay():
    model = Transformer(config(), {"altup": {"k": 2}})
    (group,) = model.plugins["altup"].param_groups()
    assert group.weight_decay == 0.0
    assert {id(p) for p in group.params} == {
        id(model.stack.p),
        id(model.stack.g),
        id(model.stack.extra.table.weight),
    }
    # The plugin keeps no second registration of its module: each parameter appears once in the state dict.
    assert not any(k.startswith("plugins.") for k in model.state_dict())


# --- configuration ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(k=0), "altup.k must be a positive integer"),
        (dict(k="2"), "altup.k must be a positive integer"),
        (
            dict(embedding="tall"),
            "plugin 'altup': option embedding must be one of ('wide', 'recycled', 'project'), got 'tall'",
        ),
        (dict(selection="random"), "one of ('alternating', 'same')"),
        (dict(reduce="max"), "one of ('mean', 'first', 'project')"),
        (dict(update="concat"), "one of ('altup', 'sum')"),
        (dict(embedding="project"), "altup.extra_width must be an integer >= k-1=1"),
        (dict(k=4, embedding="project", extra_width=2), "altup.extra_width must be an integer >= k-1=3"),
        (dict(extra_width=64), "only used with embedding='project'"),
        (dict(update="sum", embedding="recycled"), "needs an extra embedding"),
        (dict(update="sum", k=1), "needs k >= 2"),
    ],
    ids=str,
)
def test_bad_config_is_a_clear_error(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_config(AltUpPlugin, options)


def test_unknown_option_lists_the_accepted_ones():
    with pytest.raises(ValueError, match="unknown option"):
        Transformer(config(), {"altup": {"k": 2, "blocks": 3}})


def test_wrapping_something_else_than_the_plain_stack_is_an_error():
    plugin = AltUpPlugin(AltUpConfig(), config())
    with pytest.raises(ValueError, match="wraps the plain stack of blocks, but the stack slot holds Linear"):
        plugin.build(plugin.claims()[0], None, torch.nn.Linear(2, 2))


# --- composition ----------------------------------------------------------------------------------------


def test_composes_with_plugins_inside_the_blocks_in_any_order():
    specs = {"altup": {"k": 2}, "tokenid": {"layers": [1], "init_std": 0.02}}
    torch.manual_seed(3)
    a = Transformer(config(), specs)
    torch.manual_seed(3)
    b = Transformer(config(), dict(reversed(specs.items())))
    assert list(a.state_dict()) == list(b.state_dict())
    assert len(a.blocks[1].ffn_add) == 1 and isinstance(a.stack, AltUpStack)
    tok = tokens()
    assert_close(a.eval()(tok), b.eval()(tok))
    assert_close(a(tok), reference_logits(a, tok))  # the Token-ID table runs inside the computed block


def test_benchmark_script_smoke(capsys):
    """benchmarks/altup.py at toy sizes: every variant runs and the ratio to the base model is the last column."""
    spec = importlib.util.spec_from_file_location(
        "benchmark_altup", Path(__file__).resolve().parents[2] / "benchmarks" / "altup.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = "--d 32 --layers 2 --heads 2 --vocab 64 --seq 16 --batch 2 --steps 1 --rounds 1 --warmup 0 --device cpu"
    rows = bench.main(args.split())
    assert [r[0] for r in rows] == ["base", "AltUp K=2", "Recycled-AltUp K=2", "AltUp K=4"]
    assert rows[0][-1] == 1.0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert lines[0].endswith("| ratio to base |") and len(lines) == 2 + len(rows)


# --- the real `rlm fit` (tests/cli_helpers.py) -----------------------------------------------------------


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_fit_with_altup_and_tokenid(tmp_path, rlm_cache):
    fragments = [CONFIGS / "plugins" / "tokenid.yaml", CONFIGS / "plugins" / "altup.yaml"]
    run_rlm(fit_args(*fragments), tmp_path, rlm_cache)
    rows = read_metrics(tmp_path / "runs/test/version_0")
    losses = column(rows, "train/loss")
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert column(rows, "val/loss")
    assert column(rows, "train/altup_p_drift")[-1] > 0  # the coefficients were trained
    state = torch.load(tmp_path / "runs/test/ckpt/last.ckpt", map_location="cpu", weights_only=False)
    assert state["hyper_parameters"]["plugins"]["altup"]["k"] == 2
    assert {"model.stack.p", "model.stack.g", "model.stack.extra.table.weight"} <= set(state["state_dict"])
    # The Token-ID table sits inside the blocks that the AltUp stack computes.
    assert any(k.startswith("model.stack.blocks.0.ffn_add.0.") for k in state["state_dict"])
    ckpt = tmp_path / "runs/test/ckpt/last.ckpt"
    out = run_rlm(
        ["generate", "--ckpt", ckpt, "--prompt", "def ", "--max-new-tokens", "8"], tmp_path, rlm_cache
    )
    assert out.stdout.startswith("def ")  # generation from an AltUp checkpoint


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_two_cpu_processes_with_recycled_altup_and_moe(tmp_path, rlm_cache):
    # MoE in layer 1 of the 2-layer tiny model, inside the blocks AltUp computes.
    (tmp_path / "moe_tiny.yaml").write_text(
        "model:\n  plugins:\n    moe:\n      layers: [1]\n      num_experts: 4\n"
    )
    fragments = ["altup.yaml", "altup_recycled.yaml", "moe.yaml"]
    args = fit_args(*(CONFIGS / "plugins" / f for f in fragments), tmp_path / "moe_tiny.yaml") + DDP_2CPU
    proc = run_rlm(args, tmp_path, rlm_cache)
    rows = read_metrics(tmp_path / "runs/test/version_0")
    assert len(column(rows, "train/loss")) == 4
    assert (
        column(rows, "val/loss")
        and column(rows, "train/altup_p_drift")
        and column(rows, "train/aux/moe_balance")
    )
    assert "distributed_backend=gloo" in proc.stdout + proc.stderr
