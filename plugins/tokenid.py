"""Token-ID lookup tables (Baykal et al., 'The Power of External Memory in Increasing Predictive Model
Capacity'): the lookup q(x, id) picks the table entry of the token's vocabulary id, so the table has one
entry per vocabulary item and needs no router and no aux loss.

Each entry is a partial expert added to the FFN of the chosen layers:
    rank 0:  f_id(x) = b_id                       (a constant vector per token id)
    rank r:  f_id(x) = V_id relu(U_id^T x)        (U_id, V_id of shape d x r)
Lookups are embedding gathers, never a dense matmul over the vocabulary; their gradient touches only
the rows of the batch's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from rlm.plugin import Claim, Context, Mode, Plugin, Slot, check_layers
from rlm.plugins._experts import PartialEntries


@dataclass
class TokenIDConfig:
    """Options of the Token-ID tables."""

    layers: list[int] = field(default_factory=lambda: [0])
    """Layers whose FFN output gets the table entry added."""
    rank: int = 0
    """0: one constant vector per token id; r > 0: a rank-r partial expert V relu(U^T x) per token id."""
    init_std: float = 0.0
    """Initial standard deviation of the tables (0: the constant vectors start at zero, so training starts from
    the base model); the rank-r U table uses 1/sqrt(d) when this is 0."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"tokenid.rank must be a non-negative integer, got {self.rank!r}")
        if self.init_std < 0:
            raise ValueError(f"tokenid.init_std must be >= 0, got {self.init_std}")


class TokenIDTable(nn.Module):
    """One layer's table of vocab entries, rank 0 (a vector) or rank r (U, V), read by the token's id."""

    def __init__(self, vocab: int, d: int, rank: int, init_std: float) -> None:
        super().__init__()
        self.entries = PartialEntries(vocab, d, rank, init_std)

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        return self.entries(x, ctx.tokens.unsqueeze(-1))  # (B, T, d): entry of each token's own id


class TokenIDPlugin(Plugin):
    """Token-ID tables added to the FFN at chosen layers."""

    name = "tokenid"
    Config = TokenIDConfig
    order = 50

    def __init__(self, config: TokenIDConfig, model_config) -> None:
        super().__init__(config, model_config)
        self.layers = check_layers(self.name, config.layers, model_config.n_layers)

    def claims(self) -> list[Claim]:
        return [Claim(Slot.FFN, Mode.ADD, self.layers)]

    def build(self, claim: Claim, layer: int | None, current: nn.Module | None) -> nn.Module:
        c = self.model_config
        return TokenIDTable(c.vocab_size, c.d_model, self.config.rank, self.config.init_std)

    def added_parameters(self) -> int:
        """Parameters added per layer: vocab*d at rank 0, 2*rank*vocab*d at rank r."""
        per_bucket = self.model_config.d_model * (1 if self.config.rank == 0 else 2 * self.config.rank)
        return per_bucket * self.model_config.vocab_size

    def inactive_parameters(self) -> int:
        # A token reads one row of each table: all other rows are inactive for it.
        vocab = self.model_config.vocab_size
        return len(self.layers) * self.added_parameters() * (vocab - 1) // vocab
