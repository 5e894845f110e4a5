"""Mixture of experts (Shazeer et al. 2017; Switch, Fedus et al. 2021): the FFN of chosen layers becomes N experts,
y = sum_{i in top-k} w_i(x) E_i(x), with the softmax router (w = p) or Token-ID / LSH hashing (w = 1, Roller et
al. 2021) of plugins/_lookup.py. In training each expert takes C = ceil(k * tokens / N * capacity_factor)
assignments, in position order (causal); the rest pass by the residual. Evaluation is dropless. Softmax routing
adds, over non-padding tokens and summed over the layers:

    moe_balance = N * sum_i f_i P_i          (Switch eq. 4; f_i: share of argmax i, P_i: mean probability of i)
    moe_z       = mean_x logsumexp(h(x))^2   (ST-MoE, Zoph et al. 2022, eq. 5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor, nn

from rlm.model.config import ModelConfig
from rlm.model.memory import Parts, chosen_layers, ffn_terms
from rlm.plugin import Claim, Context, Mode, Plugin, Slot, check_layers
from rlm.plugins._expert_parallel import parallel_dispatch
from rlm.plugins._experts import Experts, dispatch
from rlm.plugins._lookup import LookupOptions, build_lookup, router_losses

if TYPE_CHECKING:  # the callback and Lightning are imported in callbacks(): `rlm plugins moe` stays light
    import pytorch_lightning as pl


@dataclass
class MoEConfig(LookupOptions):
    """Options of the mixture-of-experts FFN (the lookup options come first, from LookupOptions)."""

    layers: list[int] = field(default_factory=lambda: [1, 3])
    """Layers whose FFN is replaced by the experts."""
    num_experts: int = 8
    """Number of experts N."""
    expert_hidden: int | None = None
    """Hidden width of each expert; None: the model's dense FFN width."""
    capacity_factor: float = 1.25
    """Training expert capacity = k * tokens / N * capacity_factor; 0: dropless (evaluation always is)."""
    balance_coef: float = 0.01
    """alpha of the load-balancing loss alpha * N * sum_i f_i P_i (Switch: 1e-2); 0 skips it."""
    z_coef: float = 0.001
    """Weight of the router z-loss mean(logsumexp(h)^2) (ST-MoE: 1e-3); 0 skips it."""
    dispatch: Literal["auto", "grouped", "bmm"] = "auto"
    """'grouped' (one grouped GEMM over the tokens sorted by expert), 'bmm' (capacity buffers (N, C, d)) or 'auto'
    (grouped on CPU, or CUDA in bf16, with 16-byte aligned widths). Where grouped raises: bmm, with a warning."""
    expert_parallel: bool = False
    """Under torch.distributed with W processes each keeps num_experts / W experts, tokens travel by all_to_all
    (plugins/_expert_parallel.py); the same numbers as replicated experts."""
    expert_group_size: int | None = None
    """expert_parallel: processes sharing one copy of the experts (a divisor of the processes; null: a node's);
    tokens travel and capacity is decided within the group, the groups' copies kept equal. 1: no sharding."""
    overlap_chunks: int = 2
    """expert_parallel: a rank's experts are exchanged and computed in this many runs (the largest divisor of its
    expert count not above it), one run's tokens travelling while another computes; 1 blocks. Same outputs."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"moe.num_experts must be a positive integer, got {self.num_experts!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.num_experts={self.num_experts}")
        if self.expert_hidden is not None and self.expert_hidden < 1:
            raise ValueError(f"moe.expert_hidden must be positive or null, got {self.expert_hidden}")
        if self.capacity_factor < 0:
            raise ValueError(f"moe.capacity_factor must be >= 0 (0 = dropless), got {self.capacity_factor}")
        if self.balance_coef < 0 or self.z_coef < 0:
            raise ValueError(f"moe.*_coef must be >= 0, got {self.balance_coef}, {self.z_coef}")
        for name in ("expert_group_size", "overlap_chunks"):
            value = getattr(self, name)
            if (value is not None or name == "overlap_chunks") and (not isinstance(value, int) or value < 1):
                raise ValueError(f"moe.{name} must be a positive integer (1, 2, ...), got {value!r}")

    def memory(self, mc: ModelConfig, parts: Parts) -> None:
        """The experts and router in place of the dense FFNs, parameters and saved bytes (rlm.model.memory)."""
        d = mc.d_model
        layers = chosen_layers(self.layers, mc.n_layers, [1, 3])
        expert_p, expert_a = ffn_terms(mc, self.expert_hidden or mc.hidden)
        router = self.num_experts * d if self.lookup == "softmax" else 0
        ffn_p, ffn_a = ffn_terms(mc)
        k, n = self.top_k, self.num_experts
        # Rows through the experts per token: its k assignments (grouped), or capacity_factor x that (bmm buffers).
        rows = k * (max(self.capacity_factor, 1.0) if self.dispatch == "bmm" else 1.0)
        # Router: fp32 input and jittered copy 8d, three (N,) fp32 rows, ids 8k; per assignment: ids 8 + 8, gate 4,
        # the fp32 expert output and its gated copy 8d.
        act = 8 * d + 12 * n + 8 * k + 12 + k * (20 + 8 * d) + int(rows * expert_a)
        for _ in layers:
            parts.params += n * expert_p + router - ffn_p
            parts.act_per_token += act - ffn_a


class MoELayer(nn.Module):
    """One layer's experts and lookup; called as ``layer(x (B, T, d), ctx)``."""

    def __init__(self, config: MoEConfig, model_config, layer: int) -> None:
        super().__init__()
        c, mc = config, model_config
        self.config, self.layer = c, layer
        hidden = c.expert_hidden or mc.hidden
        activation = "swiglu" if mc.ffn == "gated" else "gelu"
        out_std = mc.init_std / math.sqrt(2 * mc.n_layers)  # GPT-2's scaled init, as the core's FFN has
        self.experts = Experts(c.num_experts, mc.d_model, hidden, activation, mc.init_std, out_std)
        self.lookup = build_lookup(c, mc.d_model, c.num_experts, mc.vocab_size, mc.init_std)
        self.expert_group = None  # a process group once the experts are sharded (expert_parallel)

    def capacity(self, tokens: int) -> int | None:
        """Assignments each expert takes: ceil(k * tokens / N * capacity_factor) (tokens with padding), None when
        dropless."""
        c = self.config
        if c.capacity_factor == 0:
            return None
        # In integers, the factor as the decimal it was written as: 100 tokens, 2 experts, 1.1 give 55, not 56.
        factor = Fraction(repr(float(c.capacity_factor)))
        num, den = c.top_k * tokens * factor.numerator, c.num_experts * factor.denominator
        return max(1, -(-num // den))

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        B, T, d = x.shape
        # Rows position-major (every sequence's token 0, then token 1, ...): plan() gives queue places in row
        # order, so no later position of any sequence displaces a token (causal in training).
        flat = x.transpose(0, 1).reshape(T * B, d)  # (S, d)
        valid = ctx.valid_mask().t().reshape(-1)  # (S,)
        route = self.lookup(flat, ctx.tokens.t().reshape(-1), ctx.training)
        # Evaluation and generation are dropless: a sequence's outputs never depend on the rest of the batch.
        capacity = self.capacity if ctx.training else (lambda tokens: None)
        if self.expert_group is not None:  # expert_parallel under torch.distributed: this rank's N/W experts
            y, p = parallel_dispatch(
                flat, route.index, route.weight, valid, self.experts, capacity, self.config.dispatch,
                self.expert_group, seq_len=T, chunks=self.config.overlap_chunks,
            )  # fmt: skip
        else:
            y, p = dispatch(
                flat, route.index, route.weight, valid, self.experts, capacity(B * T), self.config.dispatch
            )
        c, tag = self.config, f"l{self.layer}"
        router_losses(ctx, route, valid, "moe", tag, c.balance_coef, c.z_coef)
        with torch.no_grad():
            # Share of the valid tokens whose first choice is each expert; static shapes, so no graph break.
            first = route.index[:, 0]  # (S,)
            load = torch.zeros(c.num_experts, device=first.device).index_add_(0, first, valid.float())
            load = load / valid.sum().clamp(min=1)  # (N,)
            ctx.log(f"moe_load_max/{tag}", load.max())
            ctx.log(f"moe_dropped/{tag}", p.dropped)
            for i, value in enumerate(load.unbind()):
                ctx.log(f"moe_load/{tag}_e{i}", value)
        return y.view(T, B, d).transpose(0, 1)


class MoEPlugin(Plugin):
    """Replaces the FFN at the chosen layers with a mixture of N experts."""

    name = "moe"
    Config = MoEConfig
    order = 20

    def __init__(self, config: MoEConfig, model_config) -> None:
        super().__init__(config, model_config)
        self.layers = check_layers(self.name, config.layers, model_config.n_layers)
        self.moe_layers: dict[int, MoELayer] = {}  # plain dict: the layers are registered in their blocks

    def claims(self) -> list[Claim]:
        return [Claim(Slot.FFN, Mode.REPLACE, self.layers)]

    def build(self, claim: Claim, layer: int | None, current: nn.Module | None) -> nn.Module:
        self.moe_layers[layer] = MoELayer(self.config, self.model_config, layer)
        return self.moe_layers[layer]

    def callbacks(self) -> list[pl.Callback]:
        if not self.config.expert_parallel:
            return []
        from rlm.plugins._expert_parallel_callback import ExpertParallelCallback

        def layers() -> list[MoELayer]:
            return [self.moe_layers[i] for i in sorted(self.moe_layers)]

        return [ExpertParallelCallback(layers, self.config.expert_group_size)]

    def expert_parameters(self) -> int:
        """Parameters of one layer's N experts."""
        c, mc = self.config, self.model_config
        hidden = c.expert_hidden or mc.hidden
        per_expert = mc.d_model * hidden * (3 if mc.ffn == "gated" else 2)
        return c.num_experts * per_expert

    def inactive_parameters(self) -> int:
        # A token runs k of the N experts.
        c = self.config
        return len(self.layers) * self.expert_parameters() * (c.num_experts - c.top_k) // c.num_experts
