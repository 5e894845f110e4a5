"""Lookups of the routed plugins (moe, partial_experts): the entries q(x, id) a token reads in
L(x) + sum_{i in q(x, id)} w_i(x) f_i(x) (Baykal et al. 2023, Sec. 3):
- ``softmax``: the top-k of p = softmax(W x), weighted by p (Shazeer 2017; Fedus 2021);
- ``token_id``: the vocabulary id (weight 1), through a seeded hash when there are fewer entries than ids
  (Roller et al. 2021, 'Hash layers');
- ``lsh``: the token's cell in a grid of ``lsh_slabs`` slabs along m random directions, lsh_slabs ** m cells
  (2 slabs: sign hashing, Charikar 2002).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlm.plugin import Context

SEED = 0
"""Seed of the fixed token_id hash and the LSH directions (fixed, so the buckets are reproducible)."""


@dataclass
class LookupOptions:
    """Options of the lookup function, shared by the routed plugins' configs."""

    lookup: Literal["softmax", "token_id", "lsh"] = "softmax"
    """How a token picks its entries: 'softmax' (learned router), 'token_id' (vocabulary id) or 'lsh'."""
    top_k: int = 1
    """Entries per token (softmax only; token_id and lsh pick exactly one)."""
    renormalize: bool = False
    """Softmax top-k: divide the k gate values by their sum (needs top_k >= 2: a gate fixed at 1 learns nothing)."""
    router_jitter: float = 0.01
    """Softmax: multiplicative jitter U(1-eps, 1+eps) on the router input while training (Switch); 0 disables."""
    lsh_slabs: int = 2
    """lsh: slabs per random direction (2 = one hyperplane through the origin); entries must be a power of it."""
    lsh_width: float = 1.0
    """lsh: spacing of the parallel hyperplanes, in units of the rms-normalised token's projection (std ~1)."""

    def __post_init__(self) -> None:
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {self.top_k!r}")
        if self.lookup != "softmax" and self.top_k != 1:
            raise ValueError(f"lookup={self.lookup!r} picks one entry; top_k must be 1, got {self.top_k}")
        if self.lookup == "softmax" and self.renormalize and self.top_k == 1:
            raise ValueError("renormalize needs top_k >= 2 (a lone gate is fixed at 1 and trains nothing)")
        if not 0.0 <= self.router_jitter < 1.0:
            raise ValueError(f"router_jitter must be in [0, 1), got {self.router_jitter}")
        if not isinstance(self.lsh_slabs, int) or self.lsh_slabs < 2:
            raise ValueError(f"lsh_slabs must be an integer >= 2, got {self.lsh_slabs!r}")
        if self.lsh_width <= 0:
            raise ValueError(f"lsh_width must be positive, got {self.lsh_width}")


@dataclass
class Routing:
    """A lookup's answer for S tokens: entries index (S, k), weights (S, k) float32, router logits (S, N) float32
    (None without a router)."""

    index: Tensor
    weight: Tensor
    logits: Tensor | None = None


class SoftmaxRouter(nn.Module):
    """Learned router in float32: top-k of softmax(W x), x jittered multiplicatively while training."""

    def __init__(self, d: int, n: int, options: LookupOptions, init_std: float = 0.02) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d) * init_std)  # float32 whatever the model's dtype
        self.k, self.renormalize, self.jitter = options.top_k, options.renormalize, options.router_jitter

    def forward(self, x: Tensor, tokens: Tensor, training: bool) -> Routing:
        # The router stays in float32, autocast or not (Fedus 2021, Sec. 2.4: 'selective precision').
        with torch.autocast(x.device.type, enabled=False):
            x = x.float()  # (S, d)
            if training and self.jitter > 0:
                x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
            logits = F.linear(x, self.weight.float())  # (S, N)
            probs = logits.softmax(dim=-1)
        weight, index = probs.topk(self.k, dim=-1)  # (S, k)
        if self.renormalize:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return Routing(index, weight, logits)


def hash_table(vocab: int, n: int, seed: int) -> Tensor:
    """A fixed id -> entry map giving each of the n entries floor/ceil(vocab/n) ids, shuffled by ``seed``."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    table = torch.empty(vocab, dtype=torch.long)
    table[perm] = torch.arange(vocab) % n
    return table


class TokenIDLookup(nn.Module):
    """The token's vocabulary id (through a fixed seeded hash when there are fewer entries) picks one entry."""

    def __init__(self, vocab: int, n: int, options: LookupOptions) -> None:
        super().__init__()
        if n > vocab:
            raise ValueError(f"token_id lookup: {n} entries but {vocab} token ids; use at most {vocab}")
        table = torch.arange(vocab) if n == vocab else hash_table(vocab, n, SEED)
        self.register_buffer("table", table)  # (vocab,) long, checkpointed so buckets survive a resume

    def forward(self, x: Tensor, tokens: Tensor, training: bool) -> Routing:
        index = self.table[tokens.reshape(-1)].unsqueeze(-1)  # (S, 1)
        return Routing(index, torch.ones(index.shape, device=x.device))


def lsh_directions(d: int, n: int, options: LookupOptions) -> tuple[Tensor, Tensor]:
    """Random unit directions (d, m) and the equispaced cut positions (slabs - 1,) of an LSH grid with n cells."""
    s = options.lsh_slabs
    m = round(math.log(n, s))
    if s**m != n:
        raise ValueError(
            f"lsh lookup: {n} entries is not a power of lsh_slabs={s}; accepted: {[s**i for i in range(1, 8)]}"
        )
    g = torch.Generator().manual_seed(SEED)
    directions = F.normalize(torch.randn(d, m, generator=g), dim=0)
    cuts = (torch.arange(s - 1, dtype=torch.float32) - (s - 2) / 2) * options.lsh_width  # symmetric about 0
    return directions, cuts


class LSHLookup(nn.Module):
    """Hyperplane LSH: the grid cell of the rms-normalised token vector, cells = lsh_slabs ** directions."""

    def __init__(self, d: int, n: int, options: LookupOptions) -> None:
        super().__init__()
        directions, cuts = lsh_directions(d, n, options)
        self.register_buffer("directions", directions)  # (d, m), fixed at init
        self.register_buffer("cuts", cuts)  # (s - 1,)
        self.register_buffer("radix", options.lsh_slabs ** torch.arange(directions.shape[1]))  # (m,)

    def forward(self, x: Tensor, tokens: Tensor, training: bool) -> Routing:
        x = x.detach().float()  # buckets are fixed functions of x: no gradient through the hash
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)  # projections of std ~1 meet the cuts
        slab = torch.bucketize(x @ self.directions, self.cuts)  # (S, m) in [0, s)
        index = (slab * self.radix).sum(dim=-1, keepdim=True)  # (S, 1) mixed-radix cell number
        return Routing(index, torch.ones(index.shape, device=x.device))


def balance_loss(probs: Tensor, top1: Tensor, valid: Tensor) -> Tensor:
    """N * sum_i f_i P_i over valid tokens: probs (S, N) float32, top1 (S,) argmax entry, valid (S,) bool."""
    n = probs.shape[-1]
    w = valid.float()
    denom = w.sum().clamp(min=1.0)
    f = torch.zeros(n, device=probs.device).index_add(0, top1, w) / denom  # (N,) share of argmax
    P = (probs * w.unsqueeze(-1)).sum(0) / denom  # (N,) mean probability
    return n * (f * P).sum()


def z_loss(logits: Tensor, valid: Tensor) -> Tensor:
    """mean over valid tokens of logsumexp(h)^2, logits (S, N) float32."""
    w = valid.float()
    return (torch.logsumexp(logits, dim=-1).pow(2) * w).sum() / w.sum().clamp(min=1.0)


def router_losses(
    ctx: Context, route: Routing, valid: Tensor, prefix: str, tag: str, balance_coef: float, z_coef: float
) -> None:
    """Add '<prefix>_balance' (Switch eq. 4) and '<prefix>_z' (ST-MoE eq. 5) over valid tokens for a learned router
    when their weight is non-zero; each also logged per layer ('/<tag>')."""
    if route.logits is None:
        return
    if balance_coef > 0:
        loss = balance_loss(route.logits.softmax(dim=-1), route.index[:, 0], valid)
        ctx.add_loss(f"{prefix}_balance", loss, balance_coef)
        ctx.log(f"{prefix}_balance/{tag}", loss)
    if z_coef > 0:
        loss = z_loss(route.logits, valid)
        ctx.add_loss(f"{prefix}_z", loss, z_coef)
        ctx.log(f"{prefix}_z/{tag}", loss)


def build_lookup(options: LookupOptions, d: int, n: int, vocab: int, init_std: float = 0.02) -> nn.Module:
    """The lookup module for n entries: called as ``lookup(x (S, d), tokens (S,), training) -> Routing``."""
    if options.lookup == "softmax":
        return SoftmaxRouter(d, n, options, init_std)
    if options.lookup == "token_id":
        return TokenIDLookup(vocab, n, options)
    return LSHLookup(d, n, options)
