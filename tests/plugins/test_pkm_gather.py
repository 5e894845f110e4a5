"""The gather path of PKM's table reads (index_select and a weighted sum forward, index_add_ backward; the default
on CUDA), forced on the CPU with _pkm_ops.VALUE_READ: output and gradients against the EmbeddingBag path and the
naive per-token equations, in float32 and under bf16 autocast, and a few training steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_peer import naive_peer, peer_layer
from test_pkm import naive_memory, small_layer
from torch.testing import assert_close

from rlm.plugin import Context
from rlm.plugins import _pkm_ops
from rlm.plugins._pkm_ops import value_lookup

D = 32  # the tiny layers' width (test_pkm.small_layer, test_peer.peer_layer)
BF16 = {"atol": 2e-2, "rtol": 2e-2}


def _layer(values: str, sparse: str, seed: int = 0):
    """A float32 memory layer (gated embedding values, or PEER), built from the same seed on every call."""
    torch.manual_seed(seed)
    make = peer_layer if values == "peer" else small_layer
    plugin, layer = make(sparse=sparse, gated=values == "embedding")
    plugin.float(), layer.float()
    plugin.resolve_sparse(distributed=False)
    return plugin, layer


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 6, D, generator=g)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return (
        x,
        Context(tokens=torch.zeros(2, 6, dtype=torch.long), mask=mask),
        torch.randn(2, 6, D, generator=g),
    )


def _value_grad(plugin, key: str) -> torch.Tensor:
    """The gradient of value table ``key`` as its optimizer receives it: the row-wise Adam's reads, or ``.grad``."""
    table = plugin.values[key]
    if not plugin.sparse_active:
        return table.grad
    rows, g = plugin.row_optimizer.pending(key)
    return torch.zeros_like(table).index_copy_(0, rows, g)


def _forward_backward(path: str, values: str, sparse: str, autocast: bool = False) -> dict[str, torch.Tensor]:
    """Output and every gradient of one forward and backward on the ``path`` read."""
    old, _pkm_ops.VALUE_READ = _pkm_ops.VALUE_READ, path
    try:
        plugin, layer = _layer(values, sparse)
        x, ctx, target = _inputs()
        x.requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x, ctx)
        (y.float() * target).sum().backward()
    finally:
        _pkm_ops.VALUE_READ = old
    got = {"out": y.detach().float(), "x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return got | {key: _value_grad(plugin, key) for key in plugin.values}


def _naive(values: str) -> dict[str, torch.Tensor]:
    """The same output and gradients through the per-token loops of test_pkm / test_peer (autograd)."""
    plugin, layer = _layer(values, "false")
    x, ctx, target = _inputs()
    x.requires_grad_(True)
    tables = {k: t.detach().clone().requires_grad_(True) for k, t in plugin.values.items()}
    if values == "peer":
        y = naive_peer(layer, tables["shared_down"], tables["shared"], x.view(12, D), F.gelu)
    else:
        y = naive_memory(layer, tables["shared"], x.view(12, D), ctx.mask.view(12))
    (y.view(2, 6, D) * target).sum().backward()
    got = {"out": y.detach().view(2, 6, D), "x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return got | {k: t.grad for k, t in tables.items()}


def _assert_same(got: dict, want: dict, **tol) -> None:
    assert got.keys() == want.keys()
    for name in got:
        assert_close(got[name], want[name], **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("sparse", ["true", "false"])
@pytest.mark.parametrize("values", ["embedding", "peer"])
def test_gather_read_equals_the_bag_read_and_the_naive_loop(values, sparse):
    gather = _forward_backward("gather", values, sparse)
    _assert_same(gather, _forward_backward("bag", values, sparse))
    _assert_same(gather, _naive(values))


@pytest.mark.parametrize("values", ["embedding", "peer"])
def test_gather_read_under_bf16_autocast_is_close_to_the_bag_read(values):
    gather = _forward_backward("gather", values, "true", autocast=True)
    _assert_same(gather, _forward_backward("bag", values, "true", autocast=True), **BF16)


def test_gather_read_multiplies_in_autocasts_dtype_and_returns_the_tables():
    g = torch.Generator().manual_seed(0)
    table, slots, weights = (
        torch.randn(50, 16, generator=g),
        torch.randint(0, 50, (7, 5), generator=g),
        torch.rand(7, 5),
    )
    want = (table[slots] * weights[..., None]).sum(1)  # (N, d), the loop over the selected rows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for path in ("bag", "gather"):
            _pkm_ops.VALUE_READ = path
            try:
                out = value_lookup(slots, weights, table)
            finally:
                _pkm_ops.VALUE_READ = "auto"
            assert out.dtype == torch.float32
            if path == "bag":
                assert_close(out, want)
    bf16 = torch.bmm(weights.bfloat16().unsqueeze(1), table[slots].bfloat16()).squeeze(1).float()
    assert_close(out, bf16, atol=0, rtol=0)  # the gather path's product is the bfloat16 one
    assert_close(out, want, **BF16)


@pytest.mark.parametrize("values", ["embedding", "peer"])
def test_training_steps_on_the_gather_path_give_the_bag_paths_parameters(values, monkeypatch):
    result = {}
    for path in ("bag", "gather"):
        monkeypatch.setattr(_pkm_ops, "VALUE_READ", path)
        plugin, layer = _layer(values, "true")
        opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
        for step in range(3):
            x, ctx, target = _inputs(seed=10 + step)
            opt.zero_grad()
            (layer(x, ctx) * target).sum().backward()
            opt.step()
            plugin.row_optimizer.step()
        result[path] = {**layer.state_dict(), **{k: t.detach() for k, t in plugin.values.items()}}
        result[path] |= {f"{k}.{n}": t for k, st in plugin.row_optimizer.state.items() for n, t in st.items()}
    _assert_same(result["gather"], result["bag"])
