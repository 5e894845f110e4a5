"""The retriever's chunked cross-attention with MARGE's relevance bias (Lewis et al. 2020, eq. 2, as adapted by
Komatsuzaki 2020): the tokens of chunk j (segment S_{t+1}) attend to the tokens of the k neighbours of S_t, with

    logit(i, j in z) = q_i . k_j / sqrt(h) + beta * cos(e(S_t), e(z))      beta trainable, per layer

The neighbours are encoded once per forward (encode_neighbours) and shared by every cross-attention layer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlm.model.layers import RMSNorm, apply_rope, rope_cache
from rlm.plugin import Context
from rlm.plugins._retrieval_encoder import TokenEncoder, masked_mean_unit

if TYPE_CHECKING:
    from rlm.plugins._retrieval_neighbours import RetrievalInputs

BETA_INIT = 1.0  # initial relevance-bias scale beta of each layer


@dataclass
class Encoded:
    """The batch's neighbours as the cross-attention layers read them (computed once per forward)."""

    states: Tensor | None  # (U, M, De) the U distinct neighbours' states; None with the token embedder
    index: Tensor  # (B*n*k,) row of `states` of each neighbour slot
    key_valid: Tensor  # (B*n, k*M) real neighbour tokens of each chunk
    relevance: Tensor  # (B*n, k) cos(e(S_t), e(z)) of each chunk's neighbours
    segment_len: int  # L
    vocab: Tensor | None = None  # token embedder: (V', d) the embeddings of the distinct token ids
    rows: Tensor | None = None  # token embedder: (U, M) each neighbour token's row of `vocab`

    @property
    def neighbours(self) -> int:
        """U, the distinct neighbours."""
        return self.rows.shape[0] if self.states is None else self.states.shape[0]


def encode_neighbours(plugin: Any, inp: RetrievalInputs, ctx: Context) -> Encoded:
    """The batch's neighbours encoded, each distinct one once, as neighbour_grad says; e(S_t) with gradients."""
    encoder, label = plugin.encoder, plugin.label
    B, n, k, M = inp.tokens.shape
    L = inp.query_tokens.shape[-1]
    # (B*n, D), with gradients: the embedder's path from the LM loss
    _, e_query = encoder(inp.query_tokens.reshape(B * n, L), inp.query_mask.reshape(B * n, L))
    tokens, mask = inp.tokens.reshape(B * n * k, M), inp.mask.reshape(B * n * k, M)
    if inp.ids is not None:  # a neighbour's tokens follow from its id: encode each distinct one once
        ids = inp.ids.reshape(-1)
        uniq, index = torch.unique(ids, return_inverse=True)  # (U,), (B*n*k,)
        slots = torch.arange(len(ids), device=ids.device)
        first = torch.full_like(uniq, len(ids)).scatter_reduce(0, index, slots, "amin")  # (U,)
        tokens, mask = tokens[first], mask[first]
    else:
        index = torch.arange(B * n * k, device=tokens.device)
    mode = plugin.config.neighbour_grad if torch.is_grad_enabled() else "none"
    vocab = rows = states = None
    if isinstance(encoder, TokenEncoder):
        # no blocks: each distinct token id embedded once; the cross-attention projects from these
        # ('embedding' is 'full' here: the token embeddings are the whole encoder)
        with torch.set_grad_enabled(mode != "none"):
            vocab, rows = encoder.distinct(tokens)  # (V', d), (U, M)
            e_nb = masked_mean_unit(vocab[rows[:, :L]], mask[:, :L])  # (U, D), as TokenEncoder.forward
        vocab = vocab.float()
    else:
        # float32 (autocast off), like the relevance bias: bfloat16 neighbour embeddings rank worse
        with torch.set_grad_enabled(mode == "full"), torch.autocast(tokens.device.type, enabled=False):
            states, e_nb = encoder(tokens, mask, pool_len=L)  # (U, M, De), (U, D)
        states = states.float()
        # + 0 in value; d states / d embeddings taken as the blocks' residual identity
        if mode == "embedding":
            x0 = encoder.embed_tokens(tokens, mask)  # (U, M, De) with gradients: a table lookup
            states = states + (x0 - x0.detach())
    e_nb = e_nb[index]  # (B*n*k, D)
    relevance = (e_query.unsqueeze(1) * e_nb.view(B * n, k, -1)).sum(-1)  # (B*n, k) cosine
    valid = inp.valid.reshape(B * n, k).float()
    # means over the valid neighbours as masked sums, not valid.any() and boolean indexing (host syncs on a GPU);
    # 0 for a batch with none
    count = valid.sum().clamp(min=1)
    ctx.log(f"{label}/relevance", (relevance.detach() * valid).sum() / count)
    ctx.log(f"{label}/same_doc", (inp.same_doc.reshape(B * n, k).float() * valid).sum() / count)
    ctx.log(f"{label}/coverage", valid.amax(1).mean())
    return Encoded(states, index, inp.mask.reshape(B * n, k * M), relevance, L, vocab, rows)


def _refuse_scalar_beta(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """A checkpoint whose beta is a scalar predates beta's shape (1,): refused with what changed."""
    beta = state_dict.get(prefix + "beta")
    if beta is not None and beta.ndim == 0:
        raise ValueError(
            f"checkpoint: {prefix}beta is a scalar, from an rlm before the retriever's beta became shape (1,) (FSDP2 "
            "shards every parameter along dim 0); such checkpoints no longer load (`git log -S _beta_as_vector` says "
            "what changed): store beta reshaped to (1,)"
        )


class RetrievalCrossAttention(nn.Module):
    """Chunked cross-attention with relevance bias: chunk j's L queries attend to the k*M neighbour tokens."""

    def __init__(self, plugin: Any, layer: int) -> None:  # the RetrievalPlugin that owns it
        super().__init__()
        c = plugin.model_config
        self.layer, self.n_heads, self.head_dim = layer, c.n_heads, c.head_dim
        self.kv_heads = 1  # one key/value head shared by every query head (multi-query, Shazeer 2019)
        object.__setattr__(self, "_plugin", plugin)  # unregistered: the plugin owns this module
        self.q = nn.Linear(c.d_model, c.d_model, bias=False)
        self.kv_norm = RMSNorm(plugin.encoder.dim, c.norm_eps)
        self.kv = nn.Linear(plugin.encoder.dim, 2 * self.kv_heads * c.head_dim, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)
        for lin in (self.q, self.kv):
            nn.init.normal_(lin.weight, 0.0, c.init_std)
        if plugin.config.zero_init:  # starts as the model without retrieval (RetrievalConfig.zero_init)
            nn.init.zeros_(self.proj.weight)
        else:
            nn.init.normal_(self.proj.weight, 0.0, c.init_std / math.sqrt(2 * c.n_layers))
        # shape (1,), not a scalar: FSDP2 shards every parameter along dim 0 (and refuses 0-d ones)
        self.beta = nn.Parameter(torch.full((1,), BETA_INIT))
        self.register_load_state_dict_pre_hook(_refuse_scalar_beta)
        self.rope_base = c.rope_base

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        enc = self._plugin.encoded(ctx)
        if enc is None:  # no memory yet (before the first table lands, or no index exists): no retrieval
            return self._plugin.no_retrieval(x, self)
        key_valid, relevance, L = enc.key_valid, enc.relevance, enc.segment_len  # (B*n, k*M), (B*n, k)
        B, T, d = x.shape
        Bn, KM = key_valid.shape
        n, nk = Bn // B, relevance.shape[1]
        M = KM // nk
        h, hs, g = self.n_heads, self.head_dim, self.kv_heads
        # incremental decoding: x starts `lead` positions into the first chunk whose neighbours enc holds
        lead = ctx.offset % L if ctx.cache is not None else 0
        xq = F.pad(x, (0, 0, lead, n * L - T - lead)).reshape(Bn, L, d)  # (B*n, L, d): chunk j = segment j
        q = self.q(xq).view(Bn, L, h, hs).transpose(1, 2)  # (B*n, h, L, hs)
        # keys and values once per distinct neighbour, then laid out per chunk
        U = enc.neighbours
        kv = self._cached_keys_values(enc, ctx).view(U, M, 2, g, hs)
        kv = kv.permute(2, 0, 3, 1, 4)  # (2, U, g, M, hs)
        # Relative positions, as RETRO's chunked cross-attention has: chunk j (S_{t+1}) sits at positions L..2L-1,
        # right after its query segment S_t, which lines up with each neighbour z at 0..L-1 and its continuation
        # z+1 at L..2L-1; so "the token one position after mine in the continuation" is one fixed offset.
        cos, sin = rope_cache(max(M, 2 * L), hs, self.rope_base, device=x.device)
        q = apply_rope(q, cos[L : 2 * L], sin[L : 2 * L])
        k = apply_rope(kv[0], cos[:M], sin[:M])  # (U, g, M, hs)

        def per_chunk(t: Tensor) -> Tensor:  # (U, g, M, hs) -> (B*n, g, k*M, hs)
            return t[enc.index].view(Bn, nk, g, M, hs).transpose(1, 2).reshape(Bn, g, KM, hs)

        k, v = per_chunk(k), per_chunk(kv[1])
        # query head i reads key/value head i // (h / g): its group's queries side by side, (B*n, g, h/g * L, hs)
        q = q.reshape(Bn, g, (h // g) * L, hs)
        # relevance bias beta * cos(e(S_t), e(z)) on every key of neighbour z (MARGE eq. 2)
        bias = (self.beta * relevance).repeat_interleave(M, dim=1).to(q.dtype)  # (B*n, k*M)
        rows = key_valid.any(1)  # (B*n,) chunks with at least one key
        # a chunk with no key at all would be an all -inf row (NaN): give it zeros and zero its output
        bias = bias.masked_fill(~key_valid & rows[:, None], float("-inf"))
        attn_mask = bias[:, None, None, :].expand(Bn, g, q.shape[2], KM)  # (B*n, g, h/g * L, k*M)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).view(Bn, h, L, hs)
        y = y * rows[:, None, None, None].to(y.dtype)
        y = y.transpose(1, 2).reshape(B, n * L, d)[:, lead : lead + T]
        if self.layer == self._plugin.layers[0]:
            # a copy, not a view: under FSDP the gathered parameter is freed after this block's forward
            ctx.log(f"{self._plugin.label}/beta", self.beta.detach().squeeze(0).clone())
        return self.proj(y)

    def _cached_keys_values(self, enc: Encoded, ctx: Context) -> Tensor:
        """_keys_values, kept in the cache state while incremental decoding stays in the same chunks."""
        if ctx.cache is None:
            return self._keys_values(enc)
        kv = ctx.cache.state[self._plugin.label]["kv"]
        if self.layer not in kv:
            kv[self.layer] = self._keys_values(enc)
        return kv[self.layer]

    def _keys_values(self, enc: Encoded) -> Tensor:
        """kv(kv_norm(states)), (U, M, 2 * kv_heads * head_dim). With the token embedder s_j = [x_j, x_{j-1}], so
        (RMSNorm's weight folded into kv's W = [A | B]) kv(kv_norm(s_j)) = (A x_j + B x_{j-1}) / rms(s_j),
        rms(s_j) = sqrt((|x_j|^2 + |x_{j-1}|^2) / 2d + eps): each distinct token id is projected once."""
        if enc.states is not None:
            return self.kv(self.kv_norm(enc.states))
        x, rows = enc.vocab, enc.rows  # (V', d), (U, M)
        d = x.shape[1]
        w = self.kv.weight * self.kv_norm.weight  # (2 g hs, 2d)
        proj = x @ torch.cat([w[:, :d], w[:, d:]], 0).T  # (V', 4 g hs): A x and B x of every distinct id
        cur, nxt = proj.chunk(2, dim=1)  # the token's own half, and its half as a predecessor
        prev = F.pad(rows[:, :-1], (1, 0))  # (U, M); position 0 has no predecessor (its state's half is 0)
        has_prev = (torch.arange(rows.shape[1], device=rows.device) > 0).to(x.dtype)  # (M,)
        sq = (x * x).sum(-1)  # (V',)
        ms = (sq[rows] + sq[prev] * has_prev) / (2 * d)  # (U, M) mean square of s_j
        return (cur[rows] + nxt[prev] * has_prev[:, None]) * torch.rsqrt(ms + self.kv_norm.eps)[..., None]
