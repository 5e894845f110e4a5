"""Near-duplicate documents: word 5-gram shingles, MinHash with LSH banding, exact Jaccard of the candidates.

Lee et al. 2022 ("Deduplicating Training Data Makes Language Models Better") remove documents whose 5-gram shingle
sets have Jaccard >= 0.8, found with MinHash (Broder 1997) and LSH by bands (Leskovec et al., "Mining of Massive
Datasets", ch. 3). Every candidate pair is checked with the exact Jaccard of its shingle sets (64-bit hashes of 5
consecutive words), so no pair below the threshold is grouped; one at it is missed only when no band agrees
(probability < 1e-3 by the choice of band width). Identical shingle sets are always duplicates.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

import numpy as np
from tqdm.auto import tqdm

NGRAM = 5  # words per shingle
NUM_PERM = 128  # MinHash permutations
_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd constant that mixes a shingle's word hashes (polynomial hash)
_CHUNK = 8192  # shingles per MinHash step: bounds the (chunk, num_perm) uint64 temporaries


def shingles(text: str, cache: dict[str, int] | None = None) -> np.ndarray:
    """Sorted unique uint64 hashes of the word 5-grams of ``text`` (of its words when it has fewer than 5);
    ``cache`` (word -> hash) saves rehashing words seen in earlier documents."""
    cache = {} if cache is None else cache
    words = text.split()
    ids = np.empty(len(words), dtype=np.uint64)
    for i, w in enumerate(words):
        h = cache.get(w)
        if h is None:
            digest = hashlib.blake2b(w.encode("utf-8", "surrogatepass"), digest_size=8).digest()
            h = cache[w] = int.from_bytes(digest, "little")
        ids[i] = h
    if len(ids) < NGRAM:
        return np.unique(ids)
    n = len(ids) - NGRAM + 1
    h = ids[:n].copy()
    for j in range(1, NGRAM):
        h = h * _MULT + ids[j : j + n]  # wraps modulo 2**64
    return np.unique(h)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """|a & b| / |a | b| of two sorted unique arrays (1.0 when both are empty)."""
    inter = len(np.intersect1d(a, b, assume_unique=True))
    union = len(a) + len(b) - inter
    return inter / union if union else 1.0


def _minhash(sets: Sequence[np.ndarray], mul: np.ndarray, add: np.ndarray) -> np.ndarray:
    """(len(sets), num_perm) signatures: per permutation, the least ``mul * x + add`` (mod 2**64, mul odd: a
    multiply-shift hash) over the set; empty sets get the max."""
    out = np.full((len(sets), len(mul)), np.iinfo(np.uint64).max, dtype=np.uint64)
    x = np.concatenate(sets) if sets else np.zeros(0, np.uint64)
    owner = np.repeat(np.arange(len(sets)), [len(s) for s in sets])
    for s in range(0, len(x), _CHUNK):
        values = x[s : s + _CHUNK, None] * mul + add  # (chunk, num_perm)
        docs, first = np.unique(owner[s : s + _CHUNK], return_index=True)
        out[docs] = np.minimum(out[docs], np.minimum.reduceat(values, first, axis=0))
    return out


def _band_rows(num_perm: int, threshold: float) -> int:
    """Rows per LSH band: the most (a divisor of num_perm) that still proposes a pair at ``threshold`` with
    probability >= 0.999 (1 - (1 - t**r) ** (num_perm / r), "Mining of Massive Datasets" 3.4.2)."""
    rows = [r for r in range(1, num_perm + 1) if num_perm % r == 0]
    return max(r for r in rows if r == 1 or 1 - (1 - threshold**r) ** (num_perm // r) >= 0.999)


def near_duplicate_groups(
    texts: Sequence[str], threshold: float = 0.8, seed: int = 0, progress: bool = False
) -> list[list[int]]:
    """Groups (sorted lists of indices, 2 or more each, ordered by first index) of near-duplicate texts: pairs
    with shingle Jaccard >= ``threshold``, joined transitively (union-find). Deterministic for a given seed."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold={threshold}; accepted: 0 < threshold <= 1")
    rng = np.random.default_rng(seed)
    mul = rng.integers(0, 2**63, NUM_PERM, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    add = rng.integers(0, 2**63, NUM_PERM, dtype=np.uint64)
    cache: dict[str, int] = {}
    bar = tqdm(texts, desc="dedup: shingles", unit="doc", disable=not progress, leave=False)
    sets = [shingles(t, cache) for t in bar]
    sig = _minhash(sets, mul, add)  # (len(texts), NUM_PERM)
    parent = list(range(len(texts)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]  # path halving
            i = parent[i]
        return i

    def union(i: int, j: int) -> None:
        ri, rj = root(i), root(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)

    # identical shingle sets (identical texts among them) are duplicates; LSH then sees one of each
    reps: dict[bytes, int] = {}
    for i, s in enumerate(sets):
        union(reps.setdefault(hashlib.blake2b(s.tobytes(), digest_size=16).digest(), i), i)
    rep = np.array(sorted(reps.values()), dtype=np.int64)
    r = _band_rows(NUM_PERM, threshold)
    candidates: set[tuple[int, int]] = set()
    for band in range(0, NUM_PERM, r):
        keys = np.ascontiguousarray(sig[rep, band : band + r]).view(np.dtype((np.void, 8 * r))).ravel()
        _, bucket = np.unique(keys, return_inverse=True)
        order = np.argsort(bucket, kind="stable")
        for members in np.split(rep[order], np.flatnonzero(np.diff(bucket[order])) + 1):
            candidates.update(itertools.combinations(members.tolist(), 2))
    for i, j in sorted(candidates):
        if root(i) != root(j) and jaccard(sets[i], sets[j]) >= threshold:
            union(i, j)
    groups: dict[int, list[int]] = {}
    for i in range(len(texts)):
        groups.setdefault(root(i), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


def removed_documents(texts: Sequence[str], threshold: float = 0.8, progress: bool = False) -> np.ndarray:
    """Sorted int64 indices to drop: all of each near-duplicate group but its lowest index."""
    groups = near_duplicate_groups(texts, threshold, progress=progress)
    return np.array(sorted(i for g in groups for i in g[1:]), dtype=np.int64)
