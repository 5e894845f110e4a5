"""Validation perplexity of a finished run against the corpus' unigram level (the floor a model must beat).

    python benchmarks/unigram.py --config configs/default.yaml --metrics runs/default/version_0/metrics.csv

The unigram model is fitted on the training split's token counts (add-one smoothed) and scored on the
validation targets the LM is scored on (every token after a document's first).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

from rlm.data.module import RLMDataModule  # noqa: E402
from rlm.experiment.spec import merge  # noqa: E402


def unigram_nll(data: RLMDataModule) -> float:
    """Mean negative log-likelihood of the validation targets under the training split's unigram model."""
    store = data.store
    counts = np.zeros(data.vocab_size, dtype=np.int64)
    for doc in store.train_docs:
        counts += np.bincount(store.doc_tokens(int(doc)), minlength=data.vocab_size)
    logp = np.log((counts + 1) / (counts.sum() + data.vocab_size))
    total, n = 0.0, 0
    for doc in store.val_docs:
        targets = store.doc_tokens(int(doc))[1:].astype(np.int64)
        total -= logp[targets].sum()
        n += len(targets)
    return total / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", nargs="+", default=["configs/default.yaml"])
    p.add_argument("--metrics", type=Path, help="metrics.csv of a run (CSVLogger)")
    a = p.parse_args()
    cfg = merge([Path(c) for c in a.config])["data"]
    data = RLMDataModule(**{**cfg, "progress": False})
    data.prepare_data()
    data.setup("fit")
    nll = unigram_nll(data)
    rows = [["unigram (train counts, add-one)", "-", nll, math.exp(nll), 1.0]]
    if a.metrics:
        with open(a.metrics) as f:
            for r in csv.DictReader(f):
                if r.get("val/loss"):
                    loss = float(r["val/loss"])
                    rows.append(
                        [f"model at step {r['step']}", r["step"], loss, math.exp(loss), math.exp(loss - nll)]
                    )
    print(f"validation split: {len(data.store.val_docs)} documents, vocab {data.vocab_size}")
    print(table(["model", "step", "val loss (nats)", "val ppl", "ppl / unigram ppl"], rows))


if __name__ == "__main__":
    main()
