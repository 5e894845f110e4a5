"""Seeded clustered unit vectors: the test and benchmark data for every index type."""

from __future__ import annotations

import numpy as np


def clustered_unit_vectors(
    n: int, dim: int, n_clusters: int = 100, spread: float = 0.5, seed: int = 0
) -> np.ndarray:
    """(n, dim) float32 L2-normalised gaussian blobs around random unit centres; ``spread``: the noise's norm
    relative to the centre's (std spread/sqrt(dim) per coordinate)."""
    if n <= 0 or dim <= 0 or n_clusters <= 0:
        raise ValueError(
            f"n, dim and n_clusters must be positive, got n={n}, dim={dim}, n_clusters={n_clusters}"
        )
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_clusters, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)  # (C, dim)
    assign = rng.integers(0, n_clusters, size=n)
    x = centres[assign] + rng.standard_normal((n, dim)).astype(np.float32) * (spread / np.sqrt(dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)  # (n, dim)
    return x.astype(np.float32, copy=False)
