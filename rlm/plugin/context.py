"""The per-step context passed through forward: inputs plugins may read, and what they report back (never module
state, which breaks under activation checkpointing, DDP and torch.compile)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from rlm.plugin.cache import KVCache


@dataclass
class Context:
    """Per-step values travelling with one forward pass."""

    tokens: Tensor  # input token ids (B, T)
    mask: Tensor | None = None  # (B, T) True at real (non-padding) positions; None: every position is real
    stage: str = "train"  # 'train', 'val', 'test' or 'predict'
    segment_ids: Tensor | None = None  # (B, T // segment_len) global ids of each row's segments; -1: padding
    doc_ids: Tensor | None = None  # (B,) document id of each row
    # the segment table (rlm.data.SegmentTable) the ids index: the batch's own text; None in generation
    segments: Any = None
    offset: int = 0  # position of tokens[:, 0] in its sequence (incremental decoding)
    # incremental decoding: keys, values and plugin state of positions 0..offset-1; None: the whole sequence
    cache: KVCache | None = None
    extras: dict[str, Any] = field(default_factory=dict)  # per-step values owned by plugins, by plugin name
    # auxiliary losses, name -> (value, weight), added to the LM loss as weight * value
    aux_losses: dict[str, tuple[Tensor, float]] = field(default_factory=dict)
    metrics: dict[str, Tensor] = field(default_factory=dict)  # detached scalars to log, name -> value
    # per-token groups of the evaluation loss, name -> bool mask (B, T), logged as val/loss_by/<name>; the same
    # names on every batch (DDP reduces them by name)
    loss_groups: dict[str, Tensor] = field(default_factory=dict)
    hidden: Tensor | None = None  # the last forward's final normed states (B, T, d), for Plugin.objective
    variant: str | None = None  # the evaluation variant of this forward (Plugin.eval_variants)
    # training: makes the next step's batch on the host (rlm's loader), for work a plugin starts a step ahead
    upcoming: Callable[[], dict[str, Any]] | None = None

    @property
    def training(self) -> bool:
        return self.stage == "train"

    def valid_mask(self) -> Tensor:
        """The (B, T) bool padding mask, all True without padding."""
        return torch.ones_like(self.tokens, dtype=torch.bool) if self.mask is None else self.mask

    def add_loss(self, name: str, value: Tensor, weight: float = 1.0) -> None:
        """Add an auxiliary loss; values under one name (for example one per layer) are summed."""
        if name in self.aux_losses:
            prev, w = self.aux_losses[name]
            if w != weight:
                raise ValueError(f"aux loss {name!r} added with weights {w} and {weight}")
            value = prev + value
        self.aux_losses[name] = (value, weight)

    def log(self, name: str, value: Tensor | float) -> None:
        """Record a metric (detached)."""
        self.metrics[name] = (
            value.detach().float() if isinstance(value, Tensor) else torch.tensor(float(value))
        )

    def total_aux_loss(self) -> Tensor | None:
        """Sum of weight * value over all auxiliary losses, or None when there are none."""
        total = None
        for value, weight in self.aux_losses.values():
            term = weight * value
            total = term if total is None else total + term
        return total
