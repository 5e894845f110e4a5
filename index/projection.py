"""The narrow embedding: a PCA fitted at each rebuild, so the index holds m dims instead of d_model: y =
normalise(V_m^T x), V_m the top-m eigenvectors of the second moments X^T X of a sample. Not centred: the
search ranks by inner products of unit vectors, and centring drops the shared mean direction's part of x . y
(benchmarks/narrow_embedding.py); Projection.mean stays in the format, zero. Stored beside the index and in
its embedder identity, so an index is searched with its own."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

PROJECTION = "projection.npz"  # beside an index; absent: the index is full width
SAMPLE = 65_536  # vectors the PCA is fitted on: a stable D x D covariance's top few hundred directions
APPLY_CHUNK = 65_536  # rows narrowed at a time (bounds the centred full-width copy)
AUTO_DIM = 256  # index_dim 'auto' narrows to this width (half the embedding width where that is smaller)


@dataclass(frozen=True)
class Projection:
    """A PCA projection (n, D) -> (n, m) unit vectors: normalise((x - mean) @ components.T)."""

    mean: np.ndarray  # (D,) float32 mean subtracted first
    components: np.ndarray  # (m, D) float32 orthonormal rows: the top-m principal directions, largest first

    @property
    def in_dim(self) -> int:
        """Width D of the vectors it takes."""
        return int(self.components.shape[1])

    @property
    def dim(self) -> int:
        """Width m of the vectors it gives."""
        return int(self.components.shape[0])

    def apply(self, x: np.ndarray) -> np.ndarray:
        """(n, D) vectors -> (n, m) float32 unit vectors (n may be 0)."""
        x = np.asarray(x, dtype=np.float32)
        if len(x) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.in_dim:
            raise ValueError(
                f"vectors of shape {x.shape} given to an index projection from {self.in_dim} to {self.dim} dims: "
                "the queries must come from the embedder that built the index (full width, before projection)"
            )
        y = np.empty((len(x), self.dim), dtype=np.float32)
        for lo in range(0, len(x), APPLY_CHUNK):
            part = (x[lo : lo + APPLY_CHUNK] - self.mean) @ self.components.T  # (chunk, m)
            y[lo : lo + APPLY_CHUNK] = part / np.maximum(np.linalg.norm(part, axis=1, keepdims=True), 1e-12)
        return y

    def identity(self) -> dict[str, Any]:
        """{"in_dim", "dim", "sha" of mean and components}: recorded in the index's embedder identity."""
        h = hashlib.sha256(np.ascontiguousarray(self.mean, np.float32).tobytes())
        h.update(np.ascontiguousarray(self.components, np.float32).tobytes())
        return {"in_dim": self.in_dim, "dim": self.dim, "sha": h.hexdigest()[:16]}

    def save(self, directory: Path) -> None:
        """Write PROJECTION into `directory` (an index directory being written)."""
        with open(Path(directory) / PROJECTION, "wb") as f:  # a file object: numpy adds no suffix
            np.savez(f, mean=self.mean, components=self.components)


def load_projection(directory: str | Path) -> Projection | None:
    """The projection stored in an index directory, None for a full-width index."""
    path = Path(directory) / PROJECTION
    if not path.exists():
        return None
    with np.load(path) as f:
        return Projection(f["mean"].astype(np.float32), f["components"].astype(np.float32))


def with_projection(identity: dict[str, Any], projection: Projection | None) -> dict[str, Any]:
    """The embedder identity of the vectors an index holds: the embedder's, and the projection applied to them."""
    return {**identity, "projection": None if projection is None else projection.identity()}


def index_width(setting: int | str | None, width: int | None, rows: int, above: int) -> int | None:
    """The width m the index narrows to (None: full width) for index_dim `setting`, vectors `width` wide (None: not
    known yet) and `rows` indexed segments: 'auto' is min(AUTO_DIM, width // 2) from `above` rows, else full width."""
    if setting is None or (setting == "auto" and rows < above):
        return None
    m = setting if setting != "auto" else (AUTO_DIM if width is None else min(AUTO_DIM, width // 2))
    if width is not None and m >= width:
        raise ValueError(f"index_dim={m} must be below the embedding width {width}")
    return m


def sample_rows(n: int, size: int) -> np.ndarray:
    """Up to `size` of n row positions, evenly spaced (deterministic: the same rows on every run)."""
    if n <= size:
        return np.arange(n)
    return np.linspace(0, n - 1, size).astype(np.int64)


def fit_pca(sample: np.ndarray, m: int) -> Projection:
    """The top-m principal directions of a (n, D) sample without centring, each signed so its largest-magnitude
    entry is positive, with a zero mean."""
    x = torch.from_numpy(np.ascontiguousarray(sample, dtype=np.float32))
    n, D = x.shape
    if not 1 <= m < D:
        raise ValueError(f"a PCA to m={m} dims needs 1 <= m < {D}, the vectors' width")
    if n < 2:
        raise ValueError(f"a PCA needs at least 2 vectors, got {n}")
    cov = (x.T @ x).double()  # (D, D) second moments: a float32 product, the eigensolver in float64
    _, vectors = torch.linalg.eigh(cov)  # ascending eigenvalues
    top = vectors[:, -m:].flip(1).T  # (m, D) largest first
    sign = torch.sign(top.gather(1, top.abs().argmax(1, keepdim=True)))  # (m, 1)
    return Projection(np.zeros(D, dtype=np.float32), (top * sign).float().numpy())  # not centred


def fit_projection(vectors: np.ndarray, m: int) -> Projection:
    """fit_pca on up to SAMPLE evenly spaced rows of (n, D) vectors (one process)."""
    return fit_pca(vectors[sample_rows(len(vectors), SAMPLE)], m)
