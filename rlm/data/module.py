"""RLMDataModule: corpus -> cached tokenizer and token array -> segments -> windows -> loaders."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from rlm.data.corpus import Document, fingerprint, read_corpus
from rlm.data.pretrained import TRAIN, HFTokenizer, resolve_vocab_size, tokenizer_digest
from rlm.data.segments import SegmentTable
from rlm.data.store import CacheKey, TokenStore, build_store, build_stream_store, stream_documents, stream_key
from rlm.data.tokenizer import ModelType, Tokenizer
from rlm.data.windows import TrainLoader, Windows, eval_loader

_MIN_VOCAB = 4 + 256 + 1  # special ids, the 256 byte-fallback pieces, at least one learned piece


class RLMDataModule(pl.LightningDataModule):
    """Language-modelling windows over a tokenized corpus, with global segment ids for retrieval.

    Args:
        corpus: "stdlib" (this interpreter's standard library sources); a file, directory or glob (.jsonl, .json
            and .parquet files are read by text_field, others as one text each); "hf:NAME" (a Hugging Face dataset
            name, the path of one saved with save_to_disk, or of a data file); or a list of these.
        hf_split: Split of a Hugging Face dataset.
        hf_config: Configuration name of a Hugging Face dataset.
        text_field: Field holding the text in .jsonl, .json and .parquet files and in hf: datasets.
        extensions: File name endings read from directories.
        max_documents: Keep only the first N documents (sorted order), for quick runs; None keeps all.
        vocab_size: Number of token ids, special ids included (None: 4096, or a given tokenizer's).
        seq_len: Training window length in tokens; a multiple of segment_len.
        segment_len: Retrieval segment length in tokens.
        batch_size: Training batch size (per device).
        val_batch_size: Validation/test batch size; None uses batch_size.
        val_fraction: Fraction of documents held out for validation (split by document, seeded).
        test_fraction: Fraction of documents held out for testing (``rlm test``), disjoint from validation.
        seed: Seed of the split, the tokenizer trainer and the training order.
        cache_dir: Where tokenizers and token arrays are cached; None uses $RLM_CACHE or ~/.cache/rlm.
        num_workers: Loader worker processes (0: batches are sliced from the memory map in the main process).
        tokenizer_model_type: sentencepiece model type: bpe, unigram, char or word.
        max_tokenizer_chars: Characters of training text the tokenizer trainer sees.
        progress: Show progress bars while reading, training the tokenizer and encoding.
        tokenizer: "train" (None) trains a sentencepiece model on the training documents; or the path of a
            sentencepiece .model file, or of a Hugging Face tokenizer.json or its directory (extra ``hf``).
        streaming: Encode hf: sources on the fly into shards on disk, never holding the corpus in memory.
        dedup_threshold: Of each group of documents whose word 5-gram sets have Jaccard >= this, keep only the
            first (before the split; not with streaming). None removes none.
    """

    def __init__(
        self,
        corpus: str | list[str] = "stdlib",
        hf_split: str = "train",
        hf_config: str | None = None,
        text_field: str = "text",
        extensions: list[str] = [".py", ".txt", ".md"],  # noqa: B006 (copied below; jsonargparse shows it)
        max_documents: int | None = None,
        vocab_size: int | None = None,
        seq_len: int = 256,
        segment_len: int = 64,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        seed: int = 0,
        cache_dir: str | None = None,
        num_workers: int = 0,
        tokenizer_model_type: ModelType = "bpe",
        max_tokenizer_chars: int = 20_000_000,
        progress: bool = True,
        tokenizer: str | None = TRAIN,
        streaming: bool = False,
        dedup_threshold: float | None = 0.8,
    ) -> None:
        super().__init__()
        tokenizer = TRAIN if tokenizer is None else tokenizer
        # an existing tokenizer is opened now: a missing file or a disagreeing vocab_size fails before any work
        vocab_size = resolve_vocab_size(vocab_size, tokenizer)  # before save_hyperparameters: saved resolved
        positive = dict(vocab_size=vocab_size, seq_len=seq_len, segment_len=segment_len, batch_size=batch_size,
                        max_tokenizer_chars=max_tokenizer_chars, max_documents=max_documents,
                        val_batch_size=val_batch_size)  # fmt: skip
        for name, value in positive.items():  # None: unset
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}; accepted: a positive integer")
        specs = [corpus] if isinstance(corpus, str) else list(corpus)
        if streaming and not all(isinstance(c, str) and c.startswith("hf:") for c in specs):
            raise ValueError(
                f"streaming=True reads hf: sources only, got corpus={corpus!r}; accepted: 'hf:NAME'"
            )
        if tokenizer == TRAIN and vocab_size < _MIN_VOCAB:
            raise ValueError(
                f"vocab_size={vocab_size}; accepted: >= {_MIN_VOCAB} (4 special ids + 256 byte pieces)"
            )
        if seq_len % segment_len:
            raise ValueError(f"seq_len={seq_len} is not a multiple of segment_len={segment_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction}; accepted: 0 <= val_fraction < 1")
        if not 0.0 <= test_fraction < 1.0 or val_fraction + test_fraction >= 1.0:
            raise ValueError(
                f"test_fraction={test_fraction} (val_fraction={val_fraction}); accepted: 0 <= test_fraction < 1 "
                "and val_fraction + test_fraction < 1"
            )
        if dedup_threshold is not None and not 0.0 < dedup_threshold <= 1.0:
            raise ValueError(f"dedup_threshold={dedup_threshold}; accepted: None (no removal) or 0 < t <= 1")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers}; accepted: >= 0")
        self.save_hyperparameters()
        self.corpus, self.specs, self.max_documents = corpus, specs, max_documents
        self.hf_split, self.hf_config, self.text_field = hf_split, hf_config, text_field
        self.extensions = list(extensions)
        self.vocab_size_requested = vocab_size
        self.seq_len, self.segment_len = seq_len, segment_len
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.val_fraction, self.test_fraction, self.seed = val_fraction, test_fraction, seed
        self.cache_dir = cache_root(cache_dir)
        self.num_workers, self.progress = num_workers, progress
        self.tokenizer_model_type, self.max_tokenizer_chars = tokenizer_model_type, max_tokenizer_chars
        self.tokenizer_spec, self.streaming = tokenizer, streaming
        # as a float, so that 1 and 1.0 name one cache entry
        self.dedup_threshold = None if dedup_threshold is None else float(dedup_threshold)
        self._docs: list[Document] | None = None
        self._key: CacheKey | None = None
        self._store: TokenStore | None = None
        self._segments: SegmentTable | None = None
        self._windows: dict[str, Windows] = {}

    def documents(self) -> list[Document]:
        """The corpus's documents (read once, then kept)."""
        if self._docs is None:
            self._docs = read_corpus(
                self.corpus,
                extensions=self.extensions,
                max_documents=self.max_documents,
                hf_split=self.hf_split,
                hf_config=self.hf_config,
                text_field=self.text_field,
                progress=self.progress,
            )
        return self._docs

    def cache_key(self) -> CacheKey:
        """What the cache entry depends on (reads the corpus to fingerprint it)."""
        if self._key is None:
            self._key = CacheKey(
                corpus=stream_key(*self._stream_args()) if self.streaming else fingerprint(self.documents()),
                vocab_size=self.vocab_size_requested,
                model_type=self.tokenizer_model_type,
                seed=self.seed,
                val_fraction=self.val_fraction,
                max_tokenizer_chars=self.max_tokenizer_chars,
                test_fraction=self.test_fraction,
                tokenizer=TRAIN if self.tokenizer_spec == TRAIN else tokenizer_digest(self.tokenizer_spec),
                # a stream is not deduplicated
                dedup_threshold=None if self.streaming else self.dedup_threshold,
            )
        return self._key

    def cache_path(self) -> Path:
        """Directory of this configuration's tokenizer and token arrays."""
        return self.cache_dir / self.cache_key().digest()

    def prepare_data(self) -> None:
        """Train the tokenizer and encode the corpus unless the cache already has them (rank 0 only)."""
        root = self.cache_path()
        if not TokenStore.exists(root):  # both builders create the cache folder
            if not self.streaming:
                build_store(root, self.documents(), self.cache_key(), self.progress, self.tokenizer_spec)
                return
            prefix = f"{self.specs[0]}/{self.hf_split}/" if len(self.specs) == 1 else "stream/"
            docs = lambda: stream_documents(*self._stream_args())  # noqa: E731
            build_stream_store(root, docs, self.cache_key(), prefix, self.tokenizer_spec, self.progress)

    def _stream_args(self) -> tuple:
        return self.specs, self.hf_split, self.hf_config, self.text_field, self.max_documents

    def setup(self, stage: str | None = None) -> None:
        """Load the cache (building it first when prepare_data was not called), cut segments and windows."""
        if self._store is not None:
            return
        self.prepare_data()
        store = TokenStore(self.cache_path())
        longest = int(store.doc_lengths.max())
        if longest < self.seq_len:
            raise ValueError(
                f"seq_len={self.seq_len} but the longest document has {longest} tokens; use a smaller seq_len"
            )
        tag = f"{self.cache_key().digest()}/segment_len={self.segment_len}"
        fp = hashlib.sha256(tag.encode()).hexdigest()[:20]
        segments = SegmentTable(store.tokens, store.doc_offsets, self.segment_len, store.tokenizer.pad_id, fp)
        self._windows = {
            split: Windows(segments, store.doc_offsets, getattr(store, f"{split}_docs"), self.seq_len)
            for split in ("train", "val", "test")
        }
        self._store, self._segments = store, segments
        self._docs = None  # the text lives in the cache now; text_of() decodes it

    def train_dataloader(self) -> TrainLoader:
        """Shuffled, sharded by the attached trainer's rank, resumable (see TrainLoader)."""
        trainer = self.trainer  # set by Lightning when attached
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        # the trainer's epoch, so reload_dataloaders_every_n_epochs does not replay epoch 0 (a resume then loads
        # epoch and position from the checkpoint)
        epoch = trainer.current_epoch if trainer else 0
        args = (self.seed, rank, world, self.num_workers, epoch, self._pin())
        return TrainLoader(self.windows("train"), self.batch_size, *args)

    def _pin(self) -> bool:
        """Whether batches go to a GPU: then they are made in page-locked memory, and copied without a wait."""
        trainer = self.trainer
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def val_dataloader(self) -> DataLoader | list:
        """Validation windows in a fixed order; an empty list when val_fraction is 0."""
        windows = self.windows("val")
        return (
            eval_loader(windows, self.val_batch_size, self.num_workers, self._pin()) if len(windows) else []
        )

    def test_dataloader(self) -> DataLoader:
        """Test windows in a fixed order (the test documents, disjoint from training and validation)."""
        windows = self.windows("test")
        if not len(windows):
            raise ValueError(
                f"the test split is empty (test_fraction={self.test_fraction}, {self.store.n_docs} documents); "
                "set data.test_fraction > 0"
            )
        return eval_loader(windows, self.val_batch_size, self.num_workers, self._pin())

    def state_dict(self) -> dict[str, bytes | dict[str, bytes]]:
        """The tokenizer's bytes, so that a checkpoint carries its own (rlm.data.carried reads them):
        ``tokenizer_model``, a sentencepiece model, or ``tokenizer_files``, a Hugging Face tokenizer's by name."""
        tok = self.tokenizer if self._store is not None else None
        if isinstance(tok, Tokenizer):
            return {"tokenizer_model": Path(tok.path).read_bytes()}
        if isinstance(tok, HFTokenizer):  # its cache folder holds the HF_FILES that data.tokenizer had
            return {"tokenizer_files": {f.name: f.read_bytes() for f in sorted(Path(tok.path).iterdir())}}
        return {}

    def windows(self, split: str) -> Windows:
        """The 'train', 'val' or 'test' windows."""
        self._check_setup()
        if split not in self._windows:
            raise ValueError(f"split={split!r}; accepted: {list(self._windows)}")
        return self._windows[split]

    @property
    def store(self) -> TokenStore:
        """Tokens (memory map), document offsets, train/val/test document ids, names."""
        self._check_setup()
        return self._store

    @property
    def tokenizer(self) -> Tokenizer | HFTokenizer:
        """The corpus's tokenizer: the sentencepiece model trained on it, or a copy of data.tokenizer's."""
        return self.store.tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids, known before setup (a trained tokenizer has exactly the requested size)."""
        if self.tokenizer_spec == TRAIN and self._store is not None:
            return self._store.tokenizer.vocab_size
        return self.vocab_size_requested

    @property
    def segments(self) -> SegmentTable:
        """Global segment table over all documents."""
        self._check_setup()
        return self._segments

    @property
    def fingerprint(self) -> str:
        """Identifies corpus + tokenizer + segment_len (as SegmentTable.fingerprint)."""
        return self.segments.fingerprint

    def text_of(self, doc_id: int) -> str:
        """The text of document `doc_id`, decoded from the cache."""
        if not 0 <= doc_id < self.store.n_docs:
            raise ValueError(f"doc_id={doc_id}; accepted: 0 <= doc_id < {self.store.n_docs}")
        return self.tokenizer.decode(self.store.doc_tokens(doc_id))

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of token ids (a list, array or tensor, any shape); special ids and -100 targets are dropped."""
        flat = np.asarray(ids.detach().cpu() if isinstance(ids, torch.Tensor) else ids).reshape(-1)
        return self.tokenizer.decode([i for i in flat.tolist() if i >= 0])

    def _check_setup(self) -> None:
        if self._store is None:
            raise RuntimeError("RLMDataModule is not set up yet: call prepare_data() and setup() first")


def cache_root(cache_dir: str | None) -> Path:
    """Where tokenizers and token arrays are cached: ``cache_dir``, else $RLM_CACHE, else ~/.cache/rlm."""
    return Path(cache_dir or os.environ.get("RLM_CACHE") or Path.home() / ".cache" / "rlm").expanduser()
