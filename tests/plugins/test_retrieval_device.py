"""The retriever's search where the model runs: the memory's index searched by torch (here forced onto the CPU, as
on a GPU without faiss-gpu) finds the neighbours faiss-cpu finds, and the forward is the same; a training step's
search left running in a thread (forced onto the CPU too) gives the synchronous step's neighbours, logits and
gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from retrieval_helpers import CORPUS_OFFSETS, CORPUS_SEGMENTS, context, tiny_model

import rlm.index.memory as memory_module
from rlm.data.windows import HOST, Windows, host_copy
from rlm.index.build import IndexConfig, set_search_params
from rlm.index.device_search import TorchIVFIndex
from rlm.index.exact import TorchExactIndex
from rlm.index.memory import build_memory, embed_rows, indexed_rows
from rlm.plugin.context import Context
from rlm.plugins import retrieval as retrieval_module
from rlm.plugins._retrieval_neighbours import PendingInputs, gather_inputs


def with_memory(factory: str, **opts):
    """A tiny retriever searching online (lookup 'search') a memory of the training documents under `factory`."""
    model = tiny_model(warm_start="none", lookup="search", **opts)
    plugin = model.plugins["retrieval"]
    rows = indexed_rows(CORPUS_SEGMENTS, np.arange(10))
    embedder = plugin.snapshot(0)
    vectors = embed_rows(embedder, CORPUS_SEGMENTS, rows, 64, 0, 1, False)
    config = IndexConfig(factory=factory, target_recall=None)
    memory = build_memory(
        vectors, CORPUS_SEGMENTS, rows, 2, embedder.embedder_identity(), 0, config, None, table=False
    )
    set_search_params(memory.index.index, {"nprobe": 2} if factory.startswith("IVF") else {})
    plugin.use_memory(memory)
    return model, memory


@pytest.mark.parametrize(("factory", "searcher"), [("IVF4,Flat", TorchIVFIndex), ("Flat", TorchExactIndex)])
@pytest.mark.parametrize("stage", ["train", "val"])
def test_torch_search_on_the_models_device_finds_faiss_cpus_neighbours(
    factory, searcher, stage, monkeypatch, capsys
):
    """The same batch through faiss-cpu, then through the torch search over the index's own lists with its nprobe
    (forced on the CPU): the same neighbour ids and logits; the memory says once which search it uses."""
    windows = Windows(CORPUS_SEGMENTS, CORPUS_OFFSETS, np.arange(10), 32)
    batch = windows.collate(np.arange(len(windows)))
    model, memory = with_memory(factory)
    with torch.no_grad():
        ctx = context(model, batch, stage)
        want_ids, want = ctx.extras["retrieval"].ids, model(batch["tokens"], ctx)
    assert memory._searched is None  # a CPU model keeps faiss-cpu
    monkeypatch.setattr(memory_module, "SEARCH_DEVICES", ("cuda", "cpu"))
    with torch.no_grad():
        for _ in range(2):  # placed once, searched twice
            ctx = context(model, batch, stage)
            got_ids, got = ctx.extras["retrieval"].ids, model(batch["tokens"], ctx)
            assert (want_ids >= 0).sum() > len(batch["tokens"])
            torch.testing.assert_close(got_ids, want_ids, rtol=0, atol=0)
            torch.testing.assert_close(got, want)
    assert isinstance(memory._searched[1], searcher)
    log = capsys.readouterr().err
    assert log.count("rlm: retrieval search: ") == 1
    assert f"on cpu ({factory}" in log


def forward_and_grads(model, batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(neighbour ids, logits, every parameter's gradient) of one training forward and backward."""
    model.zero_grad()
    ctx = context(model, batch, "train")
    out = model(batch["tokens"], ctx)
    out.float().square().mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return ctx.extras["retrieval"].ids, out.detach(), grads


@pytest.mark.parametrize("device_search", [False, True])
def test_a_training_steps_search_in_the_background_equals_the_synchronous_one(device_search, monkeypatch):
    """prepare leaves the search running in a thread (PendingInputs) and the forward waits for it at the first
    cross-attention: the neighbours, logits and gradients are those of the synchronous path, with faiss-cpu or the
    torch search; prepare_ms counts the wait."""
    windows = Windows(CORPUS_SEGMENTS, CORPUS_OFFSETS, np.arange(10), 32)
    batch = windows.collate(np.arange(len(windows)))
    model, _ = with_memory("IVF4,Flat")
    want_ids, want, want_grads = forward_and_grads(model, batch)
    if device_search:
        monkeypatch.setattr(memory_module, "SEARCH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(retrieval_module, "BACKGROUND_DEVICES", ("cuda", "cpu"))
    assert isinstance(context(model, batch, "train").extras["retrieval"], PendingInputs)
    ids, got, grads = forward_and_grads(model, batch)
    torch.testing.assert_close(ids, want_ids, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=0, msg=name)
    ctx = context(model, batch, "train")
    model(batch["tokens"], ctx)
    assert ctx.metrics["retrieval/prepare_ms"] > 0
    # evaluation stays synchronous (its host half embeds again)
    assert not isinstance(context(model, batch, "val").extras["retrieval"], PendingInputs)


def test_the_next_steps_neighbours_are_searched_during_the_step_before(monkeypatch):
    """With the loader's next batch (Context.upcoming) a step searches the next step's neighbours by its own
    weights: the next step reads them (searched_ahead 1) though an update since would find others; a batch or an
    index other than the one searched for gets its own search (searched_ahead 0)."""
    windows = Windows(CORPUS_SEGMENTS, CORPUS_OFFSETS, np.arange(10), 32)
    first, second = windows.collate(np.arange(0, 6)), windows.collate(np.arange(6, 12))
    model, memory = with_memory("Flat")
    plugin = model.plugins["retrieval"]
    monkeypatch.setattr(retrieval_module, "BACKGROUND_DEVICES", ("cuda", "cpu"))

    def step(batch, upcoming):
        """(neighbour ids, searched_ahead) of a training step on `batch`, with its forward."""
        ctx = Context(batch["tokens"], batch["mask"], "train", batch["segment_ids"], batch["doc_ids"],
                      CORPUS_SEGMENTS, upcoming=lambda: upcoming)  # fmt: skip
        plugin.prepare(ctx, batch)
        model(batch["tokens"], ctx)
        return ctx.extras["retrieval"].ids, float(ctx.metrics["retrieval/searched_ahead"])

    def searched(batch):
        return context(model, batch, "train").extras["retrieval"].result().ids

    want_first, want_second = searched(first), searched(second)
    ids, ahead = step(first, second)
    assert ahead == 0.0
    torch.testing.assert_close(ids, want_first, rtol=0, atol=0)
    with torch.no_grad():  # an update: the second batch's own search would now find other neighbours
        for p in model.parameters():  # the shared embedder: the LM's own lower blocks
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    now_second = searched(second)
    assert not torch.equal(now_second, want_second)
    ids, ahead = step(second, first)
    assert ahead == 1.0
    torch.testing.assert_close(ids, want_second, rtol=0, atol=0)
    ids, ahead = step(second, first)  # the search ahead was for the first batch
    assert ahead == 0.0
    torch.testing.assert_close(ids, now_second, rtol=0, atol=0)
    plugin.use_memory(with_memory("Flat")[1])  # a rebuild's new index
    assert step(first, second)[1] == 0.0


def test_an_error_of_the_background_search_is_raised_by_the_forward(monkeypatch):
    windows = Windows(CORPUS_SEGMENTS, CORPUS_OFFSETS, np.arange(10), 32)
    batch = windows.collate(np.arange(4))
    model, memory = with_memory("Flat")
    monkeypatch.setattr(retrieval_module, "BACKGROUND_DEVICES", ("cuda", "cpu"))

    def broken(*args, **kwargs):
        raise OSError("index file gone")

    monkeypatch.setattr(memory, "search_scored", broken)
    ctx = context(model, batch, "train")
    with pytest.raises(OSError, match="index file gone"):
        model(batch["tokens"], ctx)


def test_background_gather_is_refused_for_evaluation():
    windows = Windows(CORPUS_SEGMENTS, CORPUS_OFFSETS, np.arange(10), 32)
    batch = windows.collate(np.arange(4))
    model, memory = with_memory("Flat")
    plugin = model.plugins["retrieval"]
    with pytest.raises(ValueError, match=r"background=True\) is for training steps"):
        gather_inputs(
            memory,
            batch,
            2,
            False,
            True,
            plugin._embed_queries,
            CORPUS_SEGMENTS,
            evaluation=True,
            background=True,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("factory", ["IVF4,Flat", "Flat"])
def test_on_cuda_a_training_step_searches_on_the_device_beside_its_forward(factory):
    """The model on CUDA: the memory is searched there (faiss-gpu, else torch), in the background thread on a side
    stream; the neighbours are the CPU model's with faiss-cpu, the logits and gradients close to its."""
    windows = Windows(CORPUS_SEGMENTS, CORPUS_OFFSETS, np.arange(10), 32)
    batch = windows.collate(np.arange(len(windows)))
    model, memory = with_memory(factory)
    want_ids, want, want_grads = forward_and_grads(model, batch)
    model.cuda()
    on_gpu = {name: x.cuda() if isinstance(x, torch.Tensor) else x for name, x in batch.items()}
    on_gpu[HOST] = host_copy(batch)  # what the loader's move to the device keeps
    assert isinstance(context(model, on_gpu, "train").extras["retrieval"], PendingInputs)
    ids, got, grads = forward_and_grads(model, on_gpu)
    assert memory._searched is not None and memory._searched[0].type == "cuda"
    torch.testing.assert_close(ids.cpu(), want_ids, rtol=0, atol=0)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    for name, grad in grads.items():
        torch.testing.assert_close(grad.cpu(), want_grads[name], rtol=1e-3, atol=1e-4, msg=name)
