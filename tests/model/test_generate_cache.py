"""Generation with a key/value cache against the full recompute: for the base model and every plugin, greedy
decoding with the cache gives the recomputed tokens, and its logits match the recomputed ones at every step,
including past max_seq_len, where both restart the window the same way (rlm.eval.generate, module doc)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from retrieval_helpers import CORPUS_SEGMENTS, attach_memory
from torch.testing import assert_close

from rlm.eval.generate import CachedDecoder, sample
from rlm.model.layers import causal_mask
from rlm.plugin import Context, KVCache
from rlm.plugin.cache import refill_start
from rlm.train.module import LMModule

VOCAB, WINDOW = 96, 16
PROMPT = [2, 17, 40, 5, 63, 8]
NEW = 22  # 6 + 22 tokens: the window of 16 fills, restarts from its last 8 tokens, fills again and restarts

PLUGINS = {
    "base": {},
    "moe": {"moe": {"layers": [1], "num_experts": 4}},
    "moe_top2": {"moe": {"layers": [0, 1], "num_experts": 4, "top_k": 2, "renormalize": True}},
    "moe_hash": {"moe": {"layers": [1], "num_experts": 4, "lookup": "token_id"}},
    "partial_experts": {"partial_experts": {"layers": [1], "lookup": "lsh", "buckets": 16, "rank": 2}},
    "pkm": {"pkm": {"layers": [1], "n_keys": 8, "heads": 2, "topk": 4, "k_dim": 16}},
    "pkm_batchnorm": {"pkm": {"layers": [1], "n_keys": 8, "heads": 2, "topk": 4, "k_dim": 16, "query_norm": "batchnorm"}},
    "altup": {"altup": {"k": 2}},
    "altup_router": {"altup": {"k": 3, "router": True, "reduce": "project"}},
    "altup_sum": {"altup": {"k": 2, "update": "sum"}},
    "tokenid": {"tokenid": {"layers": [0, 1], "rank": 2}},
    "tokenid_ngram": {"tokenid": {"layers": [0, 1], "ngram_orders": [2, 3], "ngram_heads": 2, "ngram_rows": 32}},
    "tokenid_ngram_embed": {"tokenid": {"ngram_orders": [1, 3], "ngram_rows": 32, "placement": "embed", "ngram_gate": False}},
    "pkm_peer": {"pkm": {"layers": [1], "n_keys": 8, "heads": 2, "topk": 4, "k_dim": 16, "values": "peer", "key_norm": True}},
    "pkm_peer_per_layer": {"pkm": {"layers": [0, 1], "n_keys": 8, "heads": 2, "topk": 4, "k_dim": 16, "values": "peer", "activation": "silu", "shared_values": False}},
    "pkm_peer_relu_gated": {"pkm": {"layers": [1], "n_keys": 8, "heads": 2, "topk": 4, "k_dim": 16, "values": "peer", "activation": "relu", "gated": True, "mode": "add"}},
    "tokenid_ngram_options": {"tokenid": {"layers": [1], "ngram_orders": [1, 4], "ngram_heads": 3, "ngram_rows": 64, "ngram_seed": 7, "ngram_gate": False}},
    "tokenid_ngram_host": {"tokenid": {"layers": [0, 1], "ngram_orders": [2, 3], "ngram_heads": 2, "ngram_rows": 32, "ngram_host": True}},
    "tokenid_moe_altup": {"tokenid": {"layers": [0]}, "moe": {"layers": [1], "num_experts": 4}, "altup": {"k": 2}},
    "knn_attention": {"knn_attention": {"k": 4, "own_k": 3}},
}  # fmt: skip
RETRIEVAL = {
    "retrieval_tokens": {"embedder": "tokens"},
    "retrieval_continuation": {"embedder": "tokens", "continuation": True},
    "retrieval_shared": {"embedder": "shared"},
}


def tiny_module(plugins: dict, window: int = WINDOW, seed: int = 0) -> LMModule:
    """d=32, 2 layers, grouped-query attention; every parameter moved off its initialisation (zero-initialised
    tables, routers and projections included), so every plugin changes the logits and greedy decoding wanders."""
    torch.manual_seed(seed)
    model = {"vocab_size": VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
             "max_seq_len": window, "tie_embeddings": False}  # fmt: skip
    module = LMModule(model=model, plugins=plugins)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return module.eval()


def retrieval_module(name: str) -> LMModule:
    """A tiny retriever (segments of 8 tokens) whose memory indexes documents 0-9 of test_retrieval's corpus."""
    opts = {
        "layers": [1],
        "k": 2,
        "progress": False,
        "zero_init": False,
        "lookup": "search",
        **RETRIEVAL[name],
    }
    module = tiny_module({"retrieval": opts}, window=24)
    attach_memory(module.model, CORPUS_SEGMENTS, np.arange(10))
    return module


def reference(module: LMModule, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding by full recompute over ids[start:], the window start moved as the cache moves it (written
    out here: start stays while the window holds at most max_seq_len tokens, else jumps to keep the last half)."""
    window = module.model.config.max_seq_len
    ids, start, out = list(prompt), 0, []
    with torch.no_grad():
        for _ in range(steps):
            if len(ids) - start > window:
                start = len(ids) - window // 2
            x = torch.tensor([ids[start:]])
            logits = module.model(x, module.make_context({"tokens": x}, "predict"))[0, -1].float()
            out.append(logits)
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :], out


def cached(module: LMModule, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with CachedDecoder, recording its logits."""
    decoder, ids, out = CachedDecoder(module), torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(steps):
            logits = decoder(ids)[0]
            out.append(logits)
            ids = torch.cat([ids, logits.argmax().view(1, 1)], 1)
    return ids[0, len(prompt) :].tolist(), out


def assert_same_generation(module: LMModule, prompt: list[int], steps: int, via_sample: bool = False) -> None:
    want, want_logits = reference(module, prompt, steps)
    got, got_logits = cached(module, prompt, steps)
    assert len(set(want)) > 3, f"degenerate reference generation {want}: the test would show little"
    for step, (a, b) in enumerate(zip(got_logits, want_logits)):
        assert_close(a, b, rtol=1e-4, atol=1e-3, msg=lambda m, s=step: f"step {s}: {m}")
    assert got == want
    if via_sample:
        assert sample(module, prompt, steps, temperature=0) == want  # sample's default is the cache


@pytest.mark.parametrize("name", list(PLUGINS))
def test_cached_generation_matches_full_recompute(name):
    # sample (what `rlm generate` runs) too where prepare does work of its own: the host table's rows
    via_sample = name in ("base", "tokenid_ngram_host")
    assert_same_generation(tiny_module(PLUGINS[name]), PROMPT, NEW, via_sample=via_sample)


@pytest.mark.parametrize("name", list(RETRIEVAL))
def test_cached_retrieval_generation_matches_full_recompute(name):
    """The retriever's chunk neighbours are searched when a chunk's first token arrives and kept in the cache; the
    window's restart (prompt 12 + 24 new tokens, window 24, restarting at 12 tokens: mid-segment) cuts chunks anew
    from the restarted window's start."""
    module = retrieval_module(name)
    prompt = (
        CORPUS_SEGMENTS.tokens(np.arange(30, 32)).reshape(-1)[3:15].tolist()
    )  # 12 tokens, mid-segment start
    assert_same_generation(module, prompt, 24)
    # the retrieval path is exercised: the prompt's chunks found neighbours
    decoder = CachedDecoder(module)
    decoder(torch.tensor([prompt]))
    chunks = decoder.cache.state["retrieval"]["chunks"]
    assert sorted(chunks) == [0, 1] and any(bool(c.valid.any()) for c in chunks.values())


def test_inside_the_window_cached_sampling_is_the_sliding_recompute():
    """Up to max_seq_len tokens the cache changes nothing, also at temperature > 0 with top-k (same generator)."""
    module = tiny_module(PLUGINS["moe"])
    steps = WINDOW - len(PROMPT)
    a = sample(module, PROMPT, steps, 0.9, 5, generator=torch.Generator().manual_seed(3), cache=True)
    b = sample(module, PROMPT, steps, 0.9, 5, generator=torch.Generator().manual_seed(3), cache=False)
    assert a == b and len(a) == steps


def test_refill_start_follows_its_rule():
    starts, start = [], 0
    for length in range(1, 30):
        start = refill_start(length, start, 8)
        starts.append(start)
        assert 0 < length - start <= 8
    # fills to 8, then restarts from the last 4 and fills again: a restart at lengths 9, 14, 19, ...
    assert [i + 1 for i in range(1, len(starts)) if starts[i] != starts[i - 1]] == [9, 14, 19, 24, 29]


def test_chunked_prefill_and_single_steps_agree():
    """Feeding a sequence to the cache in uneven chunks gives the logits of one full forward at every position."""
    module = tiny_module(PLUGINS["tokenid_moe_altup"])
    tokens = torch.randint(0, VOCAB, (2, WINDOW))
    with torch.no_grad():
        full = module.model(tokens, Context(tokens=tokens, stage="predict"))
        cache, parts = KVCache(WINDOW, batch=2), []
        for lo, hi in ((0, 5), (5, 6), (6, 13), (13, 14), (14, WINDOW)):
            chunk = tokens[:, lo:hi]
            parts.append(module.model(chunk, module.make_context({"tokens": chunk}, "predict", cache=cache)))
    assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-4)
    assert cache.length == WINDOW and torch.equal(cache.tokens, tokens)


def test_causal_mask_matches_a_naive_loop():
    mask = causal_mask(3, 4)
    naive = torch.tensor([[j <= 4 + i for j in range(7)] for i in range(3)])
    assert torch.equal(mask, naive)


def test_cache_refuses_a_wrong_offset_overflow_and_batch():
    module = tiny_module({})
    cache = KVCache(8)
    x = torch.randint(0, VOCAB, (1, 5))
    module.model(x, module.make_context({"tokens": x}, "predict", cache=cache))
    with pytest.raises(ValueError, match="overflow the cache of 8 positions"):
        module.model(x, module.make_context({"tokens": x}, "predict", cache=cache))
    with pytest.raises(ValueError, match="ctx.offset=0, but the cache holds 5"):
        module.model(x[:, :1], Context(tokens=x[:, :1], stage="predict", cache=cache))
    with pytest.raises(ValueError, match="cache of batch 1 got tokens of batch 2"):
        y = x[:, :1].repeat(2, 1)
        module.model(y, Context(tokens=y, stage="predict", offset=5, cache=cache))
    with pytest.raises(ValueError, match="capacity must be a positive integer, got 0"):
        KVCache(0)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        sample(module, [], 3)


def test_knnlm_mixer_sees_the_same_keys_with_and_without_the_cache():
    """The kNN-LM path reads the hooked key state of the last position: the cache gives it the same keys."""
    module = tiny_module({})
    seen: dict[bool, list[torch.Tensor]] = {True: [], False: []}

    class Recorder:  # the Mixer's interface: (logits (1, V), keys (1, d)) -> log-probabilities
        ds = type("DS", (), {"meta": {"layer": "ffn_input"}})()

        def __init__(self, flag: bool) -> None:
            self.flag = flag

        def __call__(self, logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
            seen[self.flag].append(keys.clone())
            return logits.log_softmax(-1)

    steps = WINDOW - len(PROMPT)
    a = sample(module, PROMPT, steps, temperature=0, mixer=Recorder(True), cache=True)
    b = sample(module, PROMPT, steps, temperature=0, mixer=Recorder(False), cache=False)
    assert a == b
    assert_close(torch.cat(seen[True]), torch.cat(seen[False]), rtol=1e-4, atol=1e-4)


def test_benchmark_script_smoke(capsys):
    """benchmarks/generate.py --smoke: both lengths run, inside the window both paths give the same tokens."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "generate.py"
    spec = importlib.util.spec_from_file_location("benchmark_generate", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--smoke"])
    assert [r[:3] for r in rows][0] == [8, "no", "8/8"] and rows[1][:2] == [40, "yes"]
    assert all(r[3] > 0 and r[4] > 0 and r[5].endswith("x") for r in rows)
    assert "| new tokens | past max_seq_len |" in capsys.readouterr().out
