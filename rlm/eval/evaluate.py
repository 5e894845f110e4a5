"""Evaluation with the tokenizer the checkpoint carries (a loss means something only under the model's own token
mapping): ``rlm eval``, and the settings ``rlm validate|test`` restore. It reports the mean token loss, its
perplexity and bits per byte, which compare across vocabularies (as The Pile reports it, Gao et al. 2020):

    bpb = sum_t NLL_t (nats) / (ln 2 * UTF-8 bytes of the evaluated text)

Every target counts (each document's tokens and its end-of-document token), in the training windows of seq_len.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from rlm.data.carried import data_settings, tokenizer_file
from rlm.data.module import RLMDataModule
from rlm.data.pretrained import TRAIN
from rlm.data.segments import SegmentTable
from rlm.data.store import TokenStore
from rlm.data.windows import IGNORE_INDEX, Windows, eval_loader
from rlm.train.checkpoint import load_checkpoint_file

# Data arguments the token cache depends on: given on the command line, they change the entry after this check.
CACHE_ARGS = ("corpus", "hf_split", "hf_config", "text_field", "extensions", "max_documents", "vocab_size",
              "val_fraction", "test_fraction", "seed", "cache_dir", "tokenizer_model_type", "max_tokenizer_chars",
              "dedup_threshold")  # fmt: skip


def with_tokenizer(
    data: dict[str, Any], ckpt: dict[str, Any], path: str | os.PathLike[str], force: bool = False
) -> dict[str, Any]:
    """Data arguments that read their tokens with the checkpoint's tokenizer: unchanged when their cache entry
    already holds it (nothing is encoded again, retrieval indices keyed by it stay valid), else (or with
    ``force``) with ``tokenizer`` set to the checkpoint's model file."""
    model = tokenizer_file(ckpt, path, data_settings(ckpt, path))  # the training data's, not `data`'s
    if force or data.get("tokenizer") not in (None, TRAIN) or not Path(model).is_file():
        return {**data, "tokenizer": model}  # an existing tokenizer's copy: its cache key is the original's
    try:
        root = RLMDataModule(**{**data, "progress": False}).cache_path()
    except (OSError, ValueError):
        return {**data, "tokenizer": model}
    if TokenStore.exists(root) and (root / "tokenizer.model").read_bytes() == Path(model).read_bytes():
        return data
    return {**data, "tokenizer": model}


def checkpoint_layer(layers: list[dict[str, Any]], args: list[str]) -> list[str]:
    """For ``rlm validate|test --ckpt_path CKPT``: ``args`` with the checkpoint's data settings as a config layer
    after the given config files (``layers``, read from ``args``), so no training config is needed; config files'
    and ``--data.*`` flags' settings still win."""
    import yaml

    path = None
    for i, arg in enumerate(args):  # the first --ckpt_path
        if arg == "--ckpt_path" and i + 1 < len(args) or arg.startswith("--ckpt_path="):
            path = args[i + 1] if arg == "--ckpt_path" else arg.split("=", 1)[1]
            break
    if path is None:
        return args
    ckpt = load_checkpoint_file(path)
    data = data_settings(ckpt, path)
    for layer in layers:
        data.update(layer.get("data") or {})
    flags = {arg.split("=", 1)[0] for arg in args if arg.startswith("--data.")}
    changed = any(f"--data.{k}" in flags for k in CACHE_ARGS)  # e.g. --data.corpus X: another cache entry
    layer = yaml.safe_dump({"data": with_tokenizer(data, ckpt, path, force=changed)})
    configs, rest, i = [], [], 0
    while i < len(args):  # the config files first (in order), then this layer, then the flags
        if args[i] in ("--config", "-c") and i + 1 < len(args):
            configs += args[i : i + 2]
            i += 2
            continue
        (configs if args[i].startswith("--config=") else rest).append(args[i])
        i += 1
    return [*configs, "--config", layer, *rest]


def checkpoint_data(
    ckpt_path: str, corpus: list[str] | None, progress: bool, force: bool = False
) -> tuple[RLMDataModule, TokenStore]:
    """The checkpoint's corpus, or all of ``corpus`` under its tokenizer, as a prepared data module and its store."""
    ckpt = load_checkpoint_file(ckpt_path)
    hp = {**data_settings(ckpt, ckpt_path), "progress": progress}
    if corpus:  # all of the new text: no document held out
        hp.update(corpus=corpus, max_documents=None, val_fraction=0.0, test_fraction=0.0)
    data = RLMDataModule(**with_tokenizer(hp, ckpt, ckpt_path, force))
    data.prepare_data()
    return data, TokenStore(data.cache_path())


def windows_of(data: RLMDataModule, store: TokenStore, docs: Any) -> Windows:
    """Windows of seq_len over the given documents of a built store (no training-length check: any text)."""
    fp = hashlib.sha256(f"{store.root.name}/segment_len={data.segment_len}".encode()).hexdigest()[:20]
    segments = SegmentTable(store.tokens, store.doc_offsets, data.segment_len, store.tokenizer.pad_id, fp)
    return Windows(segments, store.doc_offsets, docs, data.seq_len)


@torch.no_grad()
def nll_sum(
    module: Any, windows: Windows, batch_size: int, logged: dict[str, float] | None = None
) -> tuple[float, int]:
    """(sum of the token NLLs in nats, in float64; number of scored tokens) over all windows; ``logged`` receives
    the mean over batches of every metric the plugins logged."""
    module.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    seen: dict[str, list[float]] = {}
    for batch in eval_loader(windows, batch_size):
        batch = {k: v.to(module.device) for k, v in batch.items()}
        ctx = module.make_context(batch, "test", segments=windows.segments)  # this text's own segment table
        logits = module.model(batch["tokens"], ctx)  # (B, T, V)
        targets = batch["targets"]  # (B, T), IGNORE_INDEX past the document's end
        nll = F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        total += nll.double().cpu()
        count += int((targets != IGNORE_INDEX).sum())
        for name, value in ctx.metrics.items():
            seen.setdefault(name, []).append(float(value))
    if logged is not None:
        logged.update({name: sum(v) / len(v) for name, v in sorted(seen.items())})
    return float(total), count


def metrics(nll: float, tokens: int, n_bytes: int) -> dict[str, float]:
    """loss (nats per token), perplexity and bits per byte from the summed NLL."""
    loss = nll / max(tokens, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "bpb": nll / (math.log(2) * max(n_bytes, 1))}


def load_module(ckpt_path: str, device: str, tokenizer: Any) -> Any:
    """The checkpoint's LMModule on ``device``; ValueError when its vocabulary is not the tokenizer's."""
    from rlm.train.module import LMModule

    module = LMModule.load_from_checkpoint(ckpt_path, map_location=device)
    if module.model_config.vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"the model has vocab_size {module.model_config.vocab_size} but its tokenizer {tokenizer.vocab_size}"
        )
    return module


def evaluate(
    ckpt_path: str,
    corpus: list[str] | None = None,
    split: Literal["test", "val", "train"] = "test",
    batch_size: int | None = None,
    device: str = "cpu",
    progress: bool = False,
) -> dict[str, Any]:
    """Evaluate a checkpoint on its own split, or on all of ``corpus``, with its own tokenizer."""
    data, store = checkpoint_data(ckpt_path, corpus, progress)
    docs = store.train_docs if corpus else getattr(store, f"{split}_docs")
    if not len(docs):
        raise ValueError(f"the {split} split of {ckpt_path!r}'s corpus is empty")
    texts = data.documents()
    n_bytes = sum(len(texts[d].text.encode("utf-8")) for d in docs)
    module = load_module(ckpt_path, device, store.tokenizer)
    logged: dict[str, float] = {}
    nll, tokens = nll_sum(module, windows_of(data, store, docs), batch_size or data.val_batch_size, logged)
    return {
        "checkpoint": str(ckpt_path),
        "corpus": corpus if corpus else data.corpus,
        "split": "all" if corpus else split,
        "documents": int(len(docs)),
        "tokens": tokens,
        "bytes": n_bytes,
        "nll_sum": nll,
        **metrics(nll, tokens, n_bytes),
        "plugin_metrics": logged,
    }


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write ``result`` as JSON to ``path`` (atomically), if a path is given."""
    if path:
        tmp = f"{path}.tmp{os.getpid()}"
        Path(tmp).write_text(json.dumps(result, indent=2) + "\n")
        os.replace(tmp, path)
