"""The state of incremental decoding: one window of a batch (positions 0..length-1, at most ``capacity``), as
``ctx.cache`` with ``ctx.offset`` at its length; plugins keep what they carry between steps in ``state[label]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class KVCache:
    """Keys and values of every self-attention layer for one window, preallocated to ``capacity`` positions."""

    def __init__(self, capacity: int, batch: int = 1, device: torch.device | str | None = None) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"cache capacity must be a positive integer, got {capacity!r}")
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"cache batch must be a positive integer, got {batch!r}")
        self.capacity, self.batch = capacity, batch
        self.length = 0  # positions filled so far: the offset of the next forward's first token
        self.tokens = torch.zeros(batch, capacity, dtype=torch.long, device=device)  # (B, capacity)
        # layer -> keys and values (B, n_kv_heads, capacity, head_dim), allocated at the layer's first write
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}
        self.state: dict[str, Any] = {}  # plugin label -> what it carries between steps

    def check(self, offset: int, tokens: Tensor) -> None:
        """Refuse a forward that does not continue the cache exactly, or would overflow it."""
        B, T = tokens.shape
        if B != self.batch:
            raise ValueError(f"a cache of batch {self.batch} got tokens of batch {B}")
        if offset != self.length:
            raise ValueError(
                f"ctx.offset={offset}, but the cache holds {self.length} positions; they must match"
            )
        if offset + T > self.capacity:
            raise ValueError(
                f"{T} new tokens at offset {offset} overflow the cache of {self.capacity} positions; "
                "start a new cache (generation re-fills the last part of the window, see rlm.eval.generate)"
            )

    def history(self, offset: int, tokens: Tensor) -> Tensor:
        """The window's tokens up to and including the new ones, (B, offset + T)."""
        return torch.cat([self.tokens[:, :offset], tokens], dim=1)

    def update(self, layer: int, k: Tensor, v: Tensor, offset: int) -> tuple[Tensor, Tensor]:
        """Write the new keys and values (B, nkv, T, hs) at offset; return all of them so far (B, nkv, offset+T, hs)."""
        if layer not in self.kv:
            B, nkv, _, hs = k.shape
            shape = (B, nkv, self.capacity, hs)
            self.kv[layer] = (k.new_empty(shape), v.new_empty(shape))
        keys, values = self.kv[layer]
        end = offset + k.shape[2]
        keys[:, :, offset:end] = k
        values[:, :, offset:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, offset: int, tokens: Tensor) -> None:
        """Record the tokens of a finished forward and move the length past them."""
        end = offset + tokens.shape[1]
        self.tokens[:, offset:end] = tokens
        self.length = end


def refill_start(length: int, start: int, window: int) -> int:
    """The cached path's window start for a sequence of ``length`` tokens whose current window starts at ``start``:
    unchanged while the window holds at most ``window`` tokens, else the last ``window // 2`` tokens."""
    return start if length - start <= window else length - max(window // 2, 1)
