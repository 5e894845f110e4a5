"""The embedder protocol, the batched embedding loop and the mean-pool embedder against a naive reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlm.index.protocol import Embedder, MeanPoolEmbedder, embed_all, shard_range
from rlm.model import ModelConfig, Transformer
from rlm.plugin.context import Context


@pytest.fixture
def model() -> Transformer:
    return Transformer(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=16))


def batch(n: int = 5, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (n, length), generator=g)
    mask = torch.arange(length) < torch.tensor([8, 3, 1, 6, 8])[:n, None]  # ragged real lengths
    return tokens, mask


@pytest.mark.parametrize("layer", [0, 1, -1])
def test_mean_pool_matches_a_hand_run_of_the_blocks(model, layer):
    tokens, mask = batch()
    got = MeanPoolEmbedder(model, layer).embed_segments(tokens, mask)
    with torch.no_grad():  # the reference: embedding slot, then blocks[:layer+1], by hand
        ctx = Context(tokens=tokens, mask=mask, stage="predict")
        h = model.embed(tokens, ctx)
        for block in model.blocks[: (layer % 2) + 1]:
            h = block(h, ctx)
        rows = [h[i, mask[i]].mean(0) for i in range(len(tokens))]  # mean over real tokens only
        ref = torch.stack([r / r.norm() for r in rows])
    torch.testing.assert_close(got, ref)
    assert got.dtype == torch.float32 and got.shape == (5, 32)


def test_mean_pool_embedder_implements_the_protocol_and_its_identity(model):
    emb = MeanPoolEmbedder(model, 1, step=7)
    assert isinstance(emb, Embedder)
    ident = emb.embedder_identity()
    assert set(ident) == {"name", "config_hash", "weights_hash", "step"} and ident["step"] == 7
    assert MeanPoolEmbedder(model, 1, step=7).embedder_identity() == ident  # deterministic
    assert MeanPoolEmbedder(model, 0).embedder_identity()["config_hash"] != ident["config_hash"]
    with torch.no_grad():
        model.blocks[0].ffn_norm.weight.add_(1e-3)
    assert emb.embedder_identity()["weights_hash"] != ident["weights_hash"]
    model.train()
    emb.embed_segments(*batch())
    assert model.training  # the embedder ran in eval mode and put the mode back
    with pytest.raises(ValueError, match="layer=2 out of range"):
        MeanPoolEmbedder(model, 2)


def test_embed_all_shards_concatenate_to_the_whole(model):
    tokens, mask = batch()
    table_tokens = torch.cat([tokens] * 3)  # 15 segments
    table_mask = torch.cat([mask] * 3)
    seen: list[np.ndarray] = []

    def segment_tokens(ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(ids)
        return table_tokens[ids], table_mask[ids]

    emb = MeanPoolEmbedder(model)
    whole = embed_all(emb, segment_tokens, 15, batch_size=4, progress=False)
    parts = [
        embed_all(emb, segment_tokens, 15, batch_size=4, rank=r, world_size=4, progress=False)
        for r in range(4)
    ]
    torch.testing.assert_close(np.concatenate(parts), whole)
    torch.testing.assert_close(whole, emb.embed_segments(table_tokens, table_mask).numpy())
    assert whole.dtype == np.float32 and whole.shape == (15, 32)
    assert [list(shard_range(15, r, 4)) for r in range(4)] == [
        [0, 1, 2],
        [3, 4, 5, 6],
        [7, 8, 9, 10],
        [11, 12, 13, 14],
    ]
    with pytest.raises(ValueError, match="rank"):
        shard_range(15, 4, 4)
