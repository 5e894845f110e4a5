"""Device-resident search: the exact torch index keeps its vectors on the device across searches, with faiss's
results; GPU cases are marked gpu."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlm.index._faiss import faiss
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
    chunks); assigning new vectors uploads those once; the ids are faiss IndexFlatIP's, the scores close."""
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
    index.vectors = base[::-1].copy()  # the index changed: uploaded again, once
    index.search(queries, K)
    _, ids = index.search(queries, K)
    assert uploads == [1, 1]
    np.testing.assert_array_equal(ids, N - 1 - ref_ids)


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
