"""How much of the retriever's neighbour ranking survives a narrower segment embedding.

At a large corpus the `tokens` embedder's vectors are d_model wide (8 TB at 1B segments x 2048 in fp32); a narrower
embedding is the way down. This measures two ways of narrowing on a trained checkpoint's own e(.) (the L2-normalised
mean token embedding of each training segment, as the `tokens` embedder computes it): a fixed random orthonormal
projection (Johnson-Lindenstrauss: no data needed, the same on every rank) and PCA fitted on a sample of the
segments. Each is scored by recall@10 against the full-width exact search, for sample queries among the training
segments (a query never finds itself). Width m = d is the control: both keep every cosine, recall 1.

    python benchmarks/narrow_embedding.py --ckpt runs/.../last.ckpt
    python benchmarks/narrow_embedding.py --ckpt CKPT --queries 200 --widths 8 16  # smoke test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

from rlm.eval.datastore import load_for_knn  # noqa: E402
from rlm.index.memory import indexed_rows  # noqa: E402
from rlm.index.projection import fit_projection  # noqa: E402


def segment_embeddings(ckpt: str, chunk: int = 4096) -> torch.Tensor:
    """(S, d) unit e(.) of every training segment: the mean of its tokens' embeddings, normalised."""
    module, data, store = load_for_knn(ckpt, None, "cpu", False)
    data.prepare_data()
    data.setup("fit")
    segments = data.segments
    rows = indexed_rows(segments, store.train_docs)
    table_ = module.model.embed.main.weight.detach().float()
    L, out = segments.segment_len, []
    for lo in range(0, len(rows), chunk):
        ids = rows[lo : lo + chunk]
        tokens = torch.from_numpy(segments.tokens(ids)).long()
        mask = torch.from_numpy(np.arange(L) < segments.length[ids][:, None]).float()
        mean = (table_[tokens] * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1.0)
        out.append(F.normalize(mean, dim=-1))
    return torch.cat(out)


def top10(vectors: torch.Tensor, queries: torch.Tensor, k: int = 10) -> torch.Tensor:
    """(Q, k) ids of each query segment's k most similar others (itself excluded)."""
    scores = vectors[queries] @ vectors.T
    scores[torch.arange(len(queries)), queries] = -float("inf")
    return scores.topk(k, dim=1).indices


def recall(found: torch.Tensor, truth: torch.Tensor) -> float:
    """Mean share of each row of truth found in the same row of found."""
    return float(
        np.mean([len(set(a.tolist()) & set(b.tolist())) / truth.shape[1] for a, b in zip(found, truth)])
    )


def measure(embeddings: torch.Tensor, widths: list[int], queries: int, seed: int = 0) -> list[list[object]]:
    """Rows (m, recall@10 of the random projection, of PCA without centring, of the PCA rlm builds) per width m <= d.

    The last is what ``retrieval.index_dim`` ships (rlm.index.projection: fitted on up to 65,536 evenly spaced
    vectors, centred, the result re-normalised); the middle column is the uncentred SVD this benchmark chose it by.
    """
    n, d = embeddings.shape
    rng = np.random.default_rng(seed)
    q = torch.from_numpy(rng.choice(n, min(queries, n), replace=False))
    truth = top10(embeddings, q)
    sample = embeddings[torch.from_numpy(rng.choice(n, min(n, 20000), replace=False))]
    _, _, components = torch.linalg.svd(sample - sample.mean(0), full_matrices=False)  # (d, d) rows
    g = torch.Generator().manual_seed(seed)
    rows = []
    for m in [w for w in widths if w <= d]:
        basis, _ = torch.linalg.qr(torch.randn(d, m, generator=g))  # (d, m) orthonormal columns
        projected = F.normalize(embeddings @ basis, dim=-1)
        pca = F.normalize(embeddings @ components[:m].T, dim=-1)
        built = (
            embeddings
            if m == d
            else torch.from_numpy(fit_projection(embeddings.numpy(), m).apply(embeddings.numpy()))
        )
        rows.append([m, *(f"{recall(top10(x, q), truth):.3f}" for x in (projected, pca, built))])
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--ckpt", required=True, help="a trained rlm checkpoint (its own training split is embedded)"
    )
    p.add_argument(
        "--widths", type=int, nargs="+", default=[16, 32, 64, 128], help="narrow widths m (d added)"
    )
    p.add_argument("--queries", type=int, default=2000, help="sample query segments")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    embeddings = segment_embeddings(args.ckpt)
    n, d = embeddings.shape
    print(
        f"{n} training segments, e(.) {d} wide, {min(args.queries, n)} queries; recall@10 against full width"
    )
    widths = sorted({*args.widths, d})
    print(
        table(
            ["width m", "random orthonormal projection", "PCA (uncentred SVD)", "PCA as built"],
            measure(embeddings, widths, args.queries),
        )
    )


if __name__ == "__main__":
    main()
