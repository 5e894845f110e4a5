"""The native exact product-key search (plugins/_pkm_native.py) against a brute force over all n^2 pairs."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rlm.plugins import _pkm_native, _pkm_ops
from rlm.plugins._pkm_ops import product_key_topk

pytestmark = pytest.mark.skipif(
    _pkm_native.load() is None, reason="no C compiler: the native kernel is unavailable"
)


def brute_force(s1: torch.Tensor, s2: torch.Tensor, k: int) -> list[list[tuple[float, int, int]]]:
    """Per (t, h), the k best (score, i, j) over all n^2 sums s1[i] + s2[j], in the documented order.

    Order: score descending, then the rank of i in its half, then of j (a half ranks by score descending,
    then id). s1, s2: (H, N, n); the sums are formed in their dtype, as the kernel forms them.
    """
    H, N, n = s1.shape
    out = []
    for t in range(N):
        for h in range(H):
            a, b = s1[h, t], s2[h, t]
            rank1 = {i: r for r, i in enumerate(sorted(range(n), key=lambda i: (-a[i].item(), i)))}
            rank2 = {j: r for r, j in enumerate(sorted(range(n), key=lambda j: (-b[j].item(), j)))}
            sums = (a.unsqueeze(1) + b.unsqueeze(0)).tolist()  # (n, n), summed in the tensors' dtype
            best = sorted((-sums[i][j], rank1[i], rank2[j], i, j) for i in range(n) for j in range(n))[:k]
            out.append([(-s, i, j) for s, _, _, i, j in best])
    return out


def as_rows(scores: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> list[list[tuple[float, int, int]]]:
    """The kernel's (N, H, k) outputs in brute_force's layout."""
    N, H, k = scores.shape
    return [
        [(scores[t, h, e].item(), int(i[t, h, e]), int(j[t, h, e])) for e in range(k)]
        for t in range(N)
        for h in range(H)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize(
    ("n", "k"), [(1, 1), (16, 1), (16, 4), (16, 16), (37, 5), (64, 8), (100, 7), (256, 32), (256, 3)]
)  # n >= 4k: the grouped lower bound is used; k = n: every pair ranks
def test_search_equals_brute_force(dtype, ties, n, k):
    g = torch.Generator().manual_seed(n * 100 + k)
    H, N = 2, 3
    if ties:  # few distinct values: many equal scores and equal sums, ordered by the rule
        s1, s2 = (torch.randint(0, 3, (H, N, n), generator=g).to(dtype) for _ in range(2))
    else:
        s1, s2 = (torch.randn(H, N, n, generator=g, dtype=dtype) for _ in range(2))
    scores, i, j = _pkm_native.product_search(list(s1), list(s2), k)
    assert scores.dtype == dtype and i.dtype == j.dtype == torch.int64
    assert as_rows(scores, i, j) == brute_force(s1, s2, k)


def test_search_handles_infinities_and_refuses_nan():
    s1 = torch.randn(1, 4, 64)
    s2 = torch.randn(1, 4, 64)
    s1[0, 0, 5], s1[0, 1, :] = float("inf"), float("-inf")
    s2[0, 2, 7] = float("-inf")
    got = _pkm_native.product_search(list(s1), list(s2), 4)
    assert as_rows(*got) == brute_force(s1, s2, 4)
    s2[0, 3, 9] = float("nan")
    assert _pkm_native.product_search(list(s1), list(s2), 4) is None  # the caller falls back to torch


def test_search_over_threads_gives_the_same_result():
    threads = torch.get_num_threads()
    s1, s2 = torch.randn(4, 300, 256), torch.randn(4, 300, 256)
    torch.set_num_threads(1)
    one = _pkm_native.product_search(list(s1), list(s2), 16)
    torch.set_num_threads(max(2, threads))
    try:
        many = _pkm_native.product_search(list(s1), list(s2), 16)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, many):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n", [64, 512])
def test_native_and_torch_paths_agree(n, monkeypatch):
    g = torch.Generator().manual_seed(n)
    q = torch.randn(50, 4, 2, 16, generator=g)
    keys = torch.randn(4, 2, n, 16, generator=g)
    args = (q, keys, 32)
    native = product_key_topk(*args)
    monkeypatch.setattr(_pkm_native, "product_search", lambda *a: None)
    torch_path = product_key_topk(*args)
    assert torch.equal(native[1], torch_path[1])  # random float32 scores: no ties
    assert_close(native[0], torch_path[0])


def test_torch_path_is_used_for_dtypes_the_kernel_does_not_take():
    s = torch.randn(1, 2, 16, dtype=torch.bfloat16)
    assert _pkm_native.product_search([s[0]], [s[0]], 4) is None
    strided = torch.randn(16, 2).t()  # (2, 16), not contiguous
    assert _pkm_native.product_search([s[0].float()], [strided], 4) is None
    scores, i, j = _pkm_ops._search_torch(s.float(), s.float(), 4)
    assert scores.shape == i.shape == j.shape == (2, 1, 4)
