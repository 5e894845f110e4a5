"""PKM tables on huge pages: same numbers as plain tensors, aligned, and kept through an optimizer round trip."""

from __future__ import annotations

import torch

from rlm.model import ModelConfig
from rlm.plugins import _pkm_native
from rlm.plugins._pkm_rows import RowAdam
from rlm.plugins.pkm import PKMConfig, PKMPlugin


def test_huge_page_tensors_are_aligned_contiguous_and_writable():
    t = _pkm_native.huge_page_empty((2048, 1024))  # 8 MiB: large enough to be advised
    assert t.shape == (2048, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % _pkm_native.HUGE_PAGE == 0
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t))
    assert t[1234, 567] == 1234 * 1024 + 567
    small = _pkm_native.huge_page_empty((3, 5), torch.float64)
    assert small.shape == (3, 5) and small.dtype == torch.float64


def test_values_on_huge_pages_equal_the_plain_initialisation():
    mc = ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=2)
    torch.manual_seed(3)
    plugin = PKMPlugin(PKMConfig(n_keys=256, heads=2, topk=4, k_dim=8), mc)  # 64k x 64 floats: huge pages
    torch.manual_seed(3)
    want = torch.randn(256 * 256, 64) * 64**-0.5
    values = plugin.values["shared"]
    assert torch.equal(values.detach(), want)
    assert values.data_ptr() % _pkm_native.HUGE_PAGE == 0


def test_row_adam_moments_on_huge_pages_survive_a_state_dict_round_trip():
    table = _pkm_native.huge_page_empty((8192, 256)).normal_()
    opt = RowAdam(lr=0.01)
    opt.add_table("t", table)
    opt.add_lookups("t", torch.randint(0, 8192, (64, 8)), torch.rand(64, 8), torch.randn(64, 256))
    opt.step()
    state = opt.state["t"]
    assert all(state[m].data_ptr() % _pkm_native.HUGE_PAGE == 0 for m in ("exp_avg", "exp_avg_sq"))
    saved = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
    other = RowAdam(lr=0.01)
    other.add_table("t", table)
    other.load_state_dict({"state": saved})
    for name in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(other.state["t"][name], state[name])
    assert other.state["t"]["exp_avg"].data_ptr() % _pkm_native.HUGE_PAGE == 0
