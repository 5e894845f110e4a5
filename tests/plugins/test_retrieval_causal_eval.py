"""The retriever at evaluation, on documents that are not the indexed ones: validation documents of the training
table, a new corpus (``rlm eval --corpus X``), a corpus that copies a training document, and generation from a
prompt cut out of one. Causality by perturbation (changing the evaluated text after position p moves no logit
before p), and directly: no neighbour reaches the target segment or later, validation finds its own document's
past, and an indexed copy of the evaluated text's future is excluded and counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from retrieval_helpers import (
    CORPUS_SEGMENTS,
    VOCAB,
    L,
    attach_memory,
    context,
    corpus_of,
    random_docs,
    tiny_model,
)

from rlm.data.windows import Windows
from rlm.plugin import Context

SEQ = 32  # windows of 4 segments
TRAIN = np.arange(10)  # the indexed documents of CORPUS_SEGMENTS; 10 and 11 are validation documents
OPTIONS = {
    "shared": {"embedder": "shared"},
    "tokens_continuation": {"embedder": "tokens", "continuation": True},
    "same_doc_k": {"embedder": "tokens", "same_doc_k": 1, "k": 3, "warm_start": "similar"},
}


def model_with_memory(options: str):
    """A tiny retriever whose memory indexes the training documents 0-9 of CORPUS_SEGMENTS."""
    model = tiny_model(zero_init=False, **OPTIONS[options])
    memory, _ = attach_memory(model, CORPUS_SEGMENTS, TRAIN)
    return model, memory


def doc_tokens(doc: int) -> np.ndarray:
    """The tokens of a document of CORPUS_SEGMENTS."""
    seg = CORPUS_SEGMENTS
    ids = seg.doc_segments(doc)
    return np.concatenate([seg.tokens([i])[0, : seg.length[i]] for i in ids])


def evaluated(docs: list[np.ndarray], which: list[int], fingerprint: str):
    """(table, batch of every window of the documents `which`) of a corpus of `docs`."""
    segments, offsets = corpus_of(docs, fingerprint)
    windows = Windows(segments, offsets, np.asarray(which), SEQ)
    return segments, windows.collate(np.arange(len(windows)))


def perturbed(doc: np.ndarray, p: int, seed: int) -> np.ndarray:
    """The document with every token from position p on replaced by a random one (eos kept last)."""
    out = doc.copy()
    out[p:-1] = np.random.default_rng(seed).integers(4, VOCAB, size=len(out) - 1 - p)
    return out


def assert_causal(model, docs, which, fingerprint, stage, reindex=False, cuts=(9, 20, 31, 40, 47)):
    """For each cut p inside the evaluated document docs[which]: the text from p on changed, every logit whose
    input tokens all come before p is unchanged (windows compared position by position), and some later one moved.
    reindex: the evaluated documents are in the memory's table (validation), so the memory is rebuilt over the
    changed table (its indexed documents are unchanged, so the index is the same)."""
    segments, batch = evaluated(docs, [which], fingerprint)
    if reindex:
        attach_memory(model, segments, TRAIN)
    with torch.no_grad():
        base = model(batch["tokens"], context(model, batch, stage, segments))
    moved = False
    for p in cuts:
        changed = list(docs)
        changed[which] = perturbed(docs[which], p, seed=p)
        seg2, batch2 = evaluated(changed, [which], fingerprint)
        if reindex:
            attach_memory(model, seg2, TRAIN)
        with torch.no_grad():
            out = model(batch2["tokens"], context(model, batch2, stage, seg2))
        for w, start in enumerate(batch["starts"].tolist()):
            before = max(0, min(SEQ, p - start))  # inputs at window positions < before are all before p
            torch.testing.assert_close(out[w, :before], base[w, :before], rtol=0, atol=0)
            moved |= not torch.equal(out[w, before:], base[w, before:])
    assert moved
    if reindex:
        attach_memory(model, segments, TRAIN)


@pytest.mark.parametrize("options", list(OPTIONS))
def test_validation_is_causal_and_finds_its_own_documents_past(options):
    """Validation documents (in the training table, not indexed): causal by perturbation, and their chunks get
    neighbours from their own document's past (strictly before the query segment), which the index cannot give."""
    model, memory = model_with_memory(options)
    # validation documents written in a few tokens of their own, so their past outranks the training text
    docs = [doc_tokens(d) for d in range(10)] + random_docs(2, 70, seed=11, vocab=12)
    assert_causal(model, docs, 10, "test", "val", reindex=True)
    segments, batch = evaluated(docs, [10, 11], "test")
    attach_memory(model, segments, TRAIN)
    ctx = context(model, batch, "val", segments)
    with torch.no_grad():
        model(batch["tokens"], ctx)  # logs retrieval/same_doc, as validation does
    inputs = ctx.extras["retrieval"]
    ids, seg_ids = inputs.ids.numpy(), batch["segment_ids"].numpy()
    assert inputs.same_doc.any() and float(ctx.metrics["retrieval/same_doc"]) > 0
    B, n, _ = ids.shape
    for b in range(B):
        for j in range(n):
            query = seg_ids[b, 0] + j - 1  # S_t of chunk j (global id: the batch's table is the memory's)
            for z in ids[b, j][ids[b, j] >= 0]:
                if segments.doc[z] == batch["doc_ids"][b]:
                    assert z < query
                else:
                    assert memory.row_of[z] >= 0  # everything else is indexed training text


@pytest.mark.parametrize("options", list(OPTIONS))
def test_eval_on_a_new_corpus_is_causal(options):
    """``rlm eval --corpus X``: X's segment ids index X's own table, never the memory's; causal by perturbation,
    and X's documents get their own past (ids past the memory's table)."""
    model, memory = model_with_memory(options)
    docs = random_docs(3, 70, seed=7)
    assert_causal(model, docs, 1, "new-corpus", "test")
    segments, batch = evaluated(docs, [0, 1, 2], "new-corpus")
    inputs = context(model, batch, "test", segments).extras["retrieval"]
    ids = inputs.ids.numpy()
    S = len(CORPUS_SEGMENTS)
    own = ids >= S
    assert own.any() and (inputs.same_doc.numpy() == own).all()
    seg_ids = batch["segment_ids"].numpy()
    for b, j, slot in zip(*np.nonzero(own)):
        assert ids[b, j, slot] - S < seg_ids[b, 0] + j - 1  # strictly before the query segment


@pytest.mark.parametrize("options", list(OPTIONS))
def test_eval_on_a_copy_of_a_training_document_never_retrieves_its_continuation(options):
    """A corpus holding an exact copy of training document 3 (another table, so outside queries): no neighbour
    from document 3 is the copied query segment, its target or later (with continuations, none brings them), while
    the unfiltered search would have found them; and causal by perturbation."""
    model, memory = model_with_memory(options)
    docs = [random_docs(1, 70, seed=8)[0], doc_tokens(3)]
    segments, batch = evaluated(docs, [1], "copy")
    ctx = context(model, batch, "test", segments)
    ids = ctx.extras["retrieval"].ids.numpy()
    first = CORPUS_SEGMENTS.first[3]
    B, n, _ = ids.shape
    for b in range(B):
        for j in range(n):
            t = int(batch["starts"][b]) // L + j - 1  # S_t of chunk j, as a segment index in the document
            for z in ids[b, j][(ids[b, j] >= 0) & (ids[b, j] < len(CORPUS_SEGMENTS))]:
                if CORPUS_SEGMENTS.doc[z] == 3:  # before S_t, so its continuation is at most S_t
                    assert z - first < t, (b, j, z)
    assert float(ctx.metrics["retrieval/duplicates_excluded"]) == 0  # the copy filter already took them
    # the same queries without the evaluation's filters: the copy finds itself
    plugin = model.plugins["retrieval"]
    k = plugin.config.k - plugin.config.same_doc_k
    inputs = ctx.extras["retrieval"]
    e = plugin._embed_queries(inputs.query_tokens.reshape(-1, L), inputs.query_mask.reshape(-1, L)).numpy()
    raw = memory.search_scored(e, np.full(len(e), -1), k).ids.reshape(B, n, k)
    t_of = batch["starts"].numpy()[:, None] // L + np.arange(n) - 1  # (B, n)
    leaks = (CORPUS_SEGMENTS.doc[np.maximum(raw, 0)] == 3) & (raw - first >= t_of[..., None]) & (raw >= 0)
    assert leaks.any()
    assert_causal(model, docs, 1, "copy", "test")


@pytest.mark.parametrize("options", list(OPTIONS))
def test_generation_from_a_training_prompt_is_causal_and_never_retrieves_its_continuation(options):
    """Generation (no segment table: the window is its own document) from a prompt cut out of training document 3
    at an offset that is no segment boundary: no neighbour of document 3 holds a token at or after the target
    chunk's first token, and changing the prompt from position p on moves no logit before p."""
    model, memory = model_with_memory(options)
    at = 5  # the prompt starts 5 tokens into document 3
    prompt = torch.from_numpy(doc_tokens(3)[at : at + 5 * L]).long()[None]  # (1, 40)
    ctx = Context(tokens=prompt, stage="predict")
    model.plugins["retrieval"].prepare(ctx, {"tokens": prompt})
    inputs = ctx.extras["retrieval"]
    ids = inputs.ids.numpy()[0]  # (n, k)
    span = 2 * L if model.plugins["retrieval"].config.continuation else L
    seg = CORPUS_SEGMENTS
    for j in range(ids.shape[0]):
        target = at + j * L  # chunk j's first token, as a position in document 3
        for z in ids[j][(ids[j] >= 0) & (ids[j] < len(seg))]:
            if seg.doc[z] == 3:
                assert seg.offset[z] + span <= target, (j, z)
    # the same queries without the evaluation's filters: they find the prompt's continuation
    plugin = model.plugins["retrieval"]
    e = plugin._embed_queries(inputs.query_tokens.reshape(-1, L), inputs.query_mask.reshape(-1, L)).numpy()
    k_table = plugin.config.k - plugin.config.same_doc_k
    raw = memory.search_scored(e, np.full(len(e), -1), k_table).ids  # (n, k')
    target = at + np.arange(len(raw))[:, None] * L
    assert (
        (raw >= 0) & (seg.doc[np.maximum(raw, 0)] == 3) & (seg.offset[np.maximum(raw, 0)] + span > target)
    ).any()
    # a prompt written in a few tokens of its own: its own earlier segments (of the window) outrank training text
    own_prompt = torch.from_numpy(random_docs(1, 41, seed=12, vocab=12)[0][:40]).long()[None]
    own_ctx = Context(tokens=own_prompt, stage="predict")
    model.plugins["retrieval"].prepare(own_ctx, {"tokens": own_prompt})
    own_ids = own_ctx.extras["retrieval"].ids.numpy()[0]  # (n, k)
    mine = own_ids >= len(seg)  # segment id - len(seg) of the window's own table: segment j - 2 or earlier
    assert mine.any() and all(own_ids[j, i] - len(seg) < j - 1 for j, i in zip(*np.nonzero(mine)))
    with torch.no_grad():
        base = model(prompt, ctx)
        for p in (3, L, L + 5, 3 * L):
            changed = prompt.clone()
            changed[:, p:] = torch.from_numpy(
                np.random.default_rng(p).integers(4, VOCAB, (1, prompt.shape[1] - p))
            )
            ctx2 = Context(tokens=changed, stage="predict")
            model.plugins["retrieval"].prepare(ctx2, {"tokens": changed})
            out = model(changed, ctx2)
            torch.testing.assert_close(out[:, :p], base[:, :p], rtol=0, atol=0)


def test_an_indexed_copy_of_the_evaluated_future_is_excluded_and_counted():
    """A validation document whose segment 5 is an exact copy of training segment z (and segment 4 a near copy,
    so z ranks high for the query of segment 5): z is never a neighbour of a chunk whose target is segment 5 or
    earlier, and the exclusion is counted (retrieval/duplicates_excluded)."""
    model, memory = model_with_memory("tokens_continuation")
    seg = CORPUS_SEGMENTS
    z = int(seg.first[2] + 4)
    docs = [doc_tokens(d) for d in range(12)]
    val = docs[10].copy()
    near = seg.tokens([z])[0].copy()
    near[[1, 5]] = np.where(
        near[[1, 5]] != 4, 4, 5
    )  # no L / 2 tokens in a row copied: not a copy of z's text
    val[4 * L : 5 * L], val[5 * L : 6 * L] = near, seg.tokens([z])[0]
    docs[10] = val
    segments, batch = evaluated(docs, [10], "test")
    attach_memory(model, segments, TRAIN)
    ctx = context(model, batch, "val", segments)
    ids = ctx.extras["retrieval"].ids.numpy()
    targets = batch["segment_ids"].numpy() - segments.first[10]  # (B, n) segment index of each chunk's target
    for b, j in zip(*np.nonzero(targets <= 5)):
        if targets[b, j] >= 0:
            assert z not in ids[b, j] and z - 1 not in ids[b, j]  # z - 1 would bring z as its continuation
    assert float(ctx.metrics["retrieval/duplicates_excluded"]) > 0


def test_segment_ids_without_their_table_are_refused():
    """A batch with segment ids but no table would read them as the memory's ids: a clear error instead."""
    model, _ = model_with_memory("shared")
    segments, batch = evaluated(random_docs(2, 70, seed=9), [0], "other")
    ctx = Context(tokens=batch["tokens"], mask=batch["mask"], stage="test", segment_ids=batch["segment_ids"])
    with pytest.raises(ValueError, match="names no segment table"):
        model.plugins["retrieval"].prepare(ctx, batch)
