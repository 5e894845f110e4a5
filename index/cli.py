"""``rlm index build|search|eval|info``: build an index directory from a checkpoint, query it with text,
measure its recall against exact search, and print its metadata. rlm/cli/commands.py dispatches here.

`build` embeds with the retriever's own embedder when the checkpoint's model has one (any plugin that
implements the rebuild callback's MemoryOwner protocol), else with MeanPoolEmbedder: the mean-pooled hidden
state after one block of any trained checkpoint (``--layer`` picks the block, and forces mean-pooling).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from rlm.outdir import FORCE_HELP


def _load_source(
    ckpt: str, data_config: str | None, recorded: dict[str, Any] | None = None
) -> tuple[Any, Any, int, dict[str, Any]]:
    """(LMModule, set-up RLMDataModule, global step, data settings) of a checkpoint; data from the YAML or the checkpoint."""
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
    from rlm.index.memory import MemoryOwner
    from rlm.index.protocol import MeanPoolEmbedder

    if layer is None:
        owners = [p for p in module.model.plugins.values() if isinstance(p, MemoryOwner)]
        if owners:
            return owners[0].snapshot(step)  # the embedder the model retrieves with
        layer = -1
    return MeanPoolEmbedder(module.model, layer, step=step)


def cmd_build(a: argparse.Namespace) -> int:
    """Embed every segment of the chosen split with the checkpoint's model and write the index directory."""
    import torch

    from rlm.cli.check import check_writable
    from rlm.index.build import IndexConfig
    from rlm.index.protocol import embed_all
    from rlm.index.search import SegmentTable
    from rlm.index.store import META, build_index_dir
    from rlm.outdir import claim_out_dir

    config = IndexConfig(
        factory=a.factory, memory_budget_gb=a.memory_budget_gb, target_recall=a.target_recall, gpu=a.gpu
    )
    # before any embedding
    reads = [a.ckpt, *([a.config] if a.config else [])]
    dest = claim_out_dir(a.out, reads=reads, force=a.force, own=(META, "format_version"))
    check_writable(dest.parent, "--out folder", "give --out in a folder you can write to")
    module, data, step, data_hp = _load_source(a.ckpt, a.config)
    segs = data.segments
    docs = {"all": None, "train": data.store.train_docs, "val": data.store.val_docs}[a.split]
    rows = np.arange(len(segs), dtype=np.int64) if docs is None else segs.ids_of_docs(docs)
    embedder = _embedder(module, a.layer, step)

    def tokens_of(i: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        ids = rows[i]
        mask = np.arange(segs.segment_len) < segs.length[ids][:, None]  # (b, L) real tokens
        return torch.from_numpy(segs.tokens(ids)), torch.from_numpy(mask)

    vectors = embed_all(embedder, tokens_of, len(rows), a.batch_size, progress=not a.quiet)
    source = {"ckpt": str(Path(a.ckpt).resolve()), "data": data_hp, "layer": a.layer, "split": a.split}
    out = build_index_dir(
        dest,
        vectors,
        SegmentTable(segs.doc[rows], segs.offset[rows]),
        segs.fingerprint,
        embedder.embedder_identity(),
        config,
        extra={"source": source, "segment_len": segs.segment_len},
        rows=rows,
        progress=not a.quiet,
    )
    print(
        f"wrote {out.path}: {out.meta['count']} segments, {out.meta['factory']} {out.meta['search_params']}"
    )
    return 0


def cmd_search(a: argparse.Namespace) -> int:
    """Print the nearest segments of a text (embedded with the index's own checkpoint) or of a stored segment."""
    from rlm.index.store import load_index_dir, read_meta

    meta = read_meta(a.dir)
    source = meta.get("source")
    data = None
    if a.segment is not None:
        idx = load_index_dir(a.dir)
        if idx.vectors is None:
            raise ValueError(f"{a.dir} stores no vectors, so --segment cannot look one up; query with text")
        if not 0 <= a.segment < meta["count"]:
            raise ValueError(f"--segment {a.segment} out of range [0, {meta['count']})")
        query, qid = np.asarray(idx.vectors[a.segment : a.segment + 1]), np.array([a.segment])
        if source is not None:
            _, data, _, _ = _load_source(source["ckpt"], None, source.get("data") or {})
    else:
        if a.text is None:
            raise ValueError("give a query TEXT or --segment ID")
        if source is None:
            raise ValueError(
                f"{a.dir} was not built by `rlm index build` (no checkpoint recorded): use --segment"
            )
        module, data, step, _ = _load_source(source["ckpt"], None, source.get("data") or {})
        embedder = _embedder(module, source["layer"], step)
        # refuse an index whose vectors this checkpoint and corpus did not produce
        idx = load_index_dir(a.dir, data.fingerprint, embedder.embedder_identity())
        import torch

        ids = data.tokenizer.encode(a.text)[: module.model.config.max_seq_len]
        tokens = torch.tensor([ids or [data.tokenizer.unk_id]])
        query, qid = (
            embedder.embed_segments(tokens, torch.ones_like(tokens, dtype=torch.bool)).numpy(),
            np.array([-1]),
        )
    found = idx.search(query, a.k, query_ids=qid, causal=False)
    rows = idx.rows
    for rank, (row, score) in enumerate(zip(found.ids[0], found.scores[0])):
        if row < 0:
            break
        seg = int(rows[row])
        head = f"#{rank + 1}  score {score:.4f}  segment {seg}  doc {int(idx.segments.doc[row])}  offset {int(idx.segments.offset[row])}"
        print(head)
        if data is not None:
            print("    " + data.decode(data.segments.tokens(np.array([seg]))[0]).replace("\n", "\n    "))
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    """Recall@k of the index against exact search, and both searches' queries/s, on stored vectors."""
    from rlm.index.build import TorchExactIndex, recall_at_k
    from rlm.index.store import load_index_dir

    idx = load_index_dir(a.dir)
    if idx.vectors is None:
        raise ValueError(f"{a.dir} was written without its vectors (store_vectors=False); eval needs them")
    n = len(idx.vectors)
    rng = np.random.default_rng(a.seed)
    queries = np.asarray(idx.vectors[np.sort(rng.choice(n, size=min(a.queries, n), replace=False))])
    exact = TorchExactIndex(idx.vectors)
    rows = []
    for name, index in (("exact (torch)", exact), (idx.meta["factory"], idx.index)):
        start = time.perf_counter()
        _, ids = index.search(queries, a.k)
        rows.append((name, len(queries) / (time.perf_counter() - start), ids))
    exact_qps, exact_ids = rows[0][1], rows[0][2]
    print(f"| index | recall@{a.k} | queries/s | speed-up |")
    print("|---|---|---|---|")
    for name, qps, ids in rows:
        print(f"| {name} | {recall_at_k(ids, exact_ids, a.k):.4f} | {qps:.0f} | {qps / exact_qps:.2f}x |")
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    """Print the index directory's metadata."""
    from rlm.index.store import read_meta

    meta = read_meta(a.dir)
    if a.json:
        print(json.dumps(meta, indent=2))
        return 0
    emb = meta["embedder"]
    print(f"index     {a.dir}")
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


def add_index_subcommands(subparsers: Any) -> None:
    """Add build/search/eval/info parsers to an argparse subparsers object."""
    p = subparsers.add_parser("build", help="embed a corpus with a checkpoint and write an index directory")
    p.add_argument("--ckpt", required=True, help="checkpoint written by rlm fit")
    p.add_argument(
        "--config", help="data YAML (configs/data/*.yaml); default: the checkpoint's data settings"
    )
    p.add_argument("--out", required=True, help="index directory to write: new, empty or an earlier index "
                   "(replaced atomically)")  # fmt: skip
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.add_argument(
        "--layer",
        type=int,
        default=None,
        help="block whose mean-pooled output is the embedding (default: the retriever's embedder if the model "
        "has one, else the last block)",
    )
    p.add_argument("--split", choices=["all", "train", "val"], default="all", help="documents to index")
    p.add_argument("--factory", default="auto", help="'auto', 'torch' or a faiss factory string")
    p.add_argument("--memory-budget-gb", type=float, default=4.0, help="memory the codes may take (auto)")
    p.add_argument("--target-recall", type=float, default=0.95, help="recall@10 nprobe/efSearch are tuned to")
    p.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None, help="faiss on GPU")
    p.add_argument("--batch-size", type=int, default=256, help="segments per embedding batch")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p = subparsers.add_parser("search", help="show the nearest segments of a text, with scores")
    p.add_argument("dir", help="index directory")
    p.add_argument("text", nargs="?", help="query text (embedded with the index's checkpoint)")
    p.add_argument("--segment", type=int, help="query with the stored vector of this index row instead")
    p.add_argument("-k", type=int, default=5, help="neighbours to show")
    p = subparsers.add_parser("eval", help="recall@k against exact search, and queries/s")
    p.add_argument("dir", help="index directory")
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--queries", type=int, default=1000, help="stored vectors sampled as queries")
    p.add_argument("--seed", type=int, default=0)
    p = subparsers.add_parser("info", help="print an index directory's metadata")
    p.add_argument("dir", help="index directory")
    p.add_argument("--json", action="store_true", help="the raw meta.json")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``rlm index``."""
    parser = argparse.ArgumentParser(
        prog="rlm index", description="Build, search and inspect retrieval indices."
    )
    add_index_subcommands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    a = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return COMMANDS[a.command](a)
    except (ValueError, OSError) as err:  # IndexNotFoundError is an OSError; OSError: disk full, unwritable
        print(f"rlm index {a.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
