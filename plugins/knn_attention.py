"""Token-grain retrieval inside the network: each position attends to the tokens that came next after its nearest
contexts, found by the LM's own states (after kNN-LM, Khandelwal et al. 2020, and the kNN attention of Memorizing
Transformers, Wu et al. 2022, here over other documents and with the neighbours' next tokens as values).

What kNN-LM shows on rlm's corpora (issue 23): neighbours found by the LM's contextual states, and the token that
followed each, carry a large signal (-0.54 nats on the default corpus, -0.61 on prose, with no training), while the
MARGE retriever's mean token embeddings carry little of it outside code. This plugin puts that signal inside the
model, where the LM loss learns how far to trust it.

At block ``layer``, beside the self-attention (an ADD module on the same normed input y), position t with state y_t
finds neighbours j, each an entry (key y_j, value v_j = the token after j), and computes

    s_j = -||y_t - y_j||^2 / tau + b_src(j)          tau learned; b_src one learned bias per source
    a   = softmax_j(s)                               over the memory's k and the own past's own_k neighbours
    r_t = sum_j a_j E[v_j]                           E the (tied) token embedding, read without gradient
    out = sigmoid(g . y_t + c) * W_o r_t             W_o starts at zero: the model starts as the one without it

so the LM loss trains the states (through the distances), W_o, tau, the biases and the gate. Keys are
never trained through: they are states the model computed before (detached), as in a datastore.

Where the neighbours come from, the same way at every stage (the training set plus the document's own past):
- the document's own past, always: positions j < t of the same window (value x_{j+1}, at or before t);
- in training and validation during fit: a queue of the last ``memory_tokens`` training states (detached), from
  other documents than the query's; no forward pass of its own, every key is a state a step computed anyway;
- at evaluation with a datastore (``rlm knnlm build --layer attn_input``, attached by ``rlm eval --datastore`` and
  the experiment runner's ``knnlm: {rule: model}``): the k nearest of this model's states over its training split,
  searched with the causal exclusion of kNN-LM (never the evaluated document's own entries, nor a copy's).
Why a slot and not an output rule: the neighbours' tokens enter the residual stream before the last block's FFN,
so the model mixes them with its own prediction in its own way (the token memory, plugins/token_memory.py, mixes
in probability space instead); the core needs no hook beyond the attention slot's ADD mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlm.plugin import Claim, Context, Mode, Plugin, Slot, check_layers

SOURCES = ("memory", "own")


@dataclass
class KnnAttentionConfig:
    """Options of the kNN attention."""

    layer: int = -1
    """The block whose self-attention input y is the query and beside which the module runs (-1: the last)."""
    k: int = 16
    """Neighbours from the memory (the training queue, or a datastore at evaluation)."""
    own_k: int = 8
    """Neighbours from the window's own past (the continuous cache); 0: none."""
    memory_tokens: int = 4096
    """Training states kept in the queue (the latest steps'), searched exactly."""
    temperature: float | None = None
    """Initial tau (None: d_model / 8, as the token memory)."""
    random_ablation: bool = True
    """Validation also runs with every neighbour's value replaced by a random token (val/knn_attention_random/loss)."""

    def __post_init__(self) -> None:
        for name in ("k", "own_k", "memory_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"knn_attention.{name} must be a non-negative integer, got {v!r}")
        if self.k + self.own_k == 0:
            raise ValueError("knn_attention: k and own_k are both 0, so nothing is retrieved; set either > 0")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"knn_attention.temperature must be > 0 or null, got {self.temperature!r}")


def sq_dist(y: Tensor, keys: Tensor) -> Tensor:
    """||y_t - key_tj||^2 (B, T, n) of states (B, T, d) and keys (B, T, n, d), without the (B, T, n, d) difference."""
    return (
        y.square().sum(-1, keepdim=True) + keys.square().sum(-1) - 2 * torch.einsum("btnd,btd->btn", keys, y)
    ).clamp_min(0)


class KnnAttention(nn.Module):
    """The module in the attention slot's ADD list: the neighbours' next tokens, weighted by distance, gated."""

    def __init__(self, plugin: KnnAttentionPlugin, d: int) -> None:
        super().__init__()
        object.__setattr__(self, "plugin", plugin)  # not a submodule: the plugin owns this module
        self.out = nn.Linear(d, d, bias=False)
        nn.init.zeros_(self.out.weight)
        self.gate = nn.Linear(d, 1)
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)

    def forward(self, y: Tensor, ctx: Context) -> Tensor:
        p = self.plugin
        B, T, d = y.shape
        dist, values = p.neighbours(y, ctx)  # (B, T, n) with gradient into y, (B, T, n) token ids (-1: none)
        if ctx.variant == f"{p.label}_random":
            gen = torch.Generator().manual_seed(1234)
            rand = torch.randint(0, p.model_config.vocab_size, values.shape, generator=gen).to(values.device)
            values = torch.where(values >= 0, rand, values)
        n_mem = values.shape[-1] - p.config.own_k
        bias = torch.cat([p.bias[0].expand(n_mem), p.bias[1].expand(p.config.own_k)])
        s = -dist / p.log_tau.exp() + bias
        s = s.masked_fill(values < 0, float("-inf"))
        found = (values >= 0).any(-1, keepdim=True)  # (B, T, 1): a position with no neighbour adds nothing
        a = torch.softmax(s.masked_fill(~found, 0.0), -1).masked_fill(values < 0, 0.0)
        E = p.embedding().detach()
        # r = sum_j a_j E[v_j] as a weighted embedding bag: never materialises the (B, T, n, d) rows. E is read, not
        # trained through here: its gradient through the bag cost 0.13 s a step on 2 CPU threads (3.7x the bag with
        # E fixed), and the tied LM head already scores E[v] . h, which W_o learns to raise
        r = F.embedding_bag(values.clamp_min(0).flatten(0, 1), E, per_sample_weights=a.flatten(0, 1).to(E.dtype),
                            mode="sum").view(B, T, d)  # fmt: skip
        g = torch.sigmoid(self.gate(y))
        if not ctx.training and ctx.variant is None and ctx.cache is None:
            w = a.detach()
            ctx.log(f"{p.label}/own_share", w[..., n_mem:].sum(-1).mean())
            ctx.log(f"{p.label}/gate", g.detach().mean())
            ctx.log(f"{p.label}/temperature", p.log_tau.detach().exp())
        p.remember(y, ctx)
        return g * self.out(r.to(y.dtype)) * found


class KnnAttentionPlugin(Plugin):
    """Each position attends to the next tokens of its nearest contexts, keys the LM's own states (kNN attention)."""

    name = "knn_attention"
    Config = KnnAttentionConfig
    order = 95

    def __init__(self, config: KnnAttentionConfig, model_config) -> None:
        super().__init__(config, model_config)
        (self.layer,) = check_layers(self.name, [config.layer], model_config.n_layers)
        tau = config.temperature if config.temperature is not None else model_config.d_model / 8
        self.log_tau = nn.Parameter(torch.tensor(math.log(tau)))
        self.bias = nn.Parameter(torch.zeros(len(SOURCES)))
        # The training queue: keys (M, d) detached, values (M,), documents (M,). Not a buffer: a checkpoint does not
        # carry it (a resumed run refills it within memory_tokens / tokens-per-step steps).
        self._queue: list[tuple[Tensor, Tensor, Tensor]] = []
        object.__setattr__(self, "_embedding", None)
        self.datastore: Any = None
        """A kNN-LM datastore of this model's attn_input states (use_datastore); searched outside training."""
        self._store: Any = None
        self._root: str = ""

    # ----- the plugin contract -----

    def claims(self) -> list[Claim]:
        return [Claim(Slot.ATTN, Mode.ADD, [self.layer])]

    def build(self, claim: Claim, layer: int | None, current: nn.Module | None) -> nn.Module:
        return KnnAttention(self, self.model_config.d_model)

    def attach(self, model: nn.Module) -> None:
        object.__setattr__(self, "_embedding", model.token_embedding)

    def eval_variants(self) -> list[str]:
        return [f"{self.label}_random"] if self.config.random_ablation else []

    def embedding(self) -> Tensor:
        """The token embedding table (V, d) the values are read from."""
        return self._embedding.weight

    def use_datastore(self, datastore: Any, store: Any, root: str) -> None:
        """Search ``datastore`` (built with keys at ``attn_input``) outside training, excluding for each window the
        entries of its own document (or a copy of it) in ``store`` (the evaluated text's token store at ``root``)."""
        layer = datastore.meta.get("layer")
        if layer != "attn_input":
            raise ValueError(f"knn_attention: datastore {datastore.path} has keys at layer {layer!r}; the plugin "
                             "queries the last block's attention input: build it with --layer attn_input")  # fmt: skip
        if self.layer != self.model_config.n_layers - 1:
            raise ValueError(f"knn_attention: a datastore holds the last block's states; this plugin sits at "
                             f"layer {self.layer} of {self.model_config.n_layers}")  # fmt: skip
        self.datastore, self._store, self._root = datastore, store, root

    # ----- the neighbours -----

    def neighbours(self, y: Tensor, ctx: Context) -> tuple[Tensor, Tensor]:
        """(squared distances (B, T, k + own_k) with gradient into y, values (B, T, k + own_k), -1 where none)."""
        B, T, d = y.shape
        c = self.config
        parts_d, parts_v = [], []
        if c.k:
            if self.datastore is not None and not ctx.training:
                keys, vals = self._search_datastore(y, ctx)
            else:
                keys, vals = self._search_queue(y, ctx)
            parts_d.append(sq_dist(y.float(), keys))
            parts_v.append(vals)
        if c.own_k:
            od, ov = self._own_past(y, ctx)
            parts_d.append(od)
            parts_v.append(ov)
        return torch.cat(parts_d, -1), torch.cat(parts_v, -1)

    def _docs(self, ctx: Context, B: int, device: torch.device) -> Tensor:
        docs = (
            ctx.doc_ids if ctx.doc_ids is not None else -1 - torch.arange(B)
        )  # unnamed rows: their own docs
        return docs.to(device)

    def _search_queue(self, y: Tensor, ctx: Context) -> tuple[Tensor, Tensor]:
        """The k nearest queue entries of other documents: keys (B, T, k, d), values (B, T, k)."""
        B, T, d = y.shape
        k = self.config.k
        if not self._queue:
            return y.new_zeros(B, T, k, d, dtype=torch.float32), torch.full((B, T, k), -1, device=y.device)
        qk, qv, qd = (torch.cat(x) for x in zip(*self._queue))
        with torch.no_grad():
            q = y.detach().float().flatten(0, 1)  # (N, d)
            d2 = q.square().sum(-1, keepdim=True) + qk.square().sum(-1)[None] - 2 * q @ qk.T  # (N, M)
            docs = self._docs(ctx, B, y.device).repeat_interleave(T)
            d2 = d2.masked_fill(docs[:, None] == qd[None, :], float("inf"))
            kk = min(k, qk.shape[0])
            top, idx = torch.topk(d2, kk, dim=1, largest=False)
        vals = torch.where(torch.isfinite(top), qv[idx], torch.full_like(idx, -1))
        keys = qk[idx]
        if kk < k:  # a queue still shorter than k
            keys = torch.cat([keys, keys.new_zeros(B * T, k - kk, d)], 1)
            vals = torch.cat([vals, vals.new_full((B * T, k - kk), -1)], 1)
        return keys.view(B, T, k, d), vals.view(B, T, k)

    def _search_datastore(self, y: Tensor, ctx: Context) -> tuple[Tensor, Tensor]:
        """The datastore's k nearest of other documents. The datastore gives distances, not keys: the keys returned
        are placed so that the caller's ||y - key||^2 equals the searched distance (y - sqrt(d2) e_0; no gradient
        is needed outside training)."""
        B, T, d = y.shape
        k = self.config.k
        q = y.detach().float().cpu()
        docs = ctx.doc_ids.tolist() if ctx.doc_ids is not None else [None] * B
        dist = np.full((B, T, k), np.inf, np.float32)
        vals = np.full((B, T, k), -1, np.int64)
        groups: dict[Any, list[int]] = {}
        for b, doc in enumerate(docs):
            excl = (
                None
                if doc is None
                else self.datastore.exclusion(self._root, doc, self._store.doc_tokens(doc))
            )
            groups.setdefault(excl, []).append(b)
        for excl, rows in groups.items():
            dd, vv = self.datastore.search(q[rows].flatten(0, 1).numpy(), k, excl)
            dist[rows], vals[rows] = dd.reshape(len(rows), T, -1), vv.reshape(len(rows), T, -1)
        dist_t = torch.from_numpy(np.where(np.isfinite(dist), dist, 0.0)).to(y.device)
        keys = y.detach().float()[:, :, None, :].expand(B, T, k, d).clone()
        keys[..., 0] -= dist_t.clamp_min(0).sqrt()
        return keys, torch.from_numpy(vals).to(y.device)

    def _own_past(self, y: Tensor, ctx: Context) -> tuple[Tensor, Tensor]:
        """The own_k nearest earlier positions j < t of each window (value x_{j+1}): distances with gradient into
        y_t (the key y_j detached), values (B, T, own_k). Under a KV cache (generation) the earlier positions'
        keys and tokens travel in ``ctx.cache.state``, so a cached step sees the same past as the whole window."""
        B, T, d = y.shape
        k = self.config.own_k
        keys, tokens, real = y.detach().float(), ctx.tokens, ctx.valid_mask()
        P = 0
        if ctx.cache is not None:
            past = ctx.cache.state.get(self.label)
            if past is not None and past[0].shape[1] == ctx.offset:
                P = ctx.offset
                keys, tokens = torch.cat([past[0], keys], 1), torch.cat([past[1], tokens], 1)
                real = torch.cat([real.new_ones(B, P), real], 1)
            ctx.cache.state[self.label] = (keys, tokens)
        nxt = torch.cat([tokens[:, 1:], tokens.new_full((B, 1), -1)], 1)  # x_{j+1}; the last has none here
        with torch.no_grad():
            d2 = torch.cdist(y.detach().float(), keys).square()  # (B, T, P + T)
            earlier = (
                torch.arange(P + T, device=y.device)[None, :]
                < (P + torch.arange(T, device=y.device))[:, None]
            )
            allowed = earlier[None] & ((nxt >= 0) & real)[:, None, :]
            d2 = d2.masked_fill(~allowed, float("inf"))
            kk = min(k, P + T)
            top, idx = torch.topk(d2, kk, dim=-1, largest=False)  # (B, T, kk)
        vals = torch.where(torch.isfinite(top), nxt.gather(1, idx.flatten(1)).view(B, T, kk), -1)
        picked = keys.gather(1, idx.flatten(1)[..., None].expand(-1, -1, d)).view(B, T, kk, d)
        dist = sq_dist(y.float(), picked)
        if kk < k:
            dist = torch.cat([dist, dist.new_zeros(B, T, k - kk)], -1)
            vals = torch.cat([vals, vals.new_full((B, T, k - kk), -1)], -1)
        return dist, vals

    def remember(self, y: Tensor, ctx: Context) -> None:
        """In training, push the step's states (detached), next tokens and documents onto the queue."""
        if not ctx.training or not self.config.k or not self.config.memory_tokens:
            return
        B, T, d = y.shape
        nxt = torch.cat([ctx.tokens[:, 1:], ctx.tokens.new_full((B, 1), -1)], 1)
        keep = nxt >= 0
        if ctx.mask is not None:
            keep = keep & ctx.mask & torch.cat([ctx.mask[:, 1:], ctx.mask.new_zeros(B, 1)], 1)
        docs = self._docs(ctx, B, y.device)[:, None].expand(B, T)
        self._queue.append((y.detach().float()[keep], nxt[keep], docs[keep]))
        total = sum(len(v) for _, v, _ in self._queue)
        while self._queue and total - len(self._queue[0][1]) >= self.config.memory_tokens:
            total -= len(self._queue.pop(0)[1])
