"""Lookup functions: softmax router, Token-ID hash table, hyperplane LSH."""

import pytest
import torch
from torch.testing import assert_close

from rlm.plugins._lookup import (
    SEED,
    LookupOptions,
    LSHLookup,
    SoftmaxRouter,
    TokenIDLookup,
    hash_table,
    lsh_directions,
)

D = 32


def test_softmax_router_top_k_by_hand():
    router = SoftmaxRouter(D, 5, LookupOptions(top_k=2, renormalize=True))
    x = torch.randn(7, D)
    r = router(x, torch.zeros(7, dtype=torch.long), training=False)
    probs = torch.softmax(x @ router.weight.t(), -1)
    for s in range(7):
        order = sorted(range(5), key=lambda i: -probs[s, i].item())[:2]
        assert r.index[s].tolist() == order
        assert_close(r.weight[s], probs[s, order] / probs[s, order].sum())
    assert r.logits.dtype == torch.float32


def test_router_runs_in_float32_under_bfloat16_inputs():
    router = SoftmaxRouter(D, 4, LookupOptions())
    r = router(torch.randn(5, D, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.long), training=True)
    assert r.logits.dtype == torch.float32 and r.weight.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = router(torch.randn(5, D), torch.zeros(5, dtype=torch.long), training=True)
    assert r.logits.dtype == torch.float32


def test_hash_table_is_fixed_and_balanced():
    a, b = hash_table(100, 8, seed=3), hash_table(100, 8, seed=3)
    assert torch.equal(a, b)
    assert not torch.equal(a, hash_table(100, 8, seed=4))
    counts = torch.bincount(a, minlength=8)
    assert counts.max() - counts.min() <= 1  # every entry gets floor/ceil(100/8) ids


def test_token_id_lookup_maps_ids():
    opts = LookupOptions(lookup="token_id")
    ident = TokenIDLookup(16, 16, opts)
    tokens = torch.randint(0, 16, (3, 5))
    assert torch.equal(ident(torch.randn(15, D), tokens, False).index.view(3, 5), tokens)
    with pytest.raises(ValueError, match="at most 16"):
        TokenIDLookup(16, 32, opts)
    assert torch.equal(TokenIDLookup(16, 4, opts).table, hash_table(16, 4, SEED))  # fewer entries: the hash


def naive_lsh(x: torch.Tensor, directions: torch.Tensor, cuts: torch.Tensor, slabs: int) -> list[int]:
    """The grid cell by hand: count the cuts below each projection, then a mixed-radix number."""
    out = []
    for row in x:
        row = row / row.pow(2).mean().add(1e-6).sqrt()
        cell = 0
        for j in range(directions.shape[1]):
            proj = float(row @ directions[:, j])
            cell += sum(1 for c in cuts.tolist() if proj > c) * slabs**j
        out.append(cell)
    return out


@pytest.mark.parametrize("slabs, n", [(2, 16), (3, 9), (4, 64)])
def test_lsh_cells_match_the_grid_by_hand(slabs, n):
    opts = LookupOptions(lookup="lsh", lsh_slabs=slabs, lsh_width=0.7)
    lsh = LSHLookup(D, n, opts)
    x = torch.randn(50, D)
    index = lsh(x, torch.zeros(50, dtype=torch.long), True).index.view(-1)
    assert index.tolist() == naive_lsh(x, lsh.directions, lsh.cuts, slabs)
    assert int(index.max()) < n
    # Equispaced parallel cuts, symmetric about the origin.
    if slabs > 2:
        assert_close(lsh.cuts[1:] - lsh.cuts[:-1], torch.full((slabs - 2,), 0.7))
    assert_close(lsh.cuts.mean(), torch.tensor(0.0))


def test_lsh_is_stable_and_locality_sensitive():
    opts = LookupOptions(lookup="lsh")
    a, b = LSHLookup(D, 64, opts), LSHLookup(D, 64, opts)
    assert torch.equal(a.directions, b.directions)  # fixed at init by the seed
    tok = torch.zeros(2000, dtype=torch.long)
    x = torch.randn(2000, D)
    bucket = a(x, tok, True).index
    assert torch.equal(bucket, b(x, tok, False).index)
    assert torch.equal(bucket, a(3.0 * x, tok, True).index)  # scale-free: rms-normalised first
    near = a(x + 0.05 * torch.randn_like(x), tok, True).index
    far = a(torch.randn_like(x), tok, True).index
    same_near = (near == bucket).float().mean()
    same_far = (far == bucket).float().mean()
    assert same_near > 0.8 and same_far < 0.2, (same_near, same_far)


def test_lsh_needs_a_power_of_the_slabs():
    with pytest.raises(ValueError, match="not a power of lsh_slabs=2"):
        lsh_directions(D, 12, LookupOptions(lookup="lsh"))


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(lsh_slabs=1), "lsh_slabs"),
        (dict(router_jitter=1.5), "router_jitter"),
        (dict(lookup="token_id", top_k=2), "top_k"),
    ],
)
def test_bad_lookup_options(kw, words):
    with pytest.raises(ValueError, match=words):
        LookupOptions(**kw)
