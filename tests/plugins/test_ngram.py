"""Token-ID's hashed n-gram memory (Engram; Over-Tokenized Transformer) against pure-Python references."""

from __future__ import annotations

import pytest
import torch
import yaml
from cli_helpers import CONFIGS, fit_args, fit_in_process
from torch.testing import assert_close

from rlm.model import ModelConfig, Transformer
from rlm.plugin import Context, KVCache
from rlm.plugins.tokenid import NGramMemory, TokenIDConfig, TokenIDPlugin, ngram_multipliers
from rlm.train.memory import estimate

V, D = 50, 32
NGRAM = {"ngram_orders": [2, 3], "ngram_heads": 2, "ngram_rows": 16, "init_std": 0.5}


def model_config() -> ModelConfig:
    return ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=2)


def python_bucket(ngram: list[int], mult: list[int], rows: int) -> int:
    """The multiplicative-XOR hash in plain Python integers: XOR_j (token_j * a_j mod 2^31), mod rows."""
    h = 0
    for tok, a in zip(ngram, mult):
        h ^= (tok * a) % (1 << 31)
    return h % rows


def naive_ngram_sum(memory, tokens: list[int], x: torch.Tensor | None, pad: int) -> torch.Tensor:
    """Position by position: each order's n-gram (padding ids before the start), each head's row, summed."""
    mult = ngram_multipliers(memory.orders, memory.mult.shape[1], 0).tolist()
    out = []
    for t in range(len(tokens)):
        acc = torch.zeros(D, dtype=memory.table.dtype)
        for o, n in enumerate(memory.orders):
            ngram = [tokens[p] if p >= 0 else pad for p in range(t - n + 1, t + 1)]
            for h in range(len(mult[o])):
                head = o * len(mult[o]) + h
                acc = acc + memory.table[head * memory.rows + python_bucket(ngram, mult[o][h], memory.rows)]
        if x is not None:
            acc = acc * torch.sigmoid(x[t] @ memory.gate.weight[0] + memory.gate.bias[0])
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("gate", [False, True])
def test_ngram_sum_equals_a_naive_loop_with_python_hashes(gate):
    plugin = TokenIDPlugin(TokenIDConfig(layers=[1], ngram_gate=gate, **NGRAM), model_config())
    memory = plugin.build(plugin.claims()[0], 1, None)
    if gate:
        torch.nn.init.normal_(memory.gate.weight)
    tokens = torch.randint(0, V, (2, 7))
    x = torch.randn(2, 7, D)
    y = memory(x, Context(tokens=tokens))
    for b in range(2):
        ref = naive_ngram_sum(memory, tokens[b].tolist(), x[b] if gate else None, pad=V)
        assert_close(y[b], ref)


def test_hash_spreads_ngrams_and_its_multipliers_come_from_the_seed():
    a = ngram_multipliers([2, 3], 4, seed=0)
    assert a.shape == (2, 4, 3) and bool((a % 2 == 1).all()) and int(a.max()) < 1 << 31
    assert torch.equal(a, ngram_multipliers([2, 3], 4, seed=0)) and not torch.equal(
        a, ngram_multipliers([2, 3], 4, 1)
    )
    rows = 64
    buckets = {python_bucket([i, j], a[0, 0, :2].tolist(), rows) for i in range(V) for j in range(V)}
    assert len(buckets) == rows  # V^2 = 2500 bigrams reach every row


@pytest.mark.parametrize("placement", ["ffn", "embed"])
def test_ngram_memory_is_causal(placement):
    """Changing the tokens after position 5 never moves the logits at positions <= 5."""
    torch.manual_seed(0)
    opts = NGRAM | {"layers": [0, 1], "placement": placement, "ngram_gate": placement == "ffn"}
    model = Transformer(model_config(), {"tokenid": opts})
    tokens = torch.randint(0, V, (2, 10))
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % V
    with torch.no_grad():
        a, b = model(tokens, Context(tokens=tokens)), model(changed, Context(tokens=changed))
    assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_cached_steps_read_the_previous_tokens_from_the_cache():
    plugin = TokenIDPlugin(TokenIDConfig(layers=[0], ngram_gate=False, **NGRAM), model_config())
    memory = plugin.build(plugin.claims()[0], 0, None)
    tokens = torch.randint(0, V, (1, 6))
    full = memory(None, Context(tokens=tokens))
    cache = KVCache(8)
    cache.advance(0, tokens[:, :4])
    step = memory(None, Context(tokens=tokens[:, 4:], offset=4, cache=cache))
    assert_close(step, full[:, 4:])


@pytest.mark.parametrize("placement", ["ffn", "embed"])
def test_parameter_counts_match_the_estimate(placement):
    opts = NGRAM | {"layers": [0, 1], "placement": placement, "ngram_gate": placement == "ffn"}
    model = Transformer(model_config(), {"tokenid": opts})
    base = Transformer(model_config())
    added = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in base.parameters())
    modules = 2 if placement == "ffn" else 1
    assert (
        added
        == modules * model.plugins["tokenid"].added_parameters()
        == modules * (4 * 16 * D + (D + 1) * (placement == "ffn"))
    )
    mc = {"vocab_size": V, "d_model": D, "n_layers": 2, "n_heads": 2}
    got = estimate({"model": {"model": mc, "plugins": {"tokenid": opts}}})["params"]
    assert got - estimate({"model": {"model": mc}})["params"] == added


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"ngram_orders": [2, 2]}, "distinct integers >= 1, got [2, 2]"),
        ({"ngram_orders": [0]}, "distinct integers >= 1"),
        ({"ngram_orders": [2], "rank": 2}, "needs rank 0"),
        ({"ngram_rows": 0}, "ngram_rows must be a positive integer, got 0"),
        ({"placement": "attn"}, "placement='attn' is unknown"),
        ({"placement": "embed"}, "needs ngram_orders"),
        ({"placement": "embed", "ngram_orders": [2]}, "ngram_gate .* set it false"),
    ],
)
def test_bad_ngram_config_is_a_clear_error(kw, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        TokenIDConfig(**kw)


@pytest.mark.parametrize("placement", ["ffn", "embed"])
def test_two_step_fit_with_the_ngram_memory_trains(placement):
    opts = NGRAM | {"layers": [1], "placement": placement, "ngram_gate": placement == "ffn"}
    losses, module = fit_in_process({"tokenid": opts})
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    tables = [m.table for m in module.model.modules() if isinstance(m, NGramMemory)]
    assert len(tables) == 1 and tables[0].isfinite().all()


def test_config_fragment_parses_and_builds_the_ngram_memory(rlm_main, tmp_path):
    fragment = CONFIGS / "plugins" / "tokenid_ngram.yaml"
    done = rlm_main(fit_args(fragment) + ["--print_config"], tmp_path)
    assert done.returncode == 0, done.stderr
    spec = yaml.safe_load(done.stdout)["model"]["plugins"]["tokenid"]
    assert spec["ngram_orders"] == [2, 3] and spec["placement"] == "ffn"
    with torch.device("meta"):
        model = Transformer(
            ModelConfig(), {"tokenid": yaml.safe_load(fragment.read_text())["model"]["plugins"]["tokenid"]}
        )
    assert isinstance(model.blocks[1].ffn_add[0], NGramMemory)
