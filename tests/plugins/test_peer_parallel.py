"""PKM's PEER values (He 2024) under DDP on 2 gloo processes against 1 process on the same global batch: the down
table u_i and the up table v_i are updated by the row-wise Adam from the exchanged reads (plugins/_pkm_rows.py
exchange_lookups), the query and sub-keys by SGD on DDP's averaged gradient."""

import pytest
import torch
from torch.testing import assert_close

from rlm.distributed.parallel import spawn_local
from rlm.model import ModelConfig
from rlm.plugin import Context
from rlm.plugins.pkm import PKMConfig, PKMPlugin

D, B, T, STEPS = 16, 2, 5, 3  # B rows per rank
TABLES = ("shared", "shared_down")


def _peer(distributed: bool):
    """A float64 PEER memory at layer 0 (64 experts, 2 heads x top-4, qk-norm), sparse values: row-wise Adam."""
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=50, d_model=D, n_layers=2, n_heads=2)
    config = PKMConfig(layers=[0], n_keys=8, heads=2, topk=4, k_dim=12, values="peer", key_norm=True)
    plugin = PKMPlugin(config, mc).double()
    layer = plugin.build(plugin.claims()[0], 0, None).double()
    assert plugin.resolve_sparse(distributed=distributed, row_exchange=True)
    return plugin, layer


def _train(plugin, layer, rows: slice) -> dict:
    """STEPS steps of loss = sum(m * r) / rows of the local batch: the row-wise Adam on u and v, SGD on the rest."""
    g = torch.Generator().manual_seed(1)
    sgd = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(STEPS):
        # x requires a gradient as a hidden state does: without one the down rows' read has no backward
        x = torch.randn(2 * B, T, D, generator=g, dtype=torch.float64)[rows].requires_grad_()
        r = torch.randn(2 * B, T, D, generator=g, dtype=torch.float64)[rows]
        ctx = Context(tokens=torch.zeros(x.shape[:2], dtype=torch.long))
        ((layer(x, ctx) * r).sum() / x.shape[0]).backward()
        plugin.row_optimizer.step()
        sgd.step()
        sgd.zero_grad()
    inner = getattr(layer, "module", layer)
    out = {k: plugin.values[k].detach().clone() for k in TABLES}
    out |= {"keys": inner.keys.detach().clone(), "query": inner.query.weight.detach().clone()}
    out["steps"] = [int(plugin.row_optimizer.state[k]["step"]) for k in TABLES]
    return out


def _worker(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        plugin, layer = _peer(distributed=True)
        # DDP all-reduces the query and sub-keys; the value tables have no .grad (requires_grad False), so it
        # leaves them to the row exchange.
        out[rank] = _train(plugin, DistributedDataParallel(layer), slice(rank * B, (rank + 1) * B))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# slow: two gloo processes, each starting torch
@pytest.mark.slow
@pytest.mark.ddp
def test_peer_down_and_up_tables_under_ddp_match_one_process_on_the_global_batch():
    got = spawn_local(_worker)
    plugin, layer = _peer(distributed=False)
    before = {k: plugin.values[k].detach().clone() for k in TABLES}
    want = _train(plugin, layer, slice(0, 2 * B))
    for key in (*TABLES, "keys", "query"):
        assert torch.equal(got[0][key], got[1][key]), key  # the replicas stay equal
        assert_close(got[0][key], want[key], msg=lambda m, k=key: f"{k}: {m}")
    assert got[0]["steps"] == want["steps"] == [STEPS, STEPS]
    for key in TABLES:  # the steps moved both tables
        assert not torch.equal(want[key], before[key]), key
