"""A sentencepiece tokenizer trained on the corpus, with fixed special ids (pad=0, unk=1, bos=2, eos=3); a user's
own model that lacks some of them (sentencepiece's defaults have no pad piece) gets a valid stand-in id."""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal, get_args

import sentencepiece as spm

ModelType = Literal["bpe", "unigram", "char", "word"]
MODEL_TYPES = get_args(ModelType)
# Sentences longer than this (bytes) are dropped by the trainer; chunks of _CHUNK_CHARS stay well below it.
_MAX_SENTENCE_BYTES = 16384
_CHUNK_CHARS = 2000


def _chunks(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    """Cut texts at line ends into pieces of at most _CHUNK_CHARS characters; stop after `max_chars` in all."""
    total = 0
    for text in texts:
        start = 0
        while start < len(text) and total < max_chars:
            end = min(start + _CHUNK_CHARS, len(text))
            if end < len(text):  # prefer to cut after a newline, so the trainer sees whole lines
                newline = text.rfind("\n", start, end)
                end = newline + 1 if newline > start else end
            total += end - start
            yield text[start:end]
            start = end
        if total >= max_chars:
            return


class SpecialIds:
    """The special ids and pickling both tokenizers share (this one and rlm.data.pretrained.HFTokenizer): a trained
    model's pad, unk, bos and eos are 0, 1, 2, 3; another stands in for a tokenizer lacking one."""

    path: str
    pad_id: int
    unk_id: int  # never emitted by a byte-fallback model
    bos_id: int  # begins each document
    eos_id: int  # ends each document

    # The tokenizer is a native object: ship the path to worker processes and reopen there.
    def __getstate__(self) -> dict[str, str]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["path"])


class Tokenizer(SpecialIds):
    """A sentencepiece model on disk; encodes any text (byte fallback) and decodes it back exactly."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self._sp = spm.SentencePieceProcessor(model_file=self.path)
        bos, eos = self._sp.bos_id(), self._sp.eos_id()  # -1: the model has no such piece
        if bos < 0 and eos < 0:
            raise ValueError(
                f"tokenizer {self.path!r} has neither a bos nor an eos piece (bos_id=eos_id=-1); documents are "
                "framed as [bos] + ids + [eos] and need one: train it with bos_id or eos_id >= 0"
            )
        self.bos_id = bos if bos >= 0 else eos
        self.eos_id = eos if eos >= 0 else bos
        # Padding is never trained on (targets there are -100, mask False), so any valid id does; unk, which every
        # sentencepiece model has, is the one a byte-fallback model never emits.
        self.unk_id = self._sp.unk_id()
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.unk_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, special ids included."""
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without bos/eos."""
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=-1)  # sentencepiece's threads

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; pad/bos/eos are dropped."""
        return self._sp.decode([int(i) for i in ids])

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        path: str | os.PathLike[str],
        *,
        vocab_size: int,
        model_type: ModelType = "bpe",
        max_chars: int = 20_000_000,
        seed: int = 0,
    ) -> Tokenizer:
        """Train on `texts` (at most `max_chars` characters), write the model to `path`."""
        if model_type not in MODEL_TYPES:
            raise ValueError(f"tokenizer_model_type={model_type!r}; accepted: {list(MODEL_TYPES)}")
        spm.set_random_generator_seed(seed)
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=_chunks(texts, max_chars),
                model_writer=model,
                vocab_size=vocab_size,
                model_type=model_type,
                pad_id=0,
                unk_id=1,
                bos_id=2,
                eos_id=3,
                byte_fallback=True,  # any text encodes, none maps to unk
                character_coverage=1.0,
                # Code: keep text exactly as written (indentation, newlines), so decode(encode(x)) == x.
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                add_dummy_prefix=False,
                allow_whitespace_only_pieces=True,
                split_digits=True,
                max_sentence_length=_MAX_SENTENCE_BYTES,
                num_threads=os.cpu_count() or 1,
                minloglevel=2,
            )
        except RuntimeError as err:  # 'Vocabulary size too high': name the largest size that works
            if found := re.search(r"Vocabulary size too high.*?<=\s*(\d+)", str(err)):
                raise ValueError(
                    f"vocab_size={vocab_size} is too large for this corpus's training split; "
                    f"the largest that works is {found.group(1)} (use a smaller vocab_size or a larger corpus)"
                ) from err
            raise ValueError(
                f"sentencepiece could not train a tokenizer with vocab_size={vocab_size}: {err}"
            ) from err
        Path(path).write_bytes(model.getvalue())  # into the cache entry's temporary folder (store.new_entry)
        return cls(path)
