"""What a checkpoint says about its data: the data module's settings, and the tokenizer it carries, written to disk
for whoever reads it (rlm eval, generate, export, knnlm and index build, and a resumed fit)."""

from __future__ import annotations

import hashlib
import inspect
import os
from pathlib import Path
from typing import Any

from rlm.data.module import RLMDataModule, cache_root
from rlm.data.pretrained import TRAIN
from rlm.data.store import TokenStore, new_entry


def data_settings(ckpt: dict[str, Any], path: str | os.PathLike[str]) -> dict[str, Any]:
    """The data module's arguments saved in the checkpoint (those RLMDataModule still accepts)."""
    saved = ckpt.get("datamodule_hyper_parameters")
    if not saved:
        raise ValueError(f"{str(path)!r} holds no data module settings, so its tokenizer cannot be found")
    accepted = inspect.signature(RLMDataModule).parameters
    hp = {k: v for k, v in saved.items() if k in accepted}
    hp.setdefault("test_fraction", 0.0)  # written before the test split existed: its split had none
    hp.setdefault("dedup_threshold", None)  # written before deduplication existed: it removed none
    return hp


def _unpack(files: dict[str, bytes], cache: Path) -> Path:
    """A folder under ``cache``/tokenizers holding ``files`` (name -> bytes), named by their digest; written once,
    atomically, so that concurrent readers of one checkpoint share it."""
    h = hashlib.sha256()
    for name, data in sorted(files.items()):
        h.update(name.encode() + b"\0" + data + b"\0")
    target = cache / "tokenizers" / h.hexdigest()[:20]
    if not target.is_dir():
        with new_entry(target) as tmp:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
    return target


def tokenizer_file(ckpt: dict[str, Any], path: str | os.PathLike[str], hp: dict[str, Any]) -> str:
    """The checkpoint's own tokenizer on disk (a sentencepiece model file, or a Hugging Face tokenizer's folder);
    ValueError when it cannot be found."""
    state = ckpt.get(RLMDataModule.__qualname__) or {}
    if state.get("tokenizer_model"):
        # under data.tokenizer's file name: the token cache's key hashes it, so the copy finds the training entry
        spec = hp.get("tokenizer")
        name = Path(spec).name if spec not in (None, TRAIN) else "tokenizer.model"
        return str(_unpack({name: state["tokenizer_model"]}, cache_root(hp.get("cache_dir"))) / name)
    if state.get("tokenizer_files"):
        return str(_unpack(state["tokenizer_files"], cache_root(hp.get("cache_dir"))))
    if hp.get("tokenizer") not in (None, TRAIN) and Path(hp["tokenizer"]).exists():
        return str(hp["tokenizer"])
    # Older checkpoints carry no tokenizer: the cache entry they trained on has it, if it is still there.
    try:
        root = RLMDataModule(**{**hp, "progress": False}).cache_path()
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{str(path)!r} carries no tokenizer and its training corpus {hp.get('corpus')!r} cannot be read "
            f"to find the cached one ({err}); evaluating under another tokenizer would not measure this model"
        ) from err
    if not TokenStore.exists(root):
        raise ValueError(
            f"{str(path)!r} carries no tokenizer and its token cache {root} is missing (deleted, or another "
            "cache_dir / $RLM_CACHE); evaluating under another tokenizer would not measure this model"
        )
    return str(root / "tokenizer.model")
