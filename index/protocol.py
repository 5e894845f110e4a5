"""The embedder protocol the retriever implements, the batched embedding loop, and a mean-pool embedder."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from rlm.plugin.context import Context


@runtime_checkable
class Embedder(Protocol):
    """Embeds segments for the index and says which weights produced the vectors."""

    def embed_segments(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """(S, N) token ids and (S, N) bool mask (True = real token) -> (S, D) L2-normalised float32."""
        ...

    def embedder_identity(self) -> dict[str, Any]:
        """{"name", "config_hash", "weights_hash", "step"}: recorded in the index, checked on load."""
        ...


def shard_range(n: int, rank: int = 0, world_size: int = 1) -> range:
    """The contiguous block of ids [n*rank/world, n*(rank+1)/world) that `rank` embeds."""
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return range(n * rank // world_size, n * (rank + 1) // world_size)


def embed_all(
    embedder: Embedder,
    segment_tokens_fn: Callable[[np.ndarray], tuple[Tensor, Tensor]],
    n_segments: int,
    batch_size: int = 256,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
) -> np.ndarray:
    """Embed this rank's shard_range of segment ids in batches: float32 (len(shard), D), row j = id shard[j];
    segment_tokens_fn(ids) gives their (b, N) tokens and mask."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    shard = shard_range(n_segments, rank, world_size)
    ids = np.arange(shard.start, shard.stop, dtype=np.int64)
    parts = []
    with torch.no_grad():
        for lo in tqdm(
            range(0, len(ids), batch_size), desc=f"embed[{rank}/{world_size}]", disable=not progress
        ):
            tokens, mask = segment_tokens_fn(ids[lo : lo + batch_size])
            parts.append(embedder.embed_segments(tokens, mask).float().cpu().numpy())
    if not parts:  # an empty shard: its dimension is unknown without embedding something
        return np.zeros((0, 0), dtype=np.float32)
    return np.concatenate(parts).astype(np.float32, copy=False)


class _Stop(Exception):
    """Raised by the capture hook: nothing after the chosen block needs computing."""


def weights_hash(module: nn.Module) -> str:
    """Hash of every parameter and buffer (names, shapes, values) of a module."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class MeanPoolEmbedder:
    """Mean over real tokens of the hidden state after block `layer` of a core Transformer, L2-normalised: a forward
    hook on blocks[layer] captures it (the plugins run as in training) and stops the pass there."""

    def __init__(self, model: nn.Module, layer: int = -1, step: int = 0) -> None:
        n = len(model.blocks)
        if not -n <= layer < n:
            raise ValueError(f"layer={layer} out of range for a model with {n} blocks (use 0..{n - 1} or -1)")
        self.model, self.layer, self.step = model, layer % n, step

    @torch.no_grad()
    def embed_segments(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """(S, N) tokens and mask -> (S, d_model) unit float32 vectors."""
        if tokens.shape != mask.shape or tokens.ndim != 2:
            raise ValueError(
                f"tokens and mask must both be (S, N), got {tuple(tokens.shape)} and {tuple(mask.shape)}"
            )
        device = next(self.model.parameters()).device
        tokens, mask = tokens.to(device), mask.to(device=device, dtype=torch.bool)
        captured: list[Tensor] = []

        def hook(_module: nn.Module, _inputs: Any, output: Tensor) -> None:
            captured.append(output)
            raise _Stop

        handle = self.model.blocks[self.layer].register_forward_hook(hook)
        was_training = self.model.training
        self.model.eval()
        try:
            self.model(tokens, Context(tokens=tokens, mask=mask, stage="predict"))
        except _Stop:
            pass
        finally:
            handle.remove()
            self.model.train(was_training)
        h = captured[0].float()  # (S, N, d)
        w = mask.unsqueeze(-1).float()  # (S, N, 1)
        pooled = (h * w).sum(1) / w.sum(1).clamp(min=1.0)  # (S, d): mean over real tokens
        return torch.nn.functional.normalize(pooled, dim=-1)

    def embedder_identity(self) -> dict[str, Any]:
        """Name, hash of the model config and layer, hash of the weights, training step."""
        config = json.dumps(
            {"model": asdict(self.model.config), "layer": self.layer}, sort_keys=True, default=str
        )
        return {
            "name": f"meanpool@{self.layer}",
            "config_hash": hashlib.sha256(config.encode()).hexdigest()[:16],
            "weights_hash": weights_hash(self.model),
            "step": int(self.step),
        }
