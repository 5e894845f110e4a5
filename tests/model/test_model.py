"""Numerics of the core layers against naive references."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlm.model import ModelConfig, Transformer
from rlm.model.layers import RMSNorm, SelfAttention, apply_rope, rope_cache
from rlm.plugin import Context


def naive_rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i+h/2}) at position t by angle t * base^(-2i/h), one element at a time."""
    B, H, T, D = x.shape
    out = torch.empty_like(x)
    half = D // 2
    for t in range(T):
        for i in range(half):
            theta = t * base ** (-2 * i / D)
            c, s = math.cos(theta), math.sin(theta)
            a, b = x[..., t, i], x[..., t, i + half]
            out[..., t, i] = a * c - b * s
            out[..., t, i + half] = a * s + b * c
    return out


def naive_causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d) + causal mask) v with explicit loops over query positions."""
    B, H, T, D = q.shape
    out = torch.zeros_like(q)
    for t in range(T):
        scores = (q[:, :, t : t + 1] @ k[:, :, : t + 1].transpose(-1, -2)) / math.sqrt(D)  # (B, H, 1, t+1)
        out[:, :, t] = (scores.softmax(-1) @ v[:, :, : t + 1])[:, :, 0]
    return out


def test_rope_matches_naive():
    x = torch.randn(2, 3, 7, 8, dtype=torch.float64)
    cos, sin = rope_cache(7, 8, 10000.0)
    assert_close(apply_rope(x, cos.double(), sin.double()), naive_rope(x, 10000.0))


def test_rope_preserves_relative_positions():
    # q_m . k_n depends only on m - n: shifting both positions leaves the score unchanged.
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)
    cos, sin = rope_cache(20, 16, 10000.0)
    cos, sin = cos.double(), sin.double()

    def score(m, n):
        return (
            apply_rope(q, cos[m : m + 1], sin[m : m + 1]) * apply_rope(k, cos[n : n + 1], sin[n : n + 1])
        ).sum()

    assert_close(score(5, 2), score(15, 12))


@pytest.mark.parametrize("kv_heads", [None, 1, 2])
def test_attention_matches_naive(kv_heads):
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=kv_heads, max_seq_len=16)
    attn = SelfAttention(cfg).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    B, T, _ = x.shape
    q, k, v = attn.qkv(x).split([4 * 8, cfg.kv_heads * 8, cfg.kv_heads * 8], dim=-1)
    q = q.view(B, T, 4, 8).transpose(1, 2)
    k = k.view(B, T, cfg.kv_heads, 8).transpose(1, 2)
    v = v.view(B, T, cfg.kv_heads, 8).transpose(1, 2)
    q, k = naive_rope(q, cfg.rope_base), naive_rope(k, cfg.rope_base)
    rep = 4 // cfg.kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    ref = attn.proj(naive_causal_attention(q, k, v).transpose(1, 2).reshape(B, T, 32))
    assert_close(attn(x, Context(tokens=torch.zeros(B, T, dtype=torch.long))), ref)


def test_rmsnorm_matches_formula():
    norm = RMSNorm(6, eps=1e-5).double()
    norm.weight.data = torch.randn(6, dtype=torch.float64)
    x = torch.randn(3, 6, dtype=torch.float64)
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert_close(norm(x), ref)


def test_model_is_causal_and_ties_weights():
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
    model = Transformer(cfg).eval()
    assert model.head.weight is model.embed.main.table.weight
    x = torch.randint(0, 40, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 40
    assert_close(model(x)[:, :8], model(y)[:, :8])
    assert not torch.allclose(model(x)[:, 8:], model(y)[:, 8:])


def test_untied_model_has_separate_head():
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=2, tie_embeddings=False)
    model = Transformer(cfg)
    assert model.head.weight is not model.embed.main.table.weight
    assert (
        model.num_parameters()
        == Transformer(ModelConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=2)).num_parameters()
        + 40 * 32
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"d_model": 30, "n_heads": 4}, "must divide model.d_model=30"),
        ({"ffn": "swish"}, r"model: option ffn must be one of \('gated', 'plain'\), got 'swish'"),
        ({"n_layers": 0}, "model.n_layers must be a positive integer"),
        ({"d_model": 12, "n_heads": 4}, "must be even for rotary"),
        ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads=3"),
    ],
)
def test_config_errors_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_sequence_longer_than_rotary_cache_is_refused():
    model = Transformer(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("tied", [True, False])
def test_a_padded_vocabulary_is_the_same_model_and_its_padded_rows_get_no_gradient(tied):
    """vocab_multiple pads the table and the head (100 -> 128 rows); with the unpadded model's weights in the first
    100 rows the logits are the same, cut to the true vocabulary, and the padded rows get no gradient (so they
    never learn and no sampled or scored id is ever >= vocab_size)."""
    shape = dict(vocab_size=100, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=tied)
    plain = Transformer(ModelConfig(**shape))
    padded = Transformer(ModelConfig(**shape, vocab_multiple=64))
    assert padded.head.weight.shape == (128, 32) and padded.embed.main.table.weight.shape == (128, 32)
    state = plain.state_dict()
    with torch.no_grad():
        for name, value in padded.state_dict().items():
            if value.shape == state[name].shape:
                value.copy_(state[name])
            else:  # the table and the head: the real rows from the plain model, the padding left as initialised
                value[:100].copy_(state[name])
    tokens = torch.randint(0, 100, (2, 16))
    logits = padded(tokens)
    assert logits.shape == (2, 16, 100)
    assert_close(logits, plain(tokens))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    for weight in {id(w): w for w in (padded.head.weight, padded.embed.main.table.weight)}.values():
        assert weight.grad[100:].abs().sum() == 0 and weight.grad[:100].abs().sum() > 0


def test_vocab_multiple_is_checked():
    with pytest.raises(ValueError, match="vocab_multiple must be a positive integer, got 0"):
        ModelConfig(vocab_size=100, vocab_multiple=0)
    assert ModelConfig(vocab_size=50257, vocab_multiple=128).padded_vocab == 50304
