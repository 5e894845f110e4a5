"""`rlm index build|search|eval|info` round trip on a tiny checkpoint, plus the commands on random vectors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import fit_args, run_rlm

from rlm.checksums import meta_digest
from rlm.cli import main
from rlm.index.build import IndexConfig
from rlm.index.search import SegmentTable
from rlm.index.store import build_index_dir
from rlm.index.synthetic import clustered_unit_vectors

EMBEDDER = {"name": "random", "config_hash": "c", "weights_hash": "w", "step": 0}


@pytest.fixture
def random_index(tmp_path):
    x = clustered_unit_vectors(3000, 32, n_clusters=20, seed=5)
    segments = SegmentTable(np.arange(3000) // 30, (np.arange(3000) % 30) * 16)
    build_index_dir(tmp_path / "idx", x, segments, "fp", EMBEDDER, IndexConfig(factory="IVF16,Flat"))
    return tmp_path / "idx"


def test_info_eval_and_segment_search_on_random_vectors(random_index, capsys):
    assert main(["index", "info", str(random_index)]) == 0
    out = capsys.readouterr().out
    assert "3000 x 32" in out and "IVF16,Flat" in out and "nprobe" in out
    assert main(["index", "info", str(random_index), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 3000
    assert main(["index", "eval", str(random_index), "--queries", "200"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| index | recall@10 | queries/s | speed-up |" and len(table) == 4
    assert float(table[3].split("|")[2]) >= 0.9  # the IVF row's recall
    assert main(["index", "search", str(random_index), "--segment", "7", "-k", "3"]) == 0
    hits = capsys.readouterr().out.splitlines()
    assert len(hits) == 3 and all("segment 7 " not in h for h in hits)  # never itself


def test_cli_errors_are_one_line_and_exit_2(tmp_path, random_index, capsys):
    assert main(["index", "info", str(tmp_path / "nothing")]) == 2
    assert "no index at" in capsys.readouterr().err
    assert main(["index", "search", str(random_index), "some text"]) == 2
    assert "no checkpoint recorded" in capsys.readouterr().err
    assert main(["index", "search", str(random_index), "--segment", "5000"]) == 2
    assert "out of range" in capsys.readouterr().err


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_build_search_eval_info_round_trip_on_a_tiny_checkpoint(tmp_path, rlm_cache, monkeypatch, capsys):
    run_rlm(fit_args() + ["--trainer.max_steps=2"], tmp_path, rlm_cache)
    ckpt = tmp_path / "runs/test/ckpt/last.ckpt"
    monkeypatch.setenv("RLM_CACHE", str(rlm_cache))
    out = tmp_path / "idx"
    args = ["build", "--ckpt", str(ckpt), "--out", str(out), "--split", "val", "--layer", "0", "--quiet"]
    assert main(["index", *args, "--factory", "Flat"]) == 0
    assert "wrote" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert (
        meta["factory"] == "Flat"
        and meta["embedder"]["name"] == "meanpool@0"
        and meta["embedder"]["step"] == 2
    )
    assert main(["index", "search", str(out), "def __init__(self):", "-k", "2"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("score ") == 2  # two hits, each followed by its segment's text
    assert main(["index", "eval", str(out), "--queries", "50"]) == 0
    assert "| Flat | 1.0000 |" in capsys.readouterr().out
    # vectors from another embedder are refused, not silently mixed with this checkpoint's queries
    meta["embedder"]["weights_hash"] = "0" * 16
    meta["meta_sha256"] = meta_digest(meta)  # an index really built so, not meta.json edited by hand
    (out / "meta.json").write_text(json.dumps(meta))
    assert main(["index", "search", str(out), "def f():"]) == 2
    assert "another embedder" in capsys.readouterr().err
    # and the rlm console script dispatches to the same commands
    proc = run_rlm(["index", "info", out], tmp_path, rlm_cache)
    assert "meanpool@0" in proc.stdout


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_build_with_another_data_config_reads_it_with_the_checkpoints_tokenizer(
    tmp_path, rlm_cache, monkeypatch
):
    """`rlm index build --ckpt C --config DATA.yaml` trained a new tokenizer on DATA's corpus (a meaningless
    index, rc 0), and with a larger vocab_size there an IndexError traceback (issue 24, defect 2)."""
    from rlm.index.cli import _load_source

    run_rlm(fit_args() + ["--trainer.max_steps=2"], tmp_path, rlm_cache)
    ckpt = tmp_path / "runs/test/ckpt/last.ckpt"
    monkeypatch.setenv("RLM_CACHE", str(rlm_cache))
    corpus = tmp_path / "other"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i}\n" * 40)
    data_yaml = tmp_path / "other.yaml"
    data_yaml.write_text(f"data:\n  corpus: {corpus}\n  vocab_size: 2048\n  val_fraction: 0.0\n"
                         "  test_fraction: 0.0\n  max_documents: null\n")  # fmt: skip
    module, data, _, hp = _load_source(str(ckpt), str(data_yaml))
    own = torch.load(ckpt, map_location="cpu", weights_only=False)["RLMDataModule"]["tokenizer_model"]
    assert Path(hp["tokenizer"]).read_bytes() == own and hp["vocab_size"] == module.model_config.vocab_size
    assert data.store.tokenizer.vocab_size == module.model_config.vocab_size
    assert main(["index", "build", "--ckpt", str(ckpt), "--config", str(data_yaml), "--out", str(tmp_path / "idx"),
                 "--split", "train", "--quiet"]) == 0  # fmt: skip


def test_search_names_its_own_missing_checkpoint_without_a_flag_it_lacks(tmp_path):
    """`rlm index search` on an index whose checkpoint is gone named a --ckpt flag that search does not have
    (issue 24, item 11)."""
    from rlm.index.cli import _load_source

    gone = str(tmp_path / "moved.ckpt")
    with pytest.raises(ValueError, match="no longer exists: restore it, rebuild the index") as err:
        _load_source(gone, None, {})
    assert "--ckpt '" not in str(err.value)
