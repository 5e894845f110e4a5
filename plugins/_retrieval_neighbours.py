"""A batch's retrieval inputs: each chunk's query segment S_t and its k neighbours, from the last rebuild's table,
an online search of the index, or the warm start (earlier segments of the query's own document). Causality: no
neighbour, nor its continuation, is S_{t+1} or a later segment of the same document."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from rlm.data.windows import host_array
from rlm.index.memory import RetrievalMemory
from rlm.plugins._retrieval_filter import (
    as_exclusions,
    copy_exclusions,
    future_exclusions,
    merge_by_score,
    same_table,
    score_candidates,
    segment_tensors,
    window_table,
)

WARM_CANDIDATES = 16
"""The most recent earlier segments of a document that warm start 'similar' scores, and at evaluation those of a
document the index does not hold (each one embedded): four default windows back."""


@dataclass
class RetrievalInputs:
    """The batch's neighbours (ctx.extras[label]): chunk j of a row holds segment j's queries and neighbours."""

    query_tokens: Tensor  # (B, n, L) the query segment S_{j-1} of each chunk j
    query_mask: Tensor  # (B, n, L) its real tokens
    tokens: Tensor  # (B, n, k, M) neighbour tokens (M = L, or 2L with continuations)
    mask: Tensor  # (B, n, k, M) real neighbour tokens
    valid: Tensor  # (B, n, k) whether each neighbour exists
    same_doc: Tensor  # (B, n, k) whether it is from the row's own document (False when unknown)
    ids: Tensor | None = None
    """(B, n, k) neighbour ids (-1: none) in the memory's table (the batch's own without a memory); i >= S, the
    memory table's length, is segment i - S of the batch's own table (an evaluated document's past)."""
    excluded: int = 0  # results the evaluation's future-copy filter took from the batch's top k


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
    randomise: bool = False,
    evaluation: bool = False,
    exclude_copies: bool = True,
    background: bool = False,
) -> RetrievalInputs | PendingInputs:
    """Each chunk's query segment and neighbours: k - warm_k from the memory's table (or searched online), warm_k
    from the query's own past. segments: the table the batch's segment_ids index (Context.segments). evaluation:
    _retrieval_filter's filters apply. background: a PendingInputs whose thread does the host half."""
    if batch.get("segment_ids") is not None and segments is None:
        raise ValueError(
            "the batch has segment_ids but names no segment table (Context.segments): they cannot be read as ids "
            "of the retrieval memory's table; pass the table the ids index (LMModule.make_context(segments=...))"
        )
    own = segments
    # the loader's host copies: reading the device's back would be a sync every step on a GPU
    seg_np, docs, starts = (host_array(batch, name) for name in ("segment_ids", "doc_ids", "starts"))
    real = host_array(batch, "mask")  # (B, T) or None
    ref = memory.segments if memory is not None else own
    L = ref.segment_len
    if own is not None and own.segment_len != L:
        raise ValueError(f"the batch's segments have {own.segment_len} tokens, the memory's {L}")
    tokens = batch["tokens"]
    device = tokens.device
    B, T = tokens.shape
    n = -(-T // L)
    mask = batch.get("mask")
    mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.bool()
    known_future = own is not None  # generation's text has no future to read
    if own is None and evaluation and memory is not None:  # generation: the window is the document
        own, window = window_table(tokens, mask, L, ref.pad_id)
        seg_np, docs, starts = window, np.arange(B), np.zeros(B, dtype=np.int64)
    if seg_np is None or own is None:
        warm_k = 0  # no document to take a past from
    inside = memory is None or (own is not None and same_table(own, memory.segments))
    off = 0 if inside else len(memory.segments)  # own-table ids in RetrievalInputs.ids
    src = own if own is not None else ref
    chunks = F.pad(tokens, (0, n * L - T), value=ref.pad_id).view(B, n, L)
    chunk_mask = F.pad(mask, (0, n * L - T), value=False).view(B, n, L)
    # chunk j's query is segment j-1 of the window; chunk 0's is the document's previous segment, if any
    prev = np.full(B, -1, dtype=np.int64)
    if seg_np is not None and starts is not None:
        prev = np.where((starts > 0) & (seg_np[:, 0] > 0), seg_np[:, 0] - 1, -1)
    prev_tokens, prev_mask = segment_tensors(src, np.maximum(prev, 0), device)  # (B, L)
    prev_mask &= torch.from_numpy(prev >= 0).to(device)[:, None]
    q_tokens = torch.cat([prev_tokens[:, None], chunks[:, :-1]], 1)  # (B, n, L)
    q_mask = torch.cat([prev_mask[:, None], chunk_mask[:, :-1]], 1)
    # q_mask.any(-1), from the host's mask: whether chunk j's query has a real token
    real = np.ones((B, T), dtype=bool) if real is None else real.astype(bool)
    chunk_real = np.pad(real, ((0, 0), (0, n * L - T))).reshape(B, n, L).any(-1)  # (B, n)
    prev_real = (prev >= 0) & (src.length[np.maximum(prev, 0)] > 0)  # (B,)
    q_valid = np.concatenate([prev_real[:, None], chunk_real[:, :-1]], 1)  # (B, n)
    own_q = np.full((B, n), -1, dtype=np.int64)  # query ids in the batch's own table
    if seg_np is not None:
        own_q = np.where(q_valid, np.concatenate([prev[:, None], seg_np[:, : n - 1]], 1), -1)
    q_ids = own_q if inside else np.full_like(own_q, -1)  # in the memory's table: outside queries are -1
    if seg_np is not None and own is not None:
        if docs is None:
            docs = own.doc[np.maximum(seg_np[:, 0], 0)]
        doc_first = own.first[docs]  # (B,)
    warm_part = None
    if warm_k:
        c = warm_k if warm == "recent" else max(WARM_CANDIDATES, warm_k)  # 'similar' picks warm_k among c
        cands = warm_candidates_of(own_q, seg_np[:, 0], doc_first, c, continuation)
        if warm == "similar":
            cands = most_similar(own, cands, q_tokens, q_mask, warm_k, embed, seg_np[:, 0])
        warm_part = cands  # (B, n, warm_k) own-table ids
    k_table = k - warm_k if memory is not None else 0
    search = bool(k_table and online)
    rows, exclusions, e = np.zeros(0, dtype=np.int64), None, None
    if search:
        rows = np.flatnonzero(q_valid.reshape(-1))
        if evaluation and exclude_copies:  # the filters of an evaluated text (_retrieval_filter)
            q_np, m_np = q_tokens.cpu().numpy(), q_mask.cpu().numpy()
            found = [(copy_exclusions(memory, q_np, m_np, continuation), False)]
            if known_future and seg_np is not None:
                found.append((future_exclusions(memory, own, docs, seg_np, continuation), True))
            exclusions = as_exclusions(rows, found)
        if len(rows):  # on the calling thread: a shared embedder runs the LM's own blocks
            e = embed(q_tokens.reshape(B * n, L)[rows], q_mask.reshape(B * n, L)[rows])  # (R, D)

    def finish() -> RetrievalInputs:
        """The host half: read the queries, search, and fetch the neighbours' tokens."""
        parts, excluded = [], 0
        if search:
            nb = np.full((B * n, k_table), -1, dtype=np.int64)
            scores = np.full((B * n, k_table), -np.inf, dtype=np.float32)
            e_q = None
            if e is not None:
                # full width: the memory narrows the queries by its index's projection, if it has one
                e_np = e.float().cpu().numpy()  # (R, D): the one read of the queries for the CPU index
                got = memory.search_scored(e_np, q_ids.reshape(-1)[rows], k_table, exclusions)
                nb[rows], scores[rows] = got.ids, got.scores
                excluded = int(got.excluded.sum()) if got.excluded is not None else 0
                if evaluation:  # for the own-past candidates below
                    e_m = index_width(memory, e, e_np)  # (R, m): own-past scores compare with the index's
                    e_q = torch.zeros(B * n, e_m.shape[-1], device=e_m.device, dtype=e_m.dtype)  # (B*n, m)
                    e_q[torch.from_numpy(rows).to(e_m.device)] = e_m
            elif memory.collective:  # a sharded index searches with every rank: join in with no query
                memory.search_scored(np.zeros((0, 0), dtype=np.float32), rows, k_table, exclusions)
            nb, scores = nb.reshape(B, n, k_table), scores.reshape(B, n, k_table)
            if evaluation and e_q is not None and seg_np is not None:
                # a document the index does not hold: its own past, merged with the index's results by score
                held = inside & memory.indexed_mask()[np.minimum(doc_first, len(memory.segments) - 1)]  # (B,)
                cands = warm_candidates_of(
                    np.where(held[:, None], -1, own_q), seg_np[:, 0], doc_first, WARM_CANDIDATES
                )
                if warm_part is not None:  # not twice: the warm picks have their own slots
                    cands = np.where((cands[..., :, None] == warm_part[..., None, :]).any(-1), -1, cands)
                past = score_candidates(own, cands, e_q, lambda t, m: index_width(memory, embed(t, m)))
                nb = merge_by_score(nb, scores, np.where(cands >= 0, cands + off, -1), past, k_table)
            parts.append(nb)
        elif k_table:
            table = memory.neighbours[np.maximum(q_ids, 0), :k_table]
            parts.append(np.where((q_ids >= 0)[..., None], table, -1))  # (B, n, k_table)
        if warm_part is not None:
            parts.append(np.where(warm_part >= 0, warm_part + off, -1))
        nb = np.concatenate(parts, -1)  # (B, n, k)
        if randomise:
            nb = random_neighbours(nb, q_ids, ref, memory.rows if memory is not None else None)
        nb_tokens, nb_mask = two_table_tokens(ref, own, off, nb, continuation)
        if off:
            same = nb >= off  # the batch's own past; nothing of the memory's table is of its documents
        elif docs is not None:
            same = (nb >= 0) & (ref.doc[np.maximum(nb, 0)] == docs[:, None, None])
        else:
            same = np.zeros_like(nb, dtype=bool)
        arrays = (nb_tokens, nb_mask, nb >= 0, same, nb)  # tokens, mask, valid, same_doc, ids
        return RetrievalInputs(q_tokens, q_mask, *(torch.from_numpy(x).to(device) for x in arrays), excluded)

    if not background:
        return finish()
    if evaluation or (memory is not None and memory.collective):
        raise ValueError(
            "gather_inputs(background=True) is for training steps on a memory of one process: evaluation embeds "
            "again in its host half, and a sharded index's search is a collective"
        )
    return PendingInputs(finish, device, e)


class PendingInputs:
    """gather_inputs' host half (search, neighbour tokens) in a thread while the forward runs up to the first
    cross-attention. On CUDA the thread's side stream starts after everything queued so far and the caller's
    stream waits for it in result(), so neither waits for the other's kernels nor reads early."""

    def __init__(self, finish: Callable[[], RetrievalInputs], device: torch.device, uses: Tensor | None):
        self._stream = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            if uses is not None:  # freed by the caller's stream only once the side stream is done
                uses.record_stream(self._stream)
        self._out: dict[str, Any] = {}
        self._thread = threading.Thread(
            target=self._run, args=(finish,), name="retrieval-search", daemon=True
        )
        self._thread.start()

    def _run(self, finish: Callable[[], RetrievalInputs]) -> None:
        try:
            with torch.cuda.stream(self._stream):  # None: no CUDA, nothing to switch
                self._out["inputs"] = finish()
        except BaseException as err:  # raised again on the caller's thread, in result()
            self._out["error"] = err

    def result(self) -> RetrievalInputs:
        """The inputs, ready for the caller's stream; the thread's error if it failed."""
        self._thread.join()
        if "error" in self._out:
            raise self._out["error"]
        inputs = self._out["inputs"]
        if self._stream is not None:
            main = torch.cuda.current_stream(self._stream.device)
            main.wait_stream(self._stream)
            for t in (inputs.tokens, inputs.mask, inputs.valid, inputs.same_doc, inputs.ids):
                t.record_stream(main)  # made on the side stream, used on the caller's
        return inputs


def index_width(memory: RetrievalMemory, e: Tensor, host: np.ndarray | None = None) -> Tensor:
    """(R, D) unit e(.) narrowed by the memory's projection, if any, to compare with the index's scores. host: e
    already read to the host."""
    if memory.projection is None:
        return e
    host = e.float().cpu().numpy() if host is None else host
    return torch.from_numpy(memory.project(host)).to(e.device)


def two_table_tokens(ref, own, off: int, nb: np.ndarray, continuation: bool) -> tuple[np.ndarray, np.ndarray]:
    """neighbour_tokens of ids in `ref` (< off) and in the batch's own table (>= off; off = 0: one table)."""
    if not off:
        return neighbour_tokens(ref, nb, continuation)
    mine = nb >= off
    a = neighbour_tokens(ref, np.where(mine, -1, nb), continuation)
    b = neighbour_tokens(own, np.where(mine, nb - off, -1), continuation)
    return tuple(np.where(mine[..., None], y, x) for x, y in zip(a, b))


def random_neighbours(nb: np.ndarray, q_ids: np.ndarray, seg, pool: np.ndarray | None) -> np.ndarray:
    """The ablation: every neighbour (B, n, k) replaced by a random segment of the pool (None: all) of another
    document than its query's, seeded by the query ids (a batch always gets the same)."""
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
    """(B, n, c) earlier segments of each query's own document (-1 pads): before the attention window, then inside
    it, each most recent first. Every z < q (the query S_t), so z and z + 1 never reach the target S_{t+1}. With
    continuation the ones before the window come every other one first (before-2, before-4, ...), so picks and
    continuations cover before-1, before-2, ... once each. q_ids (B, n) (-1: none); window_first, doc_first (B,)."""
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
    """(B, n, k) of the candidates (B, n, c): before the window first, then by cosine to the query's e(S_t) under
    the current embedder, each distinct candidate embedded once."""
    B, n, c = cands.shape
    L = seg.segment_len
    ids, inverse = np.unique(np.maximum(cands, 0), return_inverse=True)
    device = q_tokens.device
    e_c = embed(*segment_tensors(seg, ids, device))  # (U, D)
    e_q = embed(q_tokens.reshape(B * n, L), q_mask.reshape(B * n, L)).view(B, n, 1, -1)  # (B, n, 1, D)
    e_c = e_c[torch.from_numpy(inverse.reshape(-1)).to(device)].view(B, n, c, -1)  # (B, n, c, D)
    cos = (e_q * e_c).sum(-1).cpu().numpy()
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


def source_groups(
    inputs: RetrievalInputs | None, shape: tuple[int, int], L: int, device: Any
) -> dict[str, Tensor]:
    """(B, T) masks of the chunks whose neighbours are all of the row's document (own_doc), none of it (other_doc),
    mixed, or absent (none)."""
    B, T = shape
    if inputs is None:
        everything = torch.ones(B, T, dtype=torch.bool, device=device)
        return {"own_doc": ~everything, "other_doc": ~everything, "mixed": ~everything, "none": everything}
    valid, same = inputs.valid, inputs.same_doc & inputs.valid  # (B, n, k)
    found = valid.any(-1)  # (B, n)
    own, other = found & (same == valid).all(-1), found & ~same.any(-1)
    chunk = {"own_doc": own, "other_doc": other, "mixed": found & ~own & ~other, "none": ~found}
    return {name: m.repeat_interleave(L, dim=1)[:, :T] for name, m in chunk.items()}


# the RetrievalInputs fields with a chunk dimension (dim 1)
CHUNKED = ("query_tokens", "query_mask", "tokens", "mask", "valid", "same_doc", "ids")


def chunk_slice(inp: RetrievalInputs, lo: int, hi: int) -> RetrievalInputs:
    """Chunks lo..hi-1 of every row of gather_inputs' output."""
    return RetrievalInputs(**{f: getattr(inp, f)[:, lo:hi] for f in CHUNKED})


def chunk_cat(parts: list[RetrievalInputs]) -> RetrievalInputs:
    """Consecutive chunks side by side, (B, sum of n, ...): the inverse of chunk_slice."""
    if len(parts) == 1:
        return parts[0]
    return RetrievalInputs(**{f: torch.cat([getattr(p, f) for p in parts], dim=1) for f in CHUNKED})
