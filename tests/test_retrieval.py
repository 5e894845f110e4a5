"""The retriever plugin: relevance-biased cross-attention against a naive loop, causality by perturbation,
neighbour tables against brute force, gradients into the embedder, config validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlm.data.segments import SegmentTable
from rlm.data.windows import Windows
from rlm.index.build import IndexConfig
from rlm.index.rebuild import build_memory, embed_rows, indexed_rows
from rlm.model import ModelConfig
from rlm.model.transformer import Transformer
from rlm.plugin import Context, make_config
from rlm.plugins._retrieval_encoder import cpu_bf16_native, resolve_rebuild_dtype
from rlm.plugins.retrieval import RetrievalInputs, RetrievalPlugin

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
    opts = {"layers": [1], "k": 2, "progress": False, **retrieval}
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
    )
    plugin.use_memory(memory)
    return memory, vectors


def context(model: Transformer, batch: dict, stage: str) -> Context:
    ctx = Context(
        tokens=batch["tokens"],
        mask=batch["mask"],
        stage=stage,
        segment_ids=batch.get("segment_ids"),
        doc_ids=batch.get("doc_ids"),
    )
    for plugin in model.plugins.values():
        plugin.prepare(ctx, batch)
    return ctx


def logits(model: Transformer, batch: dict, stage: str) -> torch.Tensor:
    return model(batch["tokens"], context(model, batch, stage))


@pytest.fixture
def corpus():
    """12 documents of 70 tokens (9 segments), the first 10 for training; windows of 4 segments."""
    docs = random_docs(12, 70)
    segments = make_segments(docs)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    return segments, Windows(segments, offsets, np.arange(10), 32)


# ----- numerics -----


def test_cross_attention_matches_naive_loop():
    """Relevance-biased chunked cross-attention (MARGE eq. 2) against explicit loops over heads, queries, keys."""
    model = tiny_model(continuation=False)
    plugin = model.plugins["retrieval"]
    xattn = model.blocks[1].cross_attn
    with torch.no_grad():
        xattn.beta.fill_(1.7)
    B, n, k, M, D = 2, 3, 2, L, plugin.encoder.dim
    T = n * L - 3  # a ragged last chunk
    states = torch.randn(B * n, k * M, D)
    key_valid = torch.rand(B * n, k * M) > 0.3
    key_valid[1] = False  # a chunk with no neighbour at all
    relevance = torch.rand(B * n, k) * 2 - 1
    ctx = Context(tokens=torch.zeros(B, T, dtype=torch.long))
    ctx.extras["retrieval/encoded"] = (states, key_valid, relevance, L)
    x = torch.randn(B, T, 32)
    got = xattn(x, ctx)

    h, hs = 2, 16
    kv = xattn.kv(xattn.kv_norm(states)).view(B * n, k * M, 2, h, hs)
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
                            kr = rotate(kv[c, key, 0, head], key % M)
                            s = qr @ kr / math.sqrt(hs) + 1.7 * relevance[c, z]
                            scores.append(s if key_valid[c, key] else torch.tensor(-math.inf))
                        p = torch.softmax(torch.stack(scores), 0)
                        out[head] = sum(p[key] * kv[c, key, 1, head] for key in range(k * M))
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


@pytest.mark.parametrize("stage", ["train", "val"])
@pytest.mark.parametrize("continuation", [True, False])
def test_perturbing_later_tokens_never_changes_earlier_logits(corpus, stage, continuation):
    """For cuts p at and inside segment boundaries: changing tokens[p:] leaves logits[:p] exactly as they were."""
    segments, windows = corpus
    model = tiny_model(continuation=continuation)
    attach_memory(model, segments, np.arange(10))
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


def test_lm_loss_trains_the_shared_embedder_through_retrieval(corpus):
    """Embedding rows of tokens that occur only in neighbours (never in the batch) get gradient from the LM loss."""
    segments, windows = corpus
    model = tiny_model()
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


def test_separate_embedder_gets_gradient_only_through_retrieval(corpus):
    """A separate encoder is trained by the LM loss (relevance bias and keys/values), and beta too."""
    segments, windows = corpus
    model = tiny_model(embedder="separate", encoder_dim=16, embed_layers=1)
    attach_memory(model, segments, np.arange(10))
    batch = windows.collate([1, 2, 4])
    out = logits(model, batch, "train")
    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100)
    loss.backward()
    enc = model.plugins["retrieval"].encoder
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in enc.parameters())


def test_relevance_gradient_reaches_query_and_neighbour_embeddings(corpus):
    """d loss / d beta != 0 and the cosines carry gradient into e(S_t) and e(z) (MARGE's joint training)."""
    segments, windows = corpus
    model = tiny_model(embedder="separate", encoder_dim=16)
    attach_memory(model, segments, np.arange(10))
    batch = windows.collate([1, 2])
    ctx = context(model, batch, "train")
    states, key_valid, relevance, _ = model.plugins["retrieval"].encoded(ctx)
    relevance.retain_grad()
    model(batch["tokens"], ctx).logsumexp(-1).mean().backward()
    assert relevance.grad is not None and relevance.grad.abs().sum() > 0


# ----- config -----


@pytest.mark.parametrize(
    "opts, message",
    [
        ({"k": 0}, "retrieval.k"),
        ({"embedder": "bert"}, "accepted"),
        ({"mode": "later"}, "'blocking'"),
        ({"schedule": "sometimes"}, "every N"),
        ({"schedule": "0-100:10,50-200:20"}, "overlap"),
        ({"encoder_dim": 7}, "encoder_dim"),
        ({"rebuild_dtype": "float16"}, "'bfloat16'"),
    ],
)
def test_bad_config_is_a_clear_error(opts, message):
    with pytest.raises(ValueError, match=message):
        make_config(RetrievalPlugin, opts)


def test_cross_attention_inside_the_shared_embedder_is_refused():
    with pytest.raises(ValueError, match="embed_layers"):
        tiny_model(layers=[0], embed_layers=1)


def test_no_memory_means_no_retrieval():
    """Before any index exists the cross-attention adds nothing (the model is the base model)."""
    model = tiny_model()
    tokens = torch.randint(4, VOCAB, (2, 16))
    ctx = Context(tokens=tokens)
    model.plugins["retrieval"].prepare(ctx, {"tokens": tokens})
    x = torch.randn(2, 16, 32)
    assert torch.all(model.blocks[1].cross_attn(x, ctx) == 0)


@pytest.mark.parametrize("embedder", ["shared", "separate"])
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


def test_rebuild_dtype():
    """'float32' embeds exactly as the live encoder; 'bfloat16' (autocast) ranks alike, to bf16 precision; the
    dtype is part of the embedder identity (its config hash); 'auto' picks bfloat16 only where the device computes it natively."""
    tokens = torch.randint(4, VOCAB, (16, 8))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    fp32 = tiny_model(rebuild_dtype="float32").plugins["retrieval"]
    bf16 = tiny_model(rebuild_dtype="bfloat16").plugins["retrieval"]
    exact = fp32.snapshot(0).embed_segments(tokens, mask)
    with torch.no_grad():
        torch.testing.assert_close(exact, fp32.encoder.eval()(tokens, mask)[1])
    low = bf16.snapshot(0).embed_segments(tokens, mask)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, exact, atol=0.03, rtol=0.0)  # same weights (seed 0), bf16 rounding
    assert fp32.identity(0)["weights_hash"] == bf16.identity(0)["weights_hash"]
    assert (
        fp32.identity(0)["config_hash"] != bf16.identity(0)["config_hash"]
    )  # an index of one is not the other's
    native = cpu_bf16_native()
    assert resolve_rebuild_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    with pytest.raises(ValueError, match="float16"):
        resolve_rebuild_dtype("float16", torch.device("cpu"))


def test_benchmark_script_smoke(capsys):
    """benchmarks/retrieval.py runs end to end at a tiny size and prints its three tables."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "retrieval.py"
    spec = importlib.util.spec_from_file_location("bench_retrieval", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(
        "--d 32 --layers 2 --heads 2 --vocab 128 --seq 16 --segment 8 --batch 2 --docs 12 --doc-len 32 "
        "--sizes 40 --steps 1 --rounds 1 --factory Flat".split()
    )
    out = capsys.readouterr().out
    for row in ("| no retrieval |", "| reading precomputed neighbours", "| 40 |", "| background rebuild"):
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
