"""Finding the retriever's neighbours for a batch: each chunk's query segment S_t and its k neighbours.

One job: turn a batch of windows into RetrievalInputs (token ids, masks, neighbour ids). The neighbours come
from the last rebuild's table (lookup 'table'), from an online search of the index with the current embedder
(lookup 'search', validation, generation), or, until the first table lands, from the warm start: earlier
segments of the query's own document (warm_candidates_of, most_similar). The random-neighbour ablation
(random_neighbours) swaps them for segments of other documents. Causality: no neighbour, nor its continuation,
is the target segment S_{t+1} or a later segment of the same document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from rlm.index.rebuild import RetrievalMemory


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
    ids: Tensor | None = None
    """(B, n, k) global segment ids of the neighbours (-1: none)."""


def gather_inputs(
    memory: RetrievalMemory | None,
    batch: dict[str, Any],
    k: int,
    continuation: bool,
    online: bool,
    embed,
    segments: Any = None,
    warm_k: int = 0,
    warm: str = "recent",
    warm_candidates: int = 16,
    randomise: bool = False,
) -> RetrievalInputs:
    """Query segments and their neighbours for each chunk of the batch (see RetrievalInputs): the first k - warm_k
    from the memory's table (or searched online), the last warm_k from the query's own past (warm_neighbours)."""
    seg = memory.segments if memory is not None else segments
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
    parts = []
    k_table = k - warm_k if memory is not None else 0
    if k_table and online:
        nb = np.full((B * n, k_table), -1, dtype=np.int64)
        rows = np.flatnonzero(q_valid.reshape(-1))
        if len(rows):
            e = embed(q_tokens.reshape(B * n, L)[rows], q_mask.reshape(B * n, L)[rows])  # (R, D)
            nb[rows] = memory.search(e.float().cpu().numpy(), q_ids.reshape(-1)[rows], k_table)
        elif memory.collective:  # a sharded index searches with every rank: join in with no query
            memory.search(np.zeros((0, 0), dtype=np.float32), rows, k_table)
        parts.append(nb.reshape(B, n, k_table))
    elif k_table:
        table = memory.neighbours[np.maximum(q_ids, 0), :k_table]
        parts.append(np.where((q_ids >= 0)[..., None], table, -1))  # (B, n, k_table)
    if warm_k:
        window_first = seg_ids[:, 0].cpu().numpy()
        doc_first = (
            seg.first[batch["doc_ids"].cpu().numpy()]
            if batch.get("doc_ids") is not None
            else seg.first[seg.doc[np.maximum(window_first, 0)]]
        )
        cands = warm_candidates_of(
            q_ids, window_first, doc_first, warm_k if warm == "recent" else warm_candidates, continuation
        )
        if warm == "similar":
            cands = most_similar(seg, cands, q_tokens, q_mask, warm_k, embed, window_first)
        parts.append(cands)
    nb = np.concatenate(parts, -1)  # (B, n, k)
    if randomise:
        nb = random_neighbours(nb, q_ids, seg, memory.rows if memory is not None else None)
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
        ids=torch.from_numpy(nb).to(device),
    )


def random_neighbours(nb: np.ndarray, q_ids: np.ndarray, seg, pool: np.ndarray | None) -> np.ndarray:
    """The ablation: every present neighbour (B, n, k) replaced by a random segment of the pool (None: all
    segments) from another document than its query's (so never the query's future); seeded by the query ids,
    so a batch always gets the same ones."""
    rng = np.random.default_rng(np.abs(q_ids).ravel().tolist() or [0])
    pool = np.arange(len(seg)) if pool is None else pool
    q_doc = np.where(q_ids >= 0, seg.doc[np.maximum(q_ids, 0)], -1)[..., None]  # (B, n, 1)
    out = pool[rng.integers(0, len(pool), size=nb.shape)]
    for _ in range(8):  # redraw those that landed in the query's own document
        clash = seg.doc[out] == q_doc
        if not clash.any():
            break
        out[clash] = pool[rng.integers(0, len(pool), size=int(clash.sum()))]
    return np.where((nb >= 0) & (seg.doc[out] != q_doc), out, -1)


def warm_candidates_of(
    q_ids: np.ndarray, window_first: np.ndarray, doc_first: np.ndarray, c: int, continuation: bool = False
) -> np.ndarray:
    """(B, n, c) earlier segments of each query's own document, best first (-1 pads): those before the attention
    window, most recent first, then those inside it, most recent first. Every z < q (the query S_t), so z and its
    continuation z + 1 <= S_t never reach the target segment S_{t+1}.

    With continuation (each neighbour brings z + 1), the segments before the window come every other one first,
    before-2, before-4, ..., so the picks and their continuations cover before-1, before-2, before-3, ... once each
    (the plain order would repeat before-1 as the second pick and bring the window's own first segment as the
    first pick's continuation); the skipped before-1, before-3, ... follow, then the window.

    q_ids (B, n) global query ids (-1: none); window_first (B,) the window's first segment; doc_first (B,) the
    document's first segment."""
    q = q_ids[..., None]  # (B, n, 1)
    w0, d0 = window_first[:, None, None], doc_first[:, None, None]  # (B, 1, 1)
    r = np.arange(c)  # (c,) rank of the pick
    before = np.minimum(w0, q)  # candidates before the window: before-1, before-2, ..., d0
    n_out = np.maximum(before - d0, 0)  # (B, n, 1)
    if continuation:
        even = n_out // 2  # before-2, before-4, ..., before-2*even (>= d0), then before-1, before-3, ...
        out = np.where(r < even, before - 2 - 2 * r, before - 1 - 2 * (r - even))
    else:
        out = before - 1 - r
    inside = q - 1 - (r - n_out)  # then q-1, q-2, ..., w0
    z = np.where(r < n_out, out, np.where(inside >= w0, inside, -1))
    return np.where(q >= 0, z, -1).astype(np.int64)


def most_similar(
    seg, cands: np.ndarray, q_tokens: Tensor, q_mask: Tensor, k: int, embed, window_first: np.ndarray
) -> np.ndarray:
    """(B, n, k) of the candidates (B, n, c): those before the window first, then by cosine to the query's e(S_t)
    under the current embedder (embed: no-grad tokens, mask -> unit vectors), each distinct candidate embedded once."""
    B, n, c = cands.shape
    L = seg.segment_len
    ids, inverse = np.unique(np.maximum(cands, 0), return_inverse=True)
    device = q_tokens.device
    e_c = embed(
        torch.from_numpy(seg.tokens(ids)).to(device),
        torch.from_numpy(np.arange(L) < seg.length[ids][:, None]).to(device),
    )  # (U, D)
    e_q = embed(q_tokens.reshape(B * n, L), q_mask.reshape(B * n, L)).view(B, n, 1, -1)  # (B, n, 1, D)
    cos = (
        (e_q * e_c[torch.from_numpy(inverse.reshape(-1)).to(device)].view(B, n, c, -1)).sum(-1).cpu().numpy()
    )
    score = cos + 4.0 * (cands < window_first[:, None, None])  # before the window first (cos is in [-1, 1])
    score = np.where(cands >= 0, score, -np.inf)
    order = np.argsort(-score, axis=-1, kind="stable")[..., :k]
    return np.where(np.take_along_axis(score, order, -1) > -np.inf, np.take_along_axis(cands, order, -1), -1)


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
