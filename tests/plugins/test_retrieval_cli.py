"""The retriever through the real ``rlm`` command: a fit smoke run stacked with an implicit-memory plugin,
and DDP with 2 CPU processes ending with the same index (and neighbour table) on both ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cli_helpers import CONFIGS, DDP_2CPU, REPO, column, fit_args, read_metrics, run_rlm

RUN = "runs/test/version_0"
FAST = """
model:
  plugins:
    retrieval:
      schedule: every 3
      index_factory: Flat
      mode: blocking
      progress: false
"""


def _fragment(tmp_path, text: str = FAST):
    path = tmp_path / f"retrieval_{abs(hash(text))}.yaml"
    path.write_text(text)
    return path


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_fit_with_retrieval_and_tokenid(tmp_path, rlm_cache):
    """`rlm fit` with retrieval stacked on Token-ID tables: rebuilds on schedule, metrics logged, checkpoint state."""
    args = fit_args(
        CONFIGS / "plugins" / "tokenid.yaml", CONFIGS / "plugins" / "retrieval.yaml", _fragment(tmp_path)
    )
    run_rlm(args, tmp_path, rlm_cache)
    rows = read_metrics(tmp_path / RUN)
    for name in (
        "relevance",
        "beta",
        "same_doc",
        "coverage",
        "rebuild_s",
        "steps_since_rebuild",
        "retrieval_fraction",
        "index_recall",
    ):
        assert column(rows, f"train/retrieval/{name}"), f"train/retrieval/{name} was not logged"
    assert column(rows, "val/retrieval/relevance") and column(rows, "val/loss")
    assert max(column(rows, "train/retrieval/steps_since_rebuild")) <= 3
    # the warm start retrieves from step 0 (own-document neighbours only), the first table comes at step 2
    same_doc = column(rows, "train/retrieval/same_doc")
    assert same_doc and same_doc[0] == 1.0
    ckpt = torch.load(tmp_path / "runs/test/ckpt/last.ckpt", map_location="cpu", weights_only=False)
    state = ckpt["callbacks"]["RebuildCallback[retrieval]"]
    assert state["last_step"] == 5  # rebuilt at steps 2 and 5 of 0..5 ('every 3', the first due at step 2)
    meta = json.loads((tmp_path / state["index_dir"] / "meta.json").read_text())
    assert meta["embedder"] == state["identity"] and meta["k"] == 2
    assert meta["recall"] == 1.0 and meta["target_recall"] == 0.95  # a small corpus: exact flat search
    info = run_rlm(["index", "info", tmp_path / state["index_dir"]], tmp_path, rlm_cache)
    assert "recall    1.0 against exact search (target 0.95)" in info.stdout
    assert set(ckpt["hyper_parameters"]["plugins"]) == {"tokenid", "retrieval"}
    # validation and generation outside fit search the index the checkpoint names, with the current embedder
    assert ckpt["state_dict"]["model.plugins.retrieval._extra_state"]["index_dir"].endswith("step-000000005")
    ckpt_path = tmp_path / "runs/test/ckpt/last.ckpt"
    frags = (
        CONFIGS / "plugins" / "tokenid.yaml",
        CONFIGS / "plugins" / "retrieval.yaml",
        _fragment(tmp_path),
    )
    val = run_rlm(fit_args(*frags, command="validate") + ["--ckpt_path", ckpt_path], tmp_path, rlm_cache)
    assert "val/retrieval/relevance" in val.stdout
    out = run_rlm(
        ["generate", "--ckpt", ckpt_path, "--prompt", "def ", "--max-new-tokens", "40"], tmp_path, rlm_cache
    )
    assert out.stdout.startswith("def ")
    # `rlm index build` on a retrieval checkpoint indexes with the retriever's own embedder
    run_rlm(
        ["index", "build", "--ckpt", ckpt_path, "--out", tmp_path / "idx", "--quiet"], tmp_path, rlm_cache
    )
    info = run_rlm(["index", "info", tmp_path / "idx"], tmp_path, rlm_cache)
    assert "retrieval/" in info.stdout
    found = run_rlm(["index", "search", tmp_path / "idx", "def main(", "-k", "2"], tmp_path, rlm_cache)
    assert found.stdout.strip()


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("lookup", ["search", "table"])
def test_ddp_two_processes_share_one_index(tmp_path, rlm_cache, lookup):
    """Each rank embeds half the segments; both ranks train on the index (and with lookup 'table', the neighbour
    table) rank 0 wrote from the gathered vectors. Steps 0 and 1 train on the warm start (each rank's own batch),
    the first index comes at step 2."""
    ablation = _fragment(tmp_path, FAST + f"      eval_ablation: true\n      lookup: {lookup}\n")
    args = fit_args(CONFIGS / "plugins" / "retrieval.yaml", ablation) + DDP_2CPU
    proc = run_rlm(args, tmp_path, rlm_cache)
    assert "distributed_backend=gloo" in proc.stdout + proc.stderr
    rows = read_metrics(tmp_path / RUN)
    # the evaluation hooks, reduced over both ranks: loss by neighbour source, and the random-neighbour ablation
    assert column(rows, "val/retrieval_random/loss")
    assert any(column(rows, f"val/loss_by/retrieval/{g}") for g in ("own_doc", "other_doc", "mixed", "none"))
    assert len(column(rows, "train/loss")) == 4 and column(rows, "train/retrieval/relevance")
    assert column(rows, "train/retrieval/same_doc")[0] == 1.0  # the warm start at step 0
    index_root = tmp_path / "runs/test/retrieval_index"
    built = sorted(p.name for p in index_root.glob("step-*"))
    assert built == ["step-000000002"]
    # the callback checks under DDP that every rank holds the same table (a checksum all-gather) and raises if not;
    # here: the gathered vectors are complete (one unit vector per indexed segment)
    assert_complete_unit_vectors(index_root / "step-000000002")
    assert (index_root / "step-000000002" / "neighbours.npy").exists() == (lookup == "table")


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_background_first_table(tmp_path, rlm_cache):
    """Background mode under DDP: the first table is embedded in a thread on each rank while the ranks train
    without retrieval (every parameter still gets a gradient, as DDP requires); the ranks agree it has finished
    (at a later step, or at fit end) before gathering."""
    background = _fragment(
        tmp_path, FAST.replace("mode: blocking", "mode: background\n      warm_start: none")
    )
    args = fit_args(CONFIGS / "plugins" / "retrieval.yaml", background) + DDP_2CPU
    run_rlm(args, tmp_path, rlm_cache)
    rows = read_metrics(tmp_path / RUN)
    assert len(column(rows, "train/loss")) == 4
    index_root = tmp_path / "runs/test/retrieval_index"
    built = sorted(p.name for p in index_root.glob("step-*"))
    assert built and built[0] == "step-000000000"
    assert_complete_unit_vectors(index_root / built[-1])


def assert_complete_unit_vectors(path) -> None:
    """An index directory holds one finite unit vector per indexed segment."""
    from rlm.index.store import load_index_dir

    vectors = np.asarray(load_index_dir(path).vectors)
    rows_ids = np.load(path / "rows.npy")
    assert len(vectors) == len(rows_ids) and np.isfinite(vectors).all()
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)


# slow: the benchmark script times real `rlm fit` subprocesses
@pytest.mark.slow
def test_fit_time_benchmark_smoke(tmp_path, rlm_cache, monkeypatch):
    """benchmarks/retrieval_fit.py runs `rlm fit` with and without retrieval, each retrieval run building its one
    index, and prints every variant's ratio to the base run."""
    import importlib.util

    path = REPO / "benchmarks" / "retrieval_fit.py"
    spec = importlib.util.spec_from_file_location("bench_retrieval_fit", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("RLM_CACHE", str(rlm_cache))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    configs = [CONFIGS / "default.yaml", CONFIGS / "data" / "tiny.yaml", CONFIGS / "model" / "tiny.yaml"]
    out = bench.main(["--steps", "4", "--index-at", "2", "--rounds", "1", "--config", *map(str, configs)])
    for row in (
        "| no retrieval | ",
        "| retrieval as shipped (k=2, no continuations) |",
        "| retrieval with continuations |",
    ):
        assert row in out
    assert "4 steps, one blocking index build at step 2" in out
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "4", "--index-at", "4"])
