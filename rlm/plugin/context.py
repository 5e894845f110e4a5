"""The per-step context passed through forward: inputs plugins may read, and what they report back.

Plugins never keep per-step values on modules (that breaks under activation checkpointing, DDP and torch.compile).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from rlm.plugin.cache import KVCache


@dataclass
class Context:
    """Per-step values travelling with one forward pass."""

    tokens: Tensor
    """Input token ids, (B, T)."""
    mask: Tensor | None = None
    """True at real (non-padding) positions, (B, T); None means every position is real."""
    stage: str = "train"
    """One of 'train', 'val', 'test', 'predict'."""
    segment_ids: Tensor | None = None
    """Global ids of the fixed-length segments covered by each row, (B, T // segment_len); -1 for padding."""
    doc_ids: Tensor | None = None
    """Document id of each row, (B,)."""
    segments: Any = None
    """The segment table (rlm.data.SegmentTable) segment_ids and doc_ids index: the batch's own text, not
    necessarily the training corpus; None when the batch names no segments (generation)."""
    offset: int = 0
    """Position of tokens[:, 0] within its sequence (for incremental decoding)."""
    cache: KVCache | None = None
    """Incremental decoding: keys, values and plugin state of positions 0..offset-1; the forward appends its
    own. None: the tokens are the whole sequence."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Per-step values owned by plugins, keyed by plugin name (for example the batch's neighbours)."""
    aux_losses: dict[str, tuple[Tensor, float]] = field(default_factory=dict)
    """Auxiliary losses: name -> (value, weight). Added to the LM loss as weight * value."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """Detached scalars to log, name -> value."""
    loss_groups: dict[str, Tensor] = field(default_factory=dict)
    """Per-token groups of the evaluation loss, name -> bool mask (B, T): validation logs the token-weighted loss
    of each as ``val/loss_by/<name>``. Declare the same names on every batch (DDP reduces them by name)."""
    hidden: Tensor | None = None
    """The final normed states (B, T, d) of the last forward, for Plugin.objective."""
    variant: str | None = None
    """The evaluation variant this forward computes (see Plugin.eval_variants); None for the model as it is."""

    @property
    def training(self) -> bool:
        """Whether this is a training step."""
        return self.stage == "train"

    def valid_mask(self) -> Tensor:
        """The padding mask as a (B, T) bool tensor, all True when there is no padding."""
        if self.mask is None:
            return torch.ones_like(self.tokens, dtype=torch.bool)
        return self.mask

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
        if isinstance(value, Tensor):
            value = value.detach().float()
        else:
            value = torch.tensor(float(value))
        self.metrics[name] = value

    def total_aux_loss(self) -> Tensor | None:
        """Sum of weight * value over all auxiliary losses, or None when there are none."""
        total = None
        for value, weight in self.aux_losses.values():
            term = weight * value
            total = term if total is None else total + term
        return total
