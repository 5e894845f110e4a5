"""The gather path of PKM's table reads (index_select and a weighted sum forward, index_add_ backward; the default
on CUDA), forced on the CPU with _pkm_ops.VALUE_READ: output and gradients against the EmbeddingBag path and the
naive per-token equations, in float32 and under bf16 autocast; the row-wise Adam's step without host reads against
torch's SparseAdam; on a GPU, one training step under CUDA's sync debug mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from host_reads import _Count
from test_peer import naive_peer, peer_layer
from test_pkm import naive_memory, small_layer
from torch.testing import assert_close

from rlm.plugin import Context
from rlm.plugins import _pkm_ops
from rlm.plugins._pkm_ops import value_lookup
from rlm.plugins._pkm_rows import RowAdam, touched_rows

D = 32  # the tiny layers' width (test_pkm.small_layer, test_peer.peer_layer)
BF16 = {"atol": 2e-2, "rtol": 2e-2}


def _layer(values: str, sparse: bool, seed: int = 0):
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


def _forward_backward(
    path: str, values: str, sparse: bool, autocast: bool = False, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Output and every gradient (on the CPU) of one forward and backward on the ``path`` read on ``device``."""
    old, _pkm_ops.VALUE_READ = _pkm_ops.VALUE_READ, path
    try:
        plugin, layer = _layer(values, sparse)
        plugin.to(device), layer.to(device)
        x, ctx, target = _inputs()
        x, target = x.to(device).requires_grad_(True), target.to(device)
        ctx = Context(tokens=ctx.tokens.to(device), mask=ctx.mask.to(device))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = layer(x, ctx)
        (y.float() * target).sum().backward()
    finally:
        _pkm_ops.VALUE_READ = old
    got = {"out": y.detach().float(), "x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    got |= {key: _value_grad(plugin, key) for key in plugin.values}
    return {name: t.cpu() for name, t in got.items()}


def _naive(values: str) -> dict[str, torch.Tensor]:
    """The same output and gradients through the per-token loops of test_pkm / test_peer (autograd)."""
    plugin, layer = _layer(values, False)
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


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("values", ["embedding", "peer"])
def test_gather_read_equals_the_bag_read_and_the_naive_loop(values, sparse):
    gather = _forward_backward("gather", values, sparse)
    _assert_same(gather, _forward_backward("bag", values, sparse))
    _assert_same(gather, _naive(values))


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("values", ["embedding", "peer"])
def test_gathers_in_many_blocks_give_the_same_sums(values, sparse, monkeypatch):
    whole = _forward_backward("gather", values, sparse)
    monkeypatch.setattr(_pkm_ops, "_block", lambda t: 100)  # a token, or 3 lookups, a block
    _assert_same(_forward_backward("gather", values, sparse), whole)


@pytest.mark.parametrize("values", ["embedding", "peer"])
def test_gather_read_under_bf16_autocast_is_close_to_the_bag_read(values):
    gather = _forward_backward("gather", values, True, autocast=True)
    _assert_same(gather, _forward_backward("bag", values, True, autocast=True), **BF16)


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
        plugin, layer = _layer(values, True)
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


@pytest.mark.parametrize("rows", [40, 300], ids=["more-reads-than-rows", "fewer"])
def test_touched_rows_are_the_distinct_rows_and_their_gradients(rows):
    g = torch.Generator().manual_seed(0)
    slots = torch.randint(0, 40, (30, 6), generator=g)
    slots[:, 0] = 7  # a hot row, read by every token
    weights, grad = torch.rand(30, 6, generator=g), torch.randn(30, 5, generator=g)
    opt = RowAdam()
    opt.add_table("t", torch.zeros(rows, 5))
    opt.add_lookups("t", slots, weights, grad)
    got_rows, got = touched_rows(*opt._reads("t"), rows=rows)
    want_rows, want = opt.pending("t")
    U = want_rows.numel()
    assert got_rows.shape == (min(slots.numel(), rows),)
    assert torch.equal(got_rows[:U], want_rows) and (got_rows[U:] == want_rows[-1]).all()
    assert_close(got[:U], want)
    assert torch.equal(got[U:], got[U - 1].expand(got.shape[0] - U, -1))  # the same numbers, written twice


@pytest.mark.parametrize("rows", [100, 300], ids=["more-reads-than-rows", "fewer"])
def test_row_adam_on_the_gather_path_matches_torch_sparse_adam(rows, monkeypatch):
    monkeypatch.setattr(_pkm_ops, "VALUE_READ", "gather")
    table = torch.randn(rows, 8)
    ref = table.clone().requires_grad_(True)
    opt, ref_opt = RowAdam(lr=0.01), torch.optim.SparseAdam([ref], lr=0.01)
    opt.add_table("t", table)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        dense = torch.zeros(rows, 8)
        for n, m in ((20 + step, 6), (7, 3)):  # two reads of the table add up
            slots = torch.randint(0, 60 + 10 * step, (n, m), generator=g)
            slots[:, 0] = 3  # a hot row
            weights, grad = torch.rand(n, m, generator=g), torch.rand(n, 8, generator=g) + 0.1
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


def _host_reads(path: str, values: str, monkeypatch) -> dict[str, int]:
    """Host reads (tests/host_reads.py) of one training step of a layer and its value rows on ``path``."""
    monkeypatch.setattr(_pkm_ops, "VALUE_READ", path)
    plugin, layer = _layer(values, True)
    x, ctx, target = _inputs()
    x.requires_grad_(True)
    count = _Count(set())
    # The autograd engine runs a backward with no torch-function mode: the memory's own backwards count again.
    for op in (_pkm_ops._ProductKeySearch, _pkm_ops._ValueRead):
        monkeypatch.setattr(op, "backward", staticmethod(_counted(op.backward, count)))
    with count:
        (layer(x, ctx) * target).sum().backward()
        plugin.row_optimizer.step()
    return dict(count.where)


def _counted(backward, count: _Count):
    def run(ctx, *grads):
        with count:
            return backward(ctx, *grads)

    return run


@pytest.mark.parametrize("values", ["embedding", "peer"])
def test_a_training_step_on_the_gather_path_reads_the_host_never(values, monkeypatch):
    bag = _host_reads("bag", values, monkeypatch)
    assert any("unique_consecutive _pkm_ops" in where for where in bag) and "_pkm_rows" in str(bag)  # counted
    assert _host_reads("gather", values, monkeypatch) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("values", ["embedding", "peer"])
def test_cuda_reads_gathers_and_equals_the_cpu_bag_read(values, sparse):
    assert _pkm_ops.VALUE_READ == "auto" and _pkm_ops.gathers(torch.empty(0, device="cuda"))
    cuda = _forward_backward("auto", values, sparse, device="cuda")
    _assert_same(cuda, _forward_backward("bag", values, sparse), atol=1e-5, rtol=1e-4)  # sums in other orders


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("values", ["embedding", "peer"])
def test_a_cuda_training_step_never_synchronises(values):
    torch.manual_seed(0)
    plugin, layer = _layer(values, True)
    plugin.cuda(), layer.cuda()
    x, ctx, target = _inputs()
    x, target, ctx = x.cuda(), target.cuda(), Context(tokens=ctx.tokens.cuda(), mask=ctx.mask.cuda())

    def step() -> None:  # the memory's part of a training step: forward, backward, the value rows' Adam
        layer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x, ctx)
        (y.float() * target).sum().backward()
        plugin.row_optimizer.step()

    step()  # the first step builds what is cached (the search's candidate pairs) and the row optimizer's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(t.isfinite().all() for t in plugin.values.values())
    assert all(int(st["step"]) == 2 for st in plugin.row_optimizer.state.values())
