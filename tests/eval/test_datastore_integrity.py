"""kNN-LM datastores carry the size and sha256 of their files in meta.json, and meta.json its own checksum: every
file of a datastore changed in place, truncated or deleted is refused on load with an error naming the file and
the datastore; a fresh one loads; ``rlm knnlm info`` refuses a retrieval index."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from rlm.data.tokenizer import Tokenizer
from rlm.eval.datastore import Datastore, build_datastore
from rlm.train.module import LMModule

VOCAB = 400


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """A checkpoint (an untrained 1-layer model, its tokenizer carried) and two exact datastores over three small
    files: one index, and shards of about a third of the keys each."""
    work = tmp_path_factory.mktemp("dsint")
    Tokenizer.train([Path(json.__file__).read_text()], work / "sp.model", vocab_size=VOCAB)
    corpus = []
    for name in ("decoder", "encoder", "scanner"):
        corpus.append(work / f"{name}.py")
        corpus[-1].write_text(Path(json.__file__).with_name(f"{name}.py").read_text()[:3000])
    module = LMModule(model=dict(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=32))
    ckpt = work / "ckpt" / "last.ckpt"
    ckpt.parent.mkdir()
    data = {"corpus": str(corpus[0]), "vocab_size": VOCAB, "cache_dir": str(work / "cache"), "seq_len": 32,
            "segment_len": 16, "tokenizer": "train"}  # fmt: skip
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "global_step": 1,
                "epoch": 0, "pytorch-lightning_version": pl.__version__, "datamodule_hyper_parameters": data,
                "RLMDataModule": {"tokenizer_model": (work / "sp.model").read_bytes()}}, ckpt)  # fmt: skip
    files = [str(p) for p in corpus]
    meta = build_datastore(str(ckpt), work / "ds", files, factory="SQfp16", k=4, progress=False)
    build_datastore(str(ckpt), work / "sharded", files, factory="SQfp16", k=4, progress=False,
                    shard_keys=meta["entries"] // 3)  # fmt: skip
    return {"work": work, "ckpt": ckpt, "corpus": corpus[0], "ds": work / "ds", "sharded": work / "sharded"}


def flip(path: Path) -> None:
    """One byte in the middle changed, the size kept."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {"flip": flip, "truncate": truncate, "delete": Path.unlink}
FILES = [("ds", "meta.json"), ("ds", "index.faiss"), ("ds", "values.npy"), ("ds", "docs.npy"),
         ("sharded", "meta.json"), ("sharded", "index-001.faiss"), ("sharded", "values.npy")]  # fmt: skip


def test_a_fresh_datastore_loads_and_lists_every_file(built):
    for layout, files in (("ds", ["docs.npy", "index.faiss", "values.npy"]),
                          ("sharded", ["docs.npy", "index-000.faiss", "index-001.faiss", "index-002.faiss",
                                       "values.npy"])):  # fmt: skip
        ds = Datastore(built[layout])
        assert sorted(ds.meta["sha256"]) == sorted(ds.meta["files"]) == files
        assert len(ds.values) == ds.meta["entries"] and len(ds.meta["doc_ids"]) == 3


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize(("layout", "victim"), FILES)
def test_every_damaged_file_is_refused_naming_it_and_the_datastore(built, tmp_path, layout, victim, damage):
    """Before, a same-size change loaded silently (doc_hashes edited: documents retrieved their own tokens), and
    a truncated or missing file was a faiss traceback or a numpy message naming neither file nor folder."""
    ds = tmp_path / layout
    shutil.copytree(built[layout], ds)
    DAMAGE[damage](ds / victim)
    with pytest.raises((ValueError, OSError)) as err:
        Datastore(ds)
    assert victim in str(err.value) and str(ds) in str(err.value), err.value


def test_same_size_edits_of_meta_json_are_refused(built, tmp_path, rlm_main):
    """k 4 -> 9 and one document hash changed, both keeping meta.json's size."""
    text = (built["ds"] / "meta.json").read_text()
    first = json.loads(text)["doc_hashes"][0]
    for old, new in (('"k": 4,', '"k": 9,'), (first, first[::-1])):
        ds = tmp_path / f"edited{len(old)}"
        shutil.copytree(built["ds"], ds)
        (ds / "meta.json").write_text(text.replace(old, new, 1))
        assert (ds / "meta.json").stat().st_size == len(text.encode())
        with pytest.raises(ValueError, match=r"meta.json was changed after it was written"):
            Datastore(ds)
        out = rlm_main(["knnlm", "info", ds], tmp_path)
        assert out.returncode == 2 and f"damaged kNN-LM datastore at {ds}: meta.json" in out.stderr, (
            out.stderr
        )


def test_rlm_eval_refuses_a_damaged_datastore_in_one_line(built, tmp_path, rlm_main):
    ds = tmp_path / "ds"
    shutil.copytree(built["ds"], ds)
    flip(ds / "values.npy")
    out = rlm_main(["eval", "--ckpt", built["ckpt"], "--datastore", ds, "--corpus", built["corpus"]], tmp_path,
                   built["work"] / "cache")  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"damaged kNN-LM datastore at {ds}: values.npy does not match its checksum" in out.stderr


def test_an_unreadable_index_is_named_when_checksums_are_skipped(built, tmp_path, monkeypatch):
    """RLM_INDEX_VERIFY=0 skips the checksums (sizes are still checked): faiss's error then names the file."""
    ds = tmp_path / "ds"
    shutil.copytree(built["ds"], ds)
    data = bytearray((ds / "index.faiss").read_bytes())
    data[:4] = b"XXXX"  # the index type's fourcc
    (ds / "index.faiss").write_bytes(bytes(data))
    monkeypatch.setenv("RLM_INDEX_VERIFY", "0")
    with pytest.raises(ValueError, match=rf"damaged kNN-LM datastore at {ds}: faiss cannot read index.faiss"):
        Datastore(ds)
    truncate(ds / "values.npy")
    with pytest.raises(ValueError, match=r"values.npy is \d+ bytes, meta.json says \d+"):
        Datastore(ds)


def test_knnlm_info_prints_a_datastore_and_refuses_a_retrieval_index(built, tmp_path, rlm_main):
    from rlm.index.build import IndexConfig
    from rlm.index.search import SegmentTable
    from rlm.index.store import build_index_dir

    out = rlm_main(["knnlm", "info", built["ds"]], tmp_path)
    info = json.loads(out.stdout)
    assert out.returncode == 0 and info["k"] == 4 and "doc_hashes" not in info and "sha256" not in info
    vectors = np.random.default_rng(0).normal(size=(40, 8)).astype(np.float32)
    embedder = {"name": "random", "config_hash": "c", "weights_hash": "w", "step": 0}
    idx = build_index_dir(tmp_path / "idx", vectors, SegmentTable(np.arange(40) // 4, np.arange(40) % 4 * 8), "fp",
                          embedder, IndexConfig(factory="Flat")).path  # fmt: skip
    out = rlm_main(["knnlm", "info", idx], tmp_path)
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert f"{idx} is a retrieval index" in out.stderr and f"rlm index info {idx}" in out.stderr, out.stderr
