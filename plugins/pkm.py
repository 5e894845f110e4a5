"""Product key memory (Lample et al. 2019, 'Large Memory Layers with Product Keys'), in the FFN slot.

For a token x of width d, at each chosen layer (Lample et al. Sec. 3):
    q = norm(W_q x)                      query, (H, k_dim)
    per head h: q = (q1, q2); top-k of q1.C_h and of q2.C'_h (n sub-keys each), k*k candidate sums,
        exact top-k of those: slots I_h, scores s_h              (n^2 slots searched at O(n + k^2) cost)
    m(x) = sum_h sum_{i in I_h} softmax(s_h)_i v_i               one EmbeddingBag over H*k value rows
    y = m(x)  or, gated (Berges et al. 2024):  y = W_o (m(x) * silu(W_g x))
``values: peer`` (He 2024, PEER) makes each slot a single-neuron expert, m(x) = sum_h sum_i w_hi act(u_i . x) v_i;
``key_norm`` (Berges et al. 2025) L2-normalises query halves and sub-keys. The value tables live on the plugin
and train by a row-wise lazy Adam (``sparse``); under DDP and FSDP2 they are replicated and the ranks exchange
their reads (plugins/_pkm_rows.py) over the group ``set_group`` hands in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from rlm.model.config import ModelConfig
from rlm.model.memory import Parts, chosen_layers, ffn_terms
from rlm.plugin import Claim, Context, Mode, ParamGroup, Plugin, Slot, check_layers
from rlm.plugins._pkm_native import huge_page_empty
from rlm.plugins._pkm_ops import (
    MaskedBatchNorm,
    group_size,
    product_key_topk,
    slot_stats,
    value_dot,
    value_lookup,
)
from rlm.plugins._pkm_rows import RowAdam

if TYPE_CHECKING:  # the callback and Lightning are imported in callbacks(): `rlm plugins pkm` stays light
    import pytorch_lightning as pl

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}
DOWN = "_down"  # suffix of a PEER table's down-projection table (``shared_down`` beside ``shared``)


@dataclass
class PKMConfig:
    """Options of the product key memory."""

    layers: list[int] | None = None
    """Layers whose FFN slot gets a memory; None means the middle layer [n_layers // 2]."""
    mode: Literal["replace", "add"] = "replace"
    """'replace': the memory takes the FFN's place (the paper); 'add': it runs beside the FFN."""
    n_keys: int = 512
    """Sub-keys per half and head (n); the memory has n^2 slots (512 -> 262,144)."""
    heads: int = 4
    """Memory heads H, each with its own query and sub-key sets over the same value table."""
    topk: int = 32
    """Slots selected per head (k); also the top-k taken in each half."""
    k_dim: int = 256
    """Query width per head; each half (sub-key width) is k_dim / 2."""
    query_norm: Literal["layernorm", "batchnorm", "none"] = "layernorm"
    """'layernorm': per token over each head's query (causal). 'batchnorm': the paper's (Sec. 3.3, raises key
    usage), padding left out; its training statistics include later tokens, so training leaks the future
    (evaluation uses running statistics). 'none': the raw query."""
    key_norm: bool = False
    """L2-normalise each query half and sub-key (Berges et al. 2025): a score is a sum of two cosines."""
    values: Literal["embedding", "peer"] = "embedding"
    """'embedding': a slot is a value row v_i. 'peer': a single-neuron expert act(u_i . x) v_i (He 2024), its
    down rows u_i in a second table trained like the values."""
    activation: Literal["gelu", "relu", "silu"] = "gelu"
    """values 'peer': the experts' activation."""
    shared_values: bool = True
    """One value table for every memory layer (else one table per layer)."""
    gated: bool = False
    """Gated output W_o (m(x) * silu(W_g x)) as in later memory-layer work (Berges et al. 2024)."""
    value_dropout: float = 0.0
    """Dropout on the memory output m(x) during training."""
    values_lr: float = 1e-3
    """Constant Adam learning rate of the values (Lample et al.: 1e-3), no weight decay."""
    sparse: bool | Literal["auto"] = "auto"
    """Row-wise lazy Adam on the values: 'auto' (one process, DDP and FSDP2, the values replicated; dense under
    other strategies), true, or false (dense gradients, reduced by DDP or FSDP2 with the values sharded)."""

    def __post_init__(self) -> None:
        for name in ("n_keys", "heads", "topk", "k_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"pkm.{name} must be a positive integer, got {value!r}")
        if self.topk > self.n_keys:
            raise ValueError(f"pkm.topk={self.topk} must be at most pkm.n_keys={self.n_keys}")
        if self.k_dim % 2:
            raise ValueError(f"pkm.k_dim={self.k_dim} must be even (it is split into two sub-key halves)")
        if not 0.0 <= self.value_dropout < 1.0:
            raise ValueError(f"pkm.value_dropout must be in [0, 1), got {self.value_dropout}")
        if self.values_lr <= 0:
            raise ValueError(f"pkm.values_lr must be positive, got {self.values_lr}")

    @property
    def slots(self) -> int:
        """Number of memory slots n^2."""
        return self.n_keys * self.n_keys

    def memory(self, mc: ModelConfig, parts: Parts) -> None:
        """The memory layers' parameters and saved bytes (rlm.model.memory); the values under row-wise Adam."""
        d = mc.d_model
        layers = chosen_layers(self.layers, mc.n_layers, [mc.n_layers // 2])
        ffn_p, ffn_a = ffn_terms(mc)
        norm = {"layernorm": 2 * self.k_dim, "batchnorm": 2 * self.heads * self.k_dim}.get(self.query_norm, 0)
        per_layer = d * self.heads * self.k_dim + norm + self.heads * 2 * self.n_keys * (self.k_dim // 2)
        per_layer += 2 * d * d if self.gated else 0
        tables = 1 if self.shared_values else len(layers)
        tables *= 2 if self.values == "peer" else 1  # PEER: a down table beside each up table
        values = tables * self.slots * d
        parts.params += len(layers) * per_layer + values
        if self.sparse in ("auto", True):  # one process (and DDP): the row optimizer owns the values
            parts.row_adam += values
            parts.row_tables += tables
        hk = self.heads * self.topk
        # Not counted: the fp32 output gradients the row update records. Query input 2d; layer norm input
        # 2 H k_dim, mean and 1/std 8 H; fp32 query 4 H k_dim; per head top-k ids 16 k, weights 4 k, slots 8 k.
        act = 2 * d + 6 * self.heads * self.k_dim + 8 * self.heads + 28 * hk
        if self.values == "peer":  # fp32: the input of u_i . x (4d), u_i . x, its activation, w_i act(.)
            act += 4 * d + 12 * hk
        for _ in layers:
            if self.mode == "replace":
                parts.params -= ffn_p
                parts.act_per_token -= ffn_a
            parts.act_per_token += act


class PKMLayer(nn.Module):
    """One memory layer: query network, product keys, and a read of the plugin's value table."""

    keep_fp32_params = True  # FSDP2 gathers it in fp32: bf16 sub-keys would change the slots the search reads

    def __init__(self, config: PKMConfig, d: int, owner: PKMPlugin, table: str) -> None:
        super().__init__()
        c = config
        self.heads, self.topk, self.half = c.heads, c.topk, c.k_dim // 2
        self.table = table
        self.value_dropout, self.key_norm = c.value_dropout, c.key_norm
        self.act = ACTIVATIONS[c.activation] if c.values == "peer" else None
        self.query = nn.Linear(d, c.heads * c.k_dim, bias=False)
        nn.init.normal_(self.query.weight, 0.0, d**-0.5)
        self.norm_kind = c.query_norm
        self.norm: nn.Module | None = None
        if c.query_norm == "batchnorm":
            self.norm = MaskedBatchNorm(c.heads * c.k_dim)
        elif c.query_norm == "layernorm":
            self.norm = nn.LayerNorm(c.k_dim)  # per token and head: (N, H, k_dim) over k_dim
        # Sub-keys C, C' per head, (H, 2, n, k_dim/2); uniform init as in the paper's code (XLM).
        bound = 1.0 / math.sqrt(self.half)
        self.keys = nn.Parameter(torch.empty(c.heads, 2, c.n_keys, self.half).uniform_(-bound, bound))
        self.gate = self.out = None
        if c.gated:
            self.gate = nn.Linear(d, d, bias=False)
            self.out = nn.Linear(d, d, bias=False)
            nn.init.normal_(self.gate.weight, 0.0, d**-0.5)
            nn.init.normal_(self.out.weight, 0.0, d**-0.5)
        # Summed read weight per slot over an evaluation epoch (usage / KL), written only in eval under no_grad.
        self.register_buffer("slot_weight", torch.zeros(0, dtype=torch.float64), persistent=False)
        self.collecting = False
        # A plain reference, not a submodule: the value table is registered on the plugin only.
        object.__setattr__(self, "_owner", owner)

    def lookup(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Selected slots and their softmax weights for x (N, d) with padding mask valid (N,): each (N, H, k)."""
        q = self.query(x)  # (N, H * k_dim)
        if self.norm_kind == "batchnorm":
            q = self.norm(q, valid)
        elif self.norm_kind == "layernorm":
            q = self.norm(q.view(-1, self.heads, q.shape[-1] // self.heads)).flatten(1)  # (N, H * k_dim)
        dtype = torch.promote_types(q.dtype, torch.float32)  # search and softmax in at least float32
        q = q.to(dtype).view(-1, self.heads, 2, self.half)  # (N, H, 2, k_dim/2)
        keys = self.keys.to(dtype)
        if self.key_norm:
            q, keys = F.normalize(q, dim=-1), F.normalize(keys, dim=-1)
        scores, slots = product_key_topk(q, keys, self.topk)
        return slots, scores.softmax(dim=-1)  # (N, H, k) each

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        B, T, d = x.shape
        xf = x.reshape(B * T, d)
        valid = ctx.valid_mask().reshape(B * T)
        slots, weights = self.lookup(xf, valid)  # (N, H, k)
        values = self._owner.values[self.table]
        sink = self._owner.row_optimizer if (self._owner.sparse_active and torch.is_grad_enabled()) else None
        hk = self.heads * self.topk
        rows, w = slots.view(-1, hk), weights.view(-1, hk).to(values.dtype)  # (N, H*k)
        if self.act is not None:  # PEER: w_i act(u_i . x), each selected expert's weight on its up row v_i
            down = self.table + DOWN
            u = self._owner.values[down]
            xd = xf.to(u.dtype)
            if sink is not None and not xd.requires_grad:
                # The sink gets the down rows' gradient from the read's backward, which autograd runs only when
                # an input needs a gradient (not so below a frozen network).
                xd = xd.detach().requires_grad_()
            w = w * self.act(value_dot(rows, xd, u, sink, down))
        m = value_lookup(rows, w, values, sink, self.table)
        if self.value_dropout:
            m = F.dropout(m, self.value_dropout, self.training)  # (N, d)
        if self.gate is not None:
            m = self.out(m.to(x.dtype) * F.silu(self.gate(xf)))
        if self.collecting and not self.training:
            with torch.no_grad():
                w = weights * valid.view(-1, 1, 1)  # padding reads nothing
                self.slot_weight.index_add_(0, slots.reshape(-1), w.reshape(-1).double())
        return m.view(B, T, d).to(x.dtype)


class PKMPlugin(Plugin):
    """Product key memory layers in the FFN slot of chosen layers."""

    name = "pkm"
    Config = PKMConfig
    order = 60

    def __init__(self, config: PKMConfig, model_config) -> None:
        super().__init__(config, model_config)
        n_layers = model_config.n_layers
        self.layers = check_layers(
            self.name, config.layers if config.layers is not None else [n_layers // 2], n_layers
        )
        d = model_config.d_model
        keys = ["shared"] if config.shared_values else [f"layer{i}" for i in self.layers]
        if config.values == "peer":
            keys += [k + DOWN for k in keys]
        # Values normal(0, d^-1/2) as in the paper's code, on huge pages (rows are read and updated at random);
        # the only copy of each table is registered here.
        self.values = nn.ParameterDict({})
        self.row_optimizer = RowAdam(lr=config.values_lr)
        for k in keys:
            table = huge_page_empty((config.slots, d), torch.get_default_dtype())
            self.values[k] = nn.Parameter(torch.randn(config.slots, d, out=table).mul_(d**-0.5))
            self.row_optimizer.add_table(k, self.values[k])
        self.memories: dict[int, PKMLayer] = {}  # plain dict: the layers are registered in their blocks
        self._sparse: bool | None = None  # resolved at setup (needs to know whether torch.distributed runs)
        self._exchange = False  # whether the row optimizer exchanges rows (sparse and distributed)
        self.group: Any = None  # the process group of the memory's collectives (None: the default group)

    def claims(self) -> list[Claim]:
        return [Claim(Slot.FFN, Mode(self.config.mode), self.layers)]

    def build(self, claim: Claim, layer: int | None, current: nn.Module | None) -> nn.Module:
        table = "shared" if self.config.shared_values else f"layer{layer}"
        memory = PKMLayer(self.config, self.model_config.d_model, self, table)
        if isinstance(memory.norm, MaskedBatchNorm):
            memory.norm.group = self.group
        self.memories[layer] = memory
        return memory

    def set_group(self, group: Any) -> None:
        """Run the memory's collectives over ``group`` (the data-parallel ranks; None: the default group)."""
        self.group = group
        for memory in self.memories.values():
            if isinstance(memory.norm, MaskedBatchNorm):
                memory.norm.group = group
        self._place_exchange()

    def _place_exchange(self) -> None:
        """Give the row optimizer its group when it exchanges rows."""
        group = self.group if self.group is not None else dist.group.WORLD
        self.row_optimizer.group = group if self._exchange else None

    @property
    def sparse_active(self) -> bool:
        """Whether the row-wise lazy Adam updates the values."""
        return bool(self._sparse)

    def resolve_sparse(self, distributed: bool | None = None, row_exchange: bool = True) -> bool:
        """Choose the sparse or dense value update; distributed, sparse needs ``row_exchange`` (DDP, or FSDP2
        leaving ``replicated_parameters`` whole)."""
        if distributed is None:
            distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        choice = self.config.sparse
        if choice is True and distributed and not row_exchange:
            raise ValueError(
                "pkm.sparse=true updates the values by exchanging touched rows, which works under DDP and FSDP2 "
                "(ModelParallelStrategy, torch >= 2.7) only; under this strategy use sparse: auto or false (dense "
                "gradients that the strategy reduces)"
            )
        self._sparse = choice is True or (choice == "auto" and (row_exchange or not distributed))
        self._exchange = self._sparse and distributed
        self._place_exchange()
        for table in self.values.values():
            # Sparse: neither the main optimizer nor DDP sees the values (requires_grad=False).
            table.requires_grad_(not self._sparse)
        return self._sparse

    def replicated_parameters(self) -> list[nn.Parameter]:
        # Sparse: whole on every rank, as under DDP; the row exchange keeps them equal (FSDP2 must not shard them).
        return list(self.values.values()) if self._sparse else []

    def synced_parameters(self) -> list[nn.Parameter]:
        # Sparse: the small sub-keys stay whole too (their FSDP2 gathers cost more). Dense: all sharded.
        return [layer.keys for _, layer in sorted(self.memories.items())] if self._sparse else []

    def param_groups(self) -> list[ParamGroup]:
        if self._sparse is None:
            self.resolve_sparse()
        if self._sparse:
            return []  # updated by self.row_optimizer, see PKMCallback.on_before_optimizer_step
        values = list(self.values.values())
        return [ParamGroup("pkm_values", values, lr=self.config.values_lr, weight_decay=0.0, schedule=False)]

    def callbacks(self) -> list[pl.Callback]:
        from rlm.plugins._host_table_callback import PKMCallback

        return [PKMCallback(self)]

    def inactive_parameters(self) -> int:
        # A token reads H*k rows of its table per memory layer; every other row is inactive for it.
        d, c = self.model_config.d_model, self.config
        per_table = len(self.layers) if c.shared_values else 1
        return len(self.values) * max(c.slots - per_table * c.heads * c.topk, 0) * d

    def start_stats(self) -> None:
        """Zero the per-slot read weights of every memory layer and start accumulating them (in eval mode)."""
        for memory in self.memories.values():
            memory.slot_weight = torch.zeros(
                self.config.slots, dtype=torch.float64, device=memory.keys.device
            )
            memory.collecting = True

    def stop_stats(self) -> dict[int, tuple[Tensor, Tensor]]:
        """Stop accumulating; (usage, KL to uniform) per memory layer, of the weights summed over the group."""
        stats = {}
        for layer, memory in sorted(self.memories.items()):
            memory.collecting = False
            if group_size(self.group) > 1:
                dist.all_reduce(memory.slot_weight, group=self.group)
            stats[layer] = slot_stats(memory.slot_weight)
        return stats
