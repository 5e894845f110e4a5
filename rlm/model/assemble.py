"""Applying plugins to a model while it is built: ordering, conflict checks, slot filling. Sees the model only
as an ``nn.Module`` with slots, so the import goes one way, transformer -> assemble."""

from __future__ import annotations

from typing import Any

from torch import nn

from rlm.model.layers import RMSNorm
from rlm.plugin.base import LAYERLESS, Claim, Mode, Plugin, Slot, make_config
from rlm.plugin.registry import parse_spec

_MODE_ORDER = {Mode.REPLACE: 0, Mode.ADD: 1, Mode.WRAP: 2}


def check_conflicts(plugins: dict[str, Plugin], n_layers: int) -> list[tuple[Plugin, Claim]]:
    """All claims, validated: exclusive slots, absent slots."""
    claims = [(p, c) for p in plugins.values() for c in p.claims()]
    owner: dict[tuple[Slot, int | None], str] = {}
    for plugin, claim in claims:
        for layer in claim.layers or (None,):
            if layer is not None and not 0 <= layer < n_layers:
                raise ValueError(
                    f"plugin {plugin.label!r} claims layer {layer}; the model has layers 0..{n_layers - 1}"
                )
            if claim.mode is Mode.REPLACE:
                key = (claim.slot, layer)
                if key in owner:
                    where = "" if layer is None else f" of layer {layer}"
                    raise ValueError(
                        f"plugins {owner[key]!r} and {plugin.label!r} both replace the {claim.slot.value} slot{where}; "
                        "use one of them there, or put one beside the other (mode 'add') at that layer"
                    )
                owner[key] = plugin.label
    for plugin, claim in claims:
        if claim.slot is Slot.CROSS_ATTN and claim.mode is not Mode.REPLACE:
            for layer in claim.layers:
                if (Slot.CROSS_ATTN, layer) not in owner:
                    raise ValueError(
                        f"plugin {plugin.label!r} wants to {claim.mode.value} the cross_attn slot of layer {layer}, "
                        "which no plugin fills (cross-attention is absent by default)"
                    )
    claims.sort(key=lambda pc: (_MODE_ORDER[pc[1].mode], pc[0].order, pc[0].label))
    return claims


def _get(model: nn.Module, slot: Slot, layer: int | None) -> nn.Module | None:
    if slot is Slot.EMBED:
        return model.embed.main
    if slot is Slot.STACK:
        return model.stack
    return getattr(model.blocks[layer], slot.value)


def _set(model: nn.Module, slot: Slot, layer: int | None, mode: Mode, module: nn.Module) -> None:
    if slot in LAYERLESS:
        holder, attr = (model.embed, "main") if slot is Slot.EMBED else (model, "stack")
        adds = model.embed.add if slot is Slot.EMBED else None
    else:
        holder, attr = model.blocks[layer], slot.value
        adds = getattr(holder, f"{slot.value}_add")
    if mode is Mode.ADD:
        if adds is None:
            raise ValueError(f"the {slot.value} slot takes no 'add' modules; use 'wrap'")
        adds.append(module)
        return
    setattr(holder, attr, module)
    if slot is Slot.CROSS_ATTN and mode is Mode.REPLACE and holder.cross_norm is None:
        holder.cross_norm = RMSNorm(model.config.d_model, model.config.norm_eps)


def apply_plugins(model: nn.Module, specs: dict[str, Any]) -> None:
    """Instantiate the plugins named in ``specs`` in ascending (``order``, name), whatever order the config files
    listed them in, and fill the model's slots with their modules."""
    entries = []
    for name, spec in specs.items():
        parsed = parse_spec(name, spec)
        if parsed is not None:
            cls, args = parsed
            entries.append((cls.order, name, cls, make_config(cls, args)))
    entries.sort(key=lambda e: (e[0], e[1]))
    plugins: dict[str, Plugin] = {}
    for _, name, cls, cfg in entries:
        plugin = cls(cfg, model.config)
        plugin.label = name
        plugins[name] = model.plugins[name] = plugin
    for plugin, claim in check_conflicts(plugins, model.config.n_layers):
        for layer in claim.layers or (None,):
            current = _get(model, claim.slot, layer)
            module = plugin.build(claim, layer, current)
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"plugin {plugin.label!r} built {type(module).__name__} for {claim}; expected nn.Module"
                )
            _set(model, claim.slot, layer, claim.mode, module)
    for plugin in plugins.values():
        plugin.attach(model)
