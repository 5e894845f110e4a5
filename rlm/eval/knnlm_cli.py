"""``rlm knnlm build | info``: kNN-LM datastores from a checkpoint (rlm.eval.knnlm); ``rlm eval --datastore``
and ``rlm generate --datastore`` use them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rlm.outdir import FORCE_HELP

DEVICE_HELP = "torch device, e.g. cpu or cuda:1 (default: cuda when torch sees a GPU, else cpu)"


def default_device() -> str:
    """What a ``--device`` left out means: the GPU when torch sees one."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_arg(value: str | None) -> str:
    """The device of a ``--device`` value (left out: default_device) when torch can run on it here; else ValueError
    naming the value and this machine's devices. torch itself fails late with a traceback on ``cuda`` without a
    GPU or on ``foo``, and takes ``meta``, a device that holds no data."""
    import torch

    if value is None:
        return default_device()
    here = ["cpu"]
    if torch.cuda.is_available():
        here += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    if torch.backends.mps.is_available():
        here.append("mps")
    if value not in here:
        raise ValueError(f"--device {value!r} is not usable here; accepted: {', '.join(here)}")
    return value


class ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends each option with its default, unless there is none to show (None, a flag's False) or its
    help already says what leaving it out means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    """The ``rlm knnlm`` argument parser."""
    p = argparse.ArgumentParser(prog="rlm knnlm", description="kNN-LM datastores (Khandelwal et al. 2020).")
    sub = p.add_subparsers(dest="action", required=True)
    b = sub.add_parser("build", help="build a datastore from a checkpoint's states over a corpus",
                       formatter_class=ShowDefaults)  # fmt: skip
    b.add_argument("--ckpt", required=True, help="checkpoint written by rlm fit")
    b.add_argument(
        "--out",
        required=True,
        help="datastore directory to write: new, empty or an earlier datastore (replaced atomically)",
    )
    b.add_argument("--force", action="store_true", help=FORCE_HELP)
    b.add_argument("--corpus", nargs="+", default=None,
                   help="every document of this text, read with the checkpoint's tokenizer (default: the "
                        "checkpoint's own training split)")  # fmt: skip
    b.add_argument("--layer", default="final", choices=["final", "ffn_input", "attn_input"],
                   help="keys: the final normed hidden state, the normed input of the last FFN (the paper's best), or the "
                        "normed input of the last block's attention (what the knn_attention plugin searches)")  # fmt: skip
    b.add_argument("--factory", default="auto",
                   help="auto (exact SQfp16 below --flat-below keys, else IVF-PQ) or a faiss factory string")  # fmt: skip
    b.add_argument(
        "--flat-below", type=int, default=1_000_000, help="auto: exact search below this many keys"
    )
    b.add_argument("--k", type=int, default=32, help="neighbours per token")
    b.add_argument("--target-recall", type=float, default=0.9,
                   help="tune nprobe to this recall@k against exact search")  # fmt: skip
    b.add_argument("--tune-tokens", type=int, default=16384,
                   help="validation tokens lam and the temperature are tuned on (0: none)")  # fmt: skip
    b.add_argument(
        "--max-documents", type=int, default=None, help="only the first N documents (default: all)"
    )
    b.add_argument("--shard-keys", type=int, default=None,
                   help="for big corpora: index shards index-000.faiss, ... of whole documents, about N keys each, "
                        "filling copies of one index trained on a sample, each written once its keys are "
                        "computed (memory holds one shard's keys); search merges their top-k (default: one index)")  # fmt: skip
    b.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="windows per forward pass (default: the run's validation batch size)",
    )
    b.add_argument("--device", default=None, help=DEVICE_HELP)
    i = sub.add_parser("info", help="print a datastore's metadata", formatter_class=ShowDefaults)
    i.add_argument("path", help="a datastore directory written by `rlm knnlm build`")
    return p


def main(args: list[str]) -> int:
    """Entry point of ``rlm knnlm``."""
    a = parser().parse_args(args)
    if a.action == "info":
        from rlm.eval.datastore import read_datastore_meta

        meta = read_datastore_meta(a.path)
        meta = {k: v for k, v in meta.items() if k not in ("doc_ids", "doc_hashes", "sha256")}
        print(json.dumps(meta, indent=1))
        return 0
    from rlm.eval.knnlm import build

    a.device = device_arg(a.device)
    for name in ("k", "tune_tokens", "flat_below"):
        if getattr(a, name) < (1 if name == "k" else 0):
            raise ValueError(f"--{name.replace('_', '-')}={getattr(a, name)}; accepted: a positive integer")
    if a.shard_keys is not None and a.shard_keys < 1:
        raise ValueError(f"--shard-keys={a.shard_keys}; accepted: a positive integer (keys per index shard)")
    meta = build(a.ckpt, a.out, corpus=a.corpus, layer=a.layer, factory=a.factory, k=a.k,
                 target_recall=a.target_recall, flat_below=a.flat_below, tune_tokens=a.tune_tokens,
                 batch_size=a.batch_size, device=a.device, progress=True,
                 max_documents=a.max_documents, shard_keys=a.shard_keys, force=a.force)  # fmt: skip
    tuned = meta.get("tuning") or {}
    print(f"datastore {a.out}: {meta['entries']:,} keys, {meta['factory']} {meta['search_params']} "
          f"(recall@{meta['k']} {meta['tuned_recall']}), {sum(meta['bytes'].values()) / meta['entries']:.1f} "
          f"bytes/key, built in {meta['seconds']['total']:.1f} s")  # fmt: skip
    if tuned:
        print(f"tuned on {tuned['tokens']} validation tokens: lam {tuned['lam']}, temperature "
              f"{tuned['temperature']:.4g}: loss {tuned['lm_loss']:.4f} -> {tuned['loss']:.4f}")  # fmt: skip
    return 0


def eval_main(a: Any) -> int:
    """``rlm eval`` on its options ``a`` (the parameters of rlm.cli.commands.cmd_eval): with ``--tasks``
    lm-evaluation-harness (rlm.eval.harness), with ``--datastore DIR`` the LM and kNN-LM from one pass, else plain
    rlm.eval.evaluate."""
    from rlm.eval.evaluate import main, write_json
    from rlm.eval.knnlm import evaluate_knn

    a.device = device_arg(a.device)
    if a.batch_size is not None and a.batch_size < 1:
        raise ValueError(f"--batch-size={a.batch_size}; accepted: a positive integer")
    if a.tasks is not None:  # lm-evaluation-harness, with the datastore's kNN-LM when one is given
        from rlm.eval.harness import main as harness_main

        return harness_main(a)
    if not a.datastore:
        return main(a)

    if a.knn_k is not None and a.knn_k < 1:
        raise ValueError(f"--knn-k={a.knn_k}; accepted: a positive integer")
    r = evaluate_knn(a.ckpt, a.datastore, a.corpus, a.split, a.knn_k, a.lam, a.temperature, a.knn_cache,
                     a.batch_size, a.device, progress=sys.stderr.isatty())  # fmt: skip
    lm, knn = r["lm"], r["knnlm"]
    print(
        f"{r['split']} of {r['corpus']}: {r['documents']} documents, {r['tokens']} tokens, {r['bytes']} bytes\n"
        f"LM      loss {lm['loss']:.4f}  ppl {lm['ppl']:.2f}  bits/byte {lm['bpb']:.4f}\n"
        f"kNN-LM  loss {knn['loss']:.4f}  ppl {knn['ppl']:.2f}  bits/byte {knn['bpb']:.4f}  "
        f"(lam {r['lam']}, temperature {r['temperature']:.4g}, k {r['k']}{', with the cache' if r['cache'] else ''}; "
        f"target among the neighbours {r['target_in_neighbours']:.1%})"
    )
    j, rnd = r.get("joint"), r["random_neighbours"]
    if j:
        print(f"joint   loss {j['loss']:.4f}  ppl {j['ppl']:.2f}  bits/byte {j['bpb']:.4f}  (the token memory's "
              f"mixture, temperature {j['temperature']:.4g}, bias {j['bias']:g})")  # fmt: skip
    print("random neighbours (the same distances, random values): "
          + ", ".join(f"{name} loss {m['loss']:.4f}" for name, m in rnd.items()))  # fmt: skip
    write_json(a.json, r)
    return 0
