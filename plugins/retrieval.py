"""MARGE-style retrieval for causal LMs (Komatsuzaki 2020, section 5.4, after Lewis et al. 2020, MARGE).

Documents are cut into segments of L tokens. The tokens of segment S_{t+1} cross-attend to the tokens
of the k neighbours of S_t (and, optionally, each neighbour's continuation segment), found with the
embedder e over the whole training set and the past of the document. The cross-attention logits get
MARGE's relevance bias (Lewis et al. 2020, eq. 2, as adapted by Komatsuzaki 2020):

    logit(i, j in z) = q_i . k_j / sqrt(h) + beta * cos(e(S_t), e(z))      beta trainable, per layer

so the LM loss alone trains e through the bias. Causality: segment t+1 only sees neighbours chosen
with S_t, and the neighbour tables never hold S_{t+1} or a later segment of the same document; the
first segment of a window uses the neighbours of the document's previous segment, or none.

Training reads neighbour ids from the table of the last rebuild (index/rebuild.py, the callback this
plugin returns); validation and generation search the index online with the current embedder.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlm.index.build import IndexConfig
from rlm.index.rebuild import RebuildCallback, RetrievalMemory, Schedule, load_memory_for_search
from rlm.model.layers import RMSNorm, apply_rope, rope_cache
from rlm.plugin import Claim, Context, Mode, Plugin, Slot, check_layers
from rlm.plugins._retrieval_encoder import (
    REBUILD_DTYPES,
    FrozenEmbedder,
    SeparateEncoder,
    SharedEncoder,
    config_hash,
    encoder_device,
    resolve_rebuild_dtype,
    weights_hash,
)

if TYPE_CHECKING:
    import pytorch_lightning as pl

EMBEDDERS = ("shared", "separate")
MODES = ("blocking", "background")


@dataclass
class RetrievalConfig:
    """Options of the retriever."""

    layers: list[int] = field(default_factory=lambda: [-1])
    """Layers that get a cross-attention to the neighbours (with embedder 'shared', above its blocks)."""
    k: int = 2
    """Neighbours per segment."""
    continuation: bool = True
    """Each neighbour brings its document's next segment too (keys/values of 2L tokens per neighbour)."""
    embedder: str = "shared"
    """'shared': the LM's embedding and first embed_layers blocks (MARGE); 'separate': a small encoder."""
    embed_layers: int = 1
    """Blocks of the embedder: the LM's first n blocks ('shared') or the separate encoder's depth."""
    encoder_dim: int = 64
    """Width of the separate encoder (embedder 'separate' only)."""
    beta_init: float = 1.0
    """Initial relevance-bias scale beta of each cross-attention layer."""
    schedule: str = "0-2000:500,2000-1000000000:2000"
    """When to rebuild: 'every N', piecewise 'a-b:N,...' (every N steps while a <= step < b) or 'never'."""
    mode: str = "background"
    """'background' (a snapshot embeds in a thread; atomic swap when done; until the first table lands the
    model trains without retrieval) or 'blocking' (training waits, also for the first table)."""
    index_factory: str = "auto"
    """faiss factory string, 'auto' or 'torch' (exact); see rlm.index.build.IndexConfig."""
    index_dir: str | None = None
    """Where rebuilt indices are written; None: <trainer.default_root_dir>/retrieval_index."""
    embed_batch_size: int = 256
    """Segments per embedder call during a rebuild."""
    rebuild_dtype: str = "float32"
    """dtype of the rebuild's (and online queries') embedding pass: 'float32', 'bfloat16' (autocast), or 'auto'
    (bfloat16 where the device computes it natively, else float32). bfloat16 embeds 2.5x faster on an
    AVX512-BF16 CPU but ranks less precisely: on the synthetic partner task the final top-1 hit rate was
    0.71 against 0.97 in float32. Part of the embedder identity, so a resumed run reuses an index only
    when it was embedded the same way."""
    progress: bool = True
    """Show a progress bar while embedding the corpus."""

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"retrieval.k must be a positive integer, got {self.k!r}")
        if self.embedder not in EMBEDDERS:
            raise ValueError(f"retrieval.embedder={self.embedder!r}; accepted: {list(EMBEDDERS)}")
        if not isinstance(self.embed_layers, int) or self.embed_layers < 1:
            raise ValueError(f"retrieval.embed_layers must be a positive integer, got {self.embed_layers!r}")
        if self.encoder_dim < 2 or self.encoder_dim % 2:
            raise ValueError(f"retrieval.encoder_dim must be an even integer >= 2, got {self.encoder_dim!r}")
        if self.mode not in MODES:
            raise ValueError(f"retrieval.mode={self.mode!r}; accepted: {list(MODES)}")
        if self.embed_batch_size < 1:
            raise ValueError(f"retrieval.embed_batch_size must be positive, got {self.embed_batch_size}")
        if self.rebuild_dtype not in REBUILD_DTYPES:
            raise ValueError(
                f"retrieval.rebuild_dtype={self.rebuild_dtype!r}; accepted: {list(REBUILD_DTYPES)}"
            )
        Schedule.parse(self.schedule)  # raises ValueError naming the accepted grammar
        IndexConfig(factory=self.index_factory)


@dataclass
class RetrievalInputs:
    """The batch's neighbours (ctx.extras[label]): chunk j of a row holds segment j's queries and neighbours."""

    query_tokens: Tensor
    """(B, n, L) tokens of the query segment S_{j-1} of each chunk j."""
    query_mask: Tensor
    """(B, n, L) real tokens of the query segments."""
    tokens: Tensor
    """(B, n, k, M) neighbour tokens (M = L, or 2L with continuations)."""
    mask: Tensor
    """(B, n, k, M) real neighbour tokens (False for absent neighbours and continuations)."""
    valid: Tensor
    """(B, n, k) whether each neighbour exists."""
    same_doc: Tensor
    """(B, n, k) whether the neighbour is from the row's own document (False when unknown)."""


def _beta_as_vector(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Checkpoints written before beta became shape (1,) hold it as a scalar: load those as (1,)."""
    beta = state_dict.get(prefix + "beta")
    if beta is not None and beta.ndim == 0:
        state_dict[prefix + "beta"] = beta.reshape(1)


class RetrievalCrossAttention(nn.Module):
    """Chunked cross-attention with relevance bias: chunk j's L queries attend to the k*M neighbour tokens."""

    def __init__(self, plugin: RetrievalPlugin, layer: int) -> None:
        super().__init__()
        c = plugin.model_config
        self.layer, self.n_heads, self.head_dim = layer, c.n_heads, c.head_dim
        object.__setattr__(self, "_plugin", plugin)  # unregistered: the plugin owns this module
        self.q = nn.Linear(c.d_model, c.d_model, bias=False)
        self.kv_norm = RMSNorm(plugin.encoder.dim, c.norm_eps)
        self.kv = nn.Linear(plugin.encoder.dim, 2 * c.d_model, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)
        for lin in (self.q, self.kv):
            nn.init.normal_(lin.weight, 0.0, c.init_std)
        nn.init.normal_(self.proj.weight, 0.0, c.init_std / math.sqrt(2 * c.n_layers))
        # shape (1,), not a scalar: FSDP2 shards every parameter along dim 0 (and refuses 0-d ones)
        self.beta = nn.Parameter(torch.full((1,), float(plugin.config.beta_init)))
        self.register_load_state_dict_pre_hook(_beta_as_vector)
        self.rope_base = c.rope_base

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        enc = self._plugin.encoded(ctx)
        if enc is None:  # no memory yet (before the first table lands, or no index exists): no retrieval
            return self._plugin.no_retrieval(x, self)
        states, key_valid, relevance, L = enc  # (B*n, k*M, De), (B*n, k*M), (B*n, k), segment length
        B, T, d = x.shape
        Bn, KM = key_valid.shape
        n = Bn // B
        h, hs = self.n_heads, self.head_dim
        xq = F.pad(x, (0, 0, 0, n * L - T)).reshape(Bn, L, d)  # (B*n, L, d): chunk j = segment j
        q = self.q(xq).view(Bn, L, h, hs).transpose(1, 2)  # (B*n, h, L, hs)
        kv = self.kv(self.kv_norm(states)).view(Bn, KM, 2, h, hs)
        k, v = kv.unbind(2)  # (B*n, k*M, h, hs)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B*n, h, k*M, hs)
        # Relative positions, as RETRO's chunked cross-attention has: chunk j (S_{t+1}) sits at positions L..2L-1,
        # right after its query segment S_t, which lines up with each neighbour z at 0..L-1 and its continuation
        # z+1 at L..2L-1; so "the token one position after mine in the continuation" is one fixed offset.
        M = KM // relevance.shape[1]
        cos, sin = rope_cache(max(M, 2 * L), hs, self.rope_base, device=x.device)
        q = apply_rope(q, cos[L : 2 * L], sin[L : 2 * L])
        k = apply_rope(k.view(Bn, h, -1, M, hs), cos[:M], sin[:M]).view(Bn, h, KM, hs)
        # relevance bias beta * cos(e(S_t), e(z)) on every key of neighbour z (MARGE eq. 2)
        bias = (self.beta * relevance).repeat_interleave(M, dim=1).to(q.dtype)  # (B*n, k*M)
        rows = key_valid.any(1)  # (B*n,) chunks with at least one key
        # a chunk with no key at all would be an all -inf row (NaN): give it zeros and zero its output
        bias = bias.masked_fill(~key_valid & rows[:, None], float("-inf"))
        attn_mask = bias[:, None, None, :].expand(Bn, h, L, KM)  # (B*n, h, L, k*M)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B*n, h, L, hs)
        y = y * rows[:, None, None, None].to(y.dtype)
        y = y.transpose(1, 2).reshape(B, n * L, d)[:, :T]
        if self.layer == self._plugin.layers[0]:
            # a copy, not a view: under FSDP the gathered parameter is freed after this block's forward
            ctx.log(f"{self._plugin.label}/beta", self.beta.detach().squeeze(0).clone())
        return self.proj(y)


class RetrievalPlugin(Plugin):
    """The retriever: an embedder, cross-attention at chosen layers, and the index rebuild callback."""

    name = "retrieval"
    Config = RetrievalConfig
    order = 200  # after the implicit memories, so a shared embedder sees the finished lower blocks

    def __init__(self, config: RetrievalConfig, model_config) -> None:
        super().__init__(config, model_config)
        self.layers = check_layers(self.name, config.layers, model_config.n_layers)
        if config.embedder == "shared":
            if self.layers[0] < config.embed_layers:
                raise ValueError(
                    f"retrieval: cross-attention layer {self.layers[0]} is inside the shared embedder's first "
                    f"embed_layers={config.embed_layers} blocks; use layers >= {config.embed_layers}"
                )
            self.encoder = SharedEncoder(model_config, config.embed_layers)
        else:
            self.encoder = SeparateEncoder(model_config, config.embed_layers, config.encoder_dim)
        object.__setattr__(self, "memory", None)  # RetrievalMemory set by the rebuild callback
        self._saved_index_dir: str | None = None  # from a checkpoint: loaded on first use outside training
        self.prepare_seconds = 0.0
        """Wall-clock time of the last prepare() (neighbour lookup or online search): a metric."""

    # ----- the plugin contract -----

    def claims(self) -> list[Claim]:
        return [Claim(Slot.CROSS_ATTN, Mode.REPLACE, self.layers)]

    def build(self, claim: Claim, layer: int | None, current: nn.Module | None) -> nn.Module:
        return RetrievalCrossAttention(self, layer)

    def attach(self, model: nn.Module) -> None:
        if isinstance(self.encoder, SharedEncoder):
            self.encoder.bind(model)

    def callbacks(self) -> list[pl.Callback]:
        c = self.config
        return [
            RebuildCallback(
                self,
                k=c.k,
                schedule=c.schedule,
                mode=c.mode,
                index_config=IndexConfig(factory=c.index_factory, target_recall=None),
                index_dir=c.index_dir,
                batch_size=c.embed_batch_size,
                progress=c.progress,
                label=self.label,
            )
        ]

    # ----- what the rebuild callback calls (rlm.index.rebuild.MemoryOwner) -----

    def use_memory(self, memory: RetrievalMemory | None) -> None:
        """Swap in a new index and neighbour table (one reference assignment: atomic for the training loop)."""
        object.__setattr__(self, "memory", memory)

    def snapshot(self, step: int) -> FrozenEmbedder:
        """A frozen copy of the current embedder (rlm.index Embedder protocol)."""
        return FrozenEmbedder(self.encoder, self.identity(step), self._rebuild_dtype())

    def _rebuild_dtype(self) -> torch.dtype:
        return resolve_rebuild_dtype(self.config.rebuild_dtype, encoder_device(self.encoder))

    def identity(self, step: int) -> dict[str, Any]:
        """Which embedder and weights produce the vectors now."""
        return {
            "name": f"retrieval/{self.config.embedder}",
            # the resolved rebuild dtype is hashed with the config ('auto' may mean bfloat16 on one machine only)
            "config_hash": config_hash(self.config, self.model_config, self._rebuild_dtype()),
            "weights_hash": weights_hash(self.encoder.weights()),
            "step": int(step),
        }

    # ----- per batch -----

    def get_extra_state(self) -> dict[str, Any]:
        """Checkpointed with the weights: the index directory in use, so validation and generation can search it."""
        memory = self.memory
        return {
            "index_dir": str(memory.path) if memory is not None and memory.path else self._saved_index_dir
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self._saved_index_dir = state.get("index_dir")

    def _load_saved_memory(self) -> None:
        """Outside training (validate, generate) with no callback: load the checkpoint's index once, if it is there."""
        path, self._saved_index_dir = self._saved_index_dir, None
        try:
            self.use_memory(load_memory_for_search(path))
        except (FileNotFoundError, ValueError) as err:
            warnings.warn(
                f"retrieval: cannot load the index {path} named by the checkpoint ({err}); no retrieval",
                stacklevel=2,
            )

    def prepare(self, ctx: Context, batch: dict[str, Any]) -> None:
        """Put the batch's query segments and neighbours (ids from the table, or searched online) in ctx.extras."""
        if self.memory is None and self._saved_index_dir and not ctx.training:
            self._load_saved_memory()
        memory = self.memory
        if memory is None:
            ctx.extras[self.label] = None
            return
        start = time.perf_counter()
        ctx.extras[self.label] = gather_inputs(
            memory,
            batch,
            self.config.k,
            self.config.continuation,
            online=not (ctx.training and batch.get("segment_ids") is not None),
            embed=self._embed_queries,
        )
        self.prepare_seconds = time.perf_counter() - start
        ctx.log(f"{self.label}/prepare_ms", 1000.0 * self.prepare_seconds)

    @torch.no_grad()
    def _embed_queries(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """Online queries (validation, generation), embedded as the index rows were (eval mode, rebuild dtype)."""
        was = self.encoder.training
        self.encoder.eval()
        dtype = self._rebuild_dtype()
        try:
            with torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype != torch.float32):
                return self.encoder(tokens, mask)[1].float()
        finally:
            self.encoder.train(was)

    def no_retrieval(self, x: Tensor, layer: nn.Module) -> Tensor:
        """Zeros like x; under autograd, still a function of x and of the layer's and encoder's parameters (times 0),
        so every parameter gets a (zero) gradient and DDP, which expects all of them each step, keeps working
        while training waits for the first table."""
        if not torch.is_grad_enabled():
            return torch.zeros_like(x)
        params = [p for m in (layer, self.encoder) for p in m.parameters() if p.requires_grad]
        # x * 0 also reaches the block's norm in front of the cross-attention
        return x * 0.0 + 0.0 * sum(p.sum() for p in params).to(x.dtype)

    def encoded(self, ctx: Context) -> tuple[Tensor, Tensor, Tensor, int] | None:
        """Neighbour states, key mask, relevance and segment length, computed once per forward (with gradients)
        and shared by the cross-attention layers."""
        key = f"{self.label}/encoded"
        if key not in ctx.extras:
            inputs: RetrievalInputs | None = ctx.extras.get(self.label)
            ctx.extras[key] = None if inputs is None else self._encode(inputs, ctx)
        return ctx.extras[key]

    def _encode(self, inp: RetrievalInputs, ctx: Context) -> tuple[Tensor, Tensor, Tensor, int]:
        B, n, k, M = inp.tokens.shape
        L = inp.query_tokens.shape[-1]
        _, e_query = self.encoder(
            inp.query_tokens.reshape(B * n, L), inp.query_mask.reshape(B * n, L)
        )  # (B*n, D)
        states, e_nb = self.encoder(
            inp.tokens.reshape(B * n * k, M), inp.mask.reshape(B * n * k, M), pool_len=L
        )
        relevance = (e_query.unsqueeze(1) * e_nb.view(B * n, k, -1)).sum(-1)  # (B*n, k) cosine
        valid = inp.valid.reshape(B * n, k)
        if valid.any():
            ctx.log(f"{self.label}/relevance", relevance.detach()[valid].mean())
            ctx.log(f"{self.label}/same_doc", inp.same_doc.reshape(B * n, k)[valid].float().mean())
        ctx.log(f"{self.label}/coverage", valid.any(1).float().mean())
        key_valid = inp.mask.reshape(B * n, k * M)
        return states.reshape(B * n, k * M, -1), key_valid, relevance, L


def gather_inputs(
    memory: RetrievalMemory, batch: dict[str, Any], k: int, continuation: bool, online: bool, embed
) -> RetrievalInputs:
    """Query segments and their neighbours for each chunk of the batch (see RetrievalInputs)."""
    seg = memory.segments
    L = seg.segment_len
    tokens = batch["tokens"]
    device = tokens.device
    B, T = tokens.shape
    n = -(-T // L)
    mask = batch.get("mask")
    mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.bool()
    chunks = F.pad(tokens, (0, n * L - T), value=seg.pad_id).view(B, n, L)
    chunk_mask = F.pad(mask, (0, n * L - T), value=False).view(B, n, L)
    # chunk j's query is segment j-1 of the window; chunk 0's is the document's previous segment, if any
    prev = np.full(B, -1, dtype=np.int64)
    seg_ids = batch.get("segment_ids")
    if seg_ids is not None and batch.get("starts") is not None:
        first = seg_ids[:, 0].cpu().numpy()
        prev = np.where((batch["starts"].cpu().numpy() > 0) & (first > 0), first - 1, -1)
    prev_tokens = torch.from_numpy(seg.tokens(np.maximum(prev, 0))).to(device)  # (B, L)
    prev_mask = torch.from_numpy(np.arange(L) < seg.length[np.maximum(prev, 0)][:, None]).to(device)
    prev_mask &= torch.from_numpy(prev >= 0).to(device)[:, None]
    q_tokens = torch.cat([prev_tokens[:, None], chunks[:, :-1]], 1)  # (B, n, L)
    q_mask = torch.cat([prev_mask[:, None], chunk_mask[:, :-1]], 1)
    q_valid = q_mask.any(-1).cpu().numpy()  # (B, n)
    if seg_ids is not None:
        q_ids = np.concatenate([prev[:, None], seg_ids[:, : n - 1].cpu().numpy()], 1)  # (B, n) global ids
        q_ids = np.where(q_valid, q_ids, -1)
    else:
        q_ids = np.full((B, n), -1, dtype=np.int64)
    if online:
        nb = np.full((B * n, k), -1, dtype=np.int64)
        rows = np.flatnonzero(q_valid.reshape(-1))
        if len(rows):
            e = embed(q_tokens.reshape(B * n, L)[rows], q_mask.reshape(B * n, L)[rows])  # (R, D)
            nb[rows] = memory.search(e.float().cpu().numpy(), q_ids.reshape(-1)[rows], k)
        nb = nb.reshape(B, n, k)
    else:
        nb = np.where((q_ids >= 0)[..., None], memory.neighbours[np.maximum(q_ids, 0), :k], -1)  # (B, n, k)
    nb_tokens, nb_mask = neighbour_tokens(seg, nb, continuation)
    same = np.zeros_like(nb, dtype=bool)
    if batch.get("doc_ids") is not None:
        same = (nb >= 0) & (seg.doc[np.maximum(nb, 0)] == batch["doc_ids"].cpu().numpy()[:, None, None])
    return RetrievalInputs(
        query_tokens=q_tokens,
        query_mask=q_mask,
        tokens=torch.from_numpy(nb_tokens).to(device),
        mask=torch.from_numpy(nb_mask).to(device),
        valid=torch.from_numpy(nb >= 0).to(device),
        same_doc=torch.from_numpy(same).to(device),
    )


def neighbour_tokens(seg, nb: np.ndarray, continuation: bool) -> tuple[np.ndarray, np.ndarray]:
    """(..., M) tokens and real-token mask of neighbour ids nb (...), -1 = absent; M = L or 2L."""
    L = seg.segment_len
    flat = nb.reshape(-1)
    safe = np.maximum(flat, 0)
    cols = np.arange(L)
    toks = seg.tokens(safe)  # (N, L)
    mask = (cols < seg.length[safe][:, None]) & (flat >= 0)[:, None]
    if continuation:
        nxt = safe + 1
        has = (flat >= 0) & (nxt < len(seg)) & (seg.doc[np.minimum(nxt, len(seg) - 1)] == seg.doc[safe])
        nxt = np.where(has, nxt, 0)
        toks = np.concatenate([toks, seg.tokens(nxt)], 1)
        mask = np.concatenate([mask, (cols < seg.length[nxt][:, None]) & has[:, None]], 1)
    M = toks.shape[1]
    return toks.reshape(*nb.shape, M), mask.reshape(*nb.shape, M)
