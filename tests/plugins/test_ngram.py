"""Token-ID's hashed n-gram memory (Engram; Over-Tokenized Transformer) against pure-Python references."""

from __future__ import annotations

import pytest
import torch
import yaml
from cli_helpers import CONFIGS, fit_args, fit_in_process
from torch.testing import assert_close

from rlm.model import ModelConfig, Transformer
from rlm.model.memory import estimate
from rlm.plugin import Context, KVCache, make_config
from rlm.plugins.tokenid import NGramMemory, TokenIDConfig, TokenIDPlugin, ngram_multipliers

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
        ({"placement": "attn"}, "option placement must be one of .* got 'attn'"),
        ({"placement": "embed"}, "needs ngram_orders"),
        ({"placement": "embed", "ngram_orders": [2]}, "ngram_gate .* set it false"),
        ({"ngram_host": True}, "ngram_host keeps the n-gram tables on the host; it needs ngram_orders"),
        ({"ngram_orders": [2], "ngram_host_lr": 0.0}, "ngram_host_lr must be > 0, got 0.0"),
    ],
)
def test_bad_ngram_config_is_a_clear_error(kw, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        make_config(TokenIDPlugin, kw)


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


# ----- ngram_host: the tables in host memory, their rows fetched per step and updated by a row-wise Adam -----

HOST = NGRAM | {"ngram_host": True, "ngram_host_lr": 0.05}


def host_and_device_memories(device: str = "cpu"):
    """The same gated memory at layer 1 twice: with its table on the host (and its plugin) and on ``device``."""
    torch.manual_seed(0)
    plugin = TokenIDPlugin(TokenIDConfig(layers=[1], **HOST), model_config())
    host = plugin.build(plugin.claims()[0], 1, None).to(device)
    torch.nn.init.normal_(host.gate.weight)
    ref = NGramMemory(V, D, TokenIDConfig(layers=[1], **NGRAM)).to(device)
    ref.load_state_dict(host.state_dict())
    return plugin, host, ref


def lazy_adam(table: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float) -> None:
    """Adam's equations (Kingma & Ba, Algorithm 1) on the rows with a gradient only; the others keep their moments."""
    rows = table.grad.abs().sum(1) > 0
    g, (b1, b2) = table.grad[rows], (0.9, 0.999)
    m[rows] = b1 * m[rows] + (1 - b1) * g
    v[rows] = b2 * v[rows] + (1 - b2) * g * g
    m_hat, v_hat = m[rows] / (1 - b1**step), v[rows] / (1 - b2**step)
    with torch.no_grad():
        table[rows] -= lr * m_hat / (v_hat.sqrt() + 1e-8)
    table.grad = None


def host_steps_match_the_device_table(device: str) -> None:
    """Three steps, each a forward, a backward of a random linear loss and a row-wise Adam step of the host table,
    against the device table's dense gradient put through Adam's equations on the rows read (lazy Adam) at the
    same learning rate; prepare fetches the rows in steps 0 and 2, the forward itself in step 1."""
    plugin, host, ref = host_and_device_memories(device)
    assert host.table.device.type == "cpu" and not host.table.requires_grad
    m, v = torch.zeros_like(ref.table), torch.zeros_like(ref.table)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        tokens = torch.randint(0, V, (2, 9), generator=g).to(device)
        x = torch.randn(2, 9, D, generator=g).to(device).requires_grad_()
        r = torch.randn(2, 9, D, generator=g).to(device)
        ctx = Context(tokens=tokens)
        if step != 1:
            plugin.prepare(ctx, {"tokens": tokens})
        y, want = host(x, ctx), ref(x, Context(tokens=tokens))
        assert_close(y, want)
        (y * r).sum().backward()
        grads = x.grad.clone(), host.gate.weight.grad.clone()
        x.grad = None
        (want * r).sum().backward()
        assert_close(grads, (x.grad, ref.gate.weight.grad))  # through the gate and into the FFN input
        plugin.row_optimizer.step()
        lazy_adam(ref.table, m, v, step + 1, HOST["ngram_host_lr"])
        assert_close(host.table, ref.table.detach().cpu())
    assert int(plugin.row_optimizer.state["layer1"]["step"]) == 3


def test_host_table_gives_the_device_tables_logits_and_updated_rows():
    host_steps_match_the_device_table("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_table_rows_reach_the_gpu_on_a_side_stream():
    host_steps_match_the_device_table("cuda")


def test_host_table_stays_on_the_host_in_its_dtype():
    model = Transformer(model_config(), {"tokenid": HOST | {"layers": [0, 1]}}).to(torch.float64)
    memories = [m for m in model.modules() if isinstance(m, NGramMemory)]
    assert len(memories) == 2 and all(m.table.dtype == torch.float32 for m in memories)
    assert all(m.gate.weight.dtype == torch.float64 for m in memories)  # the rest moves with the model
    assert model.plugins["tokenid"].memories == {"layer0": memories[0], "layer1": memories[1]}


@pytest.mark.parametrize("placement", ["ffn", "embed"])
def test_host_table_is_causal(placement):
    """Changing the tokens after position 5 never moves the logits at positions <= 5 (rows fetched by prepare)."""
    torch.manual_seed(0)
    opts = HOST | {"layers": [0, 1], "placement": placement, "ngram_gate": placement == "ffn"}
    model = Transformer(model_config(), {"tokenid": opts})
    tokens = torch.randint(0, V, (2, 10))
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % V
    out = []
    with torch.no_grad():
        for t in (tokens, changed):
            ctx = Context(tokens=t)
            model.plugins["tokenid"].prepare(ctx, {"tokens": t})
            out.append(model(t, ctx))
    assert_close(out[0][:, :6], out[1][:, :6])
    assert not torch.allclose(out[0][:, 6:], out[1][:, 6:])


@pytest.mark.parametrize("placement", ["ffn", "embed"])
def test_two_step_fit_trains_the_host_table_with_its_row_optimizer(placement):
    opts = HOST | {"layers": [1], "placement": placement, "ngram_gate": placement == "ffn"}
    torch.manual_seed(0)
    before = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2), {"tokenid": opts})
    before = next(m for m in before.modules() if isinstance(m, NGramMemory)).table.clone()
    losses, module = fit_in_process({"tokenid": opts})
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    plugin = module.model.plugins["tokenid"]
    (table,) = plugin.row_optimizer.tables.values()
    assert not table.requires_grad and table.isfinite().all()
    assert int(next(iter(plugin.row_optimizer.state.values()))["step"]) == 2
    moved = (table != before).any(dim=1)
    assert 0 < int(moved.sum()) < table.shape[0]  # the rows read moved, the others kept their values
    optimized = {id(p) for g in module.trainer.optimizers[0].param_groups for p in g["params"]}
    assert id(table) not in optimized


def test_host_table_refuses_several_processes_and_fp16():
    from types import SimpleNamespace

    from rlm.plugins._host_table_callback import HostTableCallback

    plugin = TokenIDPlugin(TokenIDConfig(**HOST), model_config())
    (callback,) = plugin.callbacks()
    with pytest.raises(ValueError, match="ngram_host trains on one process \\(got 2\\)"):
        callback.setup(SimpleNamespace(world_size=2, precision="bf16-mixed"), None, "fit")
    with pytest.raises(ValueError, match="precision='16-mixed'"):
        callback.setup(SimpleNamespace(world_size=1, precision="16-mixed"), None, "fit")
    assert isinstance(callback, HostTableCallback)
