"""The chunked head + cross-entropy (rlm.model.loss) against the plain path: the loss and both gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rlm.model import ModelConfig, Transformer
from rlm.model.loss import head_cross_entropy


def _plain(hidden, weight, targets, vocab):
    logits = hidden @ weight[:vocab].T  # (B, T, V); float32 at least for the softmax, as LMModule
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


@pytest.mark.parametrize("chunk", [5, 7, 1000])  # several chunks, a ragged last one, one chunk
@pytest.mark.parametrize("padded", [False, True])
def test_loss_and_gradients_match_the_plain_path(chunk, padded):
    vocab, rows = 50, 64 if padded else 50
    hidden = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(rows, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (3, 7))
    targets[0, :3] = -100  # ignored positions take no part in the mean
    want = _plain(hidden, weight, targets, vocab)
    want_h, want_w = torch.autograd.grad(want * 3.0, (hidden, weight))
    got = head_cross_entropy(hidden, weight, targets, vocab, chunk=chunk)
    got_h, got_w = torch.autograd.grad(got * 3.0, (hidden, weight))  # an upstream gradient other than 1
    assert_close(got, want.to(got.dtype))
    assert_close(got_h, want_h)
    assert_close(got_w, want_w)
    assert got_w[vocab:].abs().sum() == 0


def test_under_bf16_autocast_it_matches_the_plain_path_to_bf16_rounding():
    hidden = torch.randn(4, 8, 32, requires_grad=True)
    weight = torch.randn(96, 32, requires_grad=True)
    targets = torch.randint(0, 96, (4, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _plain(hidden, weight, targets, 96)
        got = head_cross_entropy(hidden, weight, targets, 96, chunk=10)
    assert got.dtype == torch.float32
    grads = [torch.autograd.grad(loss, (hidden, weight)) for loss in (want, got)]
    assert_close(got, want, rtol=1e-3, atol=1e-3)
    for g, w in zip(grads[1], grads[0], strict=True):
        assert g.dtype == torch.float32
        assert_close(g, w, rtol=2e-2, atol=2e-3)


def test_the_model_with_targets_returns_the_loss_of_its_logits():
    model = Transformer(ModelConfig(vocab_size=100, vocab_multiple=64, d_model=32, n_layers=2, n_heads=4))
    tokens = torch.randint(0, 100, (2, 16))
    targets = tokens.roll(-1, 1)
    targets[:, -1] = -100
    want = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=-100)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    got = model(tokens, targets=targets)
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert_close(g, w, rtol=1e-4, atol=1e-6)
