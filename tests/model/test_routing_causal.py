"""Routing is causal and, at evaluation, independent of the rest of the batch (issue 14, item 3).

Perturbation tests over every routing mode of the MoE (softmax top-1 / top-2, Token-ID, LSH), with a capacity
that drops tokens and dropless, on both dispatch paths: changing later tokens never changes earlier logits
(training and evaluation), and a sequence's evaluation logits are the same alone and in a batch.
"""

import pytest
import torch
from torch.testing import assert_close

from rlm.model import ModelConfig, Transformer
from rlm.plugin import Context
from rlm.plugins.moe import MoEConfig, MoELayer

V = 64
ROUTINGS = [
    dict(lookup="softmax", top_k=1),
    dict(lookup="softmax", top_k=2),
    dict(lookup="softmax", top_k=2, renormalize=True),
    dict(lookup="token_id"),
    dict(lookup="lsh"),
]


def moe_model(routing: dict, capacity_factor: float, dispatch: str) -> Transformer:
    """Two layers, both MoE with 4 experts; no jitter, so two forwards of the same batch are equal."""
    ffn = "plain" if routing["lookup"] == "lsh" else "gated"
    mc = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, ffn=ffn, max_seq_len=64)
    moe = dict(
        layers=[0, 1], num_experts=4, capacity_factor=capacity_factor, dispatch=dispatch, router_jitter=0.0
    )
    torch.manual_seed(0)
    return Transformer(mc, {"moe": {**moe, **routing}})


def logits(model: Transformer, tokens: torch.Tensor, stage: str) -> torch.Tensor:
    return model(tokens, Context(tokens=tokens, stage=stage))  # (B, T, V)


CASES = [
    pytest.param(r, cf, dp, id=f"{'-'.join(f'{k}={v}' for k, v in r.items())}-cf={cf}-{dp}")
    for r in ROUTINGS
    for cf in (0.5, 0.0)
    for dp in ("grouped", "bmm")
]


@pytest.mark.parametrize("stage", ["train", "val"])
@pytest.mark.parametrize("routing,capacity_factor,dispatch", CASES)
def test_later_tokens_never_change_earlier_logits(routing, capacity_factor, dispatch, stage):
    model = moe_model(routing, capacity_factor, dispatch)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (3, 16), generator=gen)
    changed = tokens.clone()
    t = 7  # positions <= t are kept; every later position of every sequence changes
    changed[:, t + 1 :] = torch.randint(0, V, (3, 16 - t - 1), generator=gen)
    with torch.no_grad():
        a, b = logits(model, tokens, stage), logits(model, changed, stage)
    assert_close(a[:, : t + 1], b[:, : t + 1], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # the perturbation did reach the model


@pytest.mark.parametrize("routing,capacity_factor,dispatch", CASES)
def test_eval_logits_are_the_same_alone_and_in_a_batch(routing, capacity_factor, dispatch):
    model = moe_model(routing, capacity_factor, dispatch)
    tokens = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        batch = logits(model, tokens, "val")
        for i in range(tokens.shape[0]):
            assert_close(logits(model, tokens[i : i + 1], "val")[0], batch[i], atol=1e-5, rtol=1e-5)
        assert_close(logits(model, tokens, "predict"), batch)  # generation routes as evaluation does


@pytest.mark.parametrize("stage", ["train", "val"])
def test_issue_reproduction_top2_capacity_is_causal(stage):
    """2 experts, identity router, capacity factor 0.5 (one place per expert for 2 tokens x 2 choices), no
    jitter: token 0's output must not change when only token 1 changes. GShard's choice-major priority let
    token 1's first choice take expert 1's only place before token 0's second choice."""
    mc = ModelConfig(vocab_size=V, d_model=2, n_layers=1, n_heads=1)
    cfg = MoEConfig(layers=[0], num_experts=2, top_k=2, capacity_factor=0.5, router_jitter=0.0)
    layer = MoELayer(cfg, mc, 0)
    assert layer.capacity(2) == 1
    with torch.no_grad():
        layer.lookup.weight.copy_(torch.eye(2))
    tokens = torch.zeros(1, 2, dtype=torch.long)
    x0 = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])  # token 1 prefers expert 0 as token 0 does
    x1 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # token 1 prefers expert 1
    with torch.no_grad():
        y0 = layer(x0, Context(tokens=tokens, stage=stage))
        y1 = layer(x1, Context(tokens=tokens, stage=stage))
    assert_close(y0[0, 0], y1[0, 0])


@pytest.mark.parametrize(
    "tokens,experts,factor,top_k,expected",
    [(100, 2, 1.1, 1, 55), (100, 2, 1.25, 1, 63), (64, 8, 1.0, 2, 16), (10, 3, 1.0, 1, 4), (1, 8, 0.1, 1, 1)],
)
def test_capacity_is_integer_arithmetic(tokens, experts, factor, top_k, expected):
    mc = ModelConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=2)
    cfg = MoEConfig(layers=[0], num_experts=experts, top_k=top_k, capacity_factor=factor)
    assert MoELayer(cfg, mc, 0).capacity(tokens) == expected
