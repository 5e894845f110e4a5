"""The data pipeline: corpus, tokenizer, token cache, segments, windows and the LightningDataModule."""

from rlm.data.corpus import Document, read_corpus
from rlm.data.module import RLMDataModule
from rlm.data.segments import SegmentTable
from rlm.data.store import TokenStore
from rlm.data.tokenizer import Tokenizer
from rlm.data.windows import IGNORE_INDEX, TrainLoader, Windows

__all__ = [
    "IGNORE_INDEX",
    "Document",
    "RLMDataModule",
    "SegmentTable",
    "TokenStore",
    "Tokenizer",
    "TrainLoader",
    "Windows",
    "read_corpus",
]
