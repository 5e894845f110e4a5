"""Sampling options of rlm.eval.generate against naive references: the top-p cut against a sort-and-sum by hand,
CTRL's repetition penalty by hand, batched greedy decoding against one prompt at a time, stop strings."""

from __future__ import annotations

import pytest
import torch

from rlm.eval.generate import cut_at, penalize_repeats, pick, sample, sample_batch, stop_at, top_p_filter
from rlm.train.module import LMModule


def tiny_module(window: int = 16) -> LMModule:
    """d=32, 2 layers; parameters moved off their initialisation so greedy decoding wanders."""
    torch.manual_seed(0)
    model = {
        "vocab_size": 64,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "max_seq_len": window,
    }
    module = LMModule(model=model)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return module.eval()


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_keeps_the_smallest_set_reaching_p(p):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 3
    got = top_p_filter(logits, p)
    for row, out in zip(logits, got, strict=True):
        probs = torch.softmax(row.double(), -1)
        keep, total = set(), 0.0
        for i in sorted(range(len(row)), key=lambda i: -probs[i]):
            keep.add(i)
            total += float(probs[i])
            if total >= p:
                break
        assert {i for i in range(len(row)) if out[i] > float("-inf")} == keep
        assert torch.equal(out[sorted(keep)], row[sorted(keep)])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    seen = torch.tensor([[0, 1, 1, 3]])  # a repeat counts once
    want = torch.tensor([[2.0 / 1.5, -1.0 * 1.5, 0.5, -3.0 * 1.5, 1.0]])
    torch.testing.assert_close(penalize_repeats(logits, seen, 1.5), want)
    # greedy picks id 0 without the penalty, id 4 with it
    assert pick(logits, seen, 0.0).item() == 0 and pick(logits, seen, 0.0, repetition_penalty=2.5).item() == 4


def test_pick_with_top_p_draws_only_the_nucleus():
    logits = torch.tensor([[3.0, 2.9, -5.0, -6.0]]).repeat(200, 1)
    ids = pick(
        logits,
        logits.new_zeros(200, 1, dtype=torch.long),
        1.0,
        top_p=0.9,
        generator=torch.Generator().manual_seed(0),
    )
    assert set(ids.flatten().tolist()) == {0, 1}


def test_batched_greedy_equals_one_prompt_at_a_time():
    module = tiny_module()
    prompts = [[1, 5, 9], [2, 7, 11], [3], [4, 8, 12, 16, 20], [1, 5, 9]]  # two lengths shared, a repeat
    for cache in (True, False):
        one_by_one = [
            sample(module, p, 20, temperature=0, cache=cache) for p in prompts
        ]  # past the window of 16
        assert sample_batch(module, prompts, 20, temperature=0, cache=cache) == one_by_one


def test_a_batch_ends_each_sequence_at_its_own_eos_or_stop():
    module = tiny_module()
    prompts = [[1, 5, 9], [2, 7, 11]]
    full = sample_batch(module, prompts, 12, temperature=0)
    eos = full[0][3]
    got = sample_batch(module, prompts, 12, temperature=0, eos_id=eos)
    for ids, want in zip(got, full, strict=True):
        assert ids == (want[: want.index(eos) + 1] if eos in want else want)
    got = sample_batch(module, prompts, 12, temperature=0, stop=lambda ids: ids == full[1][:5])
    assert got == [full[0], full[1][:5]]  # the other sequence runs on to max_new_tokens


def test_stop_strings_end_the_sequence_and_are_cut():
    decode = lambda ids: "".join(chr(97 + i) for i in ids)  # noqa: E731
    stop = stop_at(decode, ["cd", "zz"])
    assert not stop([0, 1, 2]) and stop([0, 1, 2, 3])
    assert cut_at("abcdef", ["cd", "zz"]) == "ab" and cut_at("abcdef", ["zz"]) == "abcdef"
    assert cut_at("xx stop yy STOP", ["STOP", "stop"]) == "xx "
