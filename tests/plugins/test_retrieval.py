"""The retriever plugin: relevance-biased cross-attention against a naive loop, causality by perturbation,
neighbour tables against brute force, gradients into the embedder, config validation."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from retrieval_helpers import (  # noqa: E402
    CORPUS_OFFSETS,
    CORPUS_SEGMENTS,
    VOCAB,
    L,
    attach_memory,
    context,
    logits,
    make_segments,
    random_docs,
    tiny_model,
)

from rlm.data.windows import Windows
from rlm.index.build import IndexConfig
from rlm.index.memory import build_memory
from rlm.model.transformer import Transformer
from rlm.plugin import Context, make_config
from rlm.plugins._retrieval_attention import Encoded
from rlm.plugins._retrieval_neighbours import RetrievalInputs, warm_candidates_of
from rlm.plugins.retrieval import RetrievalPlugin


@pytest.fixture
def corpus():
    """12 documents of 70 tokens (9 segments), the first 10 for training; windows of 4 segments."""
    return CORPUS_SEGMENTS, Windows(CORPUS_SEGMENTS, CORPUS_OFFSETS, np.arange(10), 32)


# ----- numerics -----


def test_cross_attention_matches_naive_loop():
    """Relevance-biased chunked cross-attention (MARGE eq. 2) against explicit loops over heads, queries, keys;
    both query heads read the one key/value head (multi-query)."""
    model = tiny_model(continuation=False)
    plugin = model.plugins["retrieval"]
    xattn = model.blocks[1].cross_attn
    with torch.no_grad():
        xattn.beta.fill_(1.7)
    B, n, k, M, D = 2, 3, 2, L, plugin.encoder.dim
    T = n * L - 3  # a ragged last chunk
    U = 7  # distinct neighbours, shared by the B*n*k = 12 slots
    distinct = torch.randn(U, M, D)
    index = torch.randint(0, U, (B * n * k,))
    states = distinct[index].view(B * n, k * M, D)  # what each chunk sees
    key_valid = torch.rand(B * n, k * M) > 0.3
    key_valid[1] = False  # a chunk with no neighbour at all
    relevance = torch.rand(B * n, k) * 2 - 1
    ctx = Context(tokens=torch.zeros(B, T, dtype=torch.long))
    ctx.extras["retrieval/encoded"] = Encoded(distinct, index, key_valid, relevance, L)
    x = torch.randn(B, T, 32)
    got = xattn(x, ctx)

    h, hs = 2, 16
    g = 1  # one key/value head
    kv = xattn.kv(xattn.kv_norm(states)).view(B * n, k * M, 2, g, hs)
    inv = 1.0 / 10000.0 ** (torch.arange(0, hs, 2).float() / hs)  # rotary frequencies (Su et al. 2021)

    def rotate(vec, pos):  # one (hs,) vector at position pos: pairs (i, i + hs/2) turned by pos * inv_i
        a, b = vec[: hs // 2], vec[hs // 2 :]
        c, s = torch.cos(pos * inv), torch.sin(pos * inv)
        return torch.cat([a * c - b * s, a * s + b * c])

    want = torch.zeros(B, n * L, 32)
    for b in range(B):
        for j in range(n):
            c = b * n + j
            for t in range(j * L, min((j + 1) * L, T)):
                q = xattn.q(x[b, t]).view(h, hs)
                out = torch.zeros(h, hs)
                if key_valid[c].any():
                    for head in range(h):
                        scores = []
                        for key in range(k * M):
                            z = key // M
                            # query i of the chunk at position L + i; key m of neighbour z at position m
                            qr = rotate(q[head], L + t - j * L)
                            kr = rotate(kv[c, key, 0, head // (h // g)], key % M)
                            s = qr @ kr / math.sqrt(hs) + 1.7 * relevance[c, z]
                            scores.append(s if key_valid[c, key] else torch.tensor(-math.inf))
                        p = torch.softmax(torch.stack(scores), 0)
                        out[head] = sum(p[key] * kv[c, key, 1, head // (h // g)] for key in range(k * M))
                want[b, t] = xattn.proj(out.reshape(-1))
    torch.testing.assert_close(got, want[:, :T], rtol=1e-4, atol=1e-5)
    assert torch.all(got[0, L : 2 * L] == 0)  # chunk 1 of row 0 had no key: no output, no NaN


def test_neighbour_table_matches_brute_force(corpus):
    """Every row's neighbours = exact top-k by cosine among allowed segments; never itself, its target or later."""
    segments, _ = corpus
    model = tiny_model()
    memory, vectors = attach_memory(model, segments, np.arange(10))
    rows = memory.rows
    sims = vectors @ vectors.T  # (R, R)
    doc, start = segments.doc[rows], segments.start[rows]
    banned = (doc[:, None] == doc[None, :]) & (start[None, :] >= start[:, None])  # itself, target and later
    sims[banned] = -np.inf
    want = rows[np.argsort(-sims, axis=1, kind="stable")[:, :2]]
    np.testing.assert_array_equal(memory.neighbours[rows], want)
    for s in rows:
        for z in memory.neighbours[s]:
            # the neighbour (and its continuation z + 1) never reach the target segment s + 1
            assert not (segments.doc[z] == segments.doc[s] and z >= s)
    assert (memory.neighbours[np.setdiff1d(np.arange(len(segments)), rows)] == -1).all()


# ----- causality -----


PATHS = {
    "table": ({"warm_start": "none"}, True),
    "warm_recent": ({"warm_start": "recent"}, False),
    "warm_similar": ({"warm_start": "similar"}, False),
    "table_same_doc": ({"warm_start": "recent", "same_doc_k": 1}, True),
    "table_same_doc_similar": ({"warm_start": "similar", "same_doc_k": 1}, True),
    "tokens_table": ({"warm_start": "none", "embedder": "tokens"}, True),
    "tokens_warm_recent": ({"warm_start": "recent", "embedder": "tokens"}, False),
    "tokens_search": ({"warm_start": "none", "embedder": "tokens", "lookup": "search"}, True),
    "search_same_doc": ({"warm_start": "recent", "same_doc_k": 1, "lookup": "search"}, True),
}
"""Every way the retriever finds neighbours: (options, with a memory); without one, the warm start."""


def with_path(path: str, corpus, **opts) -> Transformer:
    """A tiny model whose neighbours come from `path` (see PATHS)."""
    segments, _ = corpus
    extra, table = PATHS[path]
    model = tiny_model(**extra, **opts)
    if table:
        attach_memory(model, segments, np.arange(10))
    return model


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("stage", ["train", "val"])
@pytest.mark.parametrize("continuation", [True, False])
def test_perturbing_later_tokens_never_changes_earlier_logits(corpus, stage, continuation, path):
    """For cuts p at and inside segment boundaries: changing tokens[p:] leaves logits[:p] exactly as they were."""
    segments, windows = corpus
    model = with_path(path, corpus, continuation=continuation)
    starts = windows.start
    batch = windows.collate(
        np.flatnonzero(starts > 0)[:3].tolist() + np.flatnonzero(starts == 0)[:2].tolist()
    )
    base = logits(model, batch, stage)
    assert torch.isfinite(base).all()
    rng = np.random.default_rng(1)
    for p in [1, L - 1, L, L + 3, 2 * L, 3 * L - 1, 3 * L]:
        other = dict(batch)
        tokens = batch["tokens"].clone()
        tokens[:, p:] = torch.from_numpy(rng.integers(4, VOCAB, size=tokens[:, p:].shape))
        other["tokens"] = tokens
        out = logits(model, other, stage)
        torch.testing.assert_close(out[:, :p], base[:, :p], rtol=0, atol=0)
        assert not torch.allclose(out[:, p:], base[:, p:])


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("stage", ["train", "val"])
def test_neighbours_never_reach_the_target_or_later(corpus, stage, path):
    """On every path, a neighbour z of chunk j's query S_t (global id q) of the same document has z < q, so
    neither z nor its continuation z + 1 is the target S_{t+1} or later; the warm start's are all own-document."""
    segments, windows = corpus
    model = with_path(path, corpus)
    batch = windows.collate(np.arange(len(windows)))
    inputs: RetrievalInputs = context(model, batch, stage).extras["retrieval"]
    ids, seg_ids = inputs.ids.numpy(), batch["segment_ids"].numpy()
    B, n, k = ids.shape
    assert (ids >= 0).sum() > B  # neighbours were found
    for b in range(B):
        doc = int(batch["doc_ids"][b])
        for j in range(n):
            target = seg_ids[b, 0] + j  # global id of window segment j (also past the document's end)
            for z in ids[b, j]:
                if z >= 0 and segments.doc[z] == doc:
                    assert z < target - 1, (b, j, z, target)  # z < q = target - 1
    if path.startswith("warm"):
        valid = ids >= 0
        assert (
            segments.doc[ids[valid]] == np.repeat(batch["doc_ids"].numpy(), n * k).reshape(B, n, k)[valid]
        ).all()
        assert inputs.same_doc[inputs.valid].all()
    if "same_doc" in path:  # the last same_doc_k come from the document's past whenever it has one
        last = ids[..., -1]
        assert (last >= 0).any()
        assert (
            segments.doc[last[last >= 0]] == np.repeat(batch["doc_ids"].numpy(), n).reshape(B, n)[last >= 0]
        ).all()


@pytest.mark.parametrize("embedder", ["shared", "tokens"])
def test_search_lookup_finds_the_tables_neighbours_while_the_embedder_is_unchanged(corpus, embedder):
    """lookup 'search': a training step searches its queries online, embedded by the current embedder; until the
    embedder moves, that is exactly the table's neighbours (the same vectors and the same causal filter), and the
    rebuild wrote no table."""
    segments, windows = corpus
    batch = windows.collate(np.arange(len(windows)))
    found = {}
    for lookup in ("table", "search"):
        model = tiny_model(embedder=embedder, warm_start="none", lookup=lookup)
        memory, _ = attach_memory(model, segments, np.arange(10))
        assert (memory.neighbours is None) == (lookup == "search")
        found[lookup] = context(model, batch, "train").extras["retrieval"].ids
    assert (found["table"] >= 0).sum() > len(batch["tokens"])
    torch.testing.assert_close(found["search"], found["table"], rtol=0, atol=0)


@pytest.mark.parametrize("continuation", [False, True])
def test_warm_candidates_match_a_naive_ordering(continuation):
    """warm_candidates_of against a loop: earlier same-document segments before the window (most recent first;
    with continuations every other one first, so picks and continuations cover each segment once), then inside
    the window before the query (most recent first); -1 pads; none for an absent query."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        d0 = int(rng.integers(0, 20))
        w0 = d0 + int(rng.integers(0, 6))
        n = int(rng.integers(1, 6))
        q = np.array([w0 - 1 if w0 > d0 else -1] + [w0 + j - 1 for j in range(1, n)])  # chunk j's query
        c = int(rng.integers(1, 9))
        got = warm_candidates_of(q[None], np.array([w0]), np.array([d0]), c, continuation)[0]  # (n, c)
        for j, qj in enumerate(q):
            if qj < 0:
                want = []
            else:
                before = [z for z in range(min(w0, qj) - 1, d0 - 1, -1)]
                if continuation:  # before-2, before-4, ... then before-1, before-3, ...
                    before = before[1::2] + before[0::2]
                inside = [z for z in range(qj - 1, w0 - 1, -1)]
                want = (before + inside)[:c]
            np.testing.assert_array_equal(got[j], want + [-1] * (c - len(want)))


def test_warm_start_similar_picks_the_closest_by_the_embedder(corpus):
    """'similar': among the candidates before the window, the k with the highest cosine to e(S_t)."""
    segments, windows = corpus
    model = with_path("warm_similar", corpus)
    plugin = model.plugins["retrieval"]
    late = np.flatnonzero(windows.start == 4 * L)[:3]
    batch = windows.collate(late)
    inputs: RetrievalInputs = context(model, batch, "train").extras["retrieval"]
    seg_ids = batch["segment_ids"].numpy()
    for b in range(len(late)):
        j = 1  # query = window segment 0; candidates: the 4 before the window (segments 0..3 of the document)
        w0 = seg_ids[b, 0]
        d0 = segments.first[segments.doc[w0]]
        cands = np.arange(w0 - 1, max(d0, w0 - 4) - 1, -1)
        q = torch.from_numpy(segments.tokens([seg_ids[b, 0]]))
        e_q = plugin._embed_queries(q, torch.ones_like(q, dtype=torch.bool))
        c_tok = torch.from_numpy(segments.tokens(cands))
        e_c = plugin._embed_queries(c_tok, torch.from_numpy(np.arange(L) < segments.length[cands][:, None]))
        want = cands[np.argsort(-(e_c @ e_q[0]).numpy(), kind="stable")[:2]]
        assert sorted(inputs.ids[b, j].tolist()) == sorted(want.tolist())


def test_warm_start_trains_cross_attention_and_embedder_without_a_table(corpus):
    """Before any table, the warm start's neighbours give beta, the cross-attention and the embedder gradient."""
    segments, windows = corpus
    model = with_path("warm_recent", corpus)
    batch = windows.collate([1, 2, 4])
    out = logits(model, batch, "train")
    torch.nn.functional.cross_entropy(
        out.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100
    ).backward()
    xattn = model.blocks[1].cross_attn
    assert xattn.beta.grad.abs() > 0 and xattn.kv.weight.grad.abs().sum() > 0
    assert model.embed.main.table.weight.grad.abs().sum() > 0


def test_zero_init_starts_as_the_model_without_retrieval(corpus):
    """zero_init: at initialisation the logits equal the same weights' logits with no neighbours at all, and the
    LM loss reaches the output projection (so the cross-attention starts to count after one step)."""
    segments, windows = corpus
    model = with_path("table", corpus, zero_init=True)
    batch = windows.collate([1, 2, 4])
    out = logits(model, batch, "train")
    assert context(model, batch, "train").extras["retrieval"] is not None  # it did retrieve
    plugin = model.plugins["retrieval"]
    plugin.use_memory(None)
    with torch.no_grad():
        bare = model(batch["tokens"], Context(tokens=batch["tokens"], stage="train"))
    torch.testing.assert_close(out.detach(), bare)
    torch.nn.functional.cross_entropy(
        out.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100
    ).backward()
    xattn = model.blocks[1].cross_attn
    assert xattn.proj.weight.grad.abs().sum() > 0
    assert xattn.kv.weight.grad.abs().sum() == 0  # no signal through a zero projection yet


def test_warm_start_none_without_a_table_means_no_retrieval(corpus):
    segments, windows = corpus
    model = tiny_model(warm_start="none", same_doc_k=1)
    assert context(model, windows.collate([1, 2]), "train").extras["retrieval"] is None


def test_first_segment_uses_previous_segment_or_nothing(corpus):
    """Chunk 0 of a window starting at 0 has no neighbours; one starting later queries segment_ids[:, 0] - 1."""
    segments, windows = corpus
    model = tiny_model()
    memory, _ = attach_memory(model, segments, np.arange(10))
    later, first = np.flatnonzero(windows.start > 0)[0], np.flatnonzero(windows.start == 0)[0]
    batch = windows.collate([later, first])
    ctx = context(model, batch, "train")
    inputs: RetrievalInputs = ctx.extras["retrieval"]
    prev = int(batch["segment_ids"][0, 0]) - 1
    np.testing.assert_array_equal(inputs.query_tokens[0, 0].numpy(), segments.tokens([prev])[0])
    want = memory.neighbours[prev]
    np.testing.assert_array_equal(inputs.tokens[0, 0, :, :L].numpy(), segments.tokens(want))
    assert not inputs.valid[1, 0].any() and not inputs.mask[1, 0].any()
    # chunk j >= 1 queries the window's segment j - 1 (the batch's own tokens)
    torch.testing.assert_close(inputs.query_tokens[:, 1:], batch["tokens"].view(2, 4, L)[:, :3])
    out = model(batch["tokens"], ctx)
    assert torch.isfinite(out).all()


# ----- gradients -----


@pytest.mark.parametrize("k", [1, 2])
def test_relevance_bias_trains_beta_only_when_a_chunk_has_neighbours_to_rank(corpus, k):
    """With one neighbour every key of a chunk gets the same bias beta * cos, which the softmax cancels: beta's
    gradient is zero (and k=1 warns); with two it ranks them and beta learns."""
    segments, windows = corpus
    if k == 1:
        with pytest.warns(UserWarning, match="k=1: every key of a chunk"):
            model = tiny_model(k=k)
    else:
        model = tiny_model(k=k)
    attach_memory(model, segments, np.arange(10))
    batch = windows.collate([1, 2, 4])
    ctx = context(model, batch, "train")
    assert ctx.extras["retrieval"].valid.any()
    out = model(batch["tokens"], ctx)
    torch.nn.functional.cross_entropy(
        out.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100
    ).backward()
    xattn = model.blocks[1].cross_attn
    assert xattn.q.weight.grad.abs().sum() > 0  # the cross-attention itself trains either way
    if k == 1:
        # zero up to rounding (3e-11 here), five orders below k=2's gradient on the same batch (8e-6)
        torch.testing.assert_close(xattn.beta.grad, torch.zeros_like(xattn.beta), atol=1e-9, rtol=0)
    else:
        assert xattn.beta.grad.abs() > 1e-6


def test_lm_loss_trains_the_shared_embedder_through_retrieval_neighbour_grad(corpus):
    """neighbour_grad: embedding rows of tokens that occur only in neighbours (never in the batch) get gradient
    from the LM loss."""
    segments, windows = corpus
    model = tiny_model(neighbour_grad="full")
    attach_memory(model, segments, np.arange(10))
    batch = windows.collate([1, 2, 4])
    ctx = context(model, batch, "train")
    inputs: RetrievalInputs = ctx.extras["retrieval"]
    out = model(batch["tokens"], ctx)
    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100)
    loss.backward()
    only_nb = np.setdiff1d(inputs.tokens[inputs.mask].unique().numpy(), batch["tokens"].unique().numpy())
    assert len(only_nb) > 0
    grad = model.embed.main.table.weight.grad
    assert grad[only_nb].abs().sum(1).gt(0).all()
    assert model.blocks[1].cross_attn.beta.grad.abs() > 0


def lm_loss_backward(model: Transformer, corpus) -> tuple[dict, RetrievalInputs]:
    """Attach a memory of the training documents, run the LM loss of three windows past their documents' starts
    (so chunk 0 has a query outside the window) backward; the batch and its retrieval inputs."""
    segments, windows = corpus
    attach_memory(model, segments, np.arange(10))
    batch = windows.collate(np.flatnonzero(windows.start > 0)[:3])
    ctx = context(model, batch, "train")
    out = model(batch["tokens"], ctx)
    torch.nn.functional.cross_entropy(
        out.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100
    ).backward()
    return batch, ctx.extras["retrieval"]


def test_lm_loss_trains_the_shared_embedder_through_the_query_embedding(corpus):
    """No neighbour gradients: the shared embedder still learns from the LM loss alone, through
    cos(e(S_t), e(z)): embedding rows of tokens that occur only in chunk 0's query (the document's previous
    segment, outside the window) get gradient; those only in neighbours get none."""
    model = tiny_model(neighbour_grad="none")
    batch, inputs = lm_loss_backward(model, corpus)
    in_batch = batch["tokens"].unique().numpy()
    only_query = np.setdiff1d(inputs.query_tokens[:, 0][inputs.query_mask[:, 0]].unique().numpy(), in_batch)
    only_nb = np.setdiff1d(np.setdiff1d(inputs.tokens[inputs.mask].unique().numpy(), in_batch), only_query)
    only_query = np.setdiff1d(only_query, inputs.tokens[inputs.mask].unique().numpy())
    assert len(only_query) > 0 and len(only_nb) > 0
    grad = model.embed.main.table.weight.grad
    assert grad[only_query].abs().sum(1).gt(0).all()
    assert grad[only_nb].abs().sum() == 0
    xattn = model.blocks[1].cross_attn
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in xattn.parameters())


@pytest.mark.parametrize("embedder", ["shared", "tokens"])
def test_no_grad_neighbours_and_dedupe_keep_the_forward_and_the_cross_attention_gradients(corpus, embedder):
    """The path with neighbours without gradients, each distinct neighbour encoded once, gives the same logits
    as the full-gradient path and as encoding every slot separately, and the same cross-attention gradients."""
    segments, windows = corpus
    model = tiny_model(neighbour_grad="full", embedder=embedder)
    attach_memory(model, segments, np.arange(10))
    plugin = model.plugins["retrieval"]
    batch = windows.collate(np.arange(len(windows)))
    xattn = model.blocks[1].cross_attn

    def run(neighbour_grad: str, dedupe: bool):
        plugin.config.neighbour_grad = neighbour_grad
        model.zero_grad(set_to_none=True)
        ctx = context(model, batch, "train")
        if not dedupe:
            ctx.extras["retrieval"].ids = None
        else:
            assert len(ctx.extras["retrieval"].ids.unique()) < ctx.extras["retrieval"].ids.numel()
        out = model(batch["tokens"], ctx)
        out.logsumexp(-1).mean().backward()
        return out.detach(), {name: p.grad.clone() for name, p in xattn.named_parameters()}

    ref, ref_grads = run("full", False)
    cases = [("full", True), ("embedding", True), ("embedding", False), ("none", True), ("none", False)]
    for neighbour_grad, dedupe in cases:
        out, grads = run(neighbour_grad, dedupe)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("neighbour_grad", ["full", "embedding", "none"])
def test_separate_embedder_gets_gradient_only_through_retrieval(corpus, neighbour_grad):
    """A separate encoder is trained by the LM loss (relevance bias, and with neighbour_grad the keys/values)."""
    segments, windows = corpus
    model = tiny_model(embedder="separate", encoder_dim=16, embed_layers=1, neighbour_grad=neighbour_grad)
    attach_memory(model, segments, np.arange(10))
    batch = windows.collate([1, 2, 4])
    out = logits(model, batch, "train")
    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100)
    loss.backward()
    enc = model.plugins["retrieval"].encoder
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in enc.parameters())


def test_token_embedder_matches_a_naive_reference():
    """embedder 'tokens': each token's state is [its embedding, its predecessor's embedding (zeros at 0)], and
    e(.) the normalised mean of the embeddings of the first pool_len real tokens; written out by loops."""
    model = tiny_model(embedder="tokens")
    enc = model.plugins["retrieval"].encoder
    table = model.embed.main.table.weight
    tokens = torch.randint(4, VOCAB, (3, 10))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, 7:] = False
    mask[2, :] = False
    states, e = enc(tokens, mask, pool_len=6)
    assert enc.dim == 64 and states.shape == (3, 10, 64) and e.shape == (3, 32)
    for n in range(3):
        for j in range(10):
            prev = table[tokens[n, j - 1]] if j > 0 else torch.zeros(32)
            torch.testing.assert_close(states[n, j], torch.cat([table[tokens[n, j]], prev]))
        real = [table[tokens[n, j]] for j in range(6) if mask[n, j]]
        want = torch.stack(real).mean(0) if real else torch.zeros(32)
        want = want / want.norm() if real else want
        torch.testing.assert_close(e[n], want)
    # the rebuild's and the online queries' path (distinct ids, no states) gives the same e
    torch.testing.assert_close(enc.pooled(tokens[:, :6], mask[:, :6]), e)


def test_token_embedder_keys_and_values_per_distinct_id_equal_the_direct_projection():
    """The token embedder's keys and values, projected once per distinct token id, equal kv(kv_norm(states)) of
    the [x_j, x_{j-1}] states computed token by token, and so do the gradients of the embedding table and of
    the projection's weights."""
    model = tiny_model(embedder="tokens")
    plugin, xattn = model.plugins["retrieval"], model.blocks[1].cross_attn
    with torch.no_grad():
        xattn.kv_norm.weight.uniform_(0.5, 1.5)  # a norm weight other than ones, so the folding is tested
    tokens = torch.randint(4, 12, (5, 9))  # few ids: rows repeat
    mask = torch.ones_like(tokens, dtype=torch.bool)
    table = model.embed.main.table.weight

    def run(direct: bool):
        model.zero_grad(set_to_none=True)
        if direct:
            states = plugin.encoder(tokens, mask)[0]
            enc = Encoded(states, torch.arange(5), mask, torch.zeros(5, 1), 9)
        else:
            vocab, rows = plugin.encoder.distinct(tokens)
            assert vocab.shape[0] < tokens.numel()
            enc = Encoded(None, torch.arange(5), mask, torch.zeros(5, 1), 9, vocab, rows)
        kv = xattn._keys_values(enc)
        kv.pow(2).sum().backward()
        return (
            kv.detach(),
            table.grad.clone(),
            xattn.kv.weight.grad.clone(),
            xattn.kv_norm.weight.grad.clone(),
        )

    (kv, *grads), (kv_ref, *grads_ref) = run(False), run(True)
    torch.testing.assert_close(kv, kv_ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, grads_ref):  # sums over tokens in another order: float32 reassociation
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("neighbour_grad", ["full", "none"])
def test_token_embedder_trains_the_embedding_table_through_retrieval(corpus, neighbour_grad):
    """embedder 'tokens': with 'full' the rows of tokens that occur only in neighbours get gradient (keys, values
    and e(z)); with 'none' they get none, while beta and every cross-attention weight still do."""
    model = tiny_model(embedder="tokens", neighbour_grad=neighbour_grad)
    batch, inputs = lm_loss_backward(model, corpus)
    seen = np.union1d(
        batch["tokens"].unique().numpy(), inputs.query_tokens[inputs.query_mask].unique().numpy()
    )
    B, n, k, M = inputs.tokens.shape
    scored = (batch["targets"] != -100).view(B, n, -1).any(-1)  # chunks with a loss term (not padding)
    real = inputs.mask & scored[:, :, None, None]
    only_nb = np.setdiff1d(inputs.tokens[real].unique().numpy(), seen)
    assert len(only_nb) > 0
    grad = model.embed.main.table.weight.grad[only_nb].abs().sum(1)
    assert grad.gt(0).all() if neighbour_grad == "full" else grad.eq(0).all()
    xattn = model.blocks[1].cross_attn
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in xattn.parameters())


def test_relevance_gradient_reaches_query_and_neighbour_embeddings(corpus):
    """d loss / d beta != 0 and the cosines carry gradient into e(S_t) and e(z) (MARGE's joint training)."""
    segments, windows = corpus
    model = tiny_model(embedder="separate", encoder_dim=16)
    attach_memory(model, segments, np.arange(10))
    batch = windows.collate([1, 2])
    ctx = context(model, batch, "train")
    relevance = model.plugins["retrieval"].encoded(ctx).relevance
    relevance.retain_grad()
    model(batch["tokens"], ctx).logsumexp(-1).mean().backward()
    assert relevance.grad is not None and relevance.grad.abs().sum() > 0


# ----- config -----


@pytest.mark.parametrize(
    "opts, message",
    [
        ({"k": 0}, "retrieval.k"),
        (
            {"embedder": "bert"},
            r"option embedder must be one of \('tokens', 'shared', 'separate'\), got 'bert'",
        ),
        ({"mode": "later"}, "'blocking'"),
        ({"schedule": "sometimes"}, "every N"),
        ({"schedule": "0-100:10,50-200:20"}, "overlap"),
        ({"encoder_dim": 7}, "encoder_dim"),
        ({"warm_start": "random"}, "'recent', 'similar', 'none'"),
        ({"same_doc_k": 3}, r"same_doc_k must be an integer in \[0, k=2\]"),
        ({"target_recall": 1.5}, "target_recall"),
        ({"neighbour_grad": True}, r"plugin 'retrieval': option neighbour_grad must be one of \('full', "),
        ({"lookup": "cache"}, r"option lookup must be one of \('table', 'search'\), got 'cache'"),
    ],
)
def test_bad_config_is_a_clear_error(opts, message):
    with pytest.raises(ValueError, match=message):
        make_config(RetrievalPlugin, opts)


def test_cross_attention_inside_the_shared_embedder_is_refused():
    with pytest.raises(ValueError, match="embed_layers"):
        tiny_model(layers=[0], embed_layers=1)


def test_a_checkpoint_with_a_scalar_beta_is_refused_naming_the_change():
    """beta is shape (1,); a checkpoint of the scalar beta rlm once wrote is refused with what changed."""
    model = tiny_model()
    state = model.state_dict()
    key = next(k for k in state if k.endswith("cross_attn.beta"))
    state[key] = state[key].reshape(())
    with pytest.raises(ValueError, match=r"beta is a scalar.*git log -S _beta_as_vector"):
        model.load_state_dict(state)


def test_no_memory_means_no_retrieval():
    """Before any index exists the cross-attention adds nothing (the model is the base model)."""
    model = tiny_model()
    tokens = torch.randint(4, VOCAB, (2, 16))
    ctx = Context(tokens=tokens)
    model.plugins["retrieval"].prepare(ctx, {"tokens": tokens})
    x = torch.randn(2, 16, 32)
    assert torch.all(model.blocks[1].cross_attn(x, ctx) == 0)


@pytest.mark.parametrize("embedder", ["shared", "separate", "tokens"])
def test_no_memory_still_gives_every_parameter_a_gradient(embedder):
    """While training waits for the first table, the cross-attention and encoder parameters get zero (not
    missing) gradients: DDP expects a gradient for every parameter at every step."""
    model = tiny_model(embedder=embedder)
    tokens = torch.randint(4, VOCAB, (2, 16))
    ctx = Context(tokens=tokens, stage="train")
    model.plugins["retrieval"].prepare(ctx, {"tokens": tokens})
    model(tokens, ctx).logsumexp(-1).mean().backward()
    plugin = model.plugins["retrieval"]
    own = list(model.blocks[1].cross_attn.parameters()) + list(plugin.encoder.parameters())
    assert own and all(p.grad is not None and torch.all(p.grad == 0) for p in own)
    assert all(p.grad is not None for p in model.parameters())  # the block's cross_norm included


def test_rebuild_embeds_in_float32_as_the_live_encoder_even_under_autocast():
    """The snapshot and the online queries embed exactly as the live encoder in float32, also inside a bfloat16
    autocast region (the trainer's mixed precision): bfloat16 ranked the index worse."""
    tokens = torch.randint(4, VOCAB, (16, 8))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    plugin = tiny_model().plugins["retrieval"]
    with torch.no_grad():
        exact = plugin.encoder.eval()(tokens, mask)[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        snapshot = plugin.snapshot(0).embed_segments(tokens, mask)
        queries = plugin._embed_queries(tokens, mask)
    torch.testing.assert_close(snapshot, exact, rtol=0, atol=0)
    torch.testing.assert_close(queries, exact, rtol=0, atol=0)


def test_benchmark_script_smoke(capsys):
    """benchmarks/retrieval.py runs end to end at a tiny size and prints its three tables."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "retrieval.py"
    spec = importlib.util.spec_from_file_location("bench_retrieval", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(
        "--d 32 --layers 2 --heads 2 --vocab 128 --seq 16 --segment 8 --batch 2 --docs 12 --doc-len 32 "
        "--step-segments 48 --sizes 40 --steps 1 --rounds 1 --factory Flat".split()
    )
    out = capsys.readouterr().out
    for row in (
        "| no retrieval |",
        "| finding the neighbours (prepare)",
        "| retrieval k=2, before the first index, warm start (the default) |",
        "| k=1: one neighbour with its continuation, lookup search |",
        "| retrieval k=2, with continuations (each neighbour and its next segment: 2x the keys), lookup search |",
        "step ratio, retrieval k=2, with continuations",
        "| online search of one step (4 queries, top 12 of ",
        "| 40 | embed, index, table |",
        "| 40 | embed, index (lookup search) |",
        "| background rebuild",
    ):
        assert row in out


def test_snapshot_is_frozen_and_independent(corpus):
    """The rebuild's snapshot embeds like the live embedder, in eval mode, and does not follow later updates."""
    segments, _ = corpus
    model = tiny_model()
    plugin = model.plugins["retrieval"]
    tokens = torch.from_numpy(segments.tokens(np.arange(6)))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    snap = plugin.snapshot(step=7)
    assert snap.embedder_identity()["step"] == 7
    assert all(not m.training for m in (snap.encoder._parts[0], *snap.encoder._parts[1]))
    before = snap.embed_segments(tokens, mask)
    torch.testing.assert_close(before, plugin._embed_queries(tokens, mask))
    torch.testing.assert_close(before.norm(dim=-1), torch.ones(6))
    with torch.no_grad():
        model.embed.main.table.weight.add_(1.0)
    torch.testing.assert_close(snap.embed_segments(tokens, mask), before)
    assert plugin.identity(7)["weights_hash"] != snap.embedder_identity()["weights_hash"]


def test_retriever_build_reaches_the_target_recall(tmp_path):
    """Above flat_below (32,768) 'auto' is IVF: build_memory, as the rebuild callback calls it with the plugin's
    default target_recall, tunes it to recall@10 >= 0.95 against exact search; meta.json records it."""
    from rlm.index.build import exact_search, recall_at_k
    from rlm.index.store import read_meta
    from rlm.index.synthetic import clustered_unit_vectors

    n_docs, per_doc = 4100, 10  # 41,000 segments of L tokens
    segments = make_segments(random_docs(n_docs, per_doc * L, seed=3))
    assert len(segments) == n_docs * per_doc
    vectors = clustered_unit_vectors(len(segments), 16, n_clusters=200, seed=4)
    rows = np.arange(len(segments))
    target = make_config(RetrievalPlugin, {}).target_recall
    assert target == 0.95
    identity = {"name": "t", "config_hash": "c", "weights_hash": "w", "step": 0}
    config = IndexConfig(factory="auto", target_recall=target)
    memory = build_memory(vectors, segments, rows, 2, identity, 0, config, tmp_path / "idx")
    assert memory.index.factory.startswith("IVF") and memory.recall >= target
    meta = read_meta(tmp_path / "idx")
    assert meta["recall"] == memory.recall and meta["target_recall"] == target
    # another sample of queries than the tuning one: recall@10 of the built index against exact search
    queries = vectors[np.random.default_rng(9).choice(len(vectors), 500, replace=False)]
    _, found = memory.index.search(queries, 10)
    _, exact = exact_search(vectors, queries, 10)
    assert recall_at_k(found, exact, 10) >= target - 0.02
    # untuned (nprobe=1), as the retriever built it before: clearly below
    untuned = build_memory(
        vectors, segments, rows, 2, identity, 0, IndexConfig(factory="auto", target_recall=None), None
    )
    _, found = untuned.index.search(queries, 10)
    assert recall_at_k(found, exact, 10) < target - 0.05


# ----- evaluation hooks: loss by neighbour source, random-neighbour ablation -----


def test_loss_groups_partition_the_validation_loss_and_the_ablation_swaps_neighbours(corpus):
    """val/loss_by/retrieval/<group> sums partition the token-weighted validation loss (each against a naive
    per-token loss); the eval variant recomputes the batch with random other-document neighbours."""
    from rlm.train.module import LMModule

    segments, windows = corpus
    torch.manual_seed(0)
    cfg = {"vocab_size": VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 128}
    opts = {
        "layers": [1],
        "k": 2,
        "progress": False,
        "eval_ablation": True,
        "same_doc_k": 1,
        "zero_init": False,
    }
    module = LMModule(model=cfg, plugins={"retrieval": opts})
    # no trainer, so no data module names the batches' table: give it as the data module would
    module.make_context = functools.partial(LMModule.make_context, module, segments=segments)
    model = module.model
    memory, _ = attach_memory(model, segments, np.arange(10))
    module.on_validation_epoch_start()
    batches = [windows.collate(np.arange(len(windows))[i::3]) for i in range(3)]
    want: dict[str, list[float]] = {}
    for batch in batches:
        with torch.no_grad():
            module._eval_step(batch, "val")
            ctx = context(model, batch, "val")
            out = model(batch["tokens"], ctx)
            tok = torch.nn.functional.cross_entropy(
                out.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100, reduction="none"
            ).view_as(batch["targets"])
            real = batch["targets"] != -100
            for name, mask in ctx.loss_groups.items():
                acc = want.setdefault(name, [0.0, 0.0])
                acc[0] += float(tok[mask & real].double().sum())
                acc[1] += int((mask & real).sum())
            ablated = Context(
                tokens=batch["tokens"],
                mask=batch["mask"],
                stage="val",
                segment_ids=batch["segment_ids"],
                doc_ids=batch["doc_ids"],
                segments=segments,
                variant="retrieval_random",
            )
            model.plugins["retrieval"].prepare(ablated, batch)
            inputs: RetrievalInputs = ablated.extras["retrieval"]
            ids, q_doc = inputs.ids.numpy(), batch["doc_ids"].numpy()[:, None, None]
            assert (ids >= 0).any() and (
                segments.doc[ids[ids >= 0]] != np.broadcast_to(q_doc, ids.shape)[ids >= 0]
            ).all()
            assert np.isin(ids[ids >= 0], memory.rows).all()
    sums = module._eval_sums
    groups = [f"loss_by/retrieval/{g}" for g in ("own_doc", "other_doc", "mixed", "none")]
    assert set(sums) == {*groups, "retrieval_random/loss"}
    assert float(sum(sums[g][1] for g in groups)) == float(module._val_count)
    torch.testing.assert_close(sum(sums[g][0] for g in groups), module._val_sum, rtol=1e-6, atol=1e-6)
    for g in groups:
        name = g.removeprefix("loss_by/")
        torch.testing.assert_close(float(sums[g][0]), want[name][0], rtol=1e-5, atol=1e-5)
        assert float(sums[g][1]) == want[name][1]
    assert float(sums["loss_by/retrieval/own_doc"][1]) > 0 and float(sums["loss_by/retrieval/mixed"][1]) > 0
    assert float(sums["retrieval_random/loss"][1]) == float(module._val_count)
    assert float(sums["retrieval_random/loss"][0]) != float(module._val_sum)


def test_neighbour_pass_runs_in_float32_under_autocast(corpus):
    """The no-gradient neighbour pass keeps float32 under a bfloat16 autocast (the removed neighbour_dtype's one
    value): the neighbours' states are bit for bit those computed without autocast."""
    segments, windows = corpus
    model = tiny_model(neighbour_grad="embedding")
    attach_memory(model, segments, np.arange(10))
    plugin = model.plugins["retrieval"]
    batch = windows.collate(np.arange(6))

    def states(autocast: bool) -> torch.Tensor:
        ctx = context(model, batch, "train")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            enc = plugin.encoded(ctx)
        assert enc is not None and enc.states is not None
        return enc.states

    ref, got = states(False), states(True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
