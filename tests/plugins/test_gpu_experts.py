"""The grouped GEMM path of the experts on CUDA in bf16: grouped against bmm against a loop over tokens.

Runs on torch versions with the public ``F.grouped_mm`` and on older ones with only ``torch._grouped_mm``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rlm.plugins import _experts
from rlm.plugins._experts import Experts, dispatch, plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BF16 = {"atol": 3e-2, "rtol": 3e-2}


def _setup(activation: str, n: int = 8, d: int = 64, hidden: int = 128, tokens: int = 96, seed: int = 0):
    torch.manual_seed(seed)
    experts = Experts(n, d, hidden, activation, 0.05, 0.05).cuda()
    x = torch.randn(tokens, d, device="cuda")
    index = torch.randint(0, n, (tokens, 2), device="cuda")
    index[:, 1] = (index[:, 0] + 1) % n  # two distinct choices per token
    weight = torch.rand(tokens, 2, device="cuda")
    return experts, x, index, weight


def _loop(experts: Experts, x, index, weight):
    """sum_j w_j E_{index_j}(x) token by token, in float32 from bf16-rounded weights and inputs."""
    up, down = experts.up.bfloat16().float(), experts.down.bfloat16().float()
    xs = x.bfloat16().float()
    y = torch.zeros_like(x)
    for s in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[s, j])
            h = xs[s] @ up[e]
            if experts.activation == "swiglu":
                gate, h = h.chunk(2)
                h = F.silu(gate) * h
            else:
                h = F.gelu(h)
            y[s] += weight[s, j] * (h @ down[e])
    return y


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(_experts, "_GROUPED_FAILED", set())


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_bmm_and_loop_agree_in_bf16(activation):
    experts, x, index, weight = _setup(activation)
    valid = torch.ones(x.shape[0], dtype=torch.bool, device="cuda")
    assert _experts.grouped_mm_op() is not None, "this torch has no grouped GEMM"
    ref = _loop(experts, x, index, weight)
    outs = {}
    for mode in ("grouped", "bmm", "auto"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs[mode], _ = dispatch(x, index, weight, valid, experts, None, mode)
        assert_close(outs[mode].float(), ref, **BF16)
    assert not _experts._GROUPED_FAILED, "the grouped GEMM raised and fell back to bmm"
    assert_close(outs["grouped"].float(), outs["bmm"].float(), **BF16)
    assert torch.equal(outs["auto"], outs["grouped"])  # auto takes the grouped GEMM on CUDA in bf16


def test_auto_takes_grouped_in_bf16_and_bmm_in_float32():
    experts, x, _, _ = _setup("swiglu")
    assert experts.grouped_ok(x.bfloat16()) == (torch.cuda.get_device_capability() >= (8, 0))
    assert not experts.grouped_ok(x)


def test_grouped_gradients_match_bmm_in_bf16():
    experts, x, index, weight = _setup("swiglu", seed=1)
    valid = torch.ones(x.shape[0], dtype=torch.bool, device="cuda")
    grads = {}
    for mode in ("grouped", "bmm"):
        experts.zero_grad()
        xg = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = dispatch(xg, index, weight, valid, experts, None, mode)
        (y.float() ** 2).sum().backward()
        grads[mode] = [xg.grad.clone(), experts.up.grad.clone(), experts.down.grad.clone()]
    assert not _experts._GROUPED_FAILED
    for g, b in zip(grads["grouped"], grads["bmm"]):
        assert_close(g, b, atol=5e-2, rtol=5e-2)


def test_grouped_with_capacity_drops_like_bmm():
    experts, x, index, weight = _setup("swiglu", seed=2)
    valid = torch.ones(x.shape[0], dtype=torch.bool, device="cuda")
    valid[-5:] = False  # padding takes no capacity
    with torch.autocast("cuda", dtype=torch.bfloat16):
        g, pg = dispatch(x, index, weight, valid, experts, 10, "grouped")
        b, pb = dispatch(x, index, weight, valid, experts, 10, "bmm")
    assert torch.equal(pg.counts, pb.counts) and int(pg.counts.max()) <= 10
    assert_close(g.float(), b.float(), **BF16)
    assert (g[-5:] == 0).all()
    assert torch.equal(plan(index, valid, 8, 10).token, pg.token)
