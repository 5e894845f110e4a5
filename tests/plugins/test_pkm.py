"""Product key memory: exact search, output, gradients, sparse Adam, statistics, optimizer group, CLI runs."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from cli_helpers import CONFIGS, DDP_2CPU, column, fit_args, read_metrics, run_rlm
from torch.testing import assert_close

from rlm.distributed.parallel import CAN_REPLICATE
from rlm.model import ModelConfig, Transformer
from rlm.plugin import Context, make_config
from rlm.plugins import _pkm_native, _pkm_ops, _pkm_rows
from rlm.plugins._pkm_ops import (
    MaskedBatchNorm,
    bag_dot,
    coalesce_rows,
    group_slots,
    product_key_topk,
    slot_stats,
)
from rlm.plugins._pkm_rows import RowAdam
from rlm.plugins.pkm import PKMConfig, PKMLayer, PKMPlugin

RUN = "runs/test/version_0"


def brute_force_topk(q: torch.Tensor, keys1: torch.Tensor, keys2: torch.Tensor, k: int):
    """Top-k over all n^2 concatenated keys cat(C_i, C'_j), slot i*n+j. q: (N, H, dk); keys: (H, n, dk/2)."""
    H, n, _ = keys1.shape
    i = torch.arange(n).repeat_interleave(n)  # slot s = i*n + j
    j = torch.arange(n).repeat(n)
    full = torch.cat([keys1[:, i], keys2[:, j]], dim=-1)  # (H, n^2, dk)
    scores = torch.einsum("nhd,hsd->nhs", q, full)  # (N, H, n^2)
    return scores.topk(k, dim=-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize(
    ("n", "k"), [(16, 1), (16, 4), (16, 16), (64, 2), (64, 4), (64, 5)]
)  # 64: grouped top-k
def test_product_key_search_is_exact(seed, heads, n, k):
    g = torch.Generator().manual_seed(seed)
    dh, N = 8, 40
    q = torch.randn(N, heads, 2 * dh, generator=g, dtype=torch.float64)
    keys = torch.randn(heads, 2, n, dh, generator=g, dtype=torch.float64)
    scores, slots = product_key_topk(q.unflatten(-1, (2, dh)), keys, k)
    ref_scores, ref_slots = brute_force_topk(q, keys[:, 0], keys[:, 1], k)
    assert torch.equal(slots, ref_slots)
    assert_close(scores, ref_scores)
    # Gradients through the selected scores (sparse sub-key backward) equal brute-force autograd.
    r = torch.randn(N, heads, k, generator=g, dtype=torch.float64)
    grads = []
    for search in (lambda q, c: product_key_topk(q.unflatten(-1, (2, dh)), c, k)[0],
                   lambda q, c: brute_force_topk(q, c[:, 0], c[:, 1], k)[0]):  # fmt: skip
        q_, c_ = q.clone().requires_grad_(True), keys.clone().requires_grad_(True)
        (search(q_, c_) * r).sum().backward()
        grads.append((q_.grad, c_.grad))
    assert_close(grads[0][0], grads[1][0])
    assert_close(grads[0][1], grads[1][1])


@pytest.mark.parametrize("onednn", [False, True])
def test_search_stays_float32_under_bf16_autocast(onednn, monkeypatch):
    # The key scores under autocast must be the fp32 ones: a bf16 score bmm reorders close keys. torch.bmm
    # is the path on CUDA (autocast casts it to bf16); on CPU fp32 the oneDNN op, which autocast leaves alone.
    if not onednn:
        monkeypatch.setattr(_pkm_ops, "_ONEDNN_LINEAR", [None])
    g = torch.Generator().manual_seed(0)
    N, H, n, dh, k = 256, 2, 64, 16, 8
    q = torch.randn(N, H, 2 * dh, generator=g)
    keys = torch.randn(H, 2, n, dh, generator=g)
    ref_scores, ref_slots = brute_force_topk(q.double(), keys[:, 0].double(), keys[:, 1].double(), k)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores, slots = product_key_topk(q.unflatten(-1, (2, dh)), keys, k)
        # what a bf16 search would pick: the same brute force on bf16-rounded scores
        bf16 = torch.einsum("nhd,hsd->nhs", q, torch.cat([keys[:, 0].repeat_interleave(n, 1),
                                                           keys[:, 1].repeat(1, n, 1)], -1))  # fmt: skip
    assert bf16.dtype == torch.bfloat16 and not torch.equal(bf16.float().topk(k, -1).indices, ref_slots)
    assert scores.dtype == torch.float32
    assert torch.equal(slots, ref_slots)
    assert_close(scores, ref_scores.float())
    # Through the layer: a bf16 query (autocast's linear) is searched in fp32.
    _, layer = small_layer(n_keys=16, topk=4)
    layer.float()
    x = torch.randn(64, 32, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        slots, weights = layer.lookup(x, torch.ones(64, dtype=torch.bool))
        q = layer.norm(layer.query(x).view(64, layer.heads, -1)).float()  # the bf16-computed query, widened
    keys = layer.keys.detach()
    ref_scores, ref_slots = brute_force_topk(q.double(), keys[:, 0].double(), keys[:, 1].double(), 4)
    assert weights.dtype == torch.float32
    assert torch.equal(slots, ref_slots)
    assert_close(weights, ref_scores.softmax(-1).float())


def small_layer(**kw) -> tuple[PKMPlugin, PKMLayer]:
    """A plugin with one memory at layer 0 of a tiny model (d=32, n=8 -> 64 slots) in float64."""
    args = dict(layers=[0], n_keys=8, heads=2, topk=4, k_dim=12, sparse=False) | kw
    mc = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2)
    plugin = PKMPlugin(PKMConfig(**args), mc)
    layer = plugin.build(plugin.claims()[0], 0, None)
    return plugin.double(), layer.double()


def naive_memory(layer: PKMLayer, values: torch.Tensor, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The paper's equations token by token: BN over valid rows, brute-force top-k, softmax, gather and sum."""
    q = x @ layer.query.weight.T  # (N, H*dk)
    if layer.norm_kind == "batchnorm":
        rows = q[valid]
        mean, var = rows.mean(0), rows.var(0, unbiased=False)
        q = (q - mean) / torch.sqrt(var + layer.norm.eps) * layer.norm.weight + layer.norm.bias
    q = q.view(len(x), layer.heads, -1)
    if layer.norm_kind == "layernorm":  # per token and head
        mean, var = q.mean(-1, keepdim=True), q.var(-1, unbiased=False, keepdim=True)
        q = (q - mean) / torch.sqrt(var + layer.norm.eps) * layer.norm.weight + layer.norm.bias
    out = []
    for t in range(len(x)):
        acc = torch.zeros(values.shape[1], dtype=x.dtype)
        for h in range(layer.heads):
            scores, slots = brute_force_topk(
                q[t : t + 1, h : h + 1], layer.keys[h : h + 1, 0], layer.keys[h : h + 1, 1], layer.topk
            )
            w = torch.softmax(scores[0, 0], dim=0)
            for wi, s in zip(w, slots[0, 0]):
                acc = acc + wi * values[s]
        if layer.gate is not None:
            acc = layer.out.weight @ (acc * torch.nn.functional.silu(layer.gate.weight @ x[t]))
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("query_norm", ["none", "batchnorm", "layernorm"])
@pytest.mark.parametrize("gated", [False, True])
def test_output_equals_naive_gather_and_sum(query_norm, gated):
    plugin, layer = small_layer(query_norm=query_norm, gated=gated)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    ctx = Context(tokens=torch.zeros(2, 5, dtype=torch.long), mask=mask)
    y = layer(x, ctx)
    ref = naive_memory(layer, plugin.values["shared"], x.view(10, 32), mask.view(10)).view(2, 5, 32)
    assert_close(y, ref)


@pytest.mark.parametrize("sparse", [False, True])
def test_gradients_match_the_dense_reference(sparse):
    plugin, layer = small_layer(sparse=sparse, gated=True)
    plugin.resolve_sparse(distributed=False)
    values = plugin.values["shared"]
    x = torch.randn(2, 6, 32, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    ctx = Context(tokens=torch.zeros(2, 6, dtype=torch.long), mask=mask)
    target = torch.randn(2, 6, 32, dtype=torch.float64)
    (layer(x, ctx) * target).sum().backward()
    got = {
        "x": x.grad,
        "query": layer.query.weight.grad,
        "keys": layer.keys.grad,
        "gate": layer.gate.weight.grad,
    }
    if sparse:
        assert values.grad is None and not values.requires_grad
        rows, row_grad = plugin.row_optimizer.pending("shared")
        got_values = torch.zeros_like(values).index_copy_(0, rows, row_grad)
    else:
        got_values = values.grad
    # Reference: autograd through the naive per-token equations on fresh leaves.
    x2 = x.detach().clone().requires_grad_(True)
    v2 = values.detach().clone().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    (naive_memory(layer, v2, x2.view(12, 32), mask.view(12)).view(2, 6, 32) * target).sum().backward()
    want = {
        "x": x2.grad,
        "query": layer.query.weight.grad,
        "keys": layer.keys.grad,
        "gate": layer.gate.weight.grad,
    }
    for name in got:
        assert_close(got[name], want[name], msg=lambda m, name=name: f"{name}: {m}")
    assert_close(got_values, v2.grad)
    touched = v2.grad.abs().sum(1) > 0
    assert 0 < int(touched.sum()) < values.shape[0]  # only some rows are touched, and only those get gradient


def test_coalesced_rows_equal_a_dense_index_add():
    slots = torch.randint(0, 20, (30, 6))
    weights = torch.rand(30, 6, dtype=torch.float64)
    grad = torch.randn(30, 5, dtype=torch.float64)
    rows, row_grad = coalesce_rows(slots, weights, grad)
    dense = torch.zeros(20, 5, dtype=torch.float64)
    for t in range(30):
        for j in range(6):
            dense[slots[t, j]] += weights[t, j] * grad[t]
    assert torch.equal(rows, slots.unique())
    assert_close(row_grad, dense[rows])


@pytest.mark.parametrize("native", [True, False], ids=["fused-kernel", "torch"])
def test_bag_dot_equals_gathered_dot_products(native, monkeypatch):
    if native and _pkm_native.load() is None:
        pytest.skip("no C compiler: the fused kernel is unavailable")
    if not native:
        monkeypatch.setattr(_pkm_native, "bag_dot", lambda *args: None)
    values, grad = torch.randn(50, 24), torch.randn(9, 24)
    slots = torch.randint(0, 50, (9, 7))
    want = torch.stack([torch.stack([values[slots[t, j]] @ grad[t] for j in range(7)]) for t in range(9)])
    assert_close(bag_dot(values, slots, grad), want)


def test_masked_batchnorm_statistics_by_hand():
    bn = MaskedBatchNorm(3, momentum=0.5).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        bn.bias.copy_(torch.tensor([0.0, -1.0, 3.0]))
    x = torch.tensor(
        [[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [5.0, 8.0, 2.0], [100.0, -50.0, 7.0]], dtype=torch.float64
    )
    mask = torch.tensor([True, True, True, False])  # the padded row must not move the statistics
    y = bn(x, mask).detach()
    for c in range(3):
        vals = [float(x[i, c]) for i in range(3)]
        mean = sum(vals) / 3
        var = sum((v - mean) ** 2 for v in vals) / 3
        for i in range(4):
            want = (float(x[i, c]) - mean) / math.sqrt(var + bn.eps) * float(bn.weight[c].detach()) + float(
                bn.bias[c].detach()
            )
            assert abs(float(y[i, c]) - want) < 1e-9
        unbiased = var * 3 / 2
        assert abs(float(bn.running_mean[c]) - 0.5 * mean) < 1e-12
        assert abs(float(bn.running_var[c]) - (0.5 + 0.5 * unbiased)) < 1e-12
    # Gradients equal those of torch's batch norm on the valid rows alone.
    x1 = x.clone().requires_grad_(True)
    (bn(x1, mask)[:3] ** 2).sum().backward()
    x2 = x[:3].clone().requires_grad_(True)
    ref = torch.nn.functional.batch_norm(
        x2, None, None, bn.weight.detach(), bn.bias.detach(), training=True, eps=bn.eps
    )
    (ref**2).sum().backward()
    assert_close(x1.grad[:3], x2.grad)
    bn.eval()
    assert_close(
        bn(x, mask), (x - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) * bn.weight + bn.bias
    )


@pytest.mark.parametrize("native", [True, False], ids=["fused-kernel", "torch"])
def test_row_adam_matches_torch_sparse_adam(native):
    if native and _pkm_native.load() is None:
        pytest.skip("no C compiler: the fused kernel is unavailable")
    table = torch.randn(300, 8)
    ref = table.clone().requires_grad_(True)
    opt = RowAdam(lr=0.01)
    opt.native = native
    opt.add_table("t", table)
    ref_opt = torch.optim.SparseAdam([ref], lr=0.01)
    for step in range(4):
        dense = torch.zeros(300, 8)
        # Two reads of the shared table (two layers, or two micro-batches): their gradients add up.
        for n, m in ((20 + step, 6), (7, 3)):
            slots = torch.randint(0, 100 + 50 * step, (n, m))
            # Gradients of one sign: float32 sums in another order must not cancel to noise that Adam rescales.
            weights, grad = torch.rand(n, m), torch.rand(n, 8) + 0.1
            opt.add_lookups("t", slots, weights, grad)
            dense.index_add_(0, slots.reshape(-1), (weights.unsqueeze(-1) * grad.unsqueeze(1)).reshape(-1, 8))
        untouched = dense.abs().sum(1) == 0
        before = table.clone()
        opt.step()
        ref.grad = dense.to_sparse()
        ref_opt.step()
        assert_close(table, ref.detach())
        assert torch.equal(table[untouched], before[untouched])
    assert not opt.reads


def test_row_adam_shares_a_grouping_of_reads_only_between_reads_of_one_slots_tensor(monkeypatch):
    """PEER's down and up tables are read at one slots tensor and share one grouping of their reads: each table
    still ends as a RowAdam holding it alone leaves it, and so do a table read at a copy of those slots and one read
    at other slots of the same shape (each grouped anew)."""
    calls = []
    monkeypatch.setattr(_pkm_rows, "group_slots", lambda slots: calls.append(slots) or group_slots(slots))
    together, want = RowAdam(lr=0.01), {}
    slots = torch.randint(0, 50, (12, 4))
    reads = (
        ("up", slots),
        ("down", slots),
        ("copy", slots.clone()),
        ("other", torch.randint(0, 50, (12, 4))),
    )
    for key, sl in reads:
        table, weights, grad = torch.randn(50, 8), torch.rand(12, 4), torch.rand(12, 8)
        alone, want[key] = RowAdam(lr=0.01), table.clone()
        alone.add_table(key, want[key])
        alone.add_lookups(key, sl, weights, grad)
        alone.step()
        together.add_table(key, table)
        together.add_lookups(key, sl, weights, grad)
    calls.clear()
    together.step()
    for key, table in together.tables.items():
        assert torch.equal(table, want[key]), key
    assert len(calls) == 3  # up and down share one; the copy and the other slots are grouped alone


@pytest.mark.parametrize("query_norm", ["none", "layernorm", "batchnorm"])
def test_query_norm_causality_in_training(query_norm):
    """layernorm and none: a token's training output never depends on later tokens (or the rest of the batch).
    batchnorm: it does, through the batch statistics (the documented train-time leak of the paper's method)."""
    plugin, layer = small_layer(query_norm=query_norm)
    layer.train()
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    changed = x.clone()
    changed[:, 5:] = torch.randn(2, 3, 32, dtype=torch.float64)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with torch.no_grad():
        a, b = (layer(t, Context(tokens=tokens, stage="train"))[:, :5] for t in (x, changed))
    if query_norm == "batchnorm":
        assert not torch.allclose(a, b)
    else:
        assert_close(a, b)


def test_native_row_adam_constants_are_double_precision():
    """One Adam step from zero moments against a float64 reference: 1 - b2 in float32 alone would be off by
    1.3e-5 relative (b2 = 0.999), far above float32 rounding of the rest."""
    if _pkm_native.load() is None:
        pytest.skip("no C compiler: the fused kernel is unavailable")
    g = torch.Generator().manual_seed(0)
    d, lr, betas, eps = 16, 1e-3, (0.9, 0.999), 1e-8
    p = torch.randn(3, d, generator=g)
    m, v = torch.zeros(3, d), torch.zeros(3, d)
    grad = torch.rand(2, d, generator=g) + 0.5
    p0 = p.double().clone()
    rows, offsets, tok = torch.tensor([0, 2]), torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    w = torch.ones(2)
    for step in (1, 2):
        assert _pkm_native.row_adam(p, m, v, rows, offsets, tok, w, grad, lr, betas, eps, step)
    gd = grad.double()
    m_ref, v_ref, p_ref = (
        torch.zeros(2, d, dtype=torch.float64),
        torch.zeros(2, d, dtype=torch.float64),
        p0[[0, 2]],
    )
    for step in (1, 2):
        m_ref = betas[0] * m_ref + (1 - betas[0]) * gd
        v_ref = betas[1] * v_ref + (1 - betas[1]) * gd * gd
        m_hat, v_hat = m_ref / (1 - betas[0] ** step), v_ref / (1 - betas[1] ** step)
        p_ref = p_ref - lr * m_hat / (v_hat.sqrt() + eps)
    assert_close(v[[0, 2]].double(), v_ref, rtol=1e-6, atol=0)
    assert_close(m[[0, 2]].double(), m_ref, rtol=1e-6, atol=0)
    assert_close(p[[0, 2]].double(), p_ref, rtol=1e-6, atol=1e-7)


def test_sparse_step_equals_dense_adam_on_first_step():
    mc = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2)
    specs = {"pkm": dict(layers=[0, 1], n_keys=8, heads=2, topk=4, k_dim=12)}
    torch.manual_seed(1)
    dense = Transformer(mc, {"pkm": specs["pkm"] | {"sparse": False}})
    sparse = Transformer(mc, {"pkm": specs["pkm"] | {"sparse": True}})
    sparse.load_state_dict(dense.state_dict())
    tokens = torch.randint(0, 50, (2, 7))
    for model in (dense, sparse):
        model.plugins["pkm"].resolve_sparse(distributed=False)
        model(tokens, Context(tokens=tokens)).square().mean().backward()
    values = dense.plugins["pkm"].values["shared"]
    torch.optim.Adam([values], lr=1e-3).step()
    sparse.plugins["pkm"].row_optimizer.step()
    # From zero moments Adam moves only rows with a gradient, so dense and lazy agree on step one.
    assert_close(sparse.plugins["pkm"].values["shared"], values.detach())


def test_usage_and_kl_on_a_hand_made_pattern():
    usage, kl = slot_stats(torch.tensor([2.0, 2.0, 0.0, 0.0]))
    assert_close(usage, torch.tensor(0.5, dtype=torch.float64))
    assert_close(kl, torch.tensor(math.log(2), dtype=torch.float64))  # log 4 + 2 * 0.5 log 0.5
    usage, kl = slot_stats(torch.full((8,), 3.0))
    assert float(usage) == 1.0 and abs(float(kl)) < 1e-12
    usage, kl = slot_stats(torch.tensor([1.0, 3.0, 0.0]))
    assert_close(
        kl, torch.tensor(math.log(3) + 0.25 * math.log(0.25) + 0.75 * math.log(0.75), dtype=torch.float64)
    )


def test_validation_statistics_accumulate_valid_reads_per_layer():
    plugin, layer = small_layer()
    plugin.memories = {0: layer}
    layer.eval()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    ctx = Context(tokens=torch.zeros(2, 5, dtype=torch.long), mask=mask, stage="val")
    plugin.start_stats()
    with torch.no_grad():
        layer(x, ctx)
        layer(x, ctx)
    slots, weights = layer.lookup(x.view(10, 32), mask.view(10))
    want = torch.zeros(64, dtype=torch.float64)
    for t in range(10):
        if mask.view(10)[t]:
            want.index_add_(0, slots[t].reshape(-1), 2 * weights[t].reshape(-1))
    assert_close(layer.slot_weight, want)
    ((usage, kl),) = plugin.stop_stats().values()
    assert_close(usage, (want > 0).double().mean())
    assert_close(kl, slot_stats(want)[1])
    with torch.no_grad():
        layer(x, ctx)  # stopped: nothing more is added
    assert_close(layer.slot_weight, want)


def test_values_are_shared_and_registered_once():
    mc = ModelConfig(vocab_size=50, d_model=32, n_layers=4, n_heads=2)
    model = Transformer(mc, {"pkm": dict(layers=[1, 2], n_keys=8, topk=2, k_dim=8)})
    names = [n for n, p in model.named_parameters() if p.shape == (64, 32)]
    assert names == ["plugins.pkm.values.shared"]
    assert model.blocks[1].ffn.table == model.blocks[2].ffn.table == "shared"
    per_layer = Transformer(
        mc, {"pkm": dict(layers=[1, 2], n_keys=8, topk=2, k_dim=8, shared_values=False, mode="add")}
    )
    assert sorted(per_layer.plugins["pkm"].values) == ["layer1", "layer2"]
    assert len(per_layer.blocks[1].ffn_add) == 1 and type(per_layer.blocks[1].ffn).__name__ == "FeedForward"
    default = Transformer(mc, {"pkm": {"n_keys": 8, "topk": 2, "k_dim": 8}})
    assert type(default.blocks[2].ffn).__name__ == "PKMLayer"  # middle layer by default


def test_param_group_reaches_the_optimizer_with_its_lr():
    from rlm.train.module import LMModule

    mc = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2)
    spec = dict(layers=[1], n_keys=8, topk=2, k_dim=8, values_lr=1e-3)
    module = LMModule(model=mc, plugins={"pkm": spec | {"sparse": False}})
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    (group,) = [g for g in opt.param_groups if g["name"] == "pkm_values"]
    values = module.model.plugins["pkm"].values["shared"]
    assert group["params"] == [values] and group["lr"] == 1e-3 and group["weight_decay"] == 0.0
    assert all(values is not p for g in opt.param_groups if g is not group for p in g["params"])
    for _ in range(3):
        opt.step()
        sched.step()
    assert group["lr"] == 1e-3  # constant while the other groups warm up
    # Sparse: the values are updated by the plugin's row optimizer and never reach AdamW.
    module = LMModule(model=mc, plugins={"pkm": spec | {"sparse": True}})
    opt = module.configure_optimizers()["optimizer"]
    values = module.model.plugins["pkm"].values["shared"]
    assert all(values is not p for g in opt.param_groups for p in g["params"])


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"mode": "wrap"}, "option mode must be one of ('replace', 'add'), got 'wrap'"),
        (
            {"query_norm": "groupnorm"},
            "query_norm must be one of ('layernorm', 'batchnorm', 'none'), got 'groupnorm'",
        ),
        ({"topk": 40, "n_keys": 32}, "at most"),
        ({"k_dim": 7}, "even"),
        ({"sparse": "true"}, "option sparse must be one of ('auto',) or bool, got 'true'"),
        ({"heads": 0}, "positive"),
        ({"value_dropout": 1.0}, "[0, 1)"),
    ],
)
def test_bad_config_is_a_clear_error(kw, words):
    with pytest.raises(ValueError, match=None) as err:
        make_config(PKMPlugin, kw)
    assert words in str(err.value)


def test_sparse_values_under_ddp_and_fsdp2_and_dense_under_other_distributed_strategies():
    plugin, _ = small_layer(sparse=True)
    with pytest.raises(ValueError, match="under DDP and FSDP2"):
        plugin.resolve_sparse(distributed=True, row_exchange=False)
    assert plugin.resolve_sparse(distributed=True, row_exchange=True) is True and not plugin.param_groups()
    plugin, _ = small_layer(sparse="auto")
    assert plugin.resolve_sparse(distributed=True, row_exchange=True) is True
    # sparse: FSDP2 must leave the tables whole (the row exchange updates them); dense: shard them like the rest
    assert plugin.replicated_parameters() == [plugin.values["shared"]]
    assert plugin.resolve_sparse(distributed=True, row_exchange=False) is False and plugin.param_groups()
    assert plugin.replicated_parameters() == []


@pytest.mark.parametrize(
    "strategy, sparse",
    [("ddp", True), ("fsdp2", CAN_REPLICATE), ("another", False)],
)
def test_the_callback_exchanges_rows_under_ddp_and_fsdp2(strategy, sparse):
    from types import SimpleNamespace

    from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy

    from rlm.plugins._host_table_callback import PKMCallback

    kind = {"ddp": DDPStrategy, "fsdp2": ModelParallelStrategy}.get(strategy)
    # setup reads the strategy's class only; 'another' stands for any other multi-process strategy
    trainer = SimpleNamespace(
        world_size=2, strategy=kind.__new__(kind) if kind else object(), precision="32-true"
    )
    plugin, _ = small_layer(sparse="auto")
    PKMCallback(plugin).setup(trainer, None, "fit")
    assert plugin.sparse_active is sparse
    assert plugin.values["shared"].requires_grad is not sparse
    assert plugin.replicated_parameters() == ([plugin.values["shared"]] if sparse else [])


def test_the_group_handed_in_reaches_every_collective_and_the_callback_keeps_it():
    from types import SimpleNamespace

    from pytorch_lightning.strategies import DDPStrategy

    from rlm.plugins._host_table_callback import PKMCallback

    group = object()  # stands for a process group: nothing here runs a collective
    plugin, layer = small_layer(sparse="auto", query_norm="batchnorm")
    assert plugin.group is None and layer.norm.group is None  # nothing handed in: the default group
    plugin.set_group(group)
    assert layer.norm.group is group and plugin.row_optimizer.group is None  # no row exchange resolved yet
    later = plugin.build(plugin.claims()[0], 1, None)  # a memory built after the group was handed in
    assert later.norm.group is group
    trainer = SimpleNamespace(world_size=2, strategy=DDPStrategy.__new__(DDPStrategy), precision="32-true")
    PKMCallback(plugin).setup(trainer, None, "fit")
    assert plugin.group is group and plugin.row_optimizer.group is group  # kept, and the exchange uses it
    assert plugin.resolve_sparse(distributed=False) and plugin.row_optimizer.group is None  # one process


def test_config_fragment_builds_the_default_model():
    with open(CONFIGS / "plugins" / "pkm.yaml") as f:
        spec = yaml.safe_load(f)["model"]["plugins"]["pkm"]
    with torch.device("meta"):
        model = Transformer(ModelConfig(), {"pkm": spec})
    assert type(model.blocks[2].ffn).__name__ == "PKMLayer"
    assert model.plugins["pkm"].values["shared"].shape == (512 * 512, 256)


def pkm_fragment(tmp_path, **kw) -> str:
    """A small PKM fragment for the 2-layer tiny model."""
    spec = dict(layers=[1], n_keys=16, heads=2, topk=4, k_dim=32) | kw
    path = tmp_path / "pkm_tiny.yaml"
    path.write_text(yaml.safe_dump({"model": {"plugins": {"pkm": spec}}}))
    return str(path)


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_fit_with_pkm_alone_and_stacked_logs_usage(tmp_path, rlm_cache):
    alone, stacked = tmp_path / "alone", tmp_path / "stacked"
    alone.mkdir(), stacked.mkdir()
    run_rlm(fit_args(pkm_fragment(tmp_path)), alone, rlm_cache)
    run_rlm(
        fit_args(CONFIGS / "plugins" / "tokenid.yaml", pkm_fragment(tmp_path, mode="add")), stacked, rlm_cache
    )
    for run in (alone, stacked):
        rows = read_metrics(run / RUN)
        assert len(column(rows, "train/loss")) == 6
        usage = column(rows, "val/pkm/layer1/usage")
        assert usage and all(0 < u <= 1 for u in usage)
        assert column(rows, "val/pkm/layer1/kl_uniform")
    # One process: values updated by the row-wise Adam, whose moments are checkpointed by the callback.
    ckpt = torch.load(alone / "runs/test/ckpt/last.ckpt", map_location="cpu", weights_only=False)
    state = ckpt["callbacks"]["PKMCallback[pkm]"]["state"]["shared"]
    assert float(state["step"]) == 6 and state["exp_avg"].abs().sum() > 0
    groups = [g.get("name") for opt in ckpt["optimizer_states"] for g in opt["param_groups"]]
    assert "pkm_values" not in groups


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_resume_restores_the_row_optimizer(tmp_path, rlm_cache):
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight.mkdir(), split.mkdir()
    fragment = pkm_fragment(tmp_path)
    run_rlm(fit_args(fragment) + ["--trainer.max_steps=6"], straight, rlm_cache)
    run_rlm(fit_args(fragment) + ["--trainer.max_steps=3"], split, rlm_cache)
    first = column(read_metrics(split / RUN), "train/loss")  # the resumed run rewrites this log
    ckpt = split / "runs/test/ckpt/last.ckpt"
    run_rlm(fit_args(fragment) + ["--trainer.max_steps=6", "--ckpt_path", ckpt], split, rlm_cache)
    a = column(read_metrics(straight / RUN), "train/loss")
    b = first + column(read_metrics(split / RUN), "train/loss")
    assert len(a) == len(b) == 6
    # Without the value moments in the checkpoint, steps 4-6 would restart Adam on the values and differ.
    assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-5)


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_two_cpu_processes_with_dense_values(tmp_path, rlm_cache):
    args = fit_args(pkm_fragment(tmp_path, sparse=False))
    args += DDP_2CPU
    proc = run_rlm(args, tmp_path, rlm_cache)
    rows = read_metrics(tmp_path / RUN)
    assert len(column(rows, "train/loss")) == 4
    assert column(rows, "val/pkm/layer1/usage")
    assert "distributed_backend=gloo" in proc.stdout + proc.stderr
    # Distributed: dense value gradients reduced by DDP, values in their own AdamW group, no row-wise state.
    ckpt = torch.load(tmp_path / "runs/test/ckpt/last.ckpt", map_location="cpu", weights_only=False)
    assert not ckpt["callbacks"]["PKMCallback[pkm]"]["state"]
    (group,) = [
        g for opt in ckpt["optimizer_states"] for g in opt["param_groups"] if g.get("name") == "pkm_values"
    ]
    assert group["lr"] == 1e-3 and group["weight_decay"] == 0.0


# slow: runs the benchmark script end to end at its smoke size
@pytest.mark.slow
def test_benchmark_script_smoke(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_pkm", CONFIGS.parent / "benchmarks" / "pkm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(
        [
            "--n",
            "32",
            "64",
            "--batch",
            "1",
            "--seq",
            "16",
            "--repeat",
            "1",
            "--model-seq",
            "16",
            "--model-batch",
            "1",
            "--option-n",
            "32",
        ]
    )
    out = capsys.readouterr().out
    assert "| pkm sparse n=64 | 4,096 |" in out and "| pkm dense n=32 |" in out
    assert "peer" in out and "pkm at layer 2, n=64" in out
    assert "| PEER values | 1,024 |" in out and "| gated | 1,024 |" in out and "| key_norm | 1,024 |" in out


def _synced_bn_worker(
    rank: int, world: int, port: int, x: torch.Tensor, mask: torch.Tensor, out: dict
) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        bn = MaskedBatchNorm(x.shape[1]).double()
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        xr = x[rows].clone().requires_grad_(True)
        y = bn(xr, mask[rows])
        (y[mask[rows]] ** 3).sum().backward()
        out[rank] = (y.detach(), xr.grad, bn.running_mean.clone(), bn.running_var.clone())
    finally:
        dist.destroy_process_group()


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
def test_batchnorm_is_synced_across_two_processes():
    import socket

    import torch.multiprocessing as mp

    x = torch.randn(12, 5, dtype=torch.float64)
    mask = torch.ones(12, dtype=torch.bool)
    mask[[2, 9, 10]] = False  # padding on both ranks
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_synced_bn_worker, args=(2, port, x, mask, out), nprocs=2)
        got = dict(out)
    # Reference: one process over all rows (statistics of every valid row of both ranks).
    bn = MaskedBatchNorm(5).double()
    x1 = x.clone().requires_grad_(True)
    y = bn(x1, mask)
    (y[mask] ** 3).sum().backward()
    assert_close(torch.cat([got[0][0], got[1][0]]), y.detach())
    assert_close(torch.cat([got[0][1], got[1][1]]), x1.grad)
    for r in (0, 1):
        assert_close(got[r][2], bn.running_mean)
        assert_close(got[r][3], bn.running_var)


def test_fused_kernels_split_over_threads_give_the_same_numbers():
    if _pkm_native.load() is None:
        pytest.skip("no C compiler: the fused kernel is unavailable")
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # enough rows below for several ranges
    try:
        values, grad = torch.randn(4000, 16), torch.rand(300, 16) + 0.1
        slots, weights = torch.randint(0, 4000, (300, 8)), torch.rand(300, 8)
        want = (values[slots] * grad.unsqueeze(1)).sum(-1)
        assert_close(bag_dot(values, slots, grad), want)
        fused, plain = RowAdam(lr=0.01), RowAdam(lr=0.01)
        plain.native = False
        for opt in (fused, plain):
            opt.add_table("t", values.clone())
            opt.add_lookups("t", slots, weights, grad)
            opt.step()
        assert_close(fused.tables["t"], plain.tables["t"])
        assert_close(fused.state["t"]["exp_avg_sq"], plain.state["t"]["exp_avg_sq"])
    finally:
        torch.set_num_threads(threads)
