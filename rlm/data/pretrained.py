"""Existing tokenizers for ``data.tokenizer``: a sentencepiece model file, or a Hugging Face ``tokenizer.json`` (or
its directory), whose special ids come from the transformers files beside it, else the usual names. A tokenizer with
only an end-of-text token (GPT-2) uses it for bos, eos and padding (masked out, so its id does not matter)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlm.data.tokenizer import SpecialIds, Tokenizer
from rlm.extras import require

TRAIN = "train"  # the data.tokenizer value that trains a sentencepiece model on the corpus
ACCEPTED = (
    "'train' (a sentencepiece model trained on the corpus), the path of a sentencepiece .model file, or a "
    "Hugging Face tokenizer: a tokenizer.json file or the directory holding it"
)
DEFAULT_VOCAB = 4096  # data.vocab_size when it is unset and the tokenizer is trained on the corpus
HF_FILES = ("tokenizer.json", "special_tokens_map.json", "tokenizer_config.json")
_CANDIDATES = {
    "bos": ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]", "<|endoftext|>"),
    "eos": ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "[SEP]"),
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
    "unk": ("<unk>", "[UNK]", "<|unk|>"),
}


class HFTokenizer(SpecialIds):
    """A Hugging Face ``tokenizers`` tokenizer with the same interface as the sentencepiece :class:`Tokenizer`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        tokenizers = require("tokenizers", "hf", "a Hugging Face tokenizer")
        self.path = str(path)
        file = _hf_file(Path(path))
        self._tok = tokenizers.Tokenizer.from_file(str(file))
        names = _declared_specials(file.parent)
        ids = {}
        for kind, candidates in _CANDIDATES.items():
            for token in ([names[kind]] if kind in names else []) + list(candidates):
                if (i := self._tok.token_to_id(token)) is not None:
                    ids[kind] = i
                    break
        if "eos" not in ids and "bos" not in ids:
            raise ValueError(
                f"tokenizer {self.path!r} has no beginning- or end-of-text token (looked for "
                f"{_CANDIDATES['bos'] + _CANDIDATES['eos']} and special_tokens_map.json); documents need one"
            )
        self.bos_id = ids.get("bos", ids.get("eos"))
        self.eos_id = ids.get("eos", self.bos_id)
        self.pad_id = ids.get("pad", self.eos_id)
        self.unk_id = ids.get("unk", self.pad_id)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _hf_file(path: Path) -> Path:
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"data.tokenizer: {str(file)!r} does not exist; accepted: {ACCEPTED}")
    return file


def _declared_specials(folder: Path) -> dict[str, str]:
    """bos/eos/pad/unk token strings declared by transformers' files beside tokenizer.json."""
    out: dict[str, str] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # the second wins
        path = folder / name
        if path.is_file():
            for kind in _CANDIDATES:
                value: Any = json.loads(path.read_text()).get(f"{kind}_token")
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    out[kind] = value
    return out


def is_sentencepiece(path: Path) -> bool:
    """A file that is not JSON is taken for a sentencepiece model (a binary protobuf)."""
    return path.is_file() and path.suffix != ".json"


def load_tokenizer(spec: str) -> Tokenizer | HFTokenizer:
    """The existing tokenizer ``data.tokenizer`` names, with a clear error for a missing or unreadable file."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data.tokenizer={spec!r} does not exist; accepted: {ACCEPTED}")
    if is_sentencepiece(path):
        try:
            return Tokenizer(path)
        except (OSError, RuntimeError) as err:
            raise ValueError(
                f"data.tokenizer={spec!r} is not a sentencepiece model ({err}); accepted: {ACCEPTED}"
            ) from err
    try:
        return HFTokenizer(path)
    except Exception as err:
        if isinstance(err, (FileNotFoundError, ModuleNotFoundError, ValueError)):
            raise
        raise ValueError(
            f"data.tokenizer={spec!r} is not a Hugging Face tokenizer ({err}); accepted: {ACCEPTED}"
        ) from err


def resolve_vocab_size(vocab_size: int | None, tokenizer: str | None = TRAIN) -> int:
    """``data.vocab_size`` as the model is sized by it: a given tokenizer's number of ids (ValueError when a set
    ``vocab_size`` disagrees), else ``vocab_size`` (DEFAULT_VOCAB when unset)."""
    if tokenizer in (None, TRAIN):
        return DEFAULT_VOCAB if vocab_size is None else vocab_size
    n_ids = load_tokenizer(tokenizer).vocab_size
    if vocab_size is not None and vocab_size != n_ids:
        raise ValueError(
            f"data.vocab_size={vocab_size} but data.tokenizer={tokenizer!r} has {n_ids} ids; accepted: "
            f"{n_ids}, or leave data.vocab_size unset (null) to take it from the tokenizer"
        )
    return n_ids


def tokenizer_digest(spec: str) -> str:
    """sha256 of the tokenizer's files, for the cache key (the same file under another path shares a cache)."""
    path = Path(spec).expanduser()
    if is_sentencepiece(path):
        files = [path]
    else:
        files = [f for f in (_hf_file(path).parent / n for n in HF_FILES) if f.is_file()]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def copy_tokenizer(spec: str, dest: Path) -> Tokenizer | HFTokenizer:
    """Copy the tokenizer into a cache entry (``tokenizer.model``, or ``hf_tokenizer/``) and open the copy."""
    path = Path(spec).expanduser()
    if is_sentencepiece(path):
        shutil.copyfile(path, dest / "tokenizer.model")
        return Tokenizer(dest / "tokenizer.model")
    folder = dest / "hf_tokenizer"
    folder.mkdir()
    file = _hf_file(path)
    shutil.copyfile(file, folder / "tokenizer.json")
    for name in HF_FILES[1:]:
        if (file.parent / name).is_file():
            shutil.copyfile(file.parent / name, folder / name)
    return HFTokenizer(folder)


def open_cached(root: Path) -> Tokenizer | HFTokenizer:
    """The tokenizer of a cache entry."""
    hf = root / "hf_tokenizer"
    return HFTokenizer(hf) if hf.is_dir() else Tokenizer(root / "tokenizer.model")
