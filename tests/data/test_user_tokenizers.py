"""Tokenizers as users bring them (``--data.tokenizer PATH``): any sentencepiece model and any tokenizer.json
train with ``rlm fit``, and the checkpoint carries the tokenizer, so every command that reads the checkpoint
works after the original file is gone."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from cli_helpers import fit_args

from rlm.data.carried import data_settings, tokenizer_file
from rlm.data.pretrained import load_tokenizer

TEXT = Path(json.__file__).read_text().splitlines(keepends=True)  # a stdlib text to train tokenizers on
CKPT = Path("runs/test/ckpt/last.ckpt")
TASKS = Path(__file__).resolve().parents[1] / "lm_eval_tasks"  # offline lm-eval tasks
HARNESS = importlib.util.find_spec("lm_eval") is not None


def _sentencepiece(folder: Path, **options) -> Path:
    """A sentencepiece model trained with its own defaults (pad_id=-1: no pad piece) and ``options``."""
    folder.mkdir()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT),
        model_prefix=str(folder / "own"),
        minloglevel=2,
        **{"vocab_size": 300, **options},
    )
    return folder / "own.model"


def _bpe(folder: Path, specials: list[str], declared: dict[str, str] | None = None) -> Path:
    """A byte-level BPE tokenizer.json trained with the tokenizers library; ``declared`` writes the
    special_tokens_map.json beside it (then the folder is what data.tokenizer names)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=350,
        special_tokens=specials,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT, trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    if declared is None:
        return folder / "tokenizer.json"
    (folder / "special_tokens_map.json").write_text(json.dumps(declared))
    return folder


TOKENIZERS = {
    "sentencepiece_defaults": lambda d: _sentencepiece(d),  # pad_id=-1
    "sentencepiece_no_pad_no_bos": lambda d: _sentencepiece(d, bos_id=-1),  # eos frames documents alone
    "sentencepiece_byte_fallback": lambda d: _sentencepiece(d, byte_fallback=True, vocab_size=400),
    "tokenizer_json_gpt2_like": lambda d: _bpe(d, ["<|endoftext|>"]),  # bos, eos and pad in one token
    "tokenizer_folder_declared": lambda d: _bpe(
        d, ["<my_pad>", "<my_bos>", "<my_eos>"], {"bos_token": "<my_bos>", "eos_token": "<my_eos>"}
    ),
}


def _fit_args(tokenizer: Path, *more: str) -> list:
    """A tiny `rlm fit` (2 steps, 40 documents) with ``tokenizer``."""
    return fit_args() + [
        f"--data.tokenizer={tokenizer}",
        "--data.vocab_size=null",
        "--data.max_documents=40",
        "--trainer.max_steps=2",
        *more,
    ]


def _fit(rlm_main, tmp_path: Path, tokenizer: Path) -> None:
    run = rlm_main(_fit_args(tokenizer), tmp_path, tmp_path / "cache")
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_a_users_tokenizer_trains_and_evaluates_after_its_file_is_gone(tmp_path, rlm_main, kind):
    source = TOKENIZERS[kind](tmp_path / "tok")
    original = load_tokenizer(str(source))
    _fit(rlm_main, tmp_path, source)
    ckpt = torch.load(tmp_path / CKPT, map_location="cpu", weights_only=False)
    assert ckpt["hyper_parameters"]["model"]["vocab_size"] == original.vocab_size
    shutil.rmtree(tmp_path / "tok")
    entries = sorted((tmp_path / "cache").iterdir())
    run = rlm_main(["eval", "--ckpt", CKPT], tmp_path, tmp_path / "cache")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "bits/byte" in run.stdout
    # the copy has the original's cache key: the training run's token cache is read, not a new one encoded
    assert sorted(p for p in (tmp_path / "cache").iterdir() if p.name != "tokenizers") == entries
    carried = load_tokenizer(tokenizer_file(ckpt, CKPT, data_settings(ckpt, CKPT)))
    text = "def f(x):\n    return {'a': x}  # é"
    assert carried.encode(text) == original.encode(text)
    ids = ("bos_id", "eos_id", "pad_id", "unk_id", "vocab_size")
    assert [getattr(carried, i) for i in ids] == [getattr(original, i) for i in ids]


@pytest.mark.parametrize("kind", ["sentencepiece_defaults", "tokenizer_folder_declared"])
def test_every_reader_uses_the_tokenizer_the_checkpoint_carries(tmp_path, rlm_main, kind):
    """generate, export, a kNN-LM datastore, a retrieval index, lm-eval tasks and resuming, after the file is gone
    (resuming names it again, as the run's own command line does)."""
    source = TOKENIZERS[kind](tmp_path / "tok")
    _fit(rlm_main, tmp_path, source)
    shutil.rmtree(tmp_path / "tok")
    # the tasks name their data files from the repository's root
    shutil.copytree(TASKS, tmp_path / "tests" / "lm_eval_tasks")
    failed = []
    for args in (
        ["generate", "--ckpt", CKPT, "--prompt", "def ", "--max-new-tokens", "4"],
        ["export", "--ckpt", CKPT, "--out", "exported"],
        ["knnlm", "build", "--ckpt", CKPT, "--out", "ds", "--max-documents", "4", "--tune-tokens", "0"],
        ["index", "build", "--ckpt", CKPT, "--out", "idx", "--factory", "Flat", "--quiet"],
        *[["eval", "--ckpt", CKPT, "--tasks-path", TASKS, "--tasks", "rlm_tiny_ll", "--limit", "2"]]
        * HARNESS,
    ):
        run = rlm_main(args, tmp_path, tmp_path / "cache")
        failed += [run.stderr[-2000:]] if run.returncode else []
    resumed = rlm_main(
        _fit_args(source, "--ckpt_path=last", "--trainer.max_steps=3"), tmp_path, tmp_path / "cache"
    )
    failed += [resumed.stderr[-2000:]] if resumed.returncode else []
    assert not failed, "\n".join(failed)
    exported = {p.name for p in (tmp_path / "exported").iterdir()}
    assert ("tokenizer.model" in exported) == kind.startswith("sentencepiece")
    assert ("special_tokens_map.json" in exported) == (kind == "tokenizer_folder_declared")
    if importlib.util.find_spec(
        "transformers"
    ):  # either loads in AutoTokenizer, with rlm's ids (docs/CLI.md)
        from transformers import AutoTokenizer

        auto = AutoTokenizer.from_pretrained(tmp_path / "exported", trust_remote_code=True)
        file = "tokenizer.model" if kind.startswith("sentencepiece") else "tokenizer.json"
        ours = load_tokenizer(str(tmp_path / "exported" / file))
        text = "def f(x):\n    return {'a': x}  # é"
        assert auto(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert torch.load(tmp_path / CKPT, map_location="cpu", weights_only=False)["global_step"] == 3


def test_a_hub_name_or_a_slow_tokenizers_folder_is_a_clear_error(tmp_path):
    """data.tokenizer is read from local files by the tokenizers library, not AutoTokenizer (as README says)."""
    with pytest.raises(
        FileNotFoundError, match=r"data.tokenizer='openai-community/gpt2' does not exist; accepted"
    ):
        load_tokenizer("openai-community/gpt2")
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "vocab.json").write_text("{}")
    (tmp_path / "slow" / "merges.txt").write_text("")
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json' does not exist; accepted"):
        load_tokenizer(str(tmp_path / "slow"))
