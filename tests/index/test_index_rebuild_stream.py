"""The background rebuild's thread embeds on a CUDA stream of its own (GPU case marked gpu); without CUDA it has
none and rebuilds as before."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from retrieval_helpers import make_segments

from rlm.plugins._retrieval_config import RetrievalConfig
from rlm.plugins._retrieval_rebuild import RebuildCallback, rebuild_stream

N = 64


class StreamOwner:
    """A stand-in MemoryOwner whose embedder returns a fixed vector per segment, computed on `device`, and records
    the CUDA stream each of its calls ran on."""

    prepare_seconds = 0.0

    def __init__(self, device: str) -> None:
        rng = np.random.default_rng(0)
        self.table = torch.from_numpy(rng.standard_normal((N, 16)).astype(np.float32)).to(device)
        self.streams: list = []
        self.memory = None

    def snapshot(self, step: int) -> StreamOwner:
        return self

    def embed_segments(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.table.is_cuda:
            self.streams.append(torch.cuda.current_stream())
        v = self.table[tokens[:, 0].to(self.table.device)]  # each segment's first token is its row
        return torch.nn.functional.normalize(v, dim=-1)

    def embedder_identity(self) -> dict:
        return {"name": "stream-owner", "config_hash": "0", "weights_hash": "0", "step": 0}

    def use_memory(self, memory) -> None:
        self.memory = memory


def rebuild_in_background(tmp_path, owner: StreamOwner) -> None:
    """One background rebuild of N one-segment documents, collected."""
    options = {"mode": "background", "lookup": "table", "index_factory": "Flat", "target_recall": None}
    cb = RebuildCallback(owner, RetrievalConfig(k=2, progress=False, **options))
    cb.segments = make_segments([np.array([i] * 8) for i in range(N)], 8)
    cb.rows, cb._root, cb._writer = np.arange(N), tmp_path, True
    trainer = SimpleNamespace(global_rank=0, world_size=1)
    cb._start_background(trainer, 3)
    cb._collect(trainer, wait=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_without_cuda_the_rebuild_has_no_stream_and_still_lands(tmp_path):
    owner = StreamOwner("cpu")
    assert rebuild_stream() is None
    rebuild_in_background(tmp_path, owner)
    assert owner.memory is not None and owner.memory.neighbours.shape == (N, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_background_rebuild_embeds_on_its_own_cuda_stream(tmp_path):
    owner = StreamOwner("cuda")
    rebuild_in_background(tmp_path, owner)
    assert owner.memory is not None and owner.memory.neighbours.shape == (N, 2)
    assert owner.streams and all(s != torch.cuda.default_stream() for s in owner.streams)
