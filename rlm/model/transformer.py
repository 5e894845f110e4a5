"""The pre-norm decoder-only transformer and its named slots (rlm.plugin.base.Slot; README, 'Adding a plugin')."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from rlm.model.assemble import apply_plugins
from rlm.model.config import ModelConfig
from rlm.model.layers import FeedForward, RMSNorm, SelfAttention, TokenEmbedding
from rlm.model.loss import head_cross_entropy
from rlm.plugin.context import Context


def _run_slot(main: nn.Module, adds: nn.ModuleList, x: Tensor, ctx: Context) -> Tensor:
    """A slot's output: its module plus every ADD module on the same input."""
    y = main(x, ctx)
    for extra in adds:
        y = y + extra(x, ctx)
    return y


class Block(nn.Module):
    """One pre-norm block: x + attn(norm(x)) [+ cross(norm(x))] then x + ffn(norm(x))."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn: nn.Module = SelfAttention(config, layer)
        self.attn_add = nn.ModuleList()
        self.cross_norm: nn.Module | None = None
        self.cross_attn: nn.Module | None = None  # absent until a plugin fills it
        self.cross_attn_add = nn.ModuleList()
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.ffn: nn.Module = FeedForward(config)
        self.ffn_add = nn.ModuleList()
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        x = x + self.drop(_run_slot(self.attn, self.attn_add, self.attn_norm(x), ctx))  # (B, T, d)
        if self.cross_attn is not None:
            x = x + self.drop(_run_slot(self.cross_attn, self.cross_attn_add, self.cross_norm(x), ctx))
        return x + self.drop(_run_slot(self.ffn, self.ffn_add, self.ffn_norm(x), ctx))


class Stack(nn.Module):
    """The stack slot's default: a plain loop over the blocks."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        for block in self.blocks:
            x = block(x, ctx)
        return x


class Embedding(nn.Module):
    """The embedding slot holder: its module plus ADD modules (for example Token-ID input tables)."""

    def __init__(self, main: nn.Module) -> None:
        super().__init__()
        self.main = main
        self.add = nn.ModuleList()

    def forward(self, tokens: Tensor, ctx: Context) -> Tensor:
        return _run_slot(self.main, self.add, tokens, ctx)


class Transformer(nn.Module):
    """Decoder-only LM whose embedding, attention, cross-attention, FFN and stack slots plugins may fill."""

    def __init__(self, config: ModelConfig, plugins: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.config = config
        token_embedding = TokenEmbedding(config)
        self.embed = Embedding(token_embedding)
        blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.stack: nn.Module = Stack(blocks)
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.head = nn.Linear(config.d_model, config.padded_vocab, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            # GPT-2's scaled init of residual output projections: std / sqrt(2 * n_layers).
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, 0.0, config.init_std / math.sqrt(2 * config.n_layers))
        if config.tie_embeddings:
            self.head.weight = token_embedding.weight
        # The blocks, reachable whatever wraps the stack; a plain list so they are not registered twice.
        object.__setattr__(self, "_blocks", list(blocks))
        self.plugins = nn.ModuleDict()
        if plugins:
            apply_plugins(self, plugins)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, self.config.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, self.config.init_std)

    @property
    def blocks(self) -> list[Block]:
        return self._blocks

    @property
    def token_embedding(self) -> nn.Embedding:
        """The base (vocab, d) token table, also the tied output head."""
        return self.head if self.config.tie_embeddings else self.embed.main.table  # type: ignore[return-value]

    def hidden(self, tokens: Tensor, ctx: Context) -> Tensor:
        """Final normed hidden states (B, T, d); with ``ctx.cache``, of the T tokens that follow the cached ones,
        whose keys, values and ids the cache then holds too."""
        if ctx.cache is not None:
            ctx.cache.check(ctx.offset, tokens)
        x = self.embed(tokens, ctx)  # (B, T, d)
        x = self.norm(self.stack(x, ctx))
        if ctx.cache is not None:
            ctx.cache.advance(ctx.offset, tokens)
        return x

    def forward(self, tokens: Tensor, ctx: Context | None = None, targets: Tensor | None = None) -> Tensor:
        """Logits (B, T, vocab): the head's padded rows (config.vocab_multiple) cut off. With ``targets`` (B, T;
        -100 ignored), their mean cross-entropy instead, without the logits (rlm.model.loss)."""
        ctx = ctx if ctx is not None else Context(tokens=tokens, stage="train" if self.training else "val")
        hidden = self.hidden(tokens, ctx)
        ctx.hidden = hidden
        if targets is not None:
            return head_cross_entropy(hidden, self.head.weight, targets, self.config.vocab_size)
        logits = self.head(hidden)  # (B, T, padded vocab)
        vocab = self.config.vocab_size
        return logits if logits.shape[-1] == vocab else logits[..., :vocab]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def added_parameters(self) -> int:
        """Parameters the plugins add over the base model (built on the meta device, no memory used)."""
        with torch.device("meta"):
            base = Transformer(self.config).num_parameters()
        return self.num_parameters() - base

    def active_parameters(self) -> int:
        """Parameters used per token: total minus what each plugin reports as unused per token."""
        return self.num_parameters() - sum(p.inactive_parameters() for p in self.plugins.values())
