"""Every private torch op the code calls sits behind a guard that falls back on any exception: each is made to
raise here, and the fallback must give the same numbers. Also the native PKM build's cache key."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rlm.plugins import _experts, _pkm_native, _pkm_ops
from rlm.plugins._experts import Experts, plan
from rlm.plugins._pkm_ops import half_scores
from rlm.plugins._pkm_rows import RowAdam


def _raise(*args, **kwargs):
    raise NotImplementedError("made to fail by the test")


def _experts_and_plan(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    experts = Experts(4, 16, 32, "swiglu", 0.1, 0.1)
    x = torch.randn(20, 16, generator=g)
    index = torch.randint(0, 4, (20, 1), generator=g)
    p = plan(index, torch.ones(20, dtype=torch.bool), 4, None)
    return experts, x.index_select(0, p.token), p


def _loop_reference(experts: Experts, x: torch.Tensor, p) -> torch.Tensor:
    """Each assignment through its own expert's weights, one token at a time."""
    rows = []
    for t in range(x.shape[0]):
        e = int(p.expert[t])
        gate, h = (x[t] @ experts.up[e]).chunk(2)
        rows.append((F.silu(gate) * h) @ experts.down[e])
    return torch.stack(rows)


@pytest.fixture
def fresh_grouped(monkeypatch):
    """An empty record of grouped-GEMM failures for the test, restored afterwards."""
    monkeypatch.setattr(_experts, "_GROUPED_FAILED", set())


def test_grouped_gemm_is_the_public_op_when_torch_has_it(monkeypatch):
    if hasattr(F, "grouped_mm"):
        assert _experts.grouped_mm_op() is F.grouped_mm
    monkeypatch.delattr(F, "grouped_mm", raising=False)
    assert _experts.grouped_mm_op() is getattr(torch, "_grouped_mm", None)


@pytest.mark.parametrize("mode", ["grouped", "auto"])
def test_grouped_gemm_that_raises_falls_back_to_bmm_with_the_same_numbers(mode, monkeypatch, fresh_grouped):
    experts, x, p = _experts_and_plan()
    ref = _loop_reference(experts, x, p)
    if experts.grouped_ok(x):
        assert_close(experts(x, p, None, "grouped"), ref, atol=1e-5, rtol=1e-4)
    monkeypatch.setattr(F, "grouped_mm", _raise, raising=False)
    monkeypatch.setattr(torch, "_grouped_mm", _raise, raising=False)
    with pytest.warns(UserWarning, match="grouped GEMM failed"):
        out = experts(x, p, None, "grouped")
    assert_close(out, ref, atol=1e-5, rtol=1e-4)
    assert not experts.grouped_ok(x)  # remembered: no second try, no second warning
    assert_close(experts(x, p, None, mode), ref, atol=1e-5, rtol=1e-4)


def test_no_grouped_gemm_at_all_means_bmm(monkeypatch, fresh_grouped):
    experts, x, p = _experts_and_plan(1)
    monkeypatch.delattr(F, "grouped_mm", raising=False)
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    assert not experts.grouped_ok(x)
    assert_close(experts(x, p, None, "grouped"), _loop_reference(experts, x, p), atol=1e-5, rtol=1e-4)


def test_auto_takes_the_grouped_gemm_on_cuda_in_bf16_only(monkeypatch, fresh_grouped):
    """The dispatch rule on a CUDA device, checked without one: bf16 on sm80+ is grouped, float32 is bmm."""
    experts = Experts(4, 16, 32, "swiglu", 0.1, 0.1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def fake(dtype, d=16):
        size = torch.empty(0, dtype=dtype).element_size()
        return SimpleNamespace(
            device=torch.device("cuda"), dtype=dtype, shape=(8, d), element_size=lambda: size
        )

    assert experts.grouped_ok(fake(torch.bfloat16))
    assert not experts.grouped_ok(fake(torch.float32))
    assert not experts.grouped_ok(fake(torch.bfloat16, d=12))  # rows not 16-byte aligned
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert not experts.grouped_ok(fake(torch.bfloat16))


def test_onednn_linear_that_raises_falls_back_to_bmm(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, keys = torch.randn(2, 10, 8, generator=g), torch.randn(2, 30, 8, generator=g)
    ref = [q[h] @ keys[h].T for h in range(2)]
    for got, want in zip(half_scores(q, keys), ref):
        assert_close(got, want)
    monkeypatch.setattr(_pkm_ops, "_ONEDNN_LINEAR", [_raise])
    for got, want in zip(half_scores(q, keys), ref):
        assert_close(got, want)
    assert _pkm_ops._ONEDNN_LINEAR == [None]  # bmm from then on


def test_onednn_linear_lookup_that_raises_means_no_op(monkeypatch):
    monkeypatch.setattr(_pkm_ops, "_ONEDNN_LINEAR", [])
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", _raise)
    assert _pkm_ops._onednn_linear() is None


def test_row_adam_without_fused_adam_gives_the_fused_numbers(monkeypatch):
    """The PyTorch path of RowAdam (the GPU's) with torch._fused_adam_ and with it raising."""
    table = torch.randn(200, 8)
    tables, opts = [table.clone(), table.clone()], [RowAdam(lr=0.01), RowAdam(lr=0.01)]
    for opt, t in zip(opts, tables):
        opt.native = False  # not the fused C kernel
        opt.add_table("t", t)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        slots = torch.randint(0, 120, (15, 4), generator=g)
        weights, grad = torch.rand(15, 4, generator=g), torch.rand(15, 8, generator=g) + 0.1
        for opt in opts:
            opt.add_lookups("t", slots, weights, grad)
        opts[0].step()
        with monkeypatch.context() as m:
            m.setattr(torch, "_fused_adam_", _raise, raising=False)
            opts[1].step()
        assert_close(tables[1], tables[0])
        assert not torch.equal(tables[1], table)
    assert opts[0].fused and not opts[1].fused


def test_native_cache_key_names_the_architecture_and_the_compiler(monkeypatch):
    monkeypatch.setattr(_pkm_native, "_compiler_version", lambda cc: "gcc (GCC) 13.2.0")
    monkeypatch.setattr(_pkm_native.platform, "machine", lambda: "x86_64")
    base = _pkm_native.cache_key("cc")
    assert base == _pkm_native.cache_key("cc")  # stable
    monkeypatch.setattr(_pkm_native.platform, "machine", lambda: "aarch64")
    arm = _pkm_native.cache_key("cc")
    monkeypatch.setattr(_pkm_native, "_compiler_version", lambda cc: "clang version 18.1.3")
    clang = _pkm_native.cache_key("cc")
    assert len({base, arm, clang}) == 3


def test_compiler_version_is_read_from_the_compiler():
    cc = _pkm_native._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    version = _pkm_native._compiler_version(cc)
    assert version and any(ch.isdigit() for ch in version)
    assert _pkm_native._compiler_version("/nonexistent/cc") == ""
