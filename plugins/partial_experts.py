"""Mixture of partial experts (Baykal et al. 2023): FFN(x) + sum_{i in q(x, id)} w_i(x) f_i(x), with
f_i(x) = V_i relu(U_i^T x) (U_i, V_i of shape d x rank), f_i(x) = b_i at rank 0, q a lookup of plugins/_lookup.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from rlm.plugin import Claim, Context, Mode, Plugin, Slot, check_layers
from rlm.plugins._experts import PartialEntries
from rlm.plugins._lookup import LookupOptions, build_lookup, router_losses


@dataclass
class PartialExpertsConfig(LookupOptions):
    """Options of the partial experts (the lookup options come first, from LookupOptions)."""

    layers: list[int] = field(default_factory=lambda: [1])
    """Layers whose FFN output gets the looked-up partial experts added."""
    buckets: int = 1024
    """Number of table entries (buckets); token_id with buckets = vocab size gives one entry per id."""
    rank: int = 0
    """0: a constant vector per bucket; r > 0: V relu(U^T x) with U, V of shape d x r."""
    init_std: float = 0.0
    """Initial std of the tables; 0 starts the added output at zero (b and V zero, U with std 1/sqrt(d))."""
    balance_coef: float = 0.01
    """Softmax lookup: weight of the load-balancing loss 'pe_balance' (as MoE's); 0 skips it."""
    z_coef: float = 0.0
    """Softmax lookup: weight of the router z-loss 'pe_z'; 0 skips it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.buckets, int) or self.buckets < 1:
            raise ValueError(f"partial_experts.buckets must be a positive integer, got {self.buckets!r}")
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"partial_experts.rank must be a non-negative integer, got {self.rank!r}")
        if self.top_k > self.buckets:
            raise ValueError(f"partial_experts.top_k={self.top_k} exceeds buckets={self.buckets}")
        if self.init_std < 0:
            raise ValueError(f"partial_experts.init_std must be >= 0, got {self.init_std}")
        if self.balance_coef < 0 or self.z_coef < 0:
            raise ValueError(f"partial_experts.*_coef must be >= 0, got {self.balance_coef}, {self.z_coef}")


class PartialExpertsLayer(nn.Module):
    """One layer's lookup and table of partial experts; its output is added to the FFN's."""

    def __init__(self, config: PartialExpertsConfig, model_config, layer: int = 0) -> None:
        super().__init__()
        d = model_config.d_model
        self.config, self.layer = config, layer
        self.lookup = build_lookup(config, d, config.buckets, model_config.vocab_size, model_config.init_std)
        self.entries = PartialEntries(config.buckets, d, config.rank, config.init_std)

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        B, T, d = x.shape
        flat = x.reshape(B * T, d)  # (S, d)
        valid = ctx.valid_mask().reshape(-1)  # (S,)
        route = self.lookup(flat, ctx.tokens.reshape(-1), ctx.training)  # index, weight (S, k)
        router_losses(ctx, route, valid, "pe", f"l{self.layer}", self.config.balance_coef, self.config.z_coef)
        y = self.entries(flat, route.index, route.weight)  # (S, d)
        return (y * valid.unsqueeze(-1)).view(B, T, d)


class PartialExpertsPlugin(Plugin):
    """Adds looked-up partial experts to the FFN at the chosen layers."""

    name = "partial_experts"
    Config = PartialExpertsConfig
    order = 40

    def __init__(self, config: PartialExpertsConfig, model_config) -> None:
        super().__init__(config, model_config)
        self.layers = check_layers(self.name, config.layers, model_config.n_layers)

    def claims(self) -> list[Claim]:
        return [Claim(Slot.FFN, Mode.ADD, self.layers)]

    def build(self, claim: Claim, layer: int | None, current: nn.Module | None) -> nn.Module:
        return PartialExpertsLayer(self.config, self.model_config, layer)

    def added_parameters(self) -> int:
        """Table parameters one layer adds: 2 * rank * buckets * d (the paper's count), or buckets * d at rank 0."""
        c = self.config
        return c.buckets * self.model_config.d_model * (2 * c.rank if c.rank else 1)

    def inactive_parameters(self) -> int:
        # A token reads top_k of the buckets' entries.
        c = self.config
        return len(self.layers) * self.added_parameters() * (c.buckets - c.top_k) // c.buckets
