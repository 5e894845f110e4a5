"""Typed configuration of the core transformer, and the check of a config's ``Literal`` choices."""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints


@functools.cache
def _choices(cls: type) -> dict[str, tuple[tuple[Any, ...], tuple[type, ...]]]:
    """Each ``Literal``-typed field of dataclass ``cls`` (also in a union): its choices, and the union's other types."""
    out = {}
    for name, hint in get_type_hints(cls).items():
        arms = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
        choices = tuple(c for arm in arms if get_origin(arm) is Literal for c in get_args(arm))
        if choices:
            out[name] = choices, tuple(arm for arm in arms if isinstance(arm, type))
    return out


def check_choices(cls: type, values: Mapping[str, Any], where: str) -> None:
    """Raise ValueError for a value of a ``Literal``-typed field of ``cls`` outside its choices (and the union's other
    types): jsonargparse's check, for configs built in Python or read from a checkpoint."""
    for name, (choices, others) in _choices(cls).items():
        if name in values and (value := values[name]) not in choices and not isinstance(value, others):
            also = "".join(" or null" if t is type(None) else f" or {t.__name__}" for t in others)
            raise ValueError(f"{where}: option {name} must be one of {choices}{also}, got {value!r}")


@dataclass
class ModelConfig:
    """Shape of the pre-norm decoder-only transformer."""

    vocab_size: int = 4096
    """Size of the token vocabulary (linked from the data module's tokenizer)."""
    vocab_multiple: int = 1
    """Pad the embedding table and the output head to a multiple of this many rows (128 on a GPU: GEMMs at an odd
    vocabulary are slow); the logits are cut back to vocab_size, so nothing ever sees a padded id."""
    d_model: int = 256
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Number of attention heads; must divide d_model."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads."""
    ffn: Literal["gated", "plain"] = "gated"
    """FFN kind: 'gated' (SwiGLU) or 'plain' (GELU MLP)."""
    d_ff: int | None = None
    """Hidden width of the FFN; None means 4*d_model (plain) or 8/3*d_model rounded to 64 (gated)."""
    max_seq_len: int = 1024
    """Longest sequence the rotary cache covers."""
    rope_base: float = 10000.0
    """Rotary frequency base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head."""
    dropout: float = 0.0
    """Dropout on attention and FFN outputs."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation."""

    def __post_init__(self) -> None:
        check_choices(ModelConfig, vars(self), "model")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "vocab_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}; "
                f"divisors of {self.d_model} up to 64: {[h for h in range(1, 65) if self.d_model % h == 0]}"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"head size d_model/n_heads={self.d_model // self.n_heads} must be even for rotary positions"
            )
        kv = self.kv_heads
        if kv <= 0 or self.n_heads % kv:
            raise ValueError(
                f"model.n_kv_heads={self.n_kv_heads} must be positive and divide n_heads={self.n_heads}"
            )
        if self.d_ff is not None and self.d_ff <= 0:
            raise ValueError(f"model.d_ff must be positive or null, got {self.d_ff}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding table and the output head: vocab_size rounded up to vocab_multiple."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads actually used."""
        return self.n_kv_heads or self.n_heads

    @property
    def hidden(self) -> int:
        """Hidden width of the dense FFN."""
        if self.d_ff is not None:
            return self.d_ff
        if self.ffn == "plain":
            return 4 * self.d_model
        # SwiGLU at 2/3 of 4d keeps the parameter count of a plain 4d MLP (Shazeer 2020).
        return 64 * ((8 * self.d_model // 3 + 63) // 64)
