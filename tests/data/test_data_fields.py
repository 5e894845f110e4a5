"""Your own data and tokenizer: .jsonl/.json/.parquet read by field, clear errors for a wrong field or a folder
read with the wrong extensions, hf:PATH of a data file, and data.vocab_size taken from a tokenizer file."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import sentencepiece as spm
import torch
import yaml
from cli_helpers import CONFIGS, fit_args, run_rlm
from jsonargparse import Namespace

from rlm.cli.support import link_vocab
from rlm.data.corpus import fingerprint, read_corpus
from rlm.data.module import RLMDataModule
from rlm.data.pretrained import DEFAULT_VOCAB, resolve_vocab_size
from rlm.data.tokenizer import Tokenizer
from rlm.train.module import LMModule

# Rows as a user's dump has them: an id, the text under "body", some rows with empty or null text (skipped),
# text with newlines, indentation and non-ASCII characters that must come back exactly.
ROWS = [
    {"id": 0, "body": "def f(x):\n    return x + 1\n"},
    {"id": 1, "body": ""},
    {"id": 2, "body": "naïve café — 東京\n\ttabbed\n"},
    {"id": 3, "body": None},
    {"id": 4, "body": "last row, no newline"},
]
KEPT = [0, 2, 4]  # rows whose body is not empty
TEXTS = [ROWS[i]["body"] for i in KEPT]


def _write(path: Path, rows: list[dict]) -> Path:
    """``rows`` as a .jsonl, .json (a list of objects) or .parquet file, by ``path``'s ending."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    else:
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)  # several row groups
    return path


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".parquet"])
def test_record_files_are_read_by_field_one_document_per_row(tmp_path, ext):
    path = _write(tmp_path / f"data{ext}", ROWS)
    docs = read_corpus(str(path), text_field="body", progress=False)
    assert [d.text for d in docs] == TEXTS
    assert [d.name for d in docs] == [f"{path}/{i}" for i in KEPT]  # row numbers count the skipped rows
    assert [d.text for d in read_corpus(str(path), text_field="body", max_documents=2, progress=False)] == (
        TEXTS[:2]
    )
    # the same rows through a directory (with the ending in data.extensions) and a glob
    in_dir = read_corpus(str(tmp_path), text_field="body", extensions=[ext], progress=False)
    assert [d.text for d in in_dir] == TEXTS and in_dir[0].name == f"data{ext}/0"
    assert [
        d.text for d in read_corpus(str(tmp_path / f"*{ext}"), text_field="body", progress=False)
    ] == TEXTS


def test_a_folder_of_several_formats_reads_files_in_sorted_order(tmp_path):
    _write(tmp_path / "b.parquet", ROWS[:3])
    _write(tmp_path / "a" / "z.jsonl", ROWS[2:])
    (tmp_path / "c.txt").write_text("plain text stays one document\n")
    (tmp_path / "skip.csv").write_text("body\nnot read\n")
    docs = read_corpus(
        str(tmp_path), text_field="body", extensions=[".jsonl", ".parquet", ".txt"], progress=False
    )
    assert [d.name for d in docs] == ["a/z.jsonl/0", "a/z.jsonl/2", "b.parquet/0", "b.parquet/2", "c.txt"]
    assert [d.text for d in docs] == [
        ROWS[2]["body"],
        ROWS[4]["body"],
        ROWS[0]["body"],
        ROWS[2]["body"],
        "plain text stays one document\n",
    ]


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".parquet"])
def test_a_missing_field_names_it_and_the_fields_there_are(tmp_path, ext):
    path = _write(tmp_path / f"data{ext}", ROWS)
    with pytest.raises(ValueError, match=r"text_field='text' is not a (field|column) .*\['id', 'body'\]"):
        read_corpus(str(path), progress=False)
    with pytest.raises(ValueError, match=r"text_field='id' .* row 0 is int, not text"):
        read_corpus(str(path), text_field="id", progress=False)


def test_malformed_json_files_are_errors_naming_the_place(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl' line 3 is not JSON"):
        read_corpus(str(bad), progress=False)
    obj = tmp_path / "obj.json"
    obj.write_text('{"text": "a dict, not rows"}')
    with pytest.raises(ValueError, match=r"obj.json' holds a JSON dict; accepted: a list of objects"):
        read_corpus(str(obj), progress=False)
    lines = tmp_path / "lines.json"  # JSON lines under a .json name: read as datasets reads them
    lines.write_text('{"text": "one"}\n{"text": "two"}\n')
    assert [d.text for d in read_corpus(str(lines), progress=False)] == ["one", "two"]
    scalars = tmp_path / "scalars.jsonl"
    scalars.write_text('"just a string"\n')
    with pytest.raises(ValueError, match=r"row 0 of corpus file .*scalars.jsonl' is a JSON str"):
        read_corpus(str(scalars), progress=False)
    some = tmp_path / "some.jsonl"  # a later row without the field is skipped, with a warning that counts it
    some.write_text('{"text": "a"}\n{"other": "b"}\n{"text": "c"}\n')
    with pytest.warns(UserWarning, match=r"skipped 1 row\(s\) of .*some.jsonl' without a 'text' field"):
        assert [d.text for d in read_corpus(str(some), progress=False)] == ["a", "c"]


def test_a_folder_without_files_of_the_read_extensions_names_data_extensions(tmp_path):
    _write(tmp_path / "d" / "x.jsonl", ROWS)
    _write(tmp_path / "d" / "sub" / "y.jsonl", ROWS)
    (tmp_path / "d" / "notes.csv").write_text("a,b\n")
    with pytest.raises(
        ValueError,
        match=r"has no files ending in data.extensions=\['.py', '.txt', '.md'\]; it holds .jsonl \(2\), "
        r".csv \(1\)\. Set data.extensions .* --data.extensions='\[.jsonl\]'",
    ):
        read_corpus(str(tmp_path / "d"), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"corpus directory .*empty' holds no files"):
        read_corpus(str(tmp_path / "empty"), progress=False)


def test_the_fingerprint_follows_the_documents_text_field_included(tmp_path):
    rows = [{"a": f"first field {i}\n", "b": f"second field {i}\n"} for i in range(3)]
    path = _write(tmp_path / "d" / "rows.jsonl", rows)
    by_a = fingerprint(read_corpus(str(path), text_field="a", progress=False))
    assert by_a == fingerprint(read_corpus(str(path), text_field="a", progress=False))  # stable
    assert by_a != fingerprint(read_corpus(str(path), text_field="b", progress=False))
    # a folder's names are relative to it: the same files elsewhere fingerprint the same
    shutil.copytree(tmp_path / "d", tmp_path / "moved")
    here, there = (
        fingerprint(read_corpus(str(tmp_path / f), text_field="a", extensions=[".jsonl"], progress=False))
        for f in ("d", "moved")
    )
    assert here == there
    # plain text files do not depend on text_field: the same documents, the same fingerprint (and cache)
    (tmp_path / "t.txt").write_text("text\n")
    assert fingerprint(read_corpus(str(tmp_path / "t.txt"), text_field="x", progress=False)) == fingerprint(
        read_corpus(str(tmp_path / "t.txt"), progress=False)
    )


@pytest.mark.parametrize("ext", [".jsonl", ".parquet"])
def test_hf_path_of_a_local_data_file_reads_through_datasets(tmp_path, monkeypatch, ext):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    from rlm.data.store import stream_documents

    path = _write(tmp_path / f"a{ext}", ROWS)
    docs = read_corpus(f"hf:{path}", text_field="body", progress=False)
    assert [d.text for d in docs] == TEXTS and docs[0].name == f"hf:{path}/train/0"
    streamed = list(stream_documents([f"hf:{path}"], "train", None, "body", None))
    assert [d.text for d in streamed] == TEXTS
    with pytest.raises(ValueError, match=r"text_field='text' is not a column .*\['id', 'body'\]"):
        read_corpus(f"hf:{path}", progress=False)
    odd = tmp_path / "a.xyz"
    odd.write_text("?")
    with pytest.raises(ValueError, match=r"hf:.*a.xyz is a file datasets cannot read .*'.jsonl'"):
        read_corpus(f"hf:{odd}", progress=False)


def test_malformed_hf_data_files_are_errors_naming_the_file(tmp_path, monkeypatch, rlm_main):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    from rlm.data.store import stream_documents

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": oops}\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "bad.csv").write_text("text,n\na,1\nb,2,3,4\n")
    cases = {
        "bad.jsonl": r"bad.jsonl' line 3 is not JSON",
        "empty.jsonl": r"hf:.*empty.jsonl is empty; accepted: a json data file with at least one row",
        "blank.jsonl": r"hf:.*blank.jsonl is empty",
        "bad.csv": r"hf:.*bad.csv cannot be read as csv data: .*Expected 2 fields in line 3",
    }
    for name, message in cases.items():  # read whole, and streamed (datasets fails midway then)
        with pytest.raises(ValueError, match=message):
            read_corpus(f"hf:{tmp_path / name}", progress=False)
        with pytest.raises(ValueError, match=message):
            list(stream_documents([f"hf:{tmp_path / name}"], "train", None, "text", None))
    # and through the command line, as the user meets it
    args = [*fit_args(), f"--data.corpus=hf:{bad}", "--data.streaming=true", f"--data.cache_dir={tmp_path}"]
    proc = rlm_main(args, tmp_path)
    assert proc.returncode == 2 and "bad.jsonl' line 3 is not JSON" in proc.stderr, proc.stderr


# ---- data.vocab_size from the tokenizer -----------------------------------------------------------------
def _stdlib_texts(n: int) -> list[str]:
    """The first n stdlib sources (sorted), as a user's text field would hold them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8") for p in sorted(root.glob("[a-m]*.py"))[:n]]


SPM_VOCAB = 600  # the given tokenizer's size: neither the default 4096 nor the tiny config's 1024


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "given.model"
    Tokenizer.train(_stdlib_texts(12), path, vocab_size=SPM_VOCAB)
    return path


def test_vocab_size_follows_a_sentencepiece_file(tmp_path, spm_model):
    corpus = _write(tmp_path / "c.jsonl", [{"text": t} for t in _stdlib_texts(6)])
    common = dict(seq_len=32, segment_len=8, cache_dir=str(tmp_path / "cache"), progress=False)
    dm = RLMDataModule(str(corpus), tokenizer=str(spm_model), **common)
    assert dm.vocab_size == SPM_VOCAB and dm.hparams["vocab_size"] == SPM_VOCAB  # saved resolved, for eval
    same = RLMDataModule(str(corpus), tokenizer=str(spm_model), vocab_size=SPM_VOCAB, **common)
    assert same.vocab_size == SPM_VOCAB
    with pytest.raises(
        ValueError, match=rf"data.vocab_size=512 but data.tokenizer=.*given.model' has {SPM_VOCAB} ids"
    ):
        RLMDataModule(str(corpus), tokenizer=str(spm_model), vocab_size=512, **common)
    dm.setup()
    assert int(dm.store.tokens.max()) < SPM_VOCAB and dm.tokenizer.vocab_size == SPM_VOCAB
    assert RLMDataModule(str(corpus), **common).vocab_size == DEFAULT_VOCAB  # trained, unset: the default


def test_vocab_size_follows_a_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate("abcdefghij ")}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.save(str(tmp_path / "tokenizer.json"))
    assert resolve_vocab_size(None, str(tmp_path / "tokenizer.json")) == len(vocab) == 13
    assert resolve_vocab_size(None, str(tmp_path)) == 13  # the folder holding it
    with pytest.raises(ValueError, match=r"data.vocab_size=4096 but data.tokenizer=.* has 13 ids"):
        resolve_vocab_size(4096, str(tmp_path))


def test_the_cli_link_gives_the_model_the_tokenizers_size(spm_model):
    cfg = Namespace(
        data=Namespace(vocab_size=None, tokenizer=str(spm_model)),
        model=Namespace(model=Namespace(vocab_size=1)),
    )
    link_vocab(cfg)
    assert cfg.data.vocab_size == SPM_VOCAB and cfg.model.model.vocab_size == SPM_VOCAB
    cfg = Namespace(data=Namespace(vocab_size=None, tokenizer="train"), model=Namespace(model=None))
    link_vocab(cfg)
    assert cfg.data.vocab_size == DEFAULT_VOCAB
    cfg = Namespace(data=Namespace(vocab_size=1024, tokenizer=str(spm_model)), model=Namespace(model=None))
    with pytest.raises(ValueError, match=rf"data.vocab_size=1024 but .* has {SPM_VOCAB} ids"):
        link_vocab(cfg)


def test_the_default_config_takes_the_vocabulary_of_a_given_tokenizer(tmp_path, spm_model, rlm_main):
    """configs/default.yaml leaves data.vocab_size unset (4096 for a trained tokenizer), so a tokenizer file
    sizes the model with no other flag; --print_config shows what runs."""
    args = ["fit", "--config", CONFIGS / "default.yaml", f"--data.tokenizer={spm_model}", "--print_config"]
    cfg = yaml.safe_load(rlm_main(args, tmp_path).stdout)
    assert cfg["data"]["vocab_size"] == SPM_VOCAB and cfg["model"]["model"]["vocab_size"] == SPM_VOCAB


def _word_texts(n_docs: int, seed: int = 0) -> list[str]:
    """Documents of pseudo-random words, 3 to 40 of them: short, so that most validation batches hold padding."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    texts = []
    for _ in range(n_docs):
        words = [
            "".join(rng.choice(letters, int(rng.integers(1, 8)))) for _ in range(int(rng.integers(3, 40)))
        ]
        texts.append(" ".join(words) + "\n")
    return texts


@pytest.mark.parametrize("byte_fallback", [False, True])
def test_a_sentencepiece_model_trained_with_its_defaults_trains(tmp_path, byte_fallback):
    """sentencepiece's defaults have no pad piece (pad_id=-1): padding used to index the embedding at -1 and the
    first validation failed with 'IndexError: index out of range in self'."""
    texts = _word_texts(80)
    prefix = tmp_path / "own"
    vocab = 300 if byte_fallback else 200  # 256 byte pieces + specials + a few learned
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=vocab, byte_fallback=byte_fallback,
        minloglevel=2,
    )  # fmt: skip
    tok = Tokenizer(f"{prefix}.model")
    assert tok._sp.pad_id() == -1  # the defaults: no pad piece
    assert 0 <= tok.pad_id < tok.vocab_size and tok.pad_id not in (tok.bos_id, tok.eos_id)
    corpus = _write(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    dm = RLMDataModule(
        str(corpus), tokenizer=f"{prefix}.model", seq_len=32, segment_len=8, batch_size=4, val_fraction=0.25,
        cache_dir=str(tmp_path / "cache"), progress=False,
    )  # fmt: skip
    module = LMModule(
        model=dict(vocab_size=dm.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=32),
        peak_flops=1e12,
    )
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, limit_train_batches=2, limit_val_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)  # the sanity check and the epoch's end validate on padded batches
    val = [b for _, b in zip(range(2), dm.val_dataloader())]
    assert any((~b["mask"]).any() for b in val), (
        "no padding in the validation batches: the test shows nothing"
    )
    for b in val:
        assert (b["tokens"][~b["mask"]] == tok.pad_id).all() and (b["targets"][~b["mask"]] == -100).all()
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["val/loss"])


def test_a_sentencepiece_model_without_bos_or_eos(tmp_path):
    """Documents are framed [bos] + ids + [eos]: a model with one of them uses it for both; with neither, a clear
    error instead of -1 ids in the token store."""
    texts = _word_texts(40)
    for name, ids in {"no_bos": dict(bos_id=-1), "neither": dict(bos_id=-1, eos_id=-1)}.items():
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_prefix=str(tmp_path / name),
            vocab_size=200,
            minloglevel=2,
            **ids,
        )
    tok = Tokenizer(tmp_path / "no_bos.model")
    assert tok.bos_id == tok.eos_id == tok._sp.eos_id() >= 0
    with pytest.raises(ValueError, match="neither a bos nor an eos piece"):
        Tokenizer(tmp_path / "neither.model")


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_fit_on_a_jsonl_field_with_a_tokenizer_file(tmp_path, rlm_cache, spm_model):
    rows = [{"id": i, "code": t} for i, t in enumerate(_stdlib_texts(30))]
    corpus = _write(tmp_path / "mine.jsonl", rows)
    args = fit_args() + [
        f"--data.corpus={corpus}",
        "--data.text_field=code",
        f"--data.tokenizer={spm_model}",
        "--data.vocab_size=null",  # the tiny config sets 1024: unset, it follows the tokenizer
        "--trainer.max_steps=2",
    ]
    run_rlm(args, tmp_path, rlm_cache)
    state = torch.load(tmp_path / "runs/test/ckpt/last.ckpt", map_location="cpu", weights_only=False)
    assert state["hyper_parameters"]["model"]["vocab_size"] == SPM_VOCAB
    assert state["datamodule_hyper_parameters"]["text_field"] == "code"
    assert state["global_step"] == 2
