"""The plugin contract: registry, slot claims and conflicts, context, parameter groups, ordering."""

import re
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from rlm.model import ModelConfig, Transformer
from rlm.plugin import Claim, Context, Mode, Plugin, Slot, known_plugins, make_config, resolve
from rlm.plugin.registry import validate_specs
from rlm.train.module import LMModule

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, max_seq_len=32)
EVERY = "everyslot_plugin.EverySlotPlugin"


@dataclass
class _FFNConfig:
    layers: list[int] = field(default_factory=lambda: [1])


class _ReplaceFFN(Plugin):
    """Replaces the FFN with a zero map at its layers."""

    name = "replace_ffn"
    Config = _FFNConfig

    def claims(self):
        return [Claim(Slot.FFN, Mode.REPLACE, tuple(self.config.layers))]

    def build(self, claim, layer, current):
        return _Zero()


class _Zero(nn.Module):
    def forward(self, x, ctx):
        return torch.zeros_like(x)


def test_registry_lists_known_and_rejects_unknown():
    assert "tokenid" in known_plugins()
    with pytest.raises(ValueError, match=r"unknown plugin 'nope'; known plugins: \[.*'tokenid'"):
        resolve("nope")


def test_class_path_resolution_and_bad_class_path():
    assert resolve("anything", EVERY).name == "everyslot"
    with pytest.raises(ValueError, match="cannot import plugin class_path"):
        resolve("x", "no.such.module.Plugin")
    with pytest.raises(ValueError, match="not a subclass of rlm.plugin.Plugin"):
        resolve("x", "torch.nn.Linear")


def test_unknown_option_lists_accepted_fields():
    accepted = (
        "['layers', 'rank', 'init_std', 'ngram_orders', 'ngram_heads', 'ngram_rows', 'ngram_seed', "
        + ("'ngram_gate', 'placement', 'ngram_host', 'ngram_host_lr']")
    )
    with pytest.raises(ValueError, match=re.escape(f"unknown option(s) ['rnak']; accepted: {accepted}")):
        Transformer(CFG, {"tokenid": {"rnak": 2}})
    problems = validate_specs({"tokenid": {"rnak": 2}, "nope": {}, "ok": None})
    assert len(problems) == 2
    assert problems[0].startswith(f"plugin 'tokenid': unknown option(s) ['rnak']; accepted: {accepted} (")
    assert "git log -S rnak" in problems[0]  # where an option an older rlm had went
    assert problems[1] == f"unknown plugin 'nope'; known plugins: {known_plugins()} (or give a class_path)"


@dataclass
class _ChoiceConfig:
    kind: Literal["a", "b"] = "a"
    auto: bool | Literal["auto"] = "auto"
    maybe: Literal["x", "y"] | None = None


class _Choices(_ReplaceFFN):
    name = "choices"
    Config = _ChoiceConfig


def test_literal_options_outside_their_choices_are_refused_without_jsonargparse():
    """make_config (checkpoints, Python users) checks what jsonargparse checks on the command line: a Literal option's
    value, also in a union, from a dict or in an instance."""
    assert make_config(_Choices, {"kind": "b", "auto": False, "maybe": "y"}) == _ChoiceConfig("b", False, "y")
    for bad, message in [
        ({"kind": "c"}, "option kind must be one of ('a', 'b'), got 'c'"),
        ({"auto": "true"}, "option auto must be one of ('auto',) or bool, got 'true'"),
        ({"maybe": "z"}, "option maybe must be one of ('x', 'y') or null, got 'z'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"plugin 'choices': {message}")):
            make_config(_Choices, bad)
    with pytest.raises(ValueError, match="option kind must be one of"):
        make_config(_Choices, _ChoiceConfig(kind="c"))


def test_layer_validation():
    with pytest.raises(ValueError, match="layer 5 is out of range for a model of 3 layers"):
        Transformer(CFG, {"tokenid": {"layers": [5]}})
    with pytest.raises(ValueError, match="must be a list of integers"):
        Transformer(CFG, {"tokenid": {"layers": "1,2"}})


def test_conflicting_replace_claims_name_both_plugins_and_the_layer():
    spec = {
        "a": {"class_path": f"{__name__}._ReplaceFFN", "init_args": {"layers": [0, 2]}},
        "b": {"class_path": f"{__name__}._ReplaceFFN", "init_args": {"layers": [2]}},
    }
    with pytest.raises(ValueError, match="plugins 'a' and 'b' both replace the ffn slot of layer 2"):
        Transformer(CFG, spec)


def test_every_slot_is_filled_and_called():
    model = Transformer(CFG, {"every": {"class_path": EVERY, "init_args": {"layers": [1]}}})
    assert model.blocks[1].cross_attn is not None and model.blocks[1].cross_norm is not None
    assert model.blocks[0].cross_attn is None
    ctx = Context(tokens=torch.randint(0, 64, (2, 8)))
    model(ctx.tokens, ctx)
    calls = ctx.extras["calls"]
    expected = {
        "embed:replace",
        "embed:add",
        "stack:wrap",
        "attn:wrap@1",
        "cross_attn:replace@1",
        "ffn:add@1",
        "ffn:wrap@1",
    }
    assert set(calls) == expected
    assert calls.index("stack:wrap") < calls.index("attn:wrap@1") < calls.index("cross_attn:replace@1")
    assert "everyslot" in ctx.aux_losses and "everyslot_norm" in ctx.metrics


def test_absent_cross_attention_cannot_be_wrapped():
    class _WrapCross(_ReplaceFFN):
        def claims(self):
            return [Claim(Slot.CROSS_ATTN, Mode.WRAP, (0,))]

    globals()["_WrapCross"] = _WrapCross
    with pytest.raises(
        ValueError, match="wants to wrap the cross_attn slot of layer 0, which no plugin fills"
    ):
        Transformer(CFG, {"w": {"class_path": f"{__name__}._WrapCross"}})


def test_claim_validation():
    with pytest.raises(ValueError, match="model-wide and takes no layers"):
        Claim(Slot.STACK, Mode.WRAP, (0,))
    with pytest.raises(ValueError, match="needs a non-empty list of layers"):
        Claim(Slot.FFN, Mode.ADD, ())


def test_build_order_does_not_depend_on_config_order():
    a = {"tokenid": {"layers": [0], "rank": 2}, "every": {"class_path": EVERY}}
    b = dict(reversed(list(a.items())))
    torch.manual_seed(1)
    m1 = Transformer(CFG, a)
    torch.manual_seed(1)
    m2 = Transformer(CFG, b)
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert list(s1) == list(s2)
    for k in s1:
        assert_close(s1[k], s2[k])


def test_disabled_plugin_is_skipped():
    model = Transformer(CFG, {"tokenid": None})
    assert len(model.plugins) == 0 and model.added_parameters() == 0


def test_context_aux_losses_sum_and_weights():
    ctx = Context(tokens=torch.zeros(1, 2, dtype=torch.long))
    ctx.add_loss("x", torch.tensor(1.0), 0.5)
    ctx.add_loss("x", torch.tensor(2.0), 0.5)
    ctx.add_loss("y", torch.tensor(4.0), 0.25)
    assert_close(ctx.total_aux_loss(), torch.tensor(2.5))
    with pytest.raises(ValueError, match="weights 0.5 and 1.0"):
        ctx.add_loss("x", torch.tensor(1.0), 1.0)
    assert Context(tokens=torch.zeros(1, 2, dtype=torch.long)).total_aux_loss() is None


def test_lm_module_honours_plugin_groups_and_aux_loss():
    module = LMModule(CFG, {"every": {"class_path": EVERY}})
    groups = {g["name"]: g for g in module.parameter_groups()}
    gain = module.model.plugins["every"].gain
    assert [p for p in groups["everyslot_gain"]["params"]] == [gain]
    assert groups["everyslot_gain"]["lr"] == 1e-4 and groups["everyslot_gain"]["schedule"] is False
    assert all(p is not gain for g in ("decay", "no_decay") for p in groups[g]["params"])
    # Norm weights and embeddings are not decayed; matrices are.
    no_decay = {id(p) for p in groups["no_decay"]["params"]}
    assert id(module.model.norm.weight) in no_decay and id(module.model.head.weight) in no_decay
    assert id(module.model.blocks[0].attn.inner.qkv.weight) not in no_decay
    n_grouped = sum(len(g["params"]) for g in groups.values())
    assert n_grouped == len(list(module.model.parameters()))
    batch = {"tokens": torch.randint(0, 64, (2, 8)), "targets": torch.randint(0, 64, (2, 8))}
    lm, total, ctx, n = module._loss(batch, "train")
    assert ctx.extras["everyslot"] == {"prepared": True}
    value, weight = ctx.aux_losses["everyslot"]
    assert_close(total, lm + weight * value)
    assert n == 16


def test_adamw_is_fused_where_torch_can_and_takes_the_for_loops_step():
    from rlm.train.module import fused_adamw

    module = LMModule(CFG, {"every": {"class_path": EVERY}})
    assert module.configure_optimizers()["optimizer"].defaults["fused"] is True  # fp32 on CPU: auto is fused
    assert fused_adamw(None, [torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)])
    assert not fused_adamw(
        None, [torch.zeros(2), torch.zeros(2, dtype=torch.long)]
    )  # torch has no int kernel
    assert not fused_adamw(None, [torch.zeros(2, device="meta")]) and not fused_adamw(None, [])
    assert fused_adamw(False, [torch.zeros(2)]) is False and fused_adamw(True, []) is True
    off = LMModule(CFG, {"every": {"class_path": EVERY}}, {"fused": False})
    assert off.configure_optimizers()["optimizer"].defaults["fused"] is False
    # The same update as the for-loop to rounding: three steps on equal weights and gradients, both groups'
    # decay and the plugin group's own lr included.
    off.load_state_dict(module.state_dict())
    before = [p.detach().clone() for p in module.parameters()]
    opts = [m.configure_optimizers()["optimizer"] for m in (module, off)]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in module.parameters()]
        for m, opt in zip((module, off), opts):
            for p, grad in zip(m.parameters(), grads):
                p.grad = grad.clone()
            opt.step()
    for a, b in zip(module.parameters(), off.parameters()):
        assert_close(a, b)
    assert all(not torch.equal(a, b) for a, b in zip(module.parameters(), before))  # and the steps moved them


def test_parameter_accounting():
    model = Transformer(CFG, {"tokenid": {"layers": [0, 1], "rank": 0}})
    assert model.added_parameters() == 2 * 64 * 32
    assert model.active_parameters() == model.num_parameters() - 2 * 63 * 32


def test_synced_parameters_get_optimizer_groups_of_their_own_and_a_mixed_plugin_group_is_refused(monkeypatch):
    """PKM's sub-keys (synced_parameters when sparse) sit in decay/synced on one process too, so the optimizer
    state has the groups FSDP2 needs (foreach and fused kernels refuse plain tensors beside DTensors); a plugin
    group mixing synced parameters with others is an error naming the group."""
    from rlm.plugin.base import ParamGroup
    from rlm.plugins.pkm import PKMPlugin

    pkm = {"layers": [0], "n_keys": 8, "heads": 2, "topk": 4, "k_dim": 12}
    module = LMModule(CFG, {"pkm": pkm})
    keys = module.model.plugins["pkm"].memories[0].keys
    groups = {g["name"]: g for g in module.configure_optimizers()["optimizer"].param_groups}
    assert [p is keys for p in groups["decay/synced"]["params"]] == [True]
    assert not any(p is keys for name, g in groups.items() if name != "decay/synced" for p in g["params"])
    assert groups["decay/synced"]["weight_decay"] == groups["decay"]["weight_decay"] > 0
    assert "decay/synced" not in {
        g["name"] for g in LMModule(CFG, {"pkm": {**pkm, "sparse": False}}).parameter_groups()
    }

    def mixed(self):
        self.resolve_sparse(
            distributed=False
        )  # as PKM's own param_groups does: sparse, so the sub-keys are synced
        memory = self.memories[0]
        return [ParamGroup(name="pkm_mixed", params=[memory.keys, memory.query.weight])]

    monkeypatch.setattr(PKMPlugin, "param_groups", mixed)
    with pytest.raises(ValueError, match="'pkm_mixed' mixes synced_parameters"):
        LMModule(CFG, {"pkm": pkm}).parameter_groups()
