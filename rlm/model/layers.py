"""Building blocks of the core transformer: RMSNorm, rotary positions, attention, FFN. Every slot module maps
``(x, ctx)`` to a tensor of x's shape, so plugins can replace, add to or wrap any of them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlm.model.config import ModelConfig
from rlm.plugin.context import Context


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), no bias."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_cache(seq_len: int, head_dim: int, base: float, device=None) -> tuple[Tensor, Tensor]:
    """Cos/sin tables of rotary positions (Su et al. 2021), each (seq_len, head_dim/2)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of x (B, nh, T, hs) by the position angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # (T, hs/2), broadcast over (B, nh)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Rotary(nn.Module):
    """Holds the rotary tables as non-persistent buffers (recomputed, never checkpointed)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.shape = (config.max_seq_len, config.head_dim, config.rope_base)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Compute the tables (non-persistent buffers: rlm.hf calls this after loading, which leaves them empty)."""
        self.cos, self.sin = rope_cache(*self.shape, device=self.cos.device)

    def forward(self, q: Tensor, k: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        T = q.shape[-2]
        if offset + T > self.cos.shape[0]:
            raise ValueError(f"sequence of {offset + T} tokens exceeds model.max_seq_len={self.cos.shape[0]}")
        cos, sin = self.cos[offset : offset + T], self.sin[offset : offset + T]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def causal_mask(T: int, offset: int, device=None) -> Tensor:
    """(T, offset+T) bool: query i, at position offset+i, sees keys 0..offset+i (is_causal aligns top-left)."""
    return torch.ones(T, offset + T, dtype=torch.bool, device=device).tril(diagonal=offset)


class SelfAttention(nn.Module):
    """Causal multi-head (optionally grouped-query) attention with rotary positions."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer  # its keys and values in a KVCache
        self.n_heads, self.kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        self.qkv = nn.Linear(
            config.d_model, (config.n_heads + 2 * config.kv_heads) * config.head_dim, bias=False
        )
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.rotary = Rotary(config)
        self.dropout = config.dropout

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim],
            dim=-1,
        )
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q, k, ctx.offset)  # absolute positions offset..offset+T-1
        mask = None
        if ctx.cache is not None:  # incremental decoding: attend to the cached positions too
            k, v = ctx.cache.update(self.layer, k, v, ctx.offset)  # (B, nkv, offset+T, hs)
            mask = causal_mask(T, ctx.offset, x.device) if ctx.offset and T > 1 else None
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and k.shape[2] == T,  # a single new query sees every cached key
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.kv_heads != self.n_heads,
        )  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """Dense FFN: SwiGLU (gated) or GELU MLP (plain)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden
        self.gated = config.ffn == "gated"
        self.up = nn.Linear(config.d_model, (2 if self.gated else 1) * hidden, bias=False)
        self.down = nn.Linear(hidden, config.d_model, bias=False)

    def forward(self, x: Tensor, ctx: Context | None = None) -> Tensor:
        h = self.up(x)  # (B, T, [2]*hidden)
        if self.gated:
            gate, h = h.chunk(2, dim=-1)
            h = F.silu(gate) * h
        else:
            h = F.gelu(h)
        return self.down(h)


class TokenEmbedding(nn.Module):
    """The token embedding slot's default: one table of (padded vocab, d)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.table = nn.Embedding(config.padded_vocab, config.d_model)

    @property
    def weight(self) -> Tensor:
        return self.table.weight

    def forward(self, tokens: Tensor, ctx: Context) -> Tensor:
        return self.table(tokens)  # (B, T, d)
