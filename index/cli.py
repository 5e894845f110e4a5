"""``rlm index build|search|eval|info``: build an index directory from a checkpoint, query it with text, measure
its recall against exact search, print its metadata. rlm/cli/commands.py builds the parsers from the signatures."""

from __future__ import annotations

import inspect
import time
from json import dumps
from pathlib import Path
from typing import Any, Literal

import numpy as np


def _load_source(
    ckpt: str, data_config: str | None, recorded: dict[str, Any] | None = None
) -> tuple[Any, Any, int, dict[str, Any]]:
    """(LMModule, set-up RLMDataModule, global step, data settings) of a checkpoint; data from the YAML or it."""
    import yaml

    from rlm.data.module import RLMDataModule
    from rlm.model import ModelConfig
    from rlm.train.module import LMModule

    if not Path(ckpt).is_file():
        if recorded is not None:  # `search`: the index names its checkpoint; there is no --ckpt flag to give
            raise ValueError(
                f"the checkpoint this index was built from, {ckpt!r}, no longer exists: restore it, rebuild the "
                "index with `rlm index build --ckpt NEW`, or query a stored segment with --segment ID"
            )
        raise ValueError(f"--ckpt {ckpt!r} does not exist")
    from rlm.train.checkpoint import load_checkpoint_file

    state = load_checkpoint_file(ckpt)  # a damaged file is named, not a traceback
    data_hp = dict(state.get("datamodule_hyper_parameters") or {})
    data_hp.update(recorded or {})  # the data settings `rlm index build` recorded, for search
    if data_config is not None:
        loaded = yaml.safe_load(Path(data_config).read_text()) or {}
        data_hp.update(loaded.get("data", loaded))  # a configs/data/*.yaml file, or its 'data' mapping alone
    if not data_hp:
        raise ValueError(f"{ckpt!r} holds no data module settings: pass the data YAML with --config")
    # LightningCLI adds bookkeeping such as '_instantiator' to the saved settings: keep the real arguments
    accepted = inspect.signature(RLMDataModule).parameters
    data_hp = {key: value for key, value in data_hp.items() if key in accepted}
    given = data_hp.get("tokenizer") not in (None, "train")  # not one trained on the corpus
    if state.get("datamodule_hyper_parameters") and (data_config is not None or given):
        # Another corpus is read with the checkpoint's own tokenizer and vocabulary, never a tokenizer trained
        # anew on it (the index would be meaningless, and a larger vocab_size indexed past the embedding); an
        # existing tokenizer with the copy the checkpoint carries, as the file data.tokenizer named may be gone.
        from rlm.eval.evaluate import with_tokenizer

        vocab = (state.get("hyper_parameters") or {}).get("model", {}).get("vocab_size")
        data_hp = {**data_hp, **({"vocab_size": vocab} if vocab else {})}
        data_hp = with_tokenizer(data_hp, state, ckpt, force=data_config is not None)
    data = RLMDataModule(**{**data_hp, "progress": False})
    data.setup("predict")
    # rebuilt from the saved settings rather than LMModule.load_from_checkpoint, which (Lightning 2.6)
    # hands the saved plain dicts back to a constructor that expects ModelConfig/OptimConfig objects
    hp = state["hyper_parameters"]
    module = LMModule(model=ModelConfig(**hp["model"]), plugins=hp.get("plugins") or {})
    module.load_state_dict(state["state_dict"])
    module.eval()
    return module, data, int(state.get("global_step", 0)), data_hp


def _embedder(module: Any, layer: int | None, step: int) -> Any:
    """The retriever's own embedder (a MemoryOwner plugin) unless `layer` is given, else MeanPoolEmbedder."""
    from rlm.index.memory import MemoryOwner
    from rlm.index.protocol import MeanPoolEmbedder

    if layer is None:
        owners = [p for p in module.model.plugins.values() if isinstance(p, MemoryOwner)]
        if owners:
            return owners[0].snapshot(step)  # the embedder the model retrieves with
        layer = -1
    return MeanPoolEmbedder(module.model, layer, step=step)


def cmd_build(
    *,
    ckpt: str,
    out: str,
    config: str | None = None,
    force: bool = False,
    layer: int | None = None,
    split: Literal["all", "train", "val"] = "all",
    factory: str = "auto",
    memory_budget_gb: float = 4.0,
    target_recall: float = 0.95,
    gpu: bool | None = None,
    batch_size: int = 256,
    quiet: bool = False,
) -> int:
    """Embed a corpus with a checkpoint and write an index directory.

    Args:
        ckpt: checkpoint written by rlm fit
        out: index directory to write: new, empty or an earlier index (replaced atomically)
        config: data YAML (configs/data/*.yaml); default: the checkpoint's data settings
        force: replace --out even when it holds other files (never a folder holding --ckpt, nor the current
            one)
        layer: block whose mean-pooled output is the embedding (default: the retriever's embedder if the model
            has one, else the last block)
        split: documents to index
        factory: 'auto', 'torch' or a faiss factory string
        memory_budget_gb: memory the codes may take (auto)
        target_recall: recall@10 nprobe/efSearch are tuned to
        gpu: faiss on GPU (--no-gpu: on the CPU; default: on GPU when faiss has one)
        batch_size: segments per embedding batch
        quiet: no progress bar
    """
    from rlm.cli.check import check_writable
    from rlm.index.build import IndexConfig
    from rlm.index.memory import embed_rows
    from rlm.index.search import SegmentTable
    from rlm.index.store import META, build_index_dir
    from rlm.outdir import claim_out_dir

    index_config = IndexConfig(
        factory=factory, memory_budget_gb=memory_budget_gb, target_recall=target_recall, gpu=gpu
    )
    # before any embedding
    reads = [ckpt, *([config] if config else [])]
    dest = claim_out_dir(out, reads=reads, force=force, own=(META, "format_version"))
    check_writable(dest.parent, "--out folder", "give --out in a folder you can write to")
    module, data, step, data_hp = _load_source(ckpt, config)
    segs = data.segments
    docs = {"all": None, "train": data.store.train_docs, "val": data.store.val_docs}[split]
    rows = np.arange(len(segs), dtype=np.int64) if docs is None else segs.ids_of_docs(docs)
    embedder = _embedder(module, layer, step)
    vectors = embed_rows(embedder, segs, rows, batch_size, 0, 1, not quiet)
    source = {"ckpt": str(Path(ckpt).resolve()), "data": data_hp, "layer": layer, "split": split}
    built = build_index_dir(
        dest,
        vectors,
        SegmentTable(segs.doc[rows], segs.offset[rows]),
        segs.fingerprint,
        embedder.embedder_identity(),
        index_config,
        extra={"source": source, "segment_len": segs.segment_len},
        rows=rows,
        progress=not quiet,
    )
    print(
        f"wrote {built.path}: {built.meta['count']} segments, {built.meta['factory']} {built.meta['search_params']}"
    )
    return 0


def cmd_search(dir: str, text: str | None = None, *, segment: int | None = None, k: int = 5) -> int:
    """Show the nearest segments of a text, with scores (rlm index search DIR TEXT).

    Args:
        dir: index directory
        text: query text (embedded with the index's checkpoint)
        segment: query with the stored vector of this index row instead
        k: neighbours to show
    """
    from rlm.index.store import load_index_dir, read_meta

    meta = read_meta(dir)
    source = meta.get("source")
    data = None
    if segment is not None:
        idx = load_index_dir(dir)
        if idx.vectors is None:
            raise ValueError(f"{dir} stores no vectors, so --segment cannot look one up; query with text")
        if not 0 <= segment < meta["count"]:
            raise ValueError(f"--segment {segment} out of range [0, {meta['count']})")
        query, qid = np.asarray(idx.vectors[segment : segment + 1]), np.array([segment])
        if source is not None:
            _, data, _, _ = _load_source(source["ckpt"], None, source.get("data") or {})
    else:
        if text is None:
            raise ValueError("give a query TEXT or --segment ID")
        if source is None:
            raise ValueError(
                f"{dir} was not built by `rlm index build` (no checkpoint recorded): use --segment"
            )
        module, data, step, _ = _load_source(source["ckpt"], None, source.get("data") or {})
        embedder = _embedder(module, source["layer"], step)
        # refuse an index whose vectors this checkpoint and corpus did not produce
        idx = load_index_dir(dir, data.fingerprint, embedder.embedder_identity())
        import torch

        ids = data.tokenizer.encode(text)[: module.model.config.max_seq_len]
        tokens = torch.tensor([ids or [data.tokenizer.unk_id]])
        mask = torch.ones_like(tokens, dtype=torch.bool)
        query, qid = embedder.embed_segments(tokens, mask).numpy(), np.array([-1])
    found = idx.search(query, k, query_ids=qid, causal=False)
    rows = idx.rows
    for rank, (row, score) in enumerate(zip(found.ids[0], found.scores[0])):
        if row < 0:
            break
        seg = int(rows[row])
        doc, offset = int(idx.segments.doc[row]), int(idx.segments.offset[row])
        print(f"#{rank + 1}  score {score:.4f}  segment {seg}  doc {doc}  offset {offset}")
        if data is not None:
            print("    " + data.decode(data.segments.tokens(np.array([seg]))[0]).replace("\n", "\n    "))
    return 0


def cmd_eval(dir: str, *, k: int = 10, queries: int = 1000, seed: int = 0) -> int:
    """Recall@k against exact search, and both searches' queries/s, on stored vectors.

    Args:
        dir: index directory
        k: neighbours per query
        queries: stored vectors sampled as queries
        seed: random seed of the sample
    """
    from rlm.index.build import TorchExactIndex, recall_at_k
    from rlm.index.store import load_index_dir

    idx = load_index_dir(dir)
    if idx.vectors is None:
        raise ValueError(
            f"{dir} holds no vectors (an older rlm could write an index without them); eval needs them: rebuild it"
        )
    n = len(idx.vectors)
    rng = np.random.default_rng(seed)
    sample = np.asarray(idx.vectors[np.sort(rng.choice(n, size=min(queries, n), replace=False))])
    exact = TorchExactIndex(idx.vectors)
    rows = []
    for name, index in (("exact (torch)", exact), (idx.meta["factory"], idx.index)):
        start = time.perf_counter()
        _, ids = index.search(sample, k)
        rows.append((name, len(sample) / (time.perf_counter() - start), ids))
    exact_qps, exact_ids = rows[0][1], rows[0][2]
    print(f"| index | recall@{k} | queries/s | speed-up |")
    print("|---|---|---|---|")
    for name, qps, ids in rows:
        print(f"| {name} | {recall_at_k(ids, exact_ids, k):.4f} | {qps:.0f} | {qps / exact_qps:.2f}x |")
    return 0


def cmd_info(dir: str, *, json: bool = False) -> int:
    """Print an index directory's metadata.

    Args:
        dir: index directory
        json: the raw meta.json
    """
    from rlm.index.store import read_meta

    meta = read_meta(dir)
    if json:
        print(dumps(meta, indent=2))
        return 0
    emb = meta["embedder"]
    print(f"index     {dir}")
    print(f"vectors   {meta['count']} x {meta['dim']} ({meta['metric']}, L2-normalised)")
    print(
        f"factory   {meta['factory']}  search params {meta['search_params']}  tuned recall {meta['tuned_recall']}"
    )
    if "recall" in meta:  # written by the retriever's rebuilds
        print(f"recall    {meta['recall']} against exact search (target {meta.get('target_recall')})")
    print(f"corpus    {meta['fingerprint']}")
    print(
        f"embedder  {emb['name']}  config {emb['config_hash']}  weights {emb['weights_hash']}  step {emb['step']}"
    )
    print(f"created   {meta['created']} (faiss {meta['faiss_version']})")
    size = sum(meta["files"].values())
    print(
        f"files     {', '.join(f'{k} {v / 2**20:.1f} MiB' for k, v in meta['files'].items())} (total {size / 2**20:.1f} MiB)"
    )
    return 0


COMMANDS = {"build": cmd_build, "search": cmd_search, "eval": cmd_eval, "info": cmd_info}
