"""kNN-LM (Khandelwal et al., ICLR 2020): a trained LM interpolated with its nearest neighbours in a datastore
(rlm.eval.datastore). The state at t retrieves its k nearest keys (squared L2) and

    p_kNN(w) = sum_{i: v_i = w} exp(-d_i / T) / sum_i exp(-d_i / T)
    p(w)     = lam * p_kNN(w) + (1 - lam) * p_LM(w)                  (the paper's eq. 2, with a temperature T)

An evaluation wrapper, not a plugin: a forward hook reads the state, so it composes with every plugin. A token
never finds its own document: when the evaluated document is in the datastore (same cache entry and id, or same
tokens), its entry range is excluded inside the search. ``cache=True`` adds the document's own keys at s < t (the
continuous cache of the paper's sec. 6).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from functools import partialmethod
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from rlm.data.module import RLMDataModule
from rlm.data.store import TokenStore
from rlm.data.windows import IGNORE_INDEX, eval_loader
from rlm.eval.datastore import (
    Datastore,
    Progress,
    build_datastore,
    first_docs,
    load_for_knn,
    reading_keys,
    window_targets,
)
from rlm.eval.evaluate import windows_of

CACHE_TOKENS = 4096  # the continuous cache holds at most this many of the document's earlier positions
LAMBDAS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8)  # tried when tuning


@dataclass
class Scored:
    """Per scored token: the LM's log-probability of the target, the k neighbours' squared distances (inf where
    fewer were found) and whether their value is the target."""

    lm_logp: np.ndarray  # (N,) float64
    dists: np.ndarray  # (N, k) float32
    match: np.ndarray  # (N, k) bool
    seconds: dict[str, float] | None = None  # of the forward passes, the searches and the cache
    lm_logz: np.ndarray | None = None  # (N,) logsumexp of the logits: the joint rule needs their scale
    match_random: np.ndarray | None = None  # (N, k): a random datastore value's match, the same distances

    def log_probs(self, lam: float, temperature: float) -> np.ndarray:
        """log p(target) of the interpolation (eq. 2); tokens with no neighbour keep the LM's."""
        return interpolate(self.lm_logp, self.dists, self.match, lam, temperature)


def knn_log_prob(dists: np.ndarray, match: np.ndarray, temperature: float) -> np.ndarray:
    """log p_kNN(target) (N,) from (N, k) distances and matches: -inf where no neighbour's value is the target,
    nan where no neighbour was found."""
    logits = -torch.from_numpy(np.asarray(dists, dtype=np.float64)) / temperature  # (N, k); -inf if missing
    norm = torch.logsumexp(logits, dim=1)  # (N,)
    hit = torch.logsumexp(logits.masked_fill(~torch.from_numpy(match), float("-inf")), dim=1)
    return (hit - norm).numpy()


def interpolate(
    lm_logp: np.ndarray, dists: np.ndarray, match: np.ndarray, lam: float, temperature: float
) -> np.ndarray:
    """log(lam * p_kNN + (1 - lam) * p_LM) of each target (N,)."""
    return _mix(lm_logp, knn_log_prob(dists, match, temperature), np.isfinite(dists).any(axis=1), lam)


def _mix(lm_logp: np.ndarray, knn: np.ndarray, found: np.ndarray, lam: float) -> np.ndarray:
    """The interpolation of eq. 2 from log p_kNN (N,); tokens with no neighbour (``found`` False) keep the LM's."""
    with np.errstate(divide="ignore"):
        mixed = np.logaddexp(math.log1p(-lam) + lm_logp, math.log(lam) + np.where(found, knn, -np.inf))
    return np.where(found, mixed, lm_logp)


def joint_log_prob(
    lm_logp: np.ndarray,
    lm_logz: np.ndarray,
    dists: np.ndarray,
    match: np.ndarray,
    temperature: float,
    bias: float,
) -> np.ndarray:
    """log p(target) (N,) of the token memory's mixture (plugins/token_memory.py, TRIME's eq. 1) over the k found
    neighbours: (exp(z_y) + sum_{i: v_i = y} exp(s_i)) / (sum_v exp(z_v) + sum_i exp(s_i)), s_i = -d_i / T + b."""
    s = torch.from_numpy(-np.asarray(dists, dtype=np.float64) / temperature + bias)  # (N, k); -inf if missing
    logz, logp = torch.from_numpy(np.asarray(lm_logz, np.float64)), torch.from_numpy(np.asarray(lm_logp))
    hit = torch.logsumexp(s.masked_fill(~torch.from_numpy(match), float("-inf")), 1)
    num = torch.logaddexp(logp + logz, hit)
    return (num - torch.logaddexp(logz, torch.logsumexp(s, 1))).numpy()


def _temperatures(scored: Scored) -> list[float]:
    """A log grid of temperatures around the median nearest-neighbour distance (its scale depends on the model)."""
    d1 = scored.dists[:, 0][np.isfinite(scored.dists[:, 0])]
    scale = float(np.median(d1)) if len(d1) else 1.0
    return [scale * f for f in (0.03, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 4.0)]


BIASES = (-8.0, -6.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0)  # memory biases b tried (joint rule)


def tune_joint(scored: Scored, trained: tuple[float, float] | None = None) -> dict[str, float]:
    """The (temperature, bias) of the joint rule with the lowest mean NLL on ``scored``, over a grid and a
    token-memory model's own trained (tau, b)."""
    grid = [(t, b) for t in _temperatures(scored) for b in BIASES] + ([trained] if trained else [])
    best = {"loss": math.inf, "temperature": 1.0, "bias": 0.0}
    for t, b in grid:
        loss = -float(joint_log_prob(scored.lm_logp, scored.lm_logz, scored.dists, scored.match, t, b).mean())
        if loss < best["loss"]:
            best = {"loss": loss, "temperature": t, "bias": b}
    if trained:  # the grid's last pair
        best["trained"] = {"temperature": trained[0], "bias": trained[1], "loss": loss}
    return best


def trained_memory(module: Any) -> tuple[float, float] | None:
    """(tau, b) of a model trained with the token memory plugin, else None."""
    plugin = module.model.plugins["token_memory"] if "token_memory" in module.model.plugins else None
    return (plugin.temperature, float(plugin.bias.detach())) if plugin is not None else None


def tune(scored: Scored) -> dict[str, float]:
    """The (lam, temperature) of lowest mean NLL on ``scored``."""
    temps = _temperatures(scored)
    best = {"loss": -float(scored.lm_logp.mean()), "lam": 0.0, "temperature": temps[0]}
    base = best["loss"]
    found = np.isfinite(scored.dists).any(axis=1)
    for t in temps:
        knn = knn_log_prob(scored.dists, scored.match, t)  # once per temperature, for every lam
        for lam in LAMBDAS:
            loss = -float(_mix(scored.lm_logp, knn, found, lam).mean())
            if loss < best["loss"]:
                best = {"loss": loss, "lam": lam, "temperature": t}
    return {**best, "lm_loss": base}


def attach_datastore(module: Any, datastore: Datastore | None, store: TokenStore, root: str) -> list[str]:
    """Hand a datastore of ``attn_input`` keys to the model's knn_attention plugins, which search it inside the
    forward pass; returns the labels of the plugins that took it."""
    if datastore is None or datastore.meta.get("layer") != "attn_input":
        return []
    able = [p for p in module.model.plugins.values() if hasattr(p, "use_datastore")]
    return [p.label for p in able if p.use_datastore(datastore, store, root)]


@torch.no_grad()
def score(
    module: Any,
    windows: Any,
    store: TokenStore,
    datastore: Datastore | None,
    k: int,
    batch_size: int,
    cache: bool = False,
    progress: bool = False,
    variant: str | None = None,
) -> Scored:
    """One pass over ``windows``: the LM's log-probability of every target and its k neighbours, found in the
    datastore (minus the evaluated document's own entries) and, with ``cache``, in the document's own past."""
    module.eval()
    layer = datastore.meta["layer"] if datastore is not None else "final"
    lm, logzs, dists, match, rmatch = [], [], [], [], []
    rng = np.random.default_rng(0)
    seconds = {"forward": 0.0, "search": 0.0, "cache": 0.0}
    past: dict[int, tuple[list, list]] = {}  # doc -> (keys, values) of its earlier windows
    attach_datastore(module, datastore, store, str(Path(store.root).resolve()))
    bar = Progress("kNN-LM", window_targets(windows), "tokens", progress)
    with reading_keys(module, layer) as hooked:
        for batch in eval_loader(windows, batch_size):
            t0 = time.perf_counter()
            batch = {key: v.to(module.device) for key, v in batch.items()}
            rows, keys, t1 = scored_batch(
                module, batch, hooked, datastore, store, k, "test", windows.segments, variant
            )
            seconds["forward"] += t1 - t0
            seconds["search"] += time.perf_counter() - t1
            for b, (tgt, lm_b, logz_b, d, v) in enumerate(rows):
                n = len(tgt)
                lm.append(lm_b)
                logzs.append(logz_b)
                if cache:
                    t2 = time.perf_counter()
                    doc = int(batch["doc_ids"][b])
                    if doc not in past:  # windows come in document order: an earlier document is done
                        past.clear()
                    d, v = _with_cache(past.setdefault(doc, ([], [])), keys[b, :n], tgt, d, v, k)
                    seconds["cache"] += time.perf_counter() - t2
                dists.append(d)
                match.append(v == tgt.numpy()[:, None])
                if datastore is not None and len(datastore.values):  # random entries' values, same distances
                    drawn = np.asarray(datastore.values)[rng.integers(0, len(datastore.values), d.shape)]
                    rmatch.append(np.isfinite(d) & (drawn == tgt.numpy()[:, None]))
                else:
                    rmatch.append(np.zeros(d.shape, bool))
            bar.update(sum(len(row[0]) for row in rows))
    bar.close()
    kk = max((x.shape[1] for x in dists), default=k)

    # (N, kk): the rows of windows with fewer neighbours padded
    def cat(rows: list[np.ndarray], fill: float = 0) -> np.ndarray:
        return np.concatenate([np.pad(x, ((0, 0), (0, kk - x.shape[1])), constant_values=fill) for x in rows])

    lm_logp, lm_logz = np.concatenate(lm), np.concatenate(logzs)
    return Scored(lm_logp, cat(dists, np.inf), cat(match), seconds, lm_logz, cat(rmatch))


def scored_batch(module: Any, batch: dict[str, Any], hooked: dict[str, torch.Tensor], datastore: Datastore | None,
                 store: TokenStore, k: int, stage: str, segments: Any = None, variant: str | None = None
                 ) -> tuple[list[tuple], torch.Tensor, float]:  # fmt: skip
    """The forward pass of one evaluation batch (inside ``reading_keys``) and its datastore search: for each window
    (targets (n,), log p_LM(target) (n,), log Z (n,), distances (n, k), values (n, k)), the keys (B, T, d) on the
    CPU, and the clock after the forward pass. Windows that exclude the same entry range share one search."""
    ctx = module.make_context(batch, stage, variant, segments=segments)
    logits = module.model(batch["tokens"], ctx).float()  # (B, T, V)
    keys = hooked["keys"].float().cpu()  # (B, T, d)
    targets = batch["targets"].cpu()  # (B, T)
    logz = torch.logsumexp(logits, -1)  # (B, T)
    logp = (logits - logz[..., None]).cpu().double()
    logz = logz.cpu().double()
    lengths = (targets != IGNORE_INDEX).sum(1).tolist()  # targets are a prefix of each window
    t1 = time.perf_counter()
    found = [(np.full((n, 0), np.inf, np.float32), np.zeros((n, 0), np.int64)) for n in lengths]
    if datastore is not None:
        root = str(Path(store.root).resolve())
        groups: dict[tuple[int, int] | None, list[int]] = {}  # exclusion -> windows
        for b, doc in enumerate(batch["doc_ids"].tolist()):
            groups.setdefault(datastore.exclusion(root, doc, store.doc_tokens(doc)), []).append(b)
        for excl, group in groups.items():
            d, v = datastore.search(torch.cat([keys[b, : lengths[b]] for b in group]).numpy(), k, excl)
            lo = 0
            for b in group:
                found[b] = (d[lo : lo + lengths[b]], v[lo : lo + lengths[b]])
                lo += lengths[b]
    rows = []
    for b, n in enumerate(lengths):
        tgt = targets[b, :n]
        rows.append((tgt, logp[b, torch.arange(n), tgt].numpy(), logz[b, :n].numpy(), *found[b]))
    return rows, keys, t1


def _with_cache(
    past: tuple[list, list], keys: torch.Tensor, values: torch.Tensor, d: np.ndarray, v: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Merge the datastore's neighbours with the k nearest of the document's own past: the keys of its earlier
    windows (the last CACHE_TOKENS) and, in this window, of positions s < t (whose values s + 1 <= t are seen)."""
    n = len(keys)
    if past[0]:  # the most recent CACHE_TOKENS positions before this window, kept as one tensor
        past[0][:] = [torch.cat(past[0])[-CACHE_TOKENS:]]
        past[1][:] = [torch.cat(past[1])[-CACHE_TOKENS:]]
    pk = torch.cat([*past[0], keys]) if past[0] else keys  # (P + n, d)
    pv = torch.cat([*past[1], values]) if past[1] else values  # (P + n,)
    p = len(pk) - n
    dist = torch.cdist(keys, pk).square()  # (n, P + n)
    later = torch.arange(p + n)[None, :] >= (p + torch.arange(n))[:, None]  # (n, P + n): s >= t
    dist = dist.masked_fill(later, float("inf"))
    kk = min(k, p + n)
    cd, ci = torch.topk(dist, kk, dim=1, largest=False)  # (n, kk)
    cv = torch.where(torch.isfinite(cd), pv[ci], torch.full_like(pv[ci], -1))
    past[0].append(keys)
    past[1].append(values)
    alld = np.concatenate([d, cd.numpy().astype(np.float32)], 1)
    allv = np.concatenate([v, cv.numpy()], 1)
    order = np.argsort(alld, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(alld, order, 1), np.take_along_axis(allv, order, 1)


def tune_on(module: Any, data: RLMDataModule, store: TokenStore, ds: Datastore, docs: np.ndarray, k: int,
            tokens: int, batch_size: int, progress: bool) -> dict[str, float]:  # fmt: skip
    """lam and the temperature of lowest loss on the first ``tokens`` targets of ``docs`` (the validation split)."""
    chosen = first_docs(store, docs, tokens)
    scored = score(module, windows_of(data, store, chosen), store, ds, k, batch_size, progress=progress)
    return {**tune(scored), "tokens": len(scored.lm_logp), "documents": len(chosen),
            "joint": tune_joint(scored, trained_memory(module))}  # fmt: skip


def open_datastore(path: str | os.PathLike[str], module: Any, lam: float | None, temperature: float | None,
                   k: int | None) -> tuple[Datastore, float, float, int]:  # fmt: skip
    """The datastore of ``module``'s own states at ``path``, with lam, temperature and k: given, else the build's."""
    ds = Datastore(path)
    ds.check_model(module)
    tuned = ds.meta.get("tuning") or {}
    lam = tuned.get("lam") if lam is None else lam
    temperature = tuned.get("temperature") if temperature is None else temperature
    if lam is None or temperature is None:
        raise ValueError(f"datastore {ds.path} holds no tuned lam/temperature (built over another corpus); "
                         "pass --lam and --temperature")  # fmt: skip
    if not 0.0 <= lam < 1.0 or not temperature > 0:
        raise ValueError(f"lam={lam}, temperature={temperature}; accepted: 0 <= lam < 1, temperature > 0")
    if k is not None and k < 1:
        raise ValueError(f"k={k} neighbours; accepted: a positive integer")
    return ds, lam, temperature, k or ds.meta["k"]


def evaluate_knn(
    ckpt_path: str,
    datastore: str | os.PathLike[str],
    corpus: list[str] | None = None,
    split: str = "test",
    k: int | None = None,
    lam: float | None = None,
    temperature: float | None = None,
    cache: bool = False,
    batch_size: int | None = None,
    device: str = "cpu",
    progress: bool = False,
) -> dict[str, Any]:
    """The LM's and the kNN-LM's loss, perplexity and bits per byte, from one pass over the same tokens."""
    from rlm.eval.evaluate import metrics

    module, data, store = load_for_knn(ckpt_path, corpus, device, progress)
    ds, lam, temperature, k = open_datastore(datastore, module, lam, temperature, k)
    docs = np.arange(store.n_docs) if corpus else getattr(store, f"{split}_docs")
    if not len(docs):
        raise ValueError(f"the {split} split of {ckpt_path!r}'s corpus is empty")
    texts = data.documents()
    n_bytes = sum(len(texts[d].text.encode("utf-8")) for d in docs)
    start = time.perf_counter()
    windows, batch_size = windows_of(data, store, docs), batch_size or data.val_batch_size
    scored = score(module, windows, store, ds, k, batch_size, cache=cache, progress=progress)
    lm_nll, knn_nll = -float(scored.lm_logp.sum()), -float(scored.log_probs(lam, temperature).sum())
    n = len(scored.lm_logp)
    rand_knn = -float(interpolate(scored.lm_logp, scored.dists, scored.match_random, lam, temperature).sum())
    random = {"knnlm": metrics(rand_knn, n, n_bytes)}
    joint: dict[str, Any] | None = None
    tuned_joint = (ds.meta.get("tuning") or {}).get("joint")
    if tuned_joint:  # the token memory's rule, with the (temperature, bias) tuned at build
        t, b = tuned_joint["temperature"], tuned_joint["bias"]
        nll, rnll = (
            -float(joint_log_prob(scored.lm_logp, scored.lm_logz, scored.dists, m, t, b).sum())
            for m in (scored.match, scored.match_random)
        )
        joint = {**metrics(nll, n, n_bytes), "temperature": t, "bias": b, "trained": trained_memory(module)}
        random["joint"] = metrics(rnll, n, n_bytes)
    retrieving = attach_datastore(module, ds, store, str(Path(store.root).resolve()))
    if retrieving:  # the model searched the datastore itself: its loss again with random neighbours' tokens
        rs = score(
            module, windows, store, ds, k, batch_size, progress=progress, variant=f"{retrieving[0]}_random"
        )
        random["model"] = metrics(-float(rs.lm_logp.sum()), n, n_bytes)
    return {
        "checkpoint": str(ckpt_path), "datastore": str(ds.path), "corpus": corpus or data.corpus,
        "split": "all" if corpus else split, "documents": int(len(docs)), "tokens": n, "bytes": n_bytes,
        "lam": lam, "temperature": temperature, "k": k, "cache": cache,
        "lm": metrics(lm_nll, n, n_bytes), "knnlm": metrics(knn_nll, n, n_bytes), "joint": joint,
        "random_neighbours": random,
        "target_in_neighbours": float(scored.match.any(axis=1).mean()) if n else 0.0,
        "seconds": time.perf_counter() - start,
    }  # fmt: skip


class Mixer:
    """kNN-LM over the whole vocabulary, for sampling and for lm-evaluation-harness: each row's log-probabilities
    mixed with the datastore's neighbours of that position's state (eq. 2)."""

    def __init__(self, datastore: Datastore, lam: float, temperature: float, k: int) -> None:
        self.ds, self.lam, self.temperature, self.k = datastore, lam, temperature, k

    def __call__(self, logits: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """(N, V) mixed log-probabilities from (N, V) logits and the (N, d) keys of the same positions; a row
        with no neighbour found keeps the LM's."""
        d, v = self.ds.search(key.float().cpu().numpy(), self.k, None)  # (N, k); -1 where none was found
        logp = torch.log_softmax(logits.float(), -1).cpu().double()  # (N, V)
        found = torch.from_numpy(v >= 0)  # (N, k)
        scaled = (-torch.from_numpy(d).double() / self.temperature).masked_fill(~found, float("-inf"))
        w = torch.softmax(scaled, 1).nan_to_num(0.0)  # (N, k); a row without neighbours: nan -> 0
        p_knn = torch.zeros_like(logp).scatter_add_(1, torch.from_numpy(np.maximum(v, 0)).long(), w)
        mixed = (self.lam * p_knn + (1 - self.lam) * logp.exp()).clamp_min(1e-30).log()
        mixed = torch.where(found.any(1, keepdim=True), mixed, logp)
        return mixed.float().to(logits.device)


def build(
    ckpt_path: str, out: str | os.PathLike[str], *args: Any, tune_tokens: int = 16384, **kwargs: Any
) -> dict[str, Any]:
    """A datastore (rlm.eval.datastore.build_datastore, same arguments) with lam and the temperature tuned on the
    first ``tune_tokens`` targets of the checkpoint's validation split (0: not tuned)."""

    def tuner(ds: Datastore, module: Any, data: RLMDataModule, store: TokenStore) -> dict[str, Any]:
        return tune_on(module, data, store, ds, store.val_docs, ds.meta["k"], tune_tokens, data.val_batch_size,
                       kwargs.get("progress", True))  # fmt: skip

    return build_datastore(ckpt_path, out, *args, tuner=tuner if tune_tokens else None, **kwargs)


# ``rlm validate|test --datastore DIR``: a callback, so the core loop stays as it is. It runs each evaluation batch's
# forward again (scored_batch) and logs ``<stage>/knnlm/loss`` and, where tuned, the token memory's
# ``<stage>/joint/loss`` (summed over processes).
class DatastoreEval(pl.Callback):
    """Scores validation and test batches with a kNN-LM datastore (``rlm knnlm build``); ``lam``/``temperature``
    default to the ones tuned at build, ``k`` to the datastore's."""

    def __init__(
        self, datastore: str, k: int | None = None, lam: float | None = None, temperature: float | None = None
    ) -> None:
        super().__init__()
        self.path, self.k, self.lam, self.temperature = datastore, k, lam, temperature
        self.ds: Any = None
        self._sums: dict[str, np.ndarray] = {}  # name -> (summed NLL, tokens)

    def _load(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open the datastore, at the loop's start: after Lightning restored the checkpoint's weights."""
        if self.ds is None:
            self.ds, self.lam, self.temperature, self.k = open_datastore(
                self.path, pl_module, self.lam, self.temperature, self.k
            )

    def _start(self, *_: Any) -> None:
        self._sums = {"knnlm": np.zeros(2), "joint": np.zeros(2)}

    on_validation_epoch_start = on_test_epoch_start = _start
    on_validation_start = on_test_start = _load

    @torch.no_grad()
    def _batch(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: dict, *_: Any, stage: str
    ) -> None:
        store = trainer.datamodule.store
        with reading_keys(pl_module, self.ds.meta["layer"]) as hooked:
            rows, _, _ = scored_batch(pl_module, batch, hooked, self.ds, store, self.k, stage)
        joint = (self.ds.meta.get("tuning") or {}).get("joint")
        for tgt, lm, logz, d, v in rows:
            n, match = len(tgt), v == tgt.numpy()[:, None]
            self._sums["knnlm"] += (-interpolate(lm, d, match, self.lam, self.temperature).sum(), n)
            if joint:
                nll = -joint_log_prob(lm, logz, d, match, joint["temperature"], joint["bias"])
                self._sums["joint"] += (nll.sum(), n)

    on_validation_batch_end = partialmethod(_batch, stage="val")
    on_test_batch_end = partialmethod(_batch, stage="test")

    def _end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for name in ("knnlm", "joint"):
            total = torch.tensor(self._sums[name], dtype=torch.float64)
            total = trainer.strategy.reduce(total, reduce_op="sum") if trainer.world_size > 1 else total
            if total[1] > 0:
                loss = float(total[0] / total[1])
                pl_module.log(f"{stage}/{name}/loss", loss, rank_zero_only=True)
                pl_module.log(f"{stage}/{name}/ppl", float(np.exp(min(loss, 20.0))), rank_zero_only=True)

    on_validation_epoch_end = partialmethod(_end, stage="val")
    on_test_epoch_end = partialmethod(_end, stage="test")
