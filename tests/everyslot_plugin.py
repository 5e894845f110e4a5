"""A test plugin that claims every slot in every mode, to exercise the contract end to end."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from rlm.plugin import Claim, Context, Mode, ParamGroup, Plugin, Slot, check_layers


@dataclass
class EverySlotConfig:
    """Options of the every-slot test plugin."""

    layers: list[int] = field(default_factory=lambda: [0])
    """Layers whose attn, cross_attn and ffn slots are claimed."""
    aux_weight: float = 0.5
    """Weight of the plugin's aux loss."""


class _Counted(nn.Module):
    """Calls ``inner`` (if any), adds a learned scale, and counts its calls in the context."""

    def __init__(self, tag: str, d: int, inner: nn.Module | None = None, zero: bool = False) -> None:
        super().__init__()
        self.tag, self.inner = tag, inner
        self.scale = nn.Parameter(torch.zeros(d) if zero else torch.ones(d))

    def forward(self, x, ctx: Context):
        ctx.extras.setdefault("calls", []).append(self.tag)
        y = self.inner(x, ctx) if self.inner is not None else x
        return y * self.scale if y.is_floating_point() else y


class _Embed(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, d)

    def forward(self, tokens, ctx: Context):
        ctx.extras.setdefault("calls", []).append("embed:replace")
        return self.table(tokens)


class EverySlotPlugin(Plugin):
    """Claims embed (replace, add), attn (wrap), cross_attn (replace), ffn (add, wrap), stack (wrap)."""

    name = "everyslot"
    Config = EverySlotConfig

    def __init__(self, config, model_config) -> None:
        super().__init__(config, model_config)
        self.layers = check_layers(self.name, config.layers, model_config.n_layers)
        self.gain = nn.Parameter(torch.ones(()))

    def claims(self):
        L = self.layers
        return [
            Claim(Slot.EMBED, Mode.REPLACE),
            Claim(Slot.EMBED, Mode.ADD),
            Claim(Slot.ATTN, Mode.WRAP, L),
            Claim(Slot.CROSS_ATTN, Mode.REPLACE, L),
            Claim(Slot.FFN, Mode.ADD, L),
            Claim(Slot.FFN, Mode.WRAP, L),
            Claim(Slot.STACK, Mode.WRAP),
        ]

    def build(self, claim, layer, current):
        d = self.model_config.d_model
        tag = f"{claim.slot.value}:{claim.mode.value}" + ("" if layer is None else f"@{layer}")
        if claim.slot is Slot.EMBED and claim.mode is Mode.REPLACE:
            return _Embed(self.model_config.vocab_size, d)
        if claim.slot is Slot.EMBED:  # ADD: a small constant offset per position
            return _Counted(tag, d, inner=_Embed(self.model_config.vocab_size, d), zero=True)
        if claim.mode is Mode.WRAP:
            return _Counted(tag, d, inner=current)
        return _Counted(tag, d, zero=claim.slot is Slot.FFN)

    def prepare(self, ctx: Context, batch) -> None:
        ctx.extras[self.name] = {"prepared": True}

    def param_groups(self):
        return [
            ParamGroup(name="everyslot_gain", params=[self.gain], lr=1e-4, weight_decay=0.0, schedule=False)
        ]

    def attach(self, model) -> None:
        # Register the aux loss through the stack wrapper's output, via a forward hook on the stack.
        plugin = self

        def hook(module, args, output):
            ctx = args[1]
            ctx.add_loss("everyslot", plugin.gain * output.pow(2).mean(), plugin.config.aux_weight)
            ctx.log("everyslot_norm", output.norm())

        model.stack.register_forward_hook(hook)
