"""Builders shared by the retrieval tests (tests/plugins, tests/index, tests/model): random documents, their
segment table, a tiny retrieval model, its memory and the context of a batch."""

from __future__ import annotations

import numpy as np
import torch

from rlm.data.segments import SegmentTable
from rlm.index.build import IndexConfig
from rlm.index.memory import build_memory, embed_rows, indexed_rows
from rlm.model import ModelConfig
from rlm.model.transformer import Transformer
from rlm.plugin import Context

L = 8  # segment length of the unit tests
VOCAB = 96


def make_segments(docs: list[np.ndarray], segment_len: int = L, fingerprint: str = "test") -> SegmentTable:
    """A SegmentTable over documents given as token arrays (bos/eos included by the caller)."""
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    return SegmentTable(np.concatenate(docs).astype(np.int64), offsets, segment_len, 0, fingerprint)


def random_docs(n: int, length: int, seed: int = 0, vocab: int = VOCAB) -> list[np.ndarray]:
    """n documents of `length` random tokens framed by bos (2) and eos (3)."""
    rng = np.random.default_rng(seed)
    return [np.concatenate([[2], rng.integers(4, vocab, size=length - 2), [3]]) for _ in range(n)]


def tiny_model(seed: int = 0, **retrieval) -> Transformer:
    """d=32, 2 layers, retrieval cross-attention at layer 1."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_seq_len=128, tie_embeddings=False
    )
    # a random output projection, so gradients reach every cross-attention weight from the first step
    # the shared embedder and the neighbour table unless a test asks for others ('tokens' and 'search', the
    # defaults, have tests of their own)
    opts = {
        "layers": [1],
        "k": 2,
        "progress": False,
        "zero_init": False,
        "embedder": "shared",
        "lookup": "table",
        **retrieval,
    }
    return Transformer(cfg, {"retrieval": opts})


def attach_memory(
    model: Transformer, segments: SegmentTable, train_docs: np.ndarray, path=None, step: int = 0
):
    """Embed the training documents' segments with the model's embedder and give the plugin the memory."""
    plugin = model.plugins["retrieval"]
    rows = indexed_rows(segments, train_docs)
    embedder = plugin.snapshot(step)
    vectors = embed_rows(embedder, segments, rows, 64, 0, 1, False)
    memory = build_memory(
        vectors,
        segments,
        rows,
        plugin.config.k,
        embedder.embedder_identity(),
        step,
        IndexConfig(factory="Flat", target_recall=None),
        path,
        table=plugin.config.lookup == "table",
    )
    plugin.use_memory(memory)
    return memory, vectors


def context(model: Transformer, batch: dict, stage: str, segments: SegmentTable | None = None) -> Context:
    """The batch's context filled by the plugins; `segments` is the table its segment ids index (default: the
    table of the fixture's corpus, which every batch of these tests is cut from, when it has segment ids)."""
    if segments is None and batch.get("segment_ids") is not None:
        segments = CORPUS_SEGMENTS
    ctx = Context(
        tokens=batch["tokens"],
        mask=batch["mask"],
        stage=stage,
        segment_ids=batch.get("segment_ids"),
        doc_ids=batch.get("doc_ids"),
        segments=segments,
    )
    for plugin in model.plugins.values():
        plugin.prepare(ctx, batch)
    return ctx


def logits(model: Transformer, batch: dict, stage: str) -> torch.Tensor:
    return model(batch["tokens"], context(model, batch, stage))


def corpus_of(docs: list[np.ndarray], fingerprint: str = "test") -> tuple[SegmentTable, np.ndarray]:
    """The segment table of documents and their offsets."""
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    return make_segments(docs, fingerprint=fingerprint), offsets


CORPUS_SEGMENTS, CORPUS_OFFSETS = corpus_of(random_docs(12, 70))
