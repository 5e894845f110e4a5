"""``rlm knnlm build | info``: kNN-LM datastores from a checkpoint (rlm.eval.knnlm); ``rlm eval --datastore``
and ``rlm generate --datastore`` use them."""

from __future__ import annotations

import json
import sys
from typing import Any, Literal


def device_arg(value: str | None) -> str:
    """The device of a ``--device`` value (left out: the GPU when torch sees one) when torch can run on it here
    (torch itself fails late on ``cuda`` without a GPU, and takes ``meta``, which holds no data)."""
    import torch

    if value is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    here = ["cpu"]
    if torch.cuda.is_available():
        here += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    if torch.backends.mps.is_available():
        here.append("mps")
    if value not in here:
        raise ValueError(f"--device {value!r} is not usable here; accepted: {', '.join(here)}")
    return value


def cmd_build(
    *,
    ckpt: str,
    out: str,
    force: bool = False,
    corpus: list[str] | None = None,
    layer: Literal["final", "ffn_input", "attn_input"] = "final",
    factory: str = "auto",
    flat_below: int = 1_000_000,
    k: int = 32,
    target_recall: float = 0.9,
    tune_tokens: int = 16384,
    max_documents: int | None = None,
    shard_keys: int | None = None,
    batch_size: int | None = None,
    device: str | None = None,
) -> int:
    """Build a datastore from a checkpoint's states over a corpus (Khandelwal et al. 2020).

    Args:
        ckpt: checkpoint written by rlm fit
        out: datastore directory to write: new, empty or an earlier datastore (replaced atomically)
        force: replace --out even when it holds other files (never a folder holding --ckpt, nor the current
            one)
        corpus: every document of this text, read with the checkpoint's tokenizer (default: the checkpoint's
            own training split)
        layer: keys: the final normed hidden state, the normed input of the last FFN (the paper's best), or the
            normed input of the last block's attention (what the knn_attention plugin searches)
        factory: auto (exact SQfp16 below --flat-below keys, else IVF-PQ) or a faiss factory string
        flat_below: auto: exact search below this many keys
        k: neighbours per token
        target_recall: tune nprobe to this recall@k against exact search
        tune_tokens: validation tokens lam and the temperature are tuned on (0: none)
        max_documents: only the first N documents (default: all)
        shard_keys: for big corpora: index shards index-000.faiss, ... of whole documents, about N keys each,
            filling copies of one index trained on a sample, each written once its keys are computed (memory
            holds one shard's keys); search merges their top-k (default: one index)
        batch_size: windows per forward pass (default: the run's validation batch size)
        device: torch device, e.g. cpu or cuda:1 (default: cuda when torch sees a GPU, else cpu)
    """
    from rlm.eval.knnlm import build

    device = device_arg(device)
    for flag, value in (("k", k), ("tune-tokens", tune_tokens), ("flat-below", flat_below)):
        if value < (1 if flag == "k" else 0):
            raise ValueError(f"--{flag}={value}; accepted: a positive integer")
    if shard_keys is not None and shard_keys < 1:
        raise ValueError(f"--shard-keys={shard_keys}; accepted: a positive integer (keys per index shard)")
    meta = build(ckpt, out, corpus=corpus, layer=layer, factory=factory, k=k, target_recall=target_recall,
                 flat_below=flat_below, tune_tokens=tune_tokens, batch_size=batch_size, device=device,
                 progress=True, max_documents=max_documents, shard_keys=shard_keys, force=force)  # fmt: skip
    tuned = meta.get("tuning") or {}
    print(f"datastore {out}: {meta['entries']:,} keys, {meta['factory']} {meta['search_params']} "
          f"(recall@{meta['k']} {meta['tuned_recall']}), {sum(meta['bytes'].values()) / meta['entries']:.1f} "
          f"bytes/key, built in {meta['seconds']['total']:.1f} s")  # fmt: skip
    if tuned:
        print(f"tuned on {tuned['tokens']} validation tokens: lam {tuned['lam']}, temperature "
              f"{tuned['temperature']:.4g}: loss {tuned['lm_loss']:.4f} -> {tuned['loss']:.4f}")  # fmt: skip
    return 0


def cmd_info(path: str) -> int:
    """Print a datastore's metadata.

    Args:
        path: a datastore directory written by `rlm knnlm build`
    """
    from rlm.eval.datastore import read_datastore_meta

    meta = read_datastore_meta(path)
    print(
        json.dumps({k: v for k, v in meta.items() if k not in ("doc_ids", "doc_hashes", "sha256")}, indent=1)
    )
    return 0


COMMANDS = {"build": cmd_build, "info": cmd_info}
"""``rlm knnlm``'s subcommands (rlm.cli.commands builds their parsers from the signatures)."""


def eval_main(a: Any) -> int:
    """``rlm eval`` on the parameters of rlm.cli.commands.cmd_eval: lm-eval with ``--tasks``, the LM and kNN-LM
    from one pass with ``--datastore``, else rlm.eval.evaluate."""
    from rlm.eval.evaluate import evaluate, write_json
    from rlm.eval.knnlm import evaluate_knn

    a.device = device_arg(a.device)
    if a.batch_size is not None and a.batch_size < 1:
        raise ValueError(f"--batch-size={a.batch_size}; accepted: a positive integer")
    if a.tasks is not None:  # lm-evaluation-harness, with the datastore's kNN-LM when one is given
        from rlm.eval.harness import main as harness_main

        return harness_main(a)
    progress = sys.stderr.isatty()
    if not a.datastore:
        r = evaluate(a.ckpt, a.corpus, a.split, a.batch_size, a.device, progress=progress)
    else:
        r = evaluate_knn(a.ckpt, a.datastore, a.corpus, a.split, a.knn_k, a.lam, a.temperature, a.knn_cache,
                         a.batch_size, a.device, progress=progress)  # fmt: skip
    print("{split} of {corpus}: {documents} documents, {tokens} tokens, {bytes} bytes".format(**r))
    if not a.datastore:
        print(f"loss {r['loss']:.4f}  ppl {r['ppl']:.2f}  bits/byte {r['bpb']:.4f}")
        write_json(a.json, r)
        return 0
    lm, knn = r["lm"], r["knnlm"]
    print(
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
