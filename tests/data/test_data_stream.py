"""Data at scale: streamed hf: corpora encoded into shards, and existing tokenizers (sentencepiece, HF)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from rlm.data import store as stream_mod
from rlm.data.module import RLMDataModule
from rlm.data.pretrained import HFTokenizer, load_tokenizer
from rlm.data.tokenizer import Tokenizer
from rlm.extras import MissingExtra

datasets = pytest.importorskip("datasets")

SEQ, SEG = 32, 8


def _texts(n=40, seed=0):
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghij klmnop\n"))
    return ["".join(rng.choice(letters, int(rng.integers(50, 400)))) for _ in range(n)]


def _jsonl(folder, texts, field="text"):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "data.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({field: t, "n": len(t)}) + "\n")
    return folder


def _dm(corpus, cache, **kw):
    args = dict(vocab_size=300, seq_len=SEQ, segment_len=SEG, batch_size=4, val_fraction=0.2, progress=False)
    return RLMDataModule(corpus, cache_dir=str(cache), **{**args, **kw})


def _decoded(dm):
    return [dm.text_of(d) for d in range(dm.store.n_docs)]


def test_streamed_jsonl_round_trips_every_document(tmp_path, monkeypatch):
    texts = _texts()
    src = _jsonl(tmp_path / "src", texts)
    monkeypatch.setattr(stream_mod, "SHARD_TOKENS", 2000)  # several shards from a small corpus
    saved = []
    real_savez = np.savez
    monkeypatch.setattr(np, "savez", lambda path, **arrays: (saved.append(path), real_savez(path, **arrays)))
    dm = _dm(f"hf:{src}", tmp_path / "cache", streaming=True)
    dm.setup()
    assert _decoded(dm) == texts  # every document, in order, exactly (sentencepiece byte fallback)
    assert len(saved) > 2  # encoded in shards
    train, val = dm.store.train_docs, dm.store.val_docs
    assert len(train) and len(val) and not set(train) & set(val) and len(train) + len(val) == len(texts)
    assert [stream_mod.held_out(0, i, 0.2) for i in range(len(texts))] == [
        i in set(val) for i in range(len(texts))
    ]
    assert dm.store.names[3] == f"hf:{src}/train/3" and len(dm.store.names) == len(texts)
    assert not list((tmp_path / "cache").glob(".*"))  # the shards and temp folders are gone
    batch = next(iter(dm.train_dataloader()))
    assert batch["tokens"].shape == (4, SEQ)
    # The same corpus, read into memory with the tokenizer just trained: the same tokens per document.
    tok_path = dm.store.root / "tokenizer.model"
    mem = _dm(f"hf:{src}", tmp_path / "cache2", tokenizer=str(tok_path))
    mem.setup()
    assert [list(mem.store.doc_tokens(d)) for d in range(len(texts))] == [
        list(dm.store.doc_tokens(d)) for d in range(len(texts))
    ]


def test_stream_never_holds_the_corpus(tmp_path, monkeypatch):
    """The first shard is on disk before most of the stream has been read."""
    texts = _texts(60)
    src = _jsonl(tmp_path / "src", texts)
    monkeypatch.setattr(stream_mod, "SHARD_TOKENS", 1500)
    monkeypatch.setattr(stream_mod, "_ENCODE_BATCH", 4)  # documents per encode call (64 by default)
    read = {"n": 0, "at_first_shard": None}
    real = stream_mod._stream_one

    def counting(*args):
        for doc in real(*args):
            read["n"] += 1
            yield doc

    real_savez = np.savez

    def savez(path, **arrays):
        if read["at_first_shard"] is None:
            read["at_first_shard"] = read["n"]
        real_savez(path, **arrays)

    monkeypatch.setattr(stream_mod, "_stream_one", counting)
    dm = _dm(f"hf:{src}", tmp_path / "cache", streaming=True, tokenizer=str(_spm(tmp_path)))
    monkeypatch.setattr(np, "savez", savez)
    dm.setup()
    assert read["n"] == len(texts) and read["at_first_shard"] < len(texts) // 3


def test_an_interrupted_stream_resumes_after_its_last_shard(tmp_path, monkeypatch):
    texts = _texts(50)
    src = _jsonl(tmp_path / "src", texts)
    monkeypatch.setattr(stream_mod, "SHARD_TOKENS", 1500)
    monkeypatch.setattr(stream_mod, "_ENCODE_BATCH", 4)
    straight = _dm(f"hf:{src}", tmp_path / "a", streaming=True)
    straight.setup()
    real = stream_mod._stream_one
    passes = []

    def crashing(*args):
        passes.append(1)  # the first pass trains the tokenizer; the second, encoding, stops at document 30
        for i, doc in enumerate(real(*args)):
            if len(passes) == 2 and i == 30:
                raise KeyboardInterrupt
            yield doc

    monkeypatch.setattr(stream_mod, "_stream_one", crashing)
    with pytest.raises(KeyboardInterrupt):
        _dm(f"hf:{src}", tmp_path / "b", streaming=True).setup()
    shards = sorted((tmp_path / "b").glob(".*.stream/shard_*.npz"))
    assert 0 < len(shards)  # complete shards stay on disk
    monkeypatch.setattr(stream_mod, "_stream_one", real)
    resumed = _dm(f"hf:{src}", tmp_path / "b", streaming=True)
    resumed.setup()
    np.testing.assert_array_equal(np.asarray(resumed.store.tokens), np.asarray(straight.store.tokens))
    np.testing.assert_array_equal(resumed.store.val_docs, straight.store.val_docs)


def test_streamed_saved_dataset_and_errors(tmp_path):
    texts = _texts(12)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": texts + [""]})}).save_to_disk(
        str(tmp_path / "dd")
    )
    dm = _dm(f"hf:{tmp_path / 'dd'}", tmp_path / "cache", streaming=True, text_field="body", max_documents=10)
    dm.setup()
    assert _decoded(dm) == texts[:10]
    with pytest.raises(ValueError, match=r"hf_split='test' is not in the saved dataset .*\['train'\]"):
        _dm(f"hf:{tmp_path / 'dd'}", tmp_path / "c2", streaming=True, hf_split="test").setup()
    with pytest.raises(ValueError, match=r"text_field='text' is not a column .*\['body'\]"):
        _dm(f"hf:{tmp_path / 'dd'}", tmp_path / "c3", streaming=True).setup()
    with pytest.raises(ValueError, match=r"streaming=True reads hf: sources only, got corpus='stdlib'"):
        _dm("stdlib", tmp_path / "c4", streaming=True)


# ----- existing tokenizers ------------------------------------------------------------------------------------


def _spm(tmp_path):
    path = tmp_path / "given.model"
    if not path.exists():
        Tokenizer.train(_texts(30, seed=1), path, vocab_size=300)
    return path


def _hf_tokenizer(folder, declare=False):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    specials = ["<|endoftext|>"] + (["<my_bos>", "<my_pad>"] if declare else [])
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_texts(30, seed=2), trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    if declare:
        (folder / "special_tokens_map.json").write_text(
            json.dumps(
                {"bos_token": "<my_bos>", "eos_token": {"content": "<|endoftext|>"}, "pad_token": "<my_pad>"}
            )
        )
    return folder, tok


def test_existing_sentencepiece_model(tmp_path):
    src = _jsonl(tmp_path / "src", _texts())
    given = Tokenizer(_spm(tmp_path))
    dm = _dm(f"hf:{src}", tmp_path / "cache", tokenizer=str(_spm(tmp_path)))
    dm.setup()
    assert (dm.store.root / "tokenizer.model").read_bytes() == _spm(tmp_path).read_bytes()
    text = dm.text_of(0)
    assert list(dm.store.doc_tokens(0)) == [given.bos_id, *given.encode(text), given.eos_id]
    trained = _dm(f"hf:{src}", tmp_path / "cache")
    assert trained.cache_path() != dm.cache_path()  # the tokenizer is part of the cache key


def test_hugging_face_tokenizer_directory(tmp_path):
    folder, raw = _hf_tokenizer(tmp_path / "tok")
    texts = _texts()
    src = _jsonl(tmp_path / "src", texts)
    for streaming in (False, True):
        dm = _dm(
            f"hf:{src}",
            tmp_path / f"cache{streaming}",
            tokenizer=str(folder),
            vocab_size=None,  # taken from the tokenizer
            streaming=streaming,
        )
        dm.setup()
        assert isinstance(dm.tokenizer, HFTokenizer) and dm.vocab_size == raw.get_vocab_size()
        eot = raw.token_to_id("<|endoftext|>")
        assert (dm.tokenizer.bos_id, dm.tokenizer.eos_id, dm.tokenizer.pad_id) == (
            eot,
            eot,
            eot,
        )  # GPT-2 style
        assert sorted(_decoded(dm)) == sorted(texts)
        doc = dm.store.doc_tokens(0)
        assert list(doc) == [eot, *raw.encode(dm.text_of(0)).ids, eot]
    tok = load_tokenizer(str(folder / "tokenizer.json"))  # the file itself, not only its directory
    assert tok.vocab_size == raw.get_vocab_size()
    with pytest.raises(
        ValueError, match=rf"vocab_size=300 but data.tokenizer=.* has {raw.get_vocab_size()} ids"
    ):
        _dm(f"hf:{src}", tmp_path / "c", tokenizer=str(folder))


def test_hugging_face_special_tokens_are_read_from_its_files(tmp_path):
    folder, raw = _hf_tokenizer(tmp_path / "tok", declare=True)
    tok = load_tokenizer(str(folder))
    assert tok.bos_id == raw.token_to_id("<my_bos>") and tok.pad_id == raw.token_to_id("<my_pad>")
    assert tok.eos_id == raw.token_to_id("<|endoftext|>")
    assert tok.decode(tok.encode("abc def\n")) == "abc def\n"


def test_tokenizer_errors(tmp_path, monkeypatch):
    src = _jsonl(tmp_path / "src", _texts())
    with pytest.raises(
        FileNotFoundError, match=r"data.tokenizer='.*nope.model' does not exist; accepted: 'train'"
    ):
        _dm(f"hf:{src}", tmp_path / "c", tokenizer=str(tmp_path / "nope.model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json' does not exist"):
        _dm(f"hf:{src}", tmp_path / "c", tokenizer=str(tmp_path / "empty"))
    (tmp_path / "junk.model").write_text("not a model")
    with pytest.raises(ValueError, match=r"data.tokenizer=.*junk.model' is not a sentencepiece model"):
        _dm(f"hf:{src}", tmp_path / "c", tokenizer=str(tmp_path / "junk.model"))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match=r"data.tokenizer=.*junk.json' is not a Hugging Face tokenizer"):
        _dm(f"hf:{src}", tmp_path / "c", tokenizer=str(tmp_path / "junk.json"))
    folder, _ = _hf_tokenizer(tmp_path / "tok")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(MissingExtra, match=r"pip install 'rlm\[hf\]'"):
        load_tokenizer(str(folder))
