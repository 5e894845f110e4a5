"""rlm/model/memory.py against the real models: parameter counts on the meta device, the optimizers' real state,
and the bytes autograd saves on CPU under bf16 autocast."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlm.experiment.spec import merge
from rlm.model import Transformer
from rlm.model.memory import LOSS_BYTES_PER_LOGIT, estimate, model_config
from rlm.plugin import Context
from rlm.train.module import LMModule

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GPT2_VOCAB = 50257
H100_BYTES = 80 * 10**9

# (model file, plugin fragments, overrides of model.plugins): the GPT-2 sizes with the papers' fragments, and the
# small model (SwiGLU) with the repository's own fragments and their variants, so every formula's options vary.
CASES = {
    "gpt2_small": ("gpt2_small", [], {}),
    "gpt2_medium": ("gpt2_medium", [], {}),
    "gpt2_small+pkm": ("gpt2_small", ["gpt2/pkm"], {}),
    "gpt2_small+pkm_1M": ("gpt2_small", ["gpt2/pkm"], {"pkm": {"n_keys": 1024}}),
    "gpt2_medium+pkm": ("gpt2_medium", ["gpt2/pkm"], {"pkm": {"layers": [12]}}),
    "gpt2_small+switch": ("gpt2_small", ["gpt2/switch"], {}),
    "gpt2_small+switch64": ("gpt2_small", ["gpt2/switch"], {"moe": {"num_experts": 64}}),
    "gpt2_small+altup": ("gpt2_small", ["gpt2/altup"], {}),
    "gpt2_small+retrieval": ("gpt2_small", ["gpt2/retrieval"], {}),
    "gpt2_small+tokenid": ("gpt2_small", ["tokenid"], {}),
    "small+pkm_add_gated_batchnorm": (
        "small",
        ["pkm"],
        {
            "pkm": {
                "mode": "add",
                "gated": True,
                "query_norm": "batchnorm",
                "shared_values": False,
                "layers": [1, 2],
            }
        },
    ),
    "small+moe_top2": ("small", ["moe", "moe_top2"], {}),
    "small+moe_hash": ("small", ["moe", "moe_hash"], {}),
    "small+altup_project": ("small", ["altup"], {"altup": {"k": 3, "reduce": "project", "router": True}}),
    "small+altup_recycled": ("small", ["altup", "altup_recycled"], {}),
    "small+altup_extra_width": (
        "small",
        ["altup"],
        {"altup": {"k": 3, "embedding": "project", "extra_width": 101}},
    ),
    "small+pkm_peer": ("small", ["pkm_peer"], {"pkm": {"layers": [1, 2], "shared_values": False}}),
    "small+tokenid_ngram": ("small", ["tokenid_ngram"], {"tokenid": {"layers": [0, -1]}}),
    "small+tokenid_ngram_embed": (
        "small",
        ["tokenid_ngram"],
        {"tokenid": {"placement": "embed", "ngram_gate": False}},
    ),
    "small+tokenid_rank2": ("small", ["tokenid"], {"tokenid": {"rank": 2, "layers": [0, -1]}}),
    "small+retrieval_continuation": (
        "small",
        ["retrieval"],
        {"retrieval": {"continuation": True, "layers": [2, 3]}},
    ),
}


def merged(model: str, fragments: list[str], overrides: dict, vocab: int = GPT2_VOCAB) -> dict:
    paths = [CONFIGS / "model" / f"{model}.yaml"] + [CONFIGS / "plugins" / f"{f}.yaml" for f in fragments]
    cfg = merge(paths, {"model": {"plugins": overrides}})
    cfg["model"]["model"]["vocab_size"] = vocab
    return cfg


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_parameter_count_equals_the_model_built_on_the_meta_device(case):
    cfg = merged(*CASES[case])
    with torch.device("meta"):
        model = Transformer(model_config(cfg), cfg["model"].get("plugins") or {})
    assert estimate(cfg)["params"] == sum(p.numel() for p in model.parameters())


def _tiny(case: str) -> dict:
    """The case's fragments on a 12-layer model of width 64 (so their layer lists stay valid), tables made small."""
    model, fragments, overrides = CASES[case]
    cfg = merged(model, fragments, overrides, vocab=96)
    cfg["model"]["model"].update(d_model=64, n_heads=2, n_layers=12, d_ff=None, max_seq_len=64)
    plugins = cfg["model"].get("plugins") or {}
    if "pkm" in plugins:
        plugins["pkm"].update(n_keys=8, k_dim=16, topk=4)
        plugins["pkm"]["layers"] = [min(i, 11) for i in plugins["pkm"].get("layers") or [6]]
    return cfg


@pytest.mark.parametrize(
    "case",
    [
        "gpt2_small",
        "gpt2_small+pkm",
        "small+pkm_add_gated_batchnorm",
        "gpt2_small+switch",
        "gpt2_small+altup",
        "gpt2_small+retrieval",
        "small+tokenid_rank2",
    ],
)
def test_gradient_and_optimizer_bytes_equal_the_real_optimizers_state(case):
    cfg = _tiny(case)
    module = LMModule(
        model=model_config(cfg), plugins=cfg["model"].get("plugins"), optim=cfg["model"].get("optim")
    )
    groups = module.parameter_groups()
    for g in groups:
        g.pop("schedule")
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    grads = 0
    for g in groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
            grads += p.grad.nbytes
    optimizer.step()
    state = [
        t for s in optimizer.state.values() for t in s.values() if t.ndim > 0
    ]  # moments; 'step' is a scalar
    real = sum(t.nbytes for t in state)
    pkm = module.model.plugins["pkm"] if "pkm" in module.model.plugins else None
    if pkm is not None and pkm._sparse:  # the row optimizer allocates its moments at its first update
        rows = pkm.row_optimizer
        for key, table in rows.tables.items():
            slots = torch.tensor([[0, 1]])
            rows.add_lookups(key, slots, torch.ones(1, 2), torch.ones(1, table.shape[1]))
        rows.step()
        real += sum(t.nbytes for s in rows.state.values() for t in s.values())
        assert all(table.grad is None for table in rows.tables.values())
    est = estimate(cfg)
    assert est["optimizer_bytes"] == real
    assert est["grad_bytes"] == grads
    assert est["param_bytes"] == 4 * sum(p.numel() for p in module.parameters())


def _saved_bytes_per_token(cfg: dict, batch: int, T: int = 32) -> float:
    """Bytes autograd saves for backward in a bf16-autocast forward and loss, less those of a batch of half the size,
    per token: the batch-proportional part (weights and their bf16 copies cancel)."""

    def saved(B: int) -> int:
        torch.manual_seed(0)
        model = Transformer(model_config(cfg), cfg["model"].get("plugins") or {}).train()
        for plugin in model.plugins.values():
            plugin.param_groups()  # resolves PKM's sparse update as training does
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s.nbytes()
            return t

        tokens = torch.randint(0, model.config.vocab_size, (B, T))
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            torch.autocast("cpu", torch.bfloat16),
        ):
            logits = model(tokens, Context(tokens=tokens, stage="train"))
            F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        return sum(storages.values())

    return (saved(batch) - saved(batch // 2)) / (batch // 2 * T)


@pytest.mark.parametrize(
    "case,plugins",
    [
        ("plain", {}),
        ("gated", {}),
        ("pkm", {"pkm": {"layers": [1], "n_keys": 16, "k_dim": 32, "topk": 4}}),
        ("pkm_peer", {"pkm": {"layers": [1], "n_keys": 16, "k_dim": 32, "topk": 4, "values": "peer"}}),
        ("altup", {"altup": {"k": 3}}),
        ("tokenid_ngram", {"tokenid": {"layers": [0, 2], "ngram_orders": [2, 3], "ngram_rows": 64}}),
        (
            "tokenid_ngram_embed",
            {"tokenid": {"ngram_orders": [2], "ngram_rows": 64, "placement": "embed", "ngram_gate": False}},
        ),
        ("tokenid", {"tokenid": {"layers": [0, 2], "rank": 2}}),
        ("tokenid_rank1", {"tokenid": {"layers": [1], "rank": 1}}),
        ("moe_bmm", {"moe": {"layers": [1], "num_experts": 4, "dispatch": "bmm", "capacity_factor": 2.0}}),
    ],
)
def test_activation_bytes_equal_what_autograd_saves_under_bf16_autocast(case, plugins):
    V = 96
    fields = dict(vocab_size=V, d_model=64, n_layers=3, n_heads=4, max_seq_len=32)
    fields["ffn"] = "gated" if case == "gated" else "plain"
    cfg = {"model": {"model": fields, "plugins": plugins}, "data": {"batch_size": 1, "seq_len": 1}}
    cfg["trainer"] = {"precision": "bf16-mixed"}
    # The estimate's loss term also holds the transient bf16 logits and their fp32 copy; autograd saves the
    # fp32 log-probabilities (4 V) alone.
    predicted = estimate(cfg)["activation_bytes"] - (LOSS_BYTES_PER_LOGIT - 4) * V
    measured = _saved_bytes_per_token(cfg, batch=4)
    if case == "moe_bmm":  # capacity 2 x k x tokens / N: the buffers' rows are the estimate's, none dropped
        assert measured == pytest.approx(predicted, rel=0.02)
    else:
        assert measured == predicted


def test_gpt2_small_on_fineweb_edu_fits_an_h100_and_needs_a_tokenizer():
    files = ["model/gpt2_small.yaml", "data/fineweb_edu.yaml", "trainer/gpu.yaml"]
    cfg = merge([CONFIGS / f for f in files])
    assert cfg["trainer"]["precision"] == "bf16-mixed" and cfg["model"]["compile"] is True
    est = estimate(cfg, vocab_size=GPT2_VOCAB)
    assert est["batch_size"] * est["seq_len"] == 16 * 1024
    assert 123e6 < est["params"] < 125e6  # GPT-2 small's 124M, less the learned positions and biases
    assert est["total_bytes"] < H100_BYTES / 2
    with pytest.raises(ValueError, match="vocabulary size is unknown"):
        estimate(cfg)  # the tokenizer sets it; here none was given

    from rlm.data.module import RLMDataModule

    with pytest.raises(FileNotFoundError, match="--data.tokenizer PATH"):
        RLMDataModule(**cfg["data"])


def test_a_plugin_without_a_formula_is_named():
    cfg = merged("small", ["partial_experts"], {})
    with pytest.raises(ValueError, match="'partial_experts'.*plugins with one: \\['altup', 'moe'"):
        estimate(cfg)


def test_a_layer_outside_the_model_is_named():
    cfg = merged("gpt2_small", ["gpt2/pkm"], {"pkm": {"layers": [12]}})
    with pytest.raises(ValueError, match=r"layers \[12\] are outside the model's 12; accepted: -12..11"):
        estimate(cfg)


def test_a_host_too_small_for_every_local_process_is_refused_before_the_model_is_built(monkeypatch):
    """docs/SCALE.md section 14's bound: 4 B x parameters x local processes against MemAvailable, checked in
    LMModule.__init__ before anything is allocated; the error names the need, the processes and the memory."""
    import rlm.model.memory as memory
    import rlm.train.module as module
    from rlm.model import ModelConfig
    from rlm.model.memory import check_host_build, local_processes

    mc = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4)
    params = sum(p.numel() for p in Transformer(mc).parameters())
    check_host_build(mc, {}, processes=2, available=8 * params)  # exactly fits
    with pytest.raises(MemoryError, match=rf"{params:,} fp32 parameters in each of 2 process\(es\)"):
        check_host_build(mc, {}, processes=2, available=8 * params - 1)
    check_host_build(mc, {"moe": None}, processes=1, available=4 * params)  # a disabled plugin counts nothing
    # no formula (the estimate raises NotImplementedError for a shared encoder): the base model is counted
    shared = {"retrieval": {"layers": [1], "embedder": "shared"}}
    check_host_build(mc, shared, processes=1, available=4 * params)
    with pytest.raises(MemoryError):
        check_host_build(mc, shared, processes=1, available=4 * params - 1)

    for env, want in [({}, 1), ({"LOCAL_WORLD_SIZE": "4"}, 4), ({"SLURM_NTASKS_PER_NODE": "8(x2)"}, 8)]:
        for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert local_processes() == want

    built = []
    monkeypatch.setattr(module, "Transformer", lambda *a: built.append(a))
    monkeypatch.setattr(
        memory, "available_host_bytes", lambda: 4 * params * 8 - 1
    )  # 8 processes' need, less 1
    with pytest.raises(MemoryError, match="GiB is available"):
        module.LMModule(model=mc)
    assert built == []  # refused before the build
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    module.LMModule(model=mc)
    assert len(built) == 1


def test_host_ngram_tables_are_not_counted_on_the_device():
    """ngram_host keeps the tables in host memory: the device estimate leaves them out, and says so."""
    tokenid = {"layers": [0, 2], "ngram_orders": [2, 3], "ngram_heads": 2, "ngram_rows": 64}
    fields = dict(vocab_size=96, d_model=64, n_layers=3, n_heads=4, max_seq_len=32)
    cfgs = [
        {"model": {"model": fields, "plugins": {"tokenid": {**tokenid, "ngram_host": host}}},
         "data": {"batch_size": 1, "seq_len": 8}}
        for host in (False, True)
    ]  # fmt: skip
    device, host = estimate(cfgs[0]), estimate(cfgs[1])
    assert device["params"] - host["params"] == 2 * (2 * 2) * 64 * 64  # 2 layers x 4 heads' tables of 64 x d
    assert any("host memory" in note for note in host["notes"])
