"""Token-ID tables (Baykal et al. 2023): the token's id picks a partial expert added to the FFN,
f_id(x) = b_id (rank 0) or V_id relu(U_id^T x) (rank r); no router, no aux loss.

With ``ngram_orders``, a hashed n-gram memory (Engram, DeepSeek 2026; Over-Tokenized Transformer, Huang et al.
2025): per order n and hash head h, the n-gram ending at t is read from the head's table,
    bucket = (XOR_j (token_j * a_nhj mod 2^31)) mod rows        (a_nhj: fixed odd multipliers from ngram_seed)
    e(t) = sum_n sum_h E_nh[bucket_nh(t)]                        one EmbeddingBag over all heads and orders
beside the FFN (gated by sigmoid(w . x + b)) or added to the token embedding. Positions before the window read
a padding id (vocab_size). ``ngram_host`` keeps the tables in host memory and fetches the rows a batch reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlm.model.config import ModelConfig
from rlm.model.memory import Parts, chosen_layers
from rlm.plugin import Claim, Context, Mode, Plugin, Slot, check_layers
from rlm.plugins._experts import PartialEntries
from rlm.plugins._pkm_rows import RowAdam

if TYPE_CHECKING:  # Lightning is imported in callbacks() only, as pkm does
    import pytorch_lightning as pl


@dataclass
class TokenIDConfig:
    """Options of the Token-ID tables."""

    layers: list[int] = field(default_factory=lambda: [0])
    """Layers whose FFN output gets the table entry added."""
    rank: int = 0
    """0: one constant vector per token id; r > 0: a rank-r partial expert V relu(U^T x) per token id."""
    init_std: float = 0.0
    """Initial std of the tables (0: vectors start at zero, the base model; the rank-r U then uses 1/sqrt(d))."""
    ngram_orders: list[int] = field(default_factory=list)
    """Hashed n-gram memory: the n-gram orders read at each position, e.g. [2, 3]; empty: per-id tables."""
    ngram_heads: int = 4
    """Hash heads per order, each with its own multipliers and table; all heads' rows are summed."""
    ngram_rows: int = 65536
    """Rows of each hash head's table (the bucket count)."""
    ngram_seed: int = 0
    """Seed of the hash multipliers (kept in the config, so a checkpoint keeps its buckets)."""
    ngram_gate: bool = True
    """Scale the n-gram embedding by Engram's context gate sigmoid(w . x + b) of the FFN input (placement ffn)."""
    placement: Literal["ffn", "embed"] = "ffn"
    """'ffn': beside the FFN of ``layers`` (Engram); 'embed': added to the token embedding once (Over-Tokenized)."""
    ngram_host: bool = False
    """Keep the n-gram tables in host memory (Engram): the rows a batch reads are copied to the device (on a side
    stream on a GPU) and updated on the host by a row-wise lazy Adam (``ngram_host_lr``). One process only."""
    ngram_host_lr: float = 1e-3
    """ngram_host: the constant learning rate of the host tables' row-wise Adam."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"tokenid.rank must be a non-negative integer, got {self.rank!r}")
        if self.init_std < 0:
            raise ValueError(f"tokenid.init_std must be >= 0, got {self.init_std}")
        orders = list(self.ngram_orders)
        bad = [n for n in orders if not isinstance(n, int) or isinstance(n, bool) or n < 1]
        if bad or len(set(orders)) < len(orders):
            raise ValueError(f"tokenid.ngram_orders must be distinct integers >= 1, got {orders!r}")
        for name in ("ngram_heads", "ngram_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"tokenid.{name} must be a positive integer, got {value!r}")
        if orders and self.rank:
            raise ValueError(f"tokenid.ngram_orders needs rank 0 (rows are vectors), got {self.rank}")
        if self.placement == "embed" and not orders:
            raise ValueError("tokenid.placement='embed' needs ngram_orders, e.g. [2, 3]")
        if self.ngram_host and not orders:
            raise ValueError("tokenid.ngram_host keeps the n-gram tables on the host; it needs ngram_orders")
        if not self.ngram_host_lr > 0:
            raise ValueError(f"tokenid.ngram_host_lr must be > 0, got {self.ngram_host_lr!r}")
        if self.placement == "embed" and self.ngram_gate:
            raise ValueError("tokenid.ngram_gate reads the hidden state, which 'embed' lacks; set it false")

    def memory(self, mc: ModelConfig, parts: Parts) -> None:
        """The tables' parameters and saved bytes (rlm.model.memory); host tables are left out, with a note."""
        layers = chosen_layers(self.layers, mc.n_layers, [0])
        if self.ngram_orders:  # hashed n-gram tables (and a gate) per layer, or once at the embedding
            heads = len(self.ngram_orders) * self.ngram_heads
            modules = 1 if self.placement == "embed" else len(layers)
            table = 0 if self.ngram_host else heads * self.ngram_rows * mc.d_model  # ngram_host: on the host
            parts.params += modules * (table + (mc.d_model + 1 if self.ngram_gate else 0))
            if self.ngram_host:
                parts.notes.append("tokenid: the n-gram tables are in host memory (ngram_host), not counted")
            # EmbeddingBag ids (8 B a head), offsets, bag sizes, max indices (24); the gate's bf16 input 2d, its
            # sigmoid in bf16 and fp32 (6), the fp32 sum it scales 4d.
            gate = 6 * mc.d_model + 6 if self.ngram_gate else 0
            parts.act_per_token += modules * (8 * heads + 24 + gate)
            return
        per = mc.d_model * (1 if self.rank == 0 else 2 * self.rank) * mc.vocab_size
        parts.params += len(layers) * per
        if self.rank:  # rank 0 saves nothing: the ids are the batch's, the read a residual add
            # The token's (d, r) and (r, d) entries and its input in bf16, relu's output (r); at r = 1 einsum keeps
            # one more bf16 copy of the input (measured, tests/model/test_memory.py).
            d, r = mc.d_model, self.rank
            parts.act_per_token += len(layers) * (4 * d * r + 2 * d + 2 * r + (2 * d if r == 1 else 0))


class TokenIDTable(nn.Module):
    """One layer's table of vocab entries, rank 0 (a vector) or rank r (U, V), read by the token's id."""

    def __init__(self, vocab: int, d: int, rank: int, init_std: float) -> None:
        super().__init__()
        self.entries = PartialEntries(vocab, d, rank, init_std)

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        return self.entries(x, ctx.tokens.unsqueeze(-1))  # (B, T, d): entry of each token's own id


MASK = (1 << 31) - 1  # hashing stays below 2^62: ids and multipliers < 2^31, products masked to 31 bits


def ngram_multipliers(orders: list[int], heads: int, seed: int) -> Tensor:
    """Odd multipliers a_nhj < 2^31 for each order, head and position in the n-gram, (O, H, max order)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << 30, (len(orders), heads, max(orders)), generator=g) * 2 + 1


def with_history(ctx: Context, k: int, pad: int, tokens: Tensor | None = None) -> Tensor:
    """ctx.tokens (or their copy ``tokens``) after the k before them, (B, k + T): from the KV cache while decoding,
    padding ids before the window (a full recompute and cached decoding read the same n-grams)."""
    tokens = ctx.tokens if tokens is None else tokens
    prev = tokens[:, :0]
    if ctx.cache is not None:
        prev = ctx.cache.tokens[:, max(0, ctx.offset - k) : ctx.offset].to(tokens.device)
    fill = tokens.new_full((tokens.shape[0], k - prev.shape[1]), pad)
    return torch.cat([fill, prev, tokens], dim=1)


class NGramMemory(nn.Module):
    """Hashed n-gram tables: the summed rows of every order and hash head, gated by the FFN input if asked. With
    ``ngram_host`` the table and the hash constants stay on the host whatever the model is moved to (``_apply``),
    and forward reads the rows ``prepare`` fetched."""

    def __init__(self, vocab: int, d: int, c: TokenIDConfig) -> None:
        super().__init__()
        self.orders, self.rows, self.pad = sorted(c.ngram_orders), c.ngram_rows, vocab
        self.host = c.ngram_host
        self.key = ("", "")  # ngram_host: (plugin label, table name), where prepare leaves this table's rows
        self.sink: RowAdam | None = None  # ngram_host: the optimizer the rows' gradients go to
        self.stream: Any = None  # ngram_host on a GPU: the side stream of the copies, made on first use
        heads = len(self.orders) * c.ngram_heads
        self.table = nn.Parameter(torch.randn(heads * c.ngram_rows, d) * c.init_std)  # heads' tables stacked
        self.heads, self.seed = c.ngram_heads, c.ngram_seed
        self.register_buffer("mult", torch.empty(0, dtype=torch.long), persistent=False)
        self.register_buffer("start", torch.empty(0, dtype=torch.long), persistent=False)
        self.reset_buffers()
        self.gate = nn.Linear(d, 1) if c.ngram_gate else None
        if self.gate is not None:
            nn.init.zeros_(self.gate.weight)  # gate 1/2 everywhere at the start
            nn.init.zeros_(self.gate.bias)
        if self.host:
            self.table.requires_grad_(False)  # updated by the plugin's row-wise Adam, not the main optimizer

    def reset_buffers(self) -> None:
        """Compute the hash constants from the options (non-persistent buffers: rlm.hf calls this after loading)."""
        mult = ngram_multipliers(self.orders, self.heads, self.seed)
        self.mult = mult.to(self.mult.device)  # (O, H, max order)
        heads = len(self.orders) * self.heads
        self.start = (torch.arange(heads) * self.rows).to(self.start.device)  # (O*H,) first rows

    def _apply(self, fn: Any, recurse: bool = True) -> NGramMemory:
        if not self.host:
            return super()._apply(fn, recurse)
        # The host table, and the hash constants its ids are computed with, keep their place and dtype.
        params, buffers = self._parameters.pop("table"), {n: self._buffers.pop(n) for n in ("mult", "start")}
        try:
            return super()._apply(fn, recurse)
        finally:
            self._parameters["table"] = params
            self._buffers.update(buffers)

    def ids(self, seq: Tensor) -> Tensor:
        """Row ids of each position's n-grams in the stacked table, (B*T, O*H): seq (B, P + T) holds the
        P = max order - 1 tokens (or padding ids) before the T positions; t's n-gram is seq[P+t-n+1 .. P+t]."""
        P = max(self.orders) - 1
        T = seq.shape[1] - P
        out = []
        for o, n in enumerate(self.orders):
            h = seq.new_zeros(seq.shape[0], T, self.heads)  # (B, T, H)
            for j in range(n):
                tok = seq[:, P - n + 1 + j : P - n + 1 + j + T, None]  # (B, T, 1): the n-gram's j-th token
                h = h ^ ((tok * self.mult[o, :, j]) & MASK)
            out.append(h % self.rows)
        return torch.stack(out, dim=2).view(seq.shape[0] * T, -1) + self.start  # (B, T, O, H) as (B*T, O*H)

    def fetch(self, ids: Tensor, device: torch.device) -> tuple[Tensor, Tensor, Any]:
        """ngram_host: the distinct rows (U, d) host ``ids`` (N, m) read, on their way to ``device``: (index (N, m)
        into them, the rows, the CUDA event of their copy on the side stream or None). Under autograd the rows are
        a leaf whose gradient goes to the row optimizer."""
        rows, index = torch.unique(ids, return_inverse=True)  # (U,) ascending, (N, m)
        pinned = device.type == "cuda"
        buf = torch.empty(rows.numel(), self.table.shape[1], dtype=self.table.dtype, pin_memory=pinned)
        torch.index_select(self.table.detach(), 0, rows, out=buf)  # (U, d), the host's gather
        ready = None
        if pinned:
            if self.stream is None:
                self.stream = torch.cuda.Stream(device)
            main = torch.cuda.current_stream(device)
            with torch.cuda.stream(self.stream):
                # Page-locked sources: the copies are asynchronous, the host allocator keeps buf until they end.
                fetched = buf.to(device, non_blocking=True)
                index = index.pin_memory().to(device, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.stream)
            # Allocated on the side stream, used on the main one: not reused before the main stream is done.
            fetched.record_stream(main)
            index.record_stream(main)
        else:
            fetched, index = buf.to(device), index.to(device)
        if self.sink is not None and torch.is_grad_enabled():
            fetched.requires_grad_(True)
            fetched.register_post_accumulate_grad_hook(lambda leaf: self._to_sink(leaf, rows))
        return index, fetched, ready

    def _to_sink(self, leaf: Tensor, rows: Tensor) -> None:
        """Hand the fetched rows' gradient (U, d) to the host optimizer, one unit-weight lookup per row."""
        grad = leaf.grad.to("cpu", torch.float32)  # a GPU: waits for the backward up to this table's reader
        self.sink.add_lookups(self.key[1], rows.view(-1, 1), torch.ones(rows.numel(), 1), grad)
        leaf.grad = None

    @torch.compiler.disable  # host tensors, a side stream and a hook: not traceable
    def _host_bag(self, ctx: Context) -> Tensor:
        """ngram_host: the summed rows of each position, (B*T, d), from what prepare fetched if it did."""
        got = ctx.extras.get(self.key[0], {}).get(self.key[1])
        if got is None:  # a forward without prepare (a direct model call)
            ids = self.ids(with_history(ctx, max(self.orders) - 1, self.pad, ctx.tokens.cpu()))
            got = self.fetch(ids, ctx.tokens.device)
        index, fetched, ready = got
        if ready is not None:
            torch.cuda.current_stream(fetched.device).wait_event(ready)
        return F.embedding_bag(index, fetched, mode="sum")

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        B, T = ctx.tokens.shape
        if self.host:
            e = self._host_bag(ctx).view(B, T, -1)  # (B, T, d)
        else:
            ids = self.ids(with_history(ctx, max(self.orders) - 1, self.pad))  # (B*T, O*H)
            e = F.embedding_bag(ids, self.table, mode="sum").view(B, T, -1)  # (B, T, d)
        if self.gate is not None:
            e = e * torch.sigmoid(self.gate(x)).to(e.dtype)  # (B, T, 1) per-position context gate
        return e


class TokenIDPlugin(Plugin):
    """Token-ID tables added to the FFN at chosen layers."""

    name = "tokenid"
    Config = TokenIDConfig
    order = 50

    def __init__(self, config: TokenIDConfig, model_config) -> None:
        super().__init__(config, model_config)
        self.layers = check_layers(self.name, config.layers, model_config.n_layers)
        # ngram_host: table name -> memory; a plain dict, the memories are registered in their blocks
        self.memories: dict[str, NGramMemory] = {}
        self.row_optimizer = RowAdam(lr=config.ngram_host_lr)

    def claims(self) -> list[Claim]:
        if self.config.placement == "embed":
            return [Claim(Slot.EMBED, Mode.ADD)]
        return [Claim(Slot.FFN, Mode.ADD, self.layers)]

    def build(self, claim: Claim, layer: int | None, current: nn.Module | None) -> nn.Module:
        c = self.model_config
        if self.config.ngram_orders:
            memory = NGramMemory(c.vocab_size, c.d_model, self.config)
            if self.config.ngram_host:
                table = f"layer{layer}" if layer is not None else "embed"
                memory.key, memory.sink = (self.label, table), self.row_optimizer
                self.row_optimizer.add_table(table, memory.table)
                self.memories[table] = memory
            return memory
        return TokenIDTable(c.vocab_size, c.d_model, self.config.rank, self.config.init_std)

    def prepare(self, ctx: Context, batch: dict[str, Any]) -> None:
        """ngram_host: hash the batch on the host and start fetching each table's rows, so the copies overlap the
        layers before the first reader (not earlier: the previous step's update comes first)."""
        if not self.memories:
            return
        from rlm.data.windows import host_array  # here: importing rlm.data imports Lightning

        tokens = torch.as_tensor(host_array(batch, "tokens"))  # (B, T) on the host
        memory = next(iter(self.memories.values()))  # the tables share their orders, heads, rows and seed
        ids = memory.ids(with_history(ctx, max(memory.orders) - 1, memory.pad, tokens))  # (B*T, O*H)
        ctx.extras[self.label] = {k: m.fetch(ids, ctx.tokens.device) for k, m in self.memories.items()}

    def callbacks(self) -> list[pl.Callback]:
        if not self.config.ngram_host:
            return []
        from rlm.plugins._host_table_callback import HostTableCallback

        return [HostTableCallback(self.row_optimizer, "tokenid.ngram_host", f"TokenIDHost[{self.label}]")]

    def added_parameters(self) -> int:
        """Parameters added per layer: the table (vocab*d, 2*rank*vocab*d, or orders*heads*rows*d) and the gate."""
        c, d = self.config, self.model_config.d_model
        if c.ngram_orders:
            return len(c.ngram_orders) * c.ngram_heads * c.ngram_rows * d + (d + 1 if c.ngram_gate else 0)
        return d * (2 * c.rank if c.rank else 1) * self.model_config.vocab_size

    def inactive_parameters(self) -> int:
        # A token reads one row of each table: all other rows are inactive for it.
        c, d = self.config, self.model_config.d_model
        if c.ngram_orders:
            modules = 1 if c.placement == "embed" else len(self.layers)
            return modules * len(c.ngram_orders) * c.ngram_heads * (c.ngram_rows - 1) * d
        vocab = self.model_config.vocab_size
        return len(self.layers) * self.added_parameters() * (vocab - 1) // vocab
