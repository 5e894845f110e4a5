"""Segment embedders of the retriever: per-token states (the cross-attention's keys and values) and e(.), the
L2-normalised mean of a segment's first ``pool_len`` states (causal blocks: e(z) on [z, z+1] is e(z) on z alone)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlm.distributed.parallel import full_tensor, plain_copy
from rlm.model.config import ModelConfig
from rlm.model.layers import TokenEmbedding
from rlm.model.transformer import Block
from rlm.plugin import Context


def masked_mean_unit(states: Tensor, mask: Tensor) -> Tensor:
    """L2-normalised mean of states (N, L, D) over real tokens mask (N, L); rows with no real token give 0."""
    w = mask.to(states.dtype).unsqueeze(-1)  # (N, L, 1)
    mean = (states * w).sum(1) / w.sum(1).clamp(min=1.0)  # (N, D)
    return F.normalize(mean.float(), dim=-1)


class SegmentEncoder(nn.Module):
    """tokens (N, M), mask (N, M) -> (states (N, M, dim), e (N, embed_dim) over the first pool_len): an embedding slot
    and blocks (bound())."""

    dim: int

    @property
    def embed_dim(self) -> int:
        """Width of e(.), the vectors an index is built from."""
        return self.dim

    def bound(self) -> tuple[nn.Module, list[nn.Module]]:
        """The embedding slot and the blocks."""
        raise NotImplementedError

    def embed_tokens(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """The token embeddings (N, M, D) the blocks start from."""
        return self.bound()[0](tokens, self.context(tokens, mask))

    def run(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """Per-token states (N, M, D)."""
        embed, blocks = self.bound()
        ctx = self.context(tokens, mask)
        x = embed(tokens, ctx)  # (N, M, D)
        for block in blocks:
            x = block(x, ctx)
        return x

    def forward(self, tokens: Tensor, mask: Tensor, pool_len: int | None = None) -> tuple[Tensor, Tensor]:
        states = self.run(tokens, mask)  # (N, M, D)
        p = pool_len or tokens.shape[1]
        return states, masked_mean_unit(states[:, :p, : self.embed_dim], mask[:, :p])

    def pooled(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """e(.) alone (N, D): what an index row or an online query needs."""
        return self(tokens, mask)[1]

    def context(self, tokens: Tensor, mask: Tensor) -> Context:
        """The Context the embedding slot and the blocks run with."""
        return Context(tokens=tokens, mask=mask, stage="train" if self.training else "val")


class SharedEncoder(SegmentEncoder):
    """The LM's embedding slot and first ``n_layers`` blocks (MARGE shares its encoder), held unregistered."""

    def __init__(self, model_config: ModelConfig, n_layers: int) -> None:
        super().__init__()
        self.dim, self.n_layers = model_config.d_model, n_layers
        object.__setattr__(self, "_parts", None)

    def bind(self, model: nn.Module) -> None:
        """Point at the model's embedding and lower blocks (called from Plugin.attach)."""
        object.__setattr__(self, "_parts", (model.embed, list(model.blocks[: self.n_layers])))

    def train(self, mode: bool = True) -> SharedEncoder:
        """Also switch the referenced LM modules (a frozen deep copy must not run dropout)."""
        super().train(mode)
        if self._parts is not None:
            for module in (self._parts[0], *self._parts[1]):
                module.train(mode)
        return self

    def bound(self) -> tuple[nn.Module, list[nn.Module]]:
        """The model's embedding slot and lower blocks; an error before Plugin.attach."""
        if self._parts is None:
            raise RuntimeError(
                f"the retrieval encoder {type(self).__name__} is not bound to a model (Plugin.attach not called)"
            )
        return self._parts

    def weights(self) -> list[Tensor]:
        """The tensors that determine the embeddings (for the identity hash)."""
        embed, blocks = self._parts
        return [p for m in (embed, *blocks) for p in m.state_dict().values()]


class TokenEncoder(SharedEncoder):
    """The LM's token embeddings alone (embedder 'tokens'). A token's state is its embedding beside its predecessor's,
    so one cross-attention layer can copy as an induction head does (Olsson et al. 2022); e(.) pools the embeddings."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config, 0)
        self.dim = 2 * model_config.d_model

    @property
    def embed_dim(self) -> int:
        """e(.) pools the token embeddings alone: d_model, half the states' width."""
        return self.dim // 2

    def run(self, tokens: Tensor, mask: Tensor) -> Tensor:
        x = self.embed_tokens(tokens, mask)  # (N, M, d)
        return torch.cat([x, F.pad(x[:, :-1], (0, 0, 1, 0))], -1)  # (N, M, 2d): [x_j, x_{j-1}]

    def distinct(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The embedding (U, d) of each distinct token id, and each token's row in it (the slot is a function of the
        id alone)."""
        ids, row = torch.unique(tokens, return_inverse=True)
        x = self.embed_tokens(ids[None], torch.ones_like(ids[None], dtype=torch.bool))[0]  # (U, d)
        return x, row

    def pooled(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """e(.) from the distinct ids' embeddings, without the (N, M, 2d) states."""
        x, row = self.distinct(tokens)
        return masked_mean_unit(x[row], mask)


class SeparateEncoder(SegmentEncoder):
    """A small encoder of its own: token table and ``n_layers`` width-``dim`` blocks, then an RMSNorm."""

    def __init__(self, model_config: ModelConfig, n_layers: int, dim: int) -> None:
        super().__init__()
        heads = max(1, dim // 32)
        cfg = replace(model_config, d_model=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=None, d_ff=None)
        self.dim = dim
        self.embed = TokenEmbedding(cfg)
        nn.init.normal_(self.embed.table.weight, 0.0, cfg.init_std)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=cfg.norm_eps)

    def bound(self) -> tuple[nn.Module, list[nn.Module]]:
        return self.embed, list(self.blocks)

    def run(self, tokens: Tensor, mask: Tensor) -> Tensor:
        return self.norm(super().run(tokens, mask))

    def weights(self) -> list[Tensor]:
        """The tensors that determine the embeddings (for the identity hash)."""
        return list(self.state_dict().values())


def weights_hash(tensors: list[Tensor]) -> str:
    """sha256 of the tensors' bytes: two embedders with equal weights hash equally."""
    h = hashlib.sha256()
    for t in tensors:
        # sharded (FSDP) weights hash as the whole tensor, so every rank and a 1-process run agree
        h.update(full_tensor(t).detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def config_hash(*configs: object) -> str:
    """sha256 of dataclass configs as sorted JSON."""
    payload = json.dumps([asdict(c) for c in configs], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class FrozenEmbedder:
    """A frozen deep copy of an encoder that embeds segments for a rebuild (rlm.index's Embedder), in a thread if
    need be; in float32 whatever the autocast: bfloat16 ranks the index's segments worse."""

    def __init__(self, encoder: SegmentEncoder, identity: dict) -> None:
        # plain_copy: a deep copy with full, unsharded weights under FSDP, so the thread embeds on its own
        self.encoder = plain_copy(encoder).eval().requires_grad_(False)
        self.identity = dict(identity)

    @torch.no_grad()
    def embed_segments(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """(S, L) tokens and mask -> (S, D) float32 unit vectors."""
        device = next(self.encoder.bound()[0].parameters()).device  # a shared encoder's: the LM's embedding's
        with torch.autocast(device.type, enabled=False):
            return self.encoder.pooled(tokens.to(device), mask.to(device)).float()

    def embedder_identity(self) -> dict:
        """Which embedder and weights produced the vectors."""
        return dict(self.identity)
