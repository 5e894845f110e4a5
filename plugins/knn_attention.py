"""Token-grain retrieval inside the network: each position attends to the tokens that came next after its nearest
contexts by the LM's own states (kNN-LM, Khandelwal et al. 2020; Memorizing Transformers, Wu et al. 2022). At block
``layer``, beside the self-attention (an ADD module on its normed input y), position t finds neighbours j (key y_j,
value v_j = the token after j) and computes

    s_j = -||y_t - y_j||^2 / tau + b_src(j)          tau learned; b_src one learned bias per source
    a   = softmax_j(s)                               over the memory's k and the own past's own_k neighbours
    r_t = sum_j a_j E[v_j]                           E the (tied) token embedding, read without gradient
    out = sigmoid(g . y_t + c) * W_o r_t             W_o starts at zero: the model starts as the one without it

Keys are detached states. Neighbours come from the window's own past (j < t: a continuous cache, Grave et al. 2017,
with learned weights) and, with k > 0, from a queue of recent training states of other documents, or at evaluation
a datastore of this model's states (``rlm knnlm build --layer attn_input``) with kNN-LM's causal exclusion."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlm.plugin import Claim, Context, Mode, Plugin, Slot, check_layers


@dataclass
class KnnAttentionConfig:
    """Options of the kNN attention."""

    layer: int = -1
    """The block whose self-attention input y is the query (-1: the last)."""
    k: int = 0
    """Neighbours from the training queue (a datastore at evaluation); 0: the window's own past alone (RESULTS.md,
    "kNN attention": the queue lost to it on both corpora)."""
    own_k: int = 8
    """Neighbours from the window's own past (the continuous cache); 0: none."""
    memory_tokens: int = 4096
    """The latest training states kept in the queue, searched exactly."""

    def __post_init__(self) -> None:
        for name in ("k", "own_k", "memory_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"knn_attention.{name} must be a non-negative integer, got {v!r}")
        if self.k + self.own_k == 0:
            raise ValueError("knn_attention: k and own_k are both 0, so nothing is retrieved; set either > 0")


class NeighbourDistance(torch.autograd.Function):
    """d2 (N, n) = ||y_i - table[idx_ij]||^2 as the search computed it, with its gradient into y,
    2 (y_i sum_j g_ij - sum_j g_ij table[idx_ij]): an embedding bag, so the (N, n, d) keys are never gathered."""

    @staticmethod
    def forward(ctx, y: Tensor, table: Tensor, idx: Tensor, d2: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(y, table, idx)
        return d2.clone()

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        y, table, idx = ctx.saved_tensors
        g = g.to(table.dtype)
        pulled = F.embedding_bag(idx, table, per_sample_weights=g, mode="sum")  # (N, d)
        return (2 * (y * g.sum(-1, keepdim=True) - pulled)).to(y.dtype), None, None, None


def neighbour_distance(y: Tensor, table: Tensor, idx: Tensor, d2: Tensor) -> Tensor:
    """d2 (N, n), searched without gradient, with the gradient into y (N, d) of ||y - table[idx]||^2."""
    if not (torch.is_grad_enabled() and y.requires_grad):
        return d2
    return NeighbourDistance.apply(y, table, idx, d2)


def sq_dist_mm(q: Tensor, keys: Tensor) -> Tensor:
    """||q_i - key_j||^2 - ||q_i||^2 ((B,) N, M) in one addmm or baddbmm (a row's order is the squared distance's),
    in float32: in bfloat16 the cancellation in ||q||^2 - 2 q.k + ||k||^2 reorders the nearest neighbours."""
    mm = torch.addmm if q.ndim == 2 else torch.baddbmm
    with torch.autocast(q.device.type, enabled=False):
        return mm(keys.square().sum(-1).unsqueeze(-2), q, keys.transpose(-2, -1).to(q.dtype), alpha=-2)


def _nearest(d2: Tensor, q: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The k nearest of d2 (..., M) (sq_dist_mm's, inf where not allowed): their squared distances to q (0 where
    none), indices and whether found."""
    top, idx = torch.topk(d2, min(k, d2.shape[-1]), dim=-1, largest=False, sorted=False)
    found = torch.isfinite(top)
    return torch.where(found, (top + q.square().sum(-1, keepdim=True)).clamp_min(0), 0.0), idx, found


def _next_tokens(tokens: Tensor) -> Tensor:
    """x_{j+1} of each position of tokens (B, T); -1 for the last."""
    return torch.cat([tokens[:, 1:], tokens.new_full((tokens.shape[0], 1), -1)], 1)


def _pad(dist: Tensor, vals: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Distances and values (..., kk) padded to k neighbours with absent ones (distance 0, value -1)."""
    n = k - dist.shape[-1]
    if n <= 0:
        return dist, vals
    return torch.cat([dist, dist.new_zeros(*dist.shape[:-1], n)], -1), F.pad(vals, (0, n), value=-1)


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
        E = p._embedding.weight.detach()  # (V, d) the token embedding table
        # r = sum_j a_j E[v_j] as a weighted embedding bag: no (B, T, n, d) rows. E is not trained through here: its
        # gradient through the bag is costly, and the tied LM head already scores E[v] . h, which W_o learns to raise
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
        tau = model_config.d_model / 8  # as the token memory's
        self.log_tau = nn.Parameter(torch.tensor(math.log(tau)))
        self.bias = nn.Parameter(torch.zeros(2))  # b_src of the memory and the own past
        # The training queue, a ring of the latest memory_tokens entries: keys (M, d) detached, values (M,),
        # documents (M,); checkpointed as extra state.
        self._ring: tuple[Tensor, Tensor, Tensor] | None = None
        self._filled = 0
        self._next = 0
        # A step's entries wait here until the next search: written at once they would change the ring under the
        # step's own backward, which reads the neighbours' keys from it (NeighbourDistance)
        self._pending: list[tuple[Tensor, Tensor, Tensor]] = []
        object.__setattr__(self, "_embedding", None)
        self.datastore: Any = None  # a kNN-LM datastore of attn_input states, searched outside training
        self._store: Any = None
        self._root: str = ""

    def claims(self) -> list[Claim]:
        return [Claim(Slot.ATTN, Mode.ADD, [self.layer])]

    def build(self, claim: Claim, layer: int | None, current: nn.Module | None) -> nn.Module:
        return KnnAttention(self, self.model_config.d_model)

    def attach(self, model: nn.Module) -> None:
        object.__setattr__(self, "_embedding", model.token_embedding)

    def eval_variants(self) -> list[str]:
        """Validation also runs with random tokens as the neighbours' values (val/<label>_random/loss)."""
        return [f"{self.label}_random"]

    def use_datastore(self, datastore: Any, store: Any, root: str) -> bool:
        """Search ``datastore`` (keys at ``attn_input``) outside training, excluding each window's own document (or a
        copy) in ``store`` at ``root``. False with k 0: the datastore is then only interpolated."""
        if not self.config.k:
            return False
        layer = datastore.meta.get("layer")
        if layer != "attn_input":
            raise ValueError(f"knn_attention: datastore {datastore.path} has keys at layer {layer!r}; the plugin "
                             "queries the last block's attention input: build it with --layer attn_input")  # fmt: skip
        if self.layer != self.model_config.n_layers - 1:
            raise ValueError(f"knn_attention: a datastore holds the last block's states; this plugin sits at "
                             f"layer {self.layer} of {self.model_config.n_layers}")  # fmt: skip
        self.datastore, self._store, self._root = datastore, store, root
        return True

    def queue(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """The queue's entries (keys (n, d), next tokens (n,), documents (n,)), pending ones written first; or None."""
        while self._pending:
            self.push(*self._pending.pop(0))
        if self._ring is None or not self._filled:
            return None
        return tuple(x[: self._filled] for x in self._ring)  # type: ignore[return-value]

    def push(self, keys: Tensor, values: Tensor, docs: Tensor) -> None:
        """Write entries into the ring over its oldest."""
        M = self.config.memory_tokens
        if not M:
            return
        keys, values, docs = keys[-M:], values[-M:], docs[-M:]
        n = len(values)
        ring = self._ring
        if ring is None or ring[0].shape[1] != keys.shape[1] or ring[0].device != keys.device:
            self._ring = (keys.new_zeros(M, keys.shape[1], dtype=torch.float32), values.new_zeros(M),
                          docs.new_zeros(M))  # fmt: skip
            self._filled = self._next = 0
        pos = (self._next + torch.arange(n, device=keys.device)) % M
        for dst, src in zip(self._ring, (keys.float(), values, docs)):
            dst[pos] = src.to(dst.dtype)
        self._next = (self._next + n) % M
        self._filled = min(M, self._filled + n)

    def get_extra_state(self) -> dict[str, Any]:
        """The queue, so that evaluating a checkpoint searches what validation during fit searched."""
        # pending entries are not written into the ring: the step's backward may still read its keys
        parts = list(self._pending)
        if self._ring is not None and self._filled:
            oldest_first = (torch.roll(x, -self._next, 0) if self._filled == len(x) else x[: self._filled]
                            for x in self._ring)  # fmt: skip
            parts.insert(0, tuple(oldest_first))
        if not parts:
            return {"queue": None}
        M = self.config.memory_tokens
        return {"queue": tuple(torch.cat(x)[-M:].cpu() for x in zip(*parts))}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.clear_queue()
        queue = state.get("queue") if isinstance(state, dict) else None
        if queue is not None:
            self.push(*queue)

    def clear_queue(self) -> None:
        self._ring, self._filled, self._next, self._pending = None, 0, 0, []

    def neighbours(self, y: Tensor, ctx: Context) -> tuple[Tensor, Tensor]:
        """(squared distances (B, T, k + own_k) with gradient into y, values (-1 where none))."""
        parts = []
        if self.config.k:
            datastore = self.datastore is not None and not ctx.training
            parts.append((self._search_datastore if datastore else self._search_queue)(y, ctx))
        if self.config.own_k:
            parts.append(self._own_past(y, ctx))
        dist, vals = zip(*parts)
        return torch.cat(dist, -1), torch.cat(vals, -1)

    def _docs(self, ctx: Context, B: int, device: torch.device) -> Tensor:
        # rows the batch does not name are each their own document
        return (ctx.doc_ids if ctx.doc_ids is not None else -1 - torch.arange(B)).to(device)

    def _search_queue(self, y: Tensor, ctx: Context) -> tuple[Tensor, Tensor]:
        """The k nearest queue entries of other documents: distances (B, T, k) with gradient into y, values."""
        B, T, d = y.shape
        k = self.config.k
        queue = self.queue()
        if queue is None:
            return y.new_zeros(B, T, k, dtype=torch.float32), torch.full((B, T, k), -1, device=y.device)
        qk, qv, qd = queue
        yf = y.float().flatten(0, 1)  # (N, d)
        with torch.no_grad():
            q = yf.detach()
            d2 = sq_dist_mm(q, qk).view(B, T, -1)  # (B, T, M) up to each row's ||q||^2
            d2.masked_fill_((self._docs(ctx, B, y.device)[:, None] == qd[None, :])[:, None, :], float("inf"))
            top, idx, found = _nearest(d2.view(B * T, -1), q, k)
        vals = torch.where(found, qv[idx], -1)
        dist, vals = _pad(neighbour_distance(yf, qk, idx, top), vals, k)  # a queue still shorter than k
        return dist.view(B, T, k), vals.view(B, T, k)

    def _search_datastore(self, y: Tensor, ctx: Context) -> tuple[Tensor, Tensor]:
        """The datastore's k nearest of other documents: distances, values (B, T, k), no gradient."""
        B, T, d = y.shape
        k = self.config.k
        q = y.detach().float().cpu()
        docs = ctx.doc_ids.tolist() if ctx.doc_ids is not None else [None] * B
        dist = np.full((B, T, k), np.inf, np.float32)
        vals = np.full((B, T, k), -1, np.int64)
        groups: dict[Any, list[int]] = {}
        for b, doc in enumerate(docs):
            own = None if doc is None else self._store.doc_tokens(doc)
            excl = None if doc is None else self.datastore.exclusion(self._root, doc, own)
            groups.setdefault(excl, []).append(b)
        for excl, rows in groups.items():
            dd, vv = self.datastore.search(q[rows].flatten(0, 1).numpy(), k, excl)
            dist[rows], vals[rows] = dd.reshape(len(rows), T, -1), vv.reshape(len(rows), T, -1)
        dist_t = torch.from_numpy(np.where(np.isfinite(dist), dist, 0.0).clip(0, None)).to(y.device)
        return dist_t, torch.from_numpy(vals).to(y.device)

    def _own_past(self, y: Tensor, ctx: Context) -> tuple[Tensor, Tensor]:
        """The own_k nearest earlier positions j < t (value x_{j+1}): distances with gradient into y_t, values
        (B, T, own_k). Under a KV cache the earlier keys and tokens travel in ``ctx.cache.state``."""
        B, T, d = y.shape
        k = self.config.own_k
        yf = y.float()
        keys, tokens, real = yf.detach(), ctx.tokens, ctx.valid_mask()
        P = 0
        if ctx.cache is not None:
            past = ctx.cache.state.get(self.label)
            if past is not None and past[0].shape[1] == ctx.offset:
                P = ctx.offset
                keys, tokens = torch.cat([past[0], keys], 1), torch.cat([past[1], tokens], 1)
                real = torch.cat([real.new_ones(B, P), real], 1)
            ctx.cache.state[self.label] = (keys, tokens)
        nxt = _next_tokens(tokens)  # x_{j+1}; the last has none here
        S = P + T
        with torch.no_grad():
            q = yf.detach()
            d2 = sq_dist_mm(q, keys)  # (B, T, S)
            j = torch.arange(S, device=y.device)
            earlier = j[None, :] < (P + j[:T])[:, None]  # (T, S)
            allowed = earlier[None] & ((nxt >= 0) & real)[:, None, :]
            d2.masked_fill_(~allowed, float("inf"))
            top, idx, found = _nearest(d2, q, k)  # (B, T, kk)
        kk = idx.shape[-1]
        vals = torch.where(found, nxt.gather(1, idx.flatten(1)).view(B, T, kk), -1)
        flat = (idx + S * torch.arange(B, device=y.device)[:, None, None]).view(B * T, kk)
        dist = neighbour_distance(yf.flatten(0, 1), keys.reshape(B * S, d), flat, top.view(B * T, kk))
        return _pad(dist.view(B, T, kk), vals, k)

    def remember(self, y: Tensor, ctx: Context) -> None:
        """In training, push the step's states (detached), next tokens and documents onto the queue."""
        if not ctx.training or not self.config.k or not self.config.memory_tokens:
            return
        B, T, d = y.shape
        nxt = _next_tokens(ctx.tokens)
        keep = nxt >= 0
        if ctx.mask is not None:
            keep = keep & ctx.mask & torch.cat([ctx.mask[:, 1:], ctx.mask.new_zeros(B, 1)], 1)
        docs = self._docs(ctx, B, y.device)[:, None].expand(B, T)
        self._pending.append((y.detach()[keep], nxt[keep], docs[keep]))
