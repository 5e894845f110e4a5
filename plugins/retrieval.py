"""MARGE-style retrieval for causal LMs (Komatsuzaki 2020, sec. 5.4, after Lewis et al. 2020): the tokens of segment
S_{t+1} cross-attend to the k neighbours of S_t, found by the embedder e over the training set and the document's
past, with MARGE's relevance bias (_retrieval_attention.py), so the LM loss alone trains e. prepare() finds the
neighbours (_retrieval_neighbours.py); the callback of _retrieval_rebuild.py rebuilds the index."""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from rlm.data.windows import HOST, host_array, host_copy
from rlm.index.memory import RetrievalMemory
from rlm.index.sharded import load_memory_for_search
from rlm.plugin import Claim, Context, Mode, Plugin, Slot, check_layers
from rlm.plugins._retrieval_attention import Encoded, RetrievalCrossAttention, encode_neighbours
from rlm.plugins._retrieval_config import RetrievalConfig
from rlm.plugins._retrieval_encoder import (
    FrozenEmbedder,
    SeparateEncoder,
    SharedEncoder,
    TokenEncoder,
    config_hash,
    weights_hash,
)
from rlm.plugins._retrieval_neighbours import (
    PendingInputs,
    RetrievalInputs,
    chunk_cat,
    chunk_slice,
    gather_inputs,
    source_groups,
)

if TYPE_CHECKING:
    import pytorch_lightning as pl

BACKGROUND_DEVICES = ("cuda",)
"""Devices whose training steps search in a thread beside the forward; on the CPU it would take the forward's cores."""


def _batch_key(batch: dict[str, Any]) -> tuple:
    """What tells two training batches apart, read from the host copies (no device read)."""
    return tuple(
        None if (a := host_array(batch, n)) is None else a.tobytes()
        for n in ("tokens", "segment_ids", "starts")
    )


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
        elif config.embedder == "tokens":
            self.encoder = TokenEncoder(model_config)
        else:
            self.encoder = SeparateEncoder(model_config, config.embed_layers, config.encoder_dim)
        if isinstance(config.index_dim, int) and config.index_dim >= self.encoder.embed_dim:
            raise ValueError(
                f"retrieval.index_dim={config.index_dim} must be below the width of the {config.embedder!r} "
                f"embedder's vectors, {self.encoder.embed_dim} (null: full width; 'auto')"
            )
        object.__setattr__(self, "memory", None)  # RetrievalMemory set by the rebuild callback
        self._saved_index_dir: str | None = None  # from a checkpoint: loaded on first use outside training
        self.prepare_seconds = 0.0  # wall-clock time of the last neighbour lookup or search: a metric
        self._ahead: tuple[tuple, RetrievalMemory, PendingInputs] | None = None  # the next step's search

    def claims(self) -> list[Claim]:
        return [Claim(Slot.CROSS_ATTN, Mode.REPLACE, self.layers)]

    def build(self, claim: Claim, layer: int | None, current: nn.Module | None) -> nn.Module:
        return RetrievalCrossAttention(self, layer)

    def attach(self, model: nn.Module) -> None:
        if isinstance(self.encoder, SharedEncoder):
            self.encoder.bind(model)

    def callbacks(self) -> list[pl.Callback]:
        from rlm.plugins._retrieval_rebuild import RebuildCallback  # imports Lightning: only when training

        return [RebuildCallback(self, self.config, self.label)]

    def prepare(self, ctx: Context, batch: dict[str, Any]) -> None:
        """Put the batch's query segments and neighbours (ids from the table, or searched online) in ctx.extras."""
        # outside training no callback sets the memory: the checkpoint's index, loaded once
        if self.memory is None and self._saved_index_dir and not ctx.training:
            path, self._saved_index_dir = self._saved_index_dir, None
            try:
                self.use_memory(load_memory_for_search(path))
            except (FileNotFoundError, ValueError) as err:
                msg = f"retrieval: cannot load the index {path} named by the checkpoint ({err}); no retrieval"
                warnings.warn(msg, stacklevel=2)
        memory = self.memory
        c = self.config
        warm = c.warm_start if c.warm_start != "none" else ("recent" if c.same_doc_k else "none")
        # the warm start reads the past of the batch's documents from the batch's own table (Context.segments)
        can_warm = warm != "none" and batch.get("segment_ids") is not None
        if memory is None and not (can_warm and c.warm_start != "none"):
            ctx.extras[self.label] = None
            self._declare_loss_groups(ctx, None, 1)
            return
        if ctx.cache is not None:
            self._prepare_cached(ctx, batch)
            return
        start = time.perf_counter()
        online = not (ctx.training and batch.get("segment_ids") is not None) or (
            memory is not None and memory.neighbours is None
        )
        device = batch["tokens"].device
        if online and memory is not None:  # searched where the model runs (faiss-gpu or torch on a GPU)
            memory.place_search(device)
        # a training step's search runs in a thread: beside the step before it when the loader says the next batch
        # (ctx.upcoming), else beside its own forward up to the first cross-attention (encoded)
        background = online and ctx.training and memory is not None and not memory.collective
        background = background and device.type in BACKGROUND_DEVICES

        def gather(b: dict[str, Any]) -> RetrievalInputs | PendingInputs:
            return gather_inputs(
                memory,
                b,
                c.k,
                c.continuation,
                online=online,
                embed=self._embed_queries,
                segments=ctx.segments,
                warm_k=(c.k if memory is None else c.same_doc_k) if warm != "none" else 0,
                warm=warm,
                randomise=ctx.variant == f"{self.label}_random",
                evaluation=not ctx.training,
                exclude_copies=c.exclude_copies,
                background=background,
            )

        if background and ctx.upcoming is not None:
            inputs = self._take_ahead(batch, memory)
            ctx.log(f"{self.label}/searched_ahead", float(inputs is not None))
            if inputs is None:  # the first step, and the first after an index swap, wait for their own search
                inputs = gather(batch).result()
            ctx.extras[self.label] = inputs
            self._search_ahead(ctx.upcoming(), memory, device, gather)
        else:
            inputs = ctx.extras[self.label] = gather(batch)
        self.prepare_seconds = time.perf_counter() - start
        if isinstance(inputs, PendingInputs):
            return  # prepare_ms is logged once the forward has waited for the search (encoded)
        ctx.log(f"{self.label}/prepare_ms", 1000.0 * self.prepare_seconds)
        if not ctx.training and memory is not None and c.exclude_copies:  # the evaluated future's copies
            ctx.log(f"{self.label}/duplicates_excluded", float(inputs.excluded))
        self._declare_loss_groups(ctx, inputs, inputs.query_tokens.shape[-1])

    def _take_ahead(self, batch: dict[str, Any], memory: RetrievalMemory) -> RetrievalInputs | None:
        """The neighbours searched during the last step for this batch in this index, or None (not searched, or
        searched for another batch or index: then dropped)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        key, searched, pending = ahead
        found = pending.result()  # normally done: it ran beside the whole last step
        return found if searched is memory and key == _batch_key(batch) else None

    def _search_ahead(self, upcoming: dict[str, Any], memory: RetrievalMemory, device, gather) -> None:
        """Start the search for the next step's batch (on the host, from the loader): its queries are embedded
        now, by the weights before this step's update, one step older than its own step's; the index is older
        still (the last rebuild's), and the cross-attention scores the neighbours with the current embedder."""
        moved = {
            n: x.to(device, non_blocking=True) if isinstance(x, Tensor) else x for n, x in upcoming.items()
        }
        moved[HOST] = host_copy(upcoming)
        self._ahead = (_batch_key(upcoming), memory, gather(moved))

    def _prepare_cached(self, ctx: Context, batch: dict[str, Any]) -> None:
        """Incremental decoding: each chunk's neighbours follow from the text before it alone, so each is searched
        once, when its first token arrives, and kept in ctx.cache.state[label]."""
        if batch.get("segment_ids") is not None or batch.get("mask") is not None:
            raise ValueError(
                "retrieval: incremental decoding (ctx.cache) takes plain tokens, without segment ids or a padding "
                "mask; evaluate such batches with a full forward"
            )
        cache, c = ctx.cache, self.config
        L = self.memory.segments.segment_len
        chunks: dict[int, RetrievalInputs] = cache.state.setdefault(self.label, {}).setdefault("chunks", {})
        offset, T = ctx.offset, ctx.tokens.shape[1]
        first, last = offset // L, (offset + T - 1) // L
        if any(j not in chunks for j in range(first, last + 1)):
            start = time.perf_counter()
            self.memory.place_search(ctx.tokens.device)
            inputs = gather_inputs(
                self.memory,
                {"tokens": cache.history(offset, ctx.tokens)},
                c.k,
                c.continuation,
                online=True,
                embed=self._embed_queries,
                evaluation=True,
                exclude_copies=c.exclude_copies,
            )
            for j in range(first, last + 1):
                chunks.setdefault(j, chunk_slice(inputs, j, j + 1))
            self.prepare_seconds = time.perf_counter() - start
            ctx.log(f"{self.label}/prepare_ms", 1000.0 * self.prepare_seconds)
        ctx.extras[self.label] = chunk_cat([chunks[j] for j in range(first, last + 1)])

    @torch.no_grad()
    def _embed_queries(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """Online queries, embedded as the index rows were (FrozenEmbedder: eval mode, float32)."""
        was = self.encoder.training
        self.encoder.eval()
        try:
            with torch.autocast(tokens.device.type, enabled=False):
                return self.encoder.pooled(tokens, mask).float()
        finally:
            self.encoder.train(was)

    def encoded(self, ctx: Context) -> Encoded | None:
        """The neighbours as the cross-attention layers read them, computed once per forward."""
        key = f"{self.label}/encoded"
        if key not in ctx.extras:
            inputs: RetrievalInputs | PendingInputs | None = ctx.extras.get(self.label)
            if isinstance(inputs, PendingInputs):  # prepare_ms counts the forward's wait for the search
                start = time.perf_counter()
                inputs = ctx.extras[self.label] = inputs.result()
                self.prepare_seconds += time.perf_counter() - start
                ctx.log(f"{self.label}/prepare_ms", 1000.0 * self.prepare_seconds)
            ctx.extras[key] = None if inputs is None else self._encode(inputs, ctx)
        return ctx.extras[key]

    def _encode(self, inputs: RetrievalInputs, ctx: Context) -> Encoded:
        """encode_neighbours; under incremental decoding once per span of chunks (a chunk's L steps share it)."""
        if ctx.cache is None:
            return encode_neighbours(self, inputs, ctx)
        L = self.memory.segments.segment_len
        span = (ctx.offset // L, (ctx.offset + ctx.tokens.shape[1] - 1) // L)
        state = ctx.cache.state[self.label]
        if state.get("span") != span:
            state["span"] = span
            state["encoded"] = encode_neighbours(self, inputs, ctx)
            state["kv"] = {}  # each cross-attention layer's keys and values of these neighbours
        return state["encoded"]

    def no_retrieval(self, x: Tensor, layer: nn.Module) -> Tensor:
        """Zeros like x, with a zero gradient for the layer's and encoder's parameters (DDP expects one each step)."""
        if not torch.is_grad_enabled():
            return torch.zeros_like(x)
        params = [p for m in (layer, self.encoder) for p in m.parameters() if p.requires_grad]
        # x * 0 also reaches the block's norm in front of the cross-attention
        return x * 0.0 + 0.0 * sum(p.sum() for p in params).to(x.dtype)

    def _declare_loss_groups(self, ctx: Context, inputs: RetrievalInputs | None, L: int) -> None:
        """At evaluation, the tokens of each chunk by where its neighbours come from (val/loss_by/<label>/<group>)."""
        if ctx.training or ctx.variant is not None:
            return
        for name, mask in source_groups(inputs, ctx.tokens.shape, L, ctx.tokens.device).items():
            ctx.loss_groups[f"{self.label}/{name}"] = mask

    def use_memory(self, memory: RetrievalMemory | None) -> None:
        """Swap in a new index (one reference assignment: atomic for the training loop)."""
        object.__setattr__(self, "memory", memory)

    def eval_variants(self) -> list[str]:
        """With eval_ablation: the validation pass with random neighbours."""
        return [f"{self.label}_random"] if self.config.eval_ablation else []

    def snapshot(self, step: int) -> FrozenEmbedder:
        """A frozen copy of the current embedder (rlm.index Embedder protocol)."""
        return FrozenEmbedder(self.encoder, self.identity(step))

    def identity(self, step: int) -> dict[str, Any]:
        """Which embedder and weights produce the vectors now."""
        return {
            "name": f"retrieval/{self.config.embedder}",
            "config_hash": config_hash(self.config, self.model_config),
            "weights_hash": weights_hash(self.encoder.weights()),
            "step": int(step),
        }

    def get_extra_state(self) -> dict[str, Any]:
        """The index directory in use, checkpointed so that validation and generation can search it."""
        memory = self.memory
        return {
            "index_dir": str(memory.path) if memory is not None and memory.path else self._saved_index_dir
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self._saved_index_dir = state.get("index_dir")
