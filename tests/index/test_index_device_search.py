"""Device-resident search: the exact torch index keeps its vectors on the device across searches, the torch IVF
search answers as faiss's own IVF search of the same index, and device_index picks between them and faiss; GPU
cases are marked gpu."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import rlm.index.device_search as device_search
from rlm.index._faiss import faiss
from rlm.index.build import IndexConfig, build_index, set_search_params
from rlm.index.device_search import TorchIVFIndex, device_index
from rlm.index.exact import TorchExactIndex, as_unit_float32

N, DIM, K = 500, 16, 5


@pytest.fixture
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return as_unit_float32(rng.standard_normal((N, DIM))), as_unit_float32(rng.standard_normal((40, DIM)))


def faiss_flat(base: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """faiss IndexFlatIP's exact top-k: the reference."""
    flat = faiss.IndexFlatIP(base.shape[1])
    flat.add(base)
    return flat.search(queries, k)


def count_uploads(index: TorchExactIndex, monkeypatch) -> list[int]:
    """A list that grows by one at every upload of the index's base to its device."""
    calls: list[int] = []
    upload = TorchExactIndex._upload
    monkeypatch.setattr(TorchExactIndex, "_upload", lambda self: calls.append(1) or upload(self))
    return calls


@pytest.mark.parametrize("stored", ["float64", "read_only", "float32"])
def test_exact_index_uploads_its_vectors_once_with_faiss_results(data, stored, monkeypatch):
    """Repeated searches reuse one device copy of the base (float64 and read-only arrays are copied once, in
    chunks); the ids are faiss IndexFlatIP's, the scores close."""
    base, queries = data
    vectors = base.astype(np.float64) if stored == "float64" else base.copy()
    vectors.flags.writeable = stored != "read_only"
    index = TorchExactIndex(vectors, device="cpu", chunk_elems=40 * DIM)  # chunked upload and scan
    uploads = count_uploads(index, monkeypatch)
    ref_scores, ref_ids = faiss_flat(base, queries, K)
    for _ in range(3):
        scores, ids = index.search(queries, K)
        np.testing.assert_array_equal(ids, ref_ids)
        torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)
    resident = index._base()
    assert uploads == [1] and resident is index._base()
    assert resident.device.type == "cpu" and resident.dtype == torch.float32
    if stored == "float32":  # an in-memory float32 base is searched where it is, without a copy
        assert resident.data_ptr() == vectors.ctypes.data


def test_a_memmap_on_the_cpu_is_streamed_and_finds_the_same(data, tmp_path, monkeypatch):
    """A memory-mapped base searched on the CPU is read chunk by chunk at each search (it need not fit in memory),
    never uploaded whole."""
    base, queries = data
    np.save(tmp_path / "v.npy", base)
    index = TorchExactIndex(np.load(tmp_path / "v.npy", mmap_mode="r"), device="cpu", chunk_elems=40 * DIM)
    uploads = count_uploads(index, monkeypatch)
    _, ids = index.search(queries, K)
    np.testing.assert_array_equal(ids, faiss_flat(base, queries, K)[1])
    assert uploads == [] and index._base() is None


def test_a_base_the_device_cannot_hold_is_streamed_with_a_warning(data, monkeypatch):
    base, queries = data

    def no_room(self):
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(TorchExactIndex, "_upload", no_room)
    index = TorchExactIndex(base.astype(np.float64), device="cpu")
    with pytest.warns(UserWarning, match="do not fit on cpu; streaming"):
        _, ids = index.search(queries, K)
    np.testing.assert_array_equal(ids, faiss_flat(base, queries, K)[1])
    _, again = index.search(queries, K)  # streamed from now on, without a second try
    np.testing.assert_array_equal(again, ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_exact_index_on_cuda_keeps_its_vectors_there(data, monkeypatch):
    base, queries = data
    index = TorchExactIndex(base, device="cuda")
    uploads = count_uploads(index, monkeypatch)
    ref_scores, ref_ids = faiss_flat(base, queries, K)
    for _ in range(2):
        scores, ids = index.search(queries, K)
        np.testing.assert_array_equal(ids, ref_ids)
        torch.testing.assert_close(scores, ref_scores, rtol=1e-4, atol=1e-4)
    assert uploads == [1] and index._base().is_cuda


def trained(base: np.ndarray, factory: str, nprobe: int, metric=faiss.METRIC_INNER_PRODUCT):
    """A faiss index of `factory` trained on and holding `base`, searching nprobe lists."""
    index = faiss.index_factory(base.shape[1], factory, metric)
    index.train(base)
    index.add(base)
    faiss.extract_index_ivf(index).nprobe = nprobe
    return index


def assert_same_search(got: tuple, want: tuple) -> None:
    """Scores close; ids equal wherever the score is not tied with a neighbouring rank's (faiss may order ties
    otherwise)."""
    (s, i), (ws, wi) = got, want
    found = wi >= 0
    np.testing.assert_array_equal(i >= 0, found)
    torch.testing.assert_close(s[found], ws[found], rtol=1e-5, atol=1e-5)
    gap = np.abs(np.diff(np.where(found, ws, -10.0), axis=1))  # (Q, k - 1)
    untied = np.ones_like(found)
    untied[:, 1:] &= gap > 1e-5
    untied[:, :-1] &= gap > 1e-5
    np.testing.assert_array_equal(i[untied & found], wi[untied & found])


@pytest.mark.parametrize("factory", ["IVF16,Flat", "IVF16,SQ8", "IVF16,PQ8x4"])
@pytest.mark.parametrize("nprobe", [1, 3])
def test_torch_ivf_search_answers_as_faiss_on_the_same_index(data, factory, nprobe):
    """The torch IVF search over the index's own centroids and lists, with its nprobe, finds faiss's neighbours;
    k beyond what the probed lists hold pads with -1 as faiss does; a new nprobe on the faiss index applies."""
    base, queries = data
    index = trained(base, factory, nprobe)
    torch_ivf = TorchIVFIndex(index, "cpu", factory, chunk_elems=200 * DIM)  # several query chunks
    assert torch_ivf.nprobe == nprobe and torch_ivf.ntotal == N
    for k in (K, 200):  # 200: more than one probed list holds
        assert_same_search(torch_ivf.search(queries, k), index.search(queries, k))
    set_search_params(index, {"nprobe": 16})
    assert torch_ivf.nprobe == 16
    assert_same_search(torch_ivf.search(queries, K), index.search(queries, K))
    if factory.endswith("Flat"):  # every list of uncompressed vectors: exact search
        assert_same_search(torch_ivf.search(queries, K), faiss_flat(base, queries, K))


@pytest.mark.parametrize(
    "factory, metric",
    [
        ("PCA8,IVF4,Flat", faiss.METRIC_INNER_PRODUCT),
        ("IVF4,Flat,Refine(Flat)", faiss.METRIC_INNER_PRODUCT),
        ("IVF4,Flat", faiss.METRIC_L2),
        ("HNSW8", faiss.METRIC_INNER_PRODUCT),
    ],
)
def test_torch_ivf_search_refuses_other_indices_naming_them(data, factory, metric):
    base, _ = data
    index = faiss.index_factory(DIM, factory, metric)
    index.train(base)
    with pytest.raises(
        ValueError, match=rf"plain inner-product IVF index .* got '{re.escape(factory)}'.*faiss-gpu"
    ):
        TorchIVFIndex(index, "cpu", factory)


def test_device_index_picks_a_torch_search_that_fits_else_faiss_cpu(data, monkeypatch):
    """Without faiss-gpu: a flat index becomes the exact torch index over its own vectors, an IVF index the torch IVF
    search; an index with no torch search, or one the device has no room for, stays faiss-cpu, and the phrase
    says so."""
    base, queries = data
    monkeypatch.setattr(device_search, "gpu_available", lambda: False)
    cpu = torch.device("cpu")
    flat = build_index(base, IndexConfig(factory="Flat"))
    found, how = device_index(flat, cpu)
    assert isinstance(found, TorchExactIndex) and how == "exact torch search on cpu (Flat)"
    np.testing.assert_array_equal(found.search(queries, K)[1], flat.search(queries, K)[1])
    ivf = build_index(base, IndexConfig(factory="IVF8,Flat", target_recall=None))
    set_search_params(ivf.index, {"nprobe": 2})
    found, how = device_index(ivf, cpu)
    assert isinstance(found, TorchIVFIndex) and how == "torch IVF search on cpu (IVF8,Flat, nprobe 2)"
    assert_same_search(found.search(queries, K), ivf.search(queries, K))
    hnsw = build_index(base, IndexConfig(factory="HNSW8", target_recall=None))
    assert device_index(hnsw, cpu) == (hnsw, "faiss-cpu (HNSW8: no torch search for this index type)")
    # a CUDA device with 1 MiB free: the IVF index's 0.04 MiB fits at most half of it, the flat one too, not 8 MiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**20, 2**30))
    monkeypatch.setattr(device_search, "TorchIVFIndex", lambda index, device, name: SimpleNamespace(nprobe=2))
    assert device_index(ivf, torch.device("cuda"))[1] == "torch IVF search on cuda (IVF8,Flat, nprobe 2)"
    big = build_index(np.tile(base, (200, 1)), IndexConfig(factory="Flat"))
    found, how = device_index(big, torch.device("cuda"))
    assert found is big and how == "faiss-cpu (Flat needs 0.01 GiB, cuda has 0.00 GiB free)"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_ivf_search_on_cuda_answers_as_faiss(data):
    base, queries = data
    index = trained(base, "IVF16,Flat", 3)
    assert_same_search(TorchIVFIndex(index, "cuda").search(queries, K), index.search(queries, K))
