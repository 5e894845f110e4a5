"""A variant's kNN-LM stage after training: ``rlm knnlm build`` over the run's training split, ``rlm eval
--datastore`` on its test split, and the run's summary with the kNN-LM's test loss beside the model's own."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from typing import Any

from rlm.experiment.children import Preempted, _child_env, _run_forwarding_sigterm
from rlm.experiment.runs import LAST_CKPT, Run
from rlm.train.checkpoint import PREEMPTED

KNNLM_JSON = "test_knnlm.json"  # rlm eval --datastore of the last checkpoint on the test split
DATASTORE = "datastore"  # removed after evaluation unless kept; its meta.json stays as datastore_meta.json


def knnlm_stage(run: Run) -> bool:
    """``rlm knnlm build`` over the training split, then ``rlm eval --datastore`` on the test split;
    whether both succeeded."""
    options, ckpt, ds = run.knnlm or {}, str(run.dir / LAST_CKPT), run.dir / DATASTORE
    build = [sys.executable, "-m", "rlm", "knnlm", "build", "--ckpt", ckpt, "--out", str(ds)]
    for key in ("layer", "factory", "k", "flat_below", "target_recall", "tune_tokens", "max_documents"):
        if key in options:
            build += [f"--{key.replace('_', '-')}", str(options[key])]
    evaluate = [sys.executable, "-m", "rlm", "eval", "--ckpt", ckpt, "--split", "test", "--datastore", str(ds),
                "--json", str(run.dir / KNNLM_JSON), *(["--knn-cache"] if options.get("cache") else [])]  # fmt: skip
    with open(run.dir / "knnlm.log", "a") as log:
        for cmd in (build, evaluate):
            code = _run_forwarding_sigterm(cmd, log, _child_env())
            if code in (PREEMPTED, -signal.SIGTERM):
                raise Preempted(
                    f"{run.label}: the kNN-LM stage was stopped by SIGTERM; the next run repeats it"
                )
            if code != 0:
                return False
    if not options.get("keep"):
        shutil.copy2(ds / "meta.json", run.dir / "datastore_meta.json")
        shutil.rmtree(ds)
    return True


def with_knnlm(summary: dict[str, Any], run: Run) -> dict[str, Any]:
    """The summary of a run with a kNN-LM stage: test_* are the kNN-LM's, lm_test the model's alone, and knnlm
    says how (lam, temperature, k, the datastore's size and build time)."""
    r = json.loads((run.dir / KNNLM_JSON).read_text())
    meta_path = run.dir / DATASTORE / "meta.json"
    meta = json.loads((meta_path if meta_path.is_file() else run.dir / "datastore_meta.json").read_text())
    rule = (run.knnlm or {}).get("rule", "interpolate")
    if rule == "joint" and not r.get("joint"):
        raise ValueError(
            f"{run.label}: rule 'joint' but the datastore was not tuned for it (no validation split)"
        )
    if rule == "model" and (meta.get("layer") != "attn_input"):
        raise ValueError(f"{run.label}: rule 'model' scores a knn_attention model searching its own datastore; "
                         f"give knnlm: {{layer: attn_input}} (this datastore's keys: {meta.get('layer')!r})")  # fmt: skip
    scored = rule if rule in ("joint", "model") else "knnlm"  # evaluate_knn's name for the rule's scores
    lm = r["lm"]  # under rule 'model' the model with its datastore: test_loss and lm_test are the same number
    knn = lm if rule == "model" else r[scored]
    random = (r.get("random_neighbours") or {}).get(scored)
    out = dict(summary)
    out["lm_test"] = {"loss": lm["loss"], "ppl": lm["ppl"], "bpb": lm["bpb"]}
    out.update(test_loss=knn["loss"], test_ppl=knn["ppl"], test_bpb=knn["bpb"])
    out["knnlm"] = {
        "options": run.knnlm, "lam": r["lam"], "temperature": r["temperature"], "k": r["k"], "cache": r["cache"],
        "keys": meta.get("entries"), "factory": meta.get("factory"), "build_s": sum((meta.get("seconds") or {}).values()) or None,
        "eval_s": r.get("seconds"), "target_in_neighbours": r.get("target_in_neighbours"), "rule": rule,
        "random_loss": random["loss"] if random else None, "bias": knn.get("bias"),
    }  # fmt: skip
    if rule == "joint":
        out["knnlm"].update(temperature=knn["temperature"], lam=None, interpolate_loss=r["knnlm"]["loss"])
    return out


def without_knnlm(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary as the model alone scored it (for a run that reuses this one's training)."""
    out = dict(summary)
    if out.pop("knnlm", None) is not None:
        lm = out.pop("lm_test")
        out.update(test_loss=lm["loss"], test_ppl=lm["ppl"], test_bpb=lm["bpb"])
    return out
