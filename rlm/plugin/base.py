"""The plugin contract: what a memory plugin declares and what the core asks of it.

A plugin is one class with a typed ``Config``; it claims slots at layers and builds a module per claim. Under
incremental decoding (``ctx.cache``) a forward sees only positions ``ctx.offset..ctx.offset + T - 1``: a module
that depends on earlier positions keeps what it needs in ``ctx.cache.state[label]``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor, nn

from rlm.plugin.context import Context

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from rlm.model.config import ModelConfig


class Slot(str, enum.Enum):
    """Named places in the model that plugins fill."""

    EMBED = "embed"  # token embedding, tokens (B, T) -> (B, T, d); whole model, no layer
    ATTN = "attn"  # self-attention of block i, (B, T, d) -> (B, T, d)
    CROSS_ATTN = "cross_attn"  # cross-attention of block i, absent by default, added to the residual
    FFN = "ffn"  # FFN of block i, (B, T, d) -> (B, T, d)
    STACK = "stack"  # the loop over blocks, (B, T, d) -> (B, T, d); whole model, no layer


LAYERLESS = (Slot.EMBED, Slot.STACK)


class Mode(str, enum.Enum):
    """How a claim fills its slot."""

    REPLACE = "replace"  # the plugin's module takes the slot's place; exclusive
    ADD = "add"  # the plugin's module runs beside the slot's on the same input; outputs are summed
    WRAP = "wrap"  # the plugin's module receives the slot's current module and calls it itself


@dataclass(frozen=True)
class Claim:
    """A plugin's claim on one slot at some layers (None for whole-model slots)."""

    slot: Slot
    mode: Mode
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "slot", Slot(self.slot))
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.slot in LAYERLESS and self.layers is not None:
            raise ValueError(f"slot {self.slot.value!r} is model-wide and takes no layers, got {self.layers}")
        if self.slot not in LAYERLESS:
            if not self.layers:
                raise ValueError(f"slot {self.slot.value!r} needs a non-empty list of layers")
            object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))


@dataclass
class ParamGroup:
    """An optimizer parameter group a plugin asks for; None fields inherit the module's optimizer settings."""

    name: str
    params: list[nn.Parameter]
    lr: float | None = None
    weight_decay: float | None = None
    schedule: bool = True  # whether the warmup + cosine scales this group's learning rate


class Plugin(nn.Module):
    """Base class of every plugin: subclasses set ``name`` and ``Config`` and implement ``claims`` and ``build``.
    An ``nn.Module`` owned by the model, so state shared across layers lives on it and is checkpointed."""

    name: ClassVar[str] = ""  # the short name in configs and the registry
    # the options' dataclass, validating itself in __post_init__; a ``memory`` method (rlm.model.memory.MemoryFormula)
    # gives the memory estimate the plugin's terms
    Config: ClassVar[type] = object
    # plugins are built in ascending (order, name), whatever order configs list them in
    order: ClassVar[int] = 100

    def __init__(self, config: Any, model_config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model_config = model_config
        self.label = self.name  # the key under model.plugins; set by the assembler

    def claims(self) -> list[Claim]:
        """The slots this plugin takes."""
        raise NotImplementedError

    def build(self, claim: Claim, layer: int | None, current: nn.Module | None) -> nn.Module:
        """Build the module for ``claim`` at ``layer``, called as ``module(x, ctx)`` (embedding: ``(tokens,
        ctx)``). ``current`` is the slot's module now (None for an absent cross-attention): REPLACE takes its
        place, ADD runs beside it, WRAP must call it."""
        raise NotImplementedError

    # Optional parts of the contract; defaults do nothing.

    def prepare(self, ctx: Context, batch: dict[str, Any]) -> None:
        """Fill ``ctx.extras[self.name]`` from the batch before forward."""

    def objective(self, ctx: Context, hidden: Tensor, logits: Tensor, targets: Tensor) -> Tensor | None:
        """The training loss in place of the LM's cross-entropy, from the final normed states (B, T, d), the
        logits (B, T, V) and the targets (B, T; -100 ignored); None: cross-entropy. One plugin at most. Ignored
        outside training, so ``val/loss`` stays comparable."""
        return None

    def param_groups(self) -> list[ParamGroup]:
        """Optimizer groups for this plugin's parameters; parameters not listed use the default groups."""
        return []

    def callbacks(self) -> list[pl.Callback]:
        """Lightning callbacks this plugin needs."""
        return []

    def inactive_parameters(self) -> int:
        """Parameters of this plugin that a single token does not use (for 'active parameters per token')."""
        return 0

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters FSDP2 must leave whole and unreduced on every rank: the plugin updates them and keeps the
        replicas equal itself (PKM's row-wise Adam). Asked when the model is sharded, after callbacks' ``setup``."""
        return []

    def synced_parameters(self) -> list[nn.Parameter]:
        """Parameters the main optimizer trains that FSDP2 leaves whole on every rank, small enough that an
        all-reduce of their gradient beats FSDP2's gathers (PKM's sub-keys); rlm averages their gradients."""
        return []

    def attach(self, model: nn.Module) -> None:
        """Called once after every plugin has been built, with the assembled model."""

    def eval_variants(self) -> list[str]:
        """Extra evaluation passes: validation runs every batch again with ``ctx.variant`` set to each name and
        logs ``val/<name>/loss``."""
        return []


def make_config(plugin_cls: type[Plugin], args: Any) -> Any:
    """Build ``plugin_cls.Config`` from a dict (or take an instance), rejecting unknown keys and ``Literal`` options
    outside their choices; the Config checks the rest itself."""
    from rlm.model.config import check_choices  # here: rlm.model imports this module

    cls, where = plugin_cls.Config, f"plugin {plugin_cls.name!r}"
    if isinstance(args, cls):
        check_choices(cls, vars(args), where)
        return args
    args = dict(args or {})
    known = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(
            f"{where}: unknown option(s) {unknown}; accepted: {known} (a checkpoint or config of an "
            f"older rlm may name an option since removed: `git log -S {unknown[0]}` says what became of it)"
        )
    check_choices(cls, args, where)
    return cls(**args)


def check_layers(name: str, layers: Sequence[int], n_layers: int) -> tuple[int, ...]:
    """Validate a typed layer list against the model depth; negative indices count from the end."""
    if isinstance(layers, str) or not isinstance(layers, Iterable):
        raise ValueError(f"plugin {name!r}: layers must be a list of integers such as [1, 3], got {layers!r}")
    out = []
    for i in layers:
        if not isinstance(i, int) or not -n_layers <= i < n_layers:
            raise ValueError(
                f"plugin {name!r}: layer {i!r} is out of range for a model of {n_layers} layers "
                f"(accepted: 0..{n_layers - 1} or -{n_layers}..-1)"
            )
        out.append(i % n_layers)
    if len(set(out)) != len(out):
        raise ValueError(f"plugin {name!r}: layer list {list(layers)} repeats a layer")
    return tuple(sorted(out))
