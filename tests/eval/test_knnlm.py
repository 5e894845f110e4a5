"""kNN-LM (issue 23): the interpolation against a by-hand reference, the L2 indices against exact search, a
datastore from a real checkpoint, its refusal under another model, and causality by perturbation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import CONFIGS, run_rlm
from torch.testing import assert_close

from rlm.index.knn import BLAS_QUERIES, build_l2_index, exact_l2, search_l2

TINY = ["--config", CONFIGS / "default.yaml", "--config", CONFIGS / "data" / "tiny.yaml",
        "--config", CONFIGS / "model" / "tiny.yaml"]  # fmt: skip


def test_interpolation_matches_the_papers_equation_by_hand():
    from rlm.eval.knnlm import interpolate

    rng = np.random.default_rng(0)
    n, k, lam, temp = 7, 5, 0.3, 2.0
    lm = np.log(rng.uniform(0.01, 0.9, n))
    d = rng.uniform(0, 10, (n, k)).astype(np.float32)
    d[2, 3:] = np.inf  # fewer than k found
    match = rng.uniform(size=(n, k)) < 0.4
    match[4] = False  # no neighbour has the target: p = (1 - lam) p_LM
    d[6] = np.inf  # nothing found: the LM alone
    want = []
    for i in range(n):
        w = [math.exp(-d[i, j] / temp) for j in range(k) if np.isfinite(d[i, j])]
        if not w:
            want.append(lm[i])
            continue
        hit = sum(math.exp(-d[i, j] / temp) for j in range(k) if np.isfinite(d[i, j]) and match[i, j])
        want.append(math.log(lam * hit / sum(w) + (1 - lam) * math.exp(lm[i])))
    assert_close(
        torch.from_numpy(interpolate(lm, d, match, lam, temp)), torch.tensor(want, dtype=torch.float64)
    )


def test_l2_indices_against_exact_search():
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(6000, 16)).astype(np.float16)
    keys[3000:3005] = keys[5990:] = keys[99]  # one context seen 16 times: more ties at distance 0 than k
    q = rng.normal(size=(50, 16)).astype(np.float32)
    q[:2] = keys[[99, 3001]]
    d, ids = exact_l2(keys, q, 8, chunk=1000)
    brute = ((q[:, None, :] - keys.astype(np.float32)[None]) ** 2).sum(-1)  # (Q, N)
    want = np.argsort(brute, axis=1, kind="stable")[:, :8]
    assert (ids == want).mean() > 0.99
    assert_close(
        torch.from_numpy(d), torch.from_numpy(np.take_along_axis(brute, want, 1)), rtol=1e-4, atol=1e-3
    )
    exact = build_l2_index(keys, "SQfp16", target_recall=None)
    # a batch is searched by exact_l2's matrix products, a single query by faiss's scan: the same numbers and ids
    assert len(q) >= BLAS_QUERIES
    for excl in (None, (1000, 5000)):
        scans = [search_l2(exact.index, q[i : i + 1], 8, excl) for i in range(len(q))]
        fd, fids = search_l2(exact.index, q, 8, excl)
        assert np.array_equal(fd, np.concatenate([d for d, _ in scans]))
        assert np.array_equal(fids, np.concatenate([i for _, i in scans]))
    fd, fids = search_l2(exact.index, q, 8)
    assert np.array_equal(fids, ids)  # the index's codes are the keys
    # an excluded range is never found, and the rest is exact search over the complement
    fd, fids = search_l2(exact.index, q, 8, exclude=(1000, 5000))
    assert not ((fids >= 1000) & (fids < 5000)).any()
    rest = np.concatenate([np.arange(1000), np.arange(5000, 6000)])
    _, sub = exact_l2(keys[rest], q, 8)
    assert np.array_equal(fids, rest[sub])
    ivf = build_l2_index(keys, "IVF16,PQ8", target_recall=0.5, tune_k=8)
    assert ivf.search_params["nprobe"] >= 1 and ivf.tuned_recall >= 0.5
    _, iids = search_l2(ivf.index, q, 8, exclude=(0, 3000), params=ivf.search_params)
    assert not ((iids >= 0) & (iids < 3000)).any()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, rlm_cache):
    """A 4-step tiny checkpoint and an exact datastore over its first 6 training documents."""
    from rlm.eval.knnlm import build

    work = tmp_path_factory.mktemp("knnlm")
    run_rlm(["fit", *TINY, "--trainer.max_steps=4", "--trainer.enable_progress_bar=false",
             f"--trainer.default_root_dir={work / 'run'}"], work, rlm_cache)  # fmt: skip
    ckpt = work / "run" / "version_0" / "checkpoints" / "last.ckpt"
    import os

    os.environ["RLM_CACHE"] = str(rlm_cache)
    meta = build(
        str(ckpt), work / "ds", factory="SQfp16", k=8, tune_tokens=512, max_documents=6, progress=False
    )
    return work, ckpt, meta


# slow: reads what its module fixture trains (and builds) with real `rlm` subprocesses
@pytest.mark.slow
def test_datastore_holds_every_training_token_and_tunes_lam(tiny):
    from rlm.data.store import TokenStore

    work, ckpt, meta = tiny
    store = TokenStore(meta["store"])
    docs = np.asarray(meta["doc_ids"])
    assert list(docs) == list(store.train_docs[:6])
    assert meta["entries"] == int((store.doc_lengths[docs] - 1).sum())
    values = np.load(work / "ds" / "values.npy")
    ranges = np.load(work / "ds" / "docs.npy")
    for d, (lo, hi) in zip(docs, ranges):  # value of entry t of a document = its token t + 1
        assert (values[lo:hi] == store.doc_tokens(int(d))[1:]).all()
    tuning = meta["tuning"]
    assert 0 < tuning["lam"] < 1 and tuning["loss"] <= tuning["lm_loss"]
    assert not list(work.glob(".ds.tmp-*"))  # nothing half-written left


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_datastore_of_another_checkpoint_is_refused(tiny, tmp_path, rlm_cache):
    from rlm.eval.datastore import Datastore
    from rlm.train.module import LMModule

    work, ckpt, _ = tiny
    module = LMModule.load_from_checkpoint(ckpt, map_location="cpu")
    ds = Datastore(work / "ds")
    ds.check_model(module)  # its own model passes
    with torch.no_grad():
        module.model.head.weight[0, 0] += 1e-3
    with pytest.raises(ValueError, match="another model"):
        ds.check_model(module)
    other = tmp_path / "other.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    key = next(k for k in saved["state_dict"] if k.endswith("head.weight"))
    saved["state_dict"][key] = saved["state_dict"][key] + 0.01
    torch.save(saved, other)
    out = run_rlm(["eval", "--ckpt", other, "--datastore", work / "ds"], tmp_path, rlm_cache, check=False)
    assert out.returncode == 2 and "another model" in out.stderr and "Traceback" not in out.stderr


def _score(ckpt, ds_path, corpus, cache):
    from rlm.eval.datastore import Datastore, load_for_knn, windows_of
    from rlm.eval.knnlm import score

    module, data, store = load_for_knn(str(ckpt), corpus, "cpu", False)
    ds = Datastore(ds_path)
    docs = np.arange(store.n_docs)
    s = score(module, windows_of(data, store, docs), store, ds, 8, 4, cache=cache)
    return s, store


# slow: reads what its module fixture trains (and builds) with real `rlm` subprocesses
@pytest.mark.slow
@pytest.mark.parametrize("cache", [False, True])
def test_changing_later_tokens_never_moves_an_earlier_knnlm_probability(tiny, tmp_path, cache):
    """A document evaluated twice, the second time with its end rewritten: every target before the first
    changed token has the same kNN-LM probability, with and without the document's own past (the cache)."""
    from rlm.data.store import TokenStore

    work, ckpt, meta = tiny
    store = TokenStore(meta["store"])
    src = store.tokenizer.decode(store.doc_tokens(int(store.val_docs[0]))[1:-1].tolist())
    text = src[:3000]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "doc.py").write_text(text)
    (tmp_path / "b" / "doc.py").write_text(text[:2000] + "\n# something else entirely " * 40)
    sa, ta = _score(ckpt, work / "ds", [str(tmp_path / "a")], cache)
    sb, tb = _score(ckpt, work / "ds", [str(tmp_path / "b")], cache)
    a, b = ta.doc_tokens(0), tb.doc_tokens(0)
    same = int(np.argmin(a[: min(len(a), len(b))] == b[: min(len(a), len(b))]))  # first differing token
    assert 200 < same < len(a) - 50
    n = same - 1  # targets 1..same-1 are the same tokens in both
    for lam, t in ((0.3, 1.0), (0.7, 10.0)):
        assert_close(torch.from_numpy(sa.log_probs(lam, t)[:n]), torch.from_numpy(sb.log_probs(lam, t)[:n]))
    assert not np.allclose(sa.log_probs(0.5, 1.0)[n : n + 50], sb.log_probs(0.5, 1.0)[n : n + 50])
    if cache:  # the document's own past is used: its neighbours include earlier positions' next tokens
        assert sa.match[100:].any()


# slow: reads what its module fixture trains (and builds) with real `rlm` subprocesses
@pytest.mark.slow
def test_a_copy_of_a_training_document_retrieves_what_a_datastore_without_it_gives(tiny, tmp_path):
    """Evaluated as new text, a copy of a datastore document is recognised by its tokens and its own entries are
    excluded inside the search: its neighbours are exactly those of a datastore built without it."""
    from rlm.data.store import TokenStore
    from rlm.eval.knnlm import build

    work, ckpt, meta = tiny
    store = TokenStore(meta["store"])
    doc = int(meta["doc_ids"][0])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "copy.py").write_text(store.tokenizer.decode(store.doc_tokens(doc)[1:-1].tolist()))
    with_copy, t = _score(ckpt, work / "ds", [str(tmp_path / "c")], cache=False)
    assert (t.doc_tokens(0) == store.doc_tokens(doc)).all()
    without = tmp_path / "without"
    build(
        str(ckpt),
        without,
        factory="SQfp16",
        k=8,
        tune_tokens=0,
        documents=meta["doc_ids"][1:],
        progress=False,
    )
    reference, _ = _score(ckpt, without, [str(tmp_path / "c")], cache=False)
    assert_close(torch.from_numpy(with_copy.dists), torch.from_numpy(reference.dists))
    assert (with_copy.match == reference.match).all()


def test_the_cache_holds_only_strictly_earlier_positions():
    """The continuous cache of position t offers entries s < t only (value s + 1 <= t): never the query's own
    key (distance 0, value = its target) or a later one, across window boundaries too."""
    from rlm.eval.knnlm import _with_cache

    torch.manual_seed(0)
    past: tuple[list, list] = ([], [])
    keys = torch.randn(20, 4)
    values = torch.arange(1, 21)  # entry s predicts token s + 1
    empty_d, empty_v = np.full((10, 0), np.inf, np.float32), np.zeros((10, 0), np.int64)
    for w in range(2):  # two windows of one document
        d, v = _with_cache(
            past, keys[10 * w : 10 * w + 10], values[10 * w : 10 * w + 10], empty_d, empty_v, 6
        )
        t = np.arange(10 * w, 10 * w + 10)[:, None]
        assert ((v == -1) | (v <= t)).all() and (v[np.isfinite(d)] >= 1).all()
        assert np.isinf(d[0]).all() if w == 0 else np.isfinite(d).all()  # the first position has no past
        if w == 1:
            full = torch.cdist(keys[10:], keys).square()
            mask = torch.arange(20)[None, :] >= torch.arange(10, 20)[:, None]
            want = torch.topk(full.masked_fill(mask, float("inf")), 6, largest=False).values
            assert_close(torch.from_numpy(d), want)


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_knnlm_commands_build_evaluate_and_generate(tiny, tmp_path, rlm_cache):
    """`rlm knnlm build`, `rlm eval --datastore` (the LM and kNN-LM from one pass, the LM line equal to plain
    `rlm eval`) and `rlm generate --datastore`; bad values are one-line errors."""
    work, ckpt, _ = tiny
    ds = tmp_path / "ds"
    out = run_rlm(["knnlm", "build", "--ckpt", ckpt, "--out", ds, "--factory", "SQfp16", "--k", "8",
                   "--max-documents", "4", "--tune-tokens", "400"], tmp_path, rlm_cache)  # fmt: skip
    assert "keys" in out.stdout and "tuned on" in out.stdout
    info = json.loads(run_rlm(["knnlm", "info", ds], tmp_path, rlm_cache).stdout)
    assert info["k"] == 8 and info["factory"] == "SQfp16" and "doc_ids" not in info
    res = tmp_path / "r.json"
    out = run_rlm(
        ["eval", "--ckpt", ckpt, "--datastore", ds, "--split", "val", "--json", res], tmp_path, rlm_cache
    )
    assert "kNN-LM  loss" in out.stdout
    r = json.loads(res.read_text())
    plain = run_rlm(
        ["eval", "--ckpt", ckpt, "--split", "val", "--json", tmp_path / "p.json"], tmp_path, rlm_cache
    )
    assert plain.returncode == 0
    p = json.loads((tmp_path / "p.json").read_text())
    assert r["tokens"] == p["tokens"] and math.isclose(r["lm"]["loss"], p["loss"], rel_tol=1e-5)
    assert r["knnlm"]["loss"] < r["lm"]["loss"]  # tuned on validation, scored on it: never worse
    gen = run_rlm(["generate", "--ckpt", ckpt, "--datastore", ds, "--prompt", "import ", "--max-new-tokens", "8",
                   "--temperature", "0"], tmp_path, rlm_cache)  # fmt: skip
    assert gen.stdout.startswith("import ") and len(gen.stdout.strip()) > len("import ")
    for bad, says in (
        (["knnlm", "build", "--ckpt", ckpt, "--out", tmp_path / "x", "--k", "0"], "--k=0"),
        (["eval", "--ckpt", ckpt, "--datastore", tmp_path / "nowhere"], "no kNN-LM datastore"),
        (["eval", "--ckpt", ckpt, "--datastore", ds, "--lam", "1.5"], "lam=1.5"),
    ):
        out = run_rlm(bad, tmp_path, rlm_cache, check=False)
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
@pytest.mark.parametrize(
    "plugin", ["moe", "pkm", "altup", "tokenid", "retrieval", "token_memory", "knn_attention"]
)
def test_knnlm_composes_with_every_plugin(plugin, tmp_path, rlm_cache):
    """A datastore from a checkpoint with a memory plugin (the trained retriever included): keys are read from
    the model's final norm whatever fills the slots, and kNN-LM scores the validation split."""
    from rlm.eval.knnlm import build, evaluate_knn

    extra = ["--config", CONFIGS / "plugins" / f"{plugin}.yaml"]
    if plugin in ("moe", "pkm"):  # the shipped fragments name layers of the 4-layer default model
        extra.append(f"--model.plugins.{plugin}.layers=[1]")
    if plugin == "retrieval":
        extra += ["--model.plugins.retrieval.schedule=every 2", "--model.plugins.retrieval.index_factory=Flat",
                  "--model.plugins.retrieval.mode=blocking", "--model.plugins.retrieval.progress=false"]  # fmt: skip
    run_rlm(["fit", *TINY, *extra, "--trainer.max_steps=3", "--trainer.enable_progress_bar=false",
             f"--trainer.default_root_dir={tmp_path / 'run'}"], tmp_path, rlm_cache)  # fmt: skip
    ckpt = tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt"
    import os

    os.environ["RLM_CACHE"] = str(rlm_cache)
    build(str(ckpt), tmp_path / "ds", factory="SQfp16", k=8, tune_tokens=400, max_documents=3, progress=False)
    r = evaluate_knn(str(ckpt), tmp_path / "ds", split="val")
    assert (
        r["tokens"] > 0 and math.isfinite(r["knnlm"]["loss"]) and r["knnlm"]["loss"] < r["lm"]["loss"] + 0.05
    )
    assert math.isfinite(r["joint"]["loss"]) and r["random_neighbours"]["knnlm"]["loss"] > 0
    if (
        plugin == "token_memory"
    ):  # the joint rule was tuned with the model's own tau and b among the candidates
        assert r["joint"]["trained"] is not None and r["joint"]["trained"][0] > 0


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_rlm_test_and_validate_take_a_datastore_and_match_rlm_eval(tiny, tmp_path, rlm_cache):
    """`rlm test --datastore DS` logs test/knnlm/loss (and the joint rule's) from Lightning's loop: the same
    numbers as `rlm eval --datastore` on the test split; `rlm validate` logs val/knnlm/loss; the model's own
    test/loss is untouched."""
    import re

    work, ckpt, _ = tiny
    out = run_rlm(["test", "--ckpt", ckpt, "--datastore", work / "ds", "--trainer.enable_progress_bar=false"],
                  tmp_path, rlm_cache)  # fmt: skip

    def read(name: str, text: str) -> float:
        return float(re.search(rf"{re.escape(name)}\s*[│|]?\s*([0-9][0-9.e+-]*)", text).group(1))

    res = tmp_path / "r.json"
    run_rlm(["eval", "--ckpt", ckpt, "--datastore", work / "ds", "--json", res], tmp_path, rlm_cache)
    r = json.loads(res.read_text())
    assert math.isclose(read("test/loss", out.stdout), r["lm"]["loss"], rel_tol=1e-4)
    assert math.isclose(read("test/knnlm/loss", out.stdout), r["knnlm"]["loss"], rel_tol=1e-4)
    assert math.isclose(read("test/joint/loss", out.stdout), r["joint"]["loss"], rel_tol=1e-4)
    val = run_rlm(["validate", "--ckpt", ckpt, "--datastore", work / "ds", "--trainer.enable_progress_bar=false"],
                  tmp_path, rlm_cache)  # fmt: skip
    assert "val/knnlm/loss" in val.stdout
    bad = run_rlm(["test", "--ckpt", ckpt, "--datastore"], tmp_path, rlm_cache, check=False)
    assert bad.returncode == 2 and "--datastore needs a directory" in bad.stderr


def test_shards_are_whole_documents_and_the_estimate_holds_one_shard():
    from rlm.eval.datastore import estimate, shard_docs

    parts = shard_docs(np.array([5, 1, 1, 9, 2, 2, 0, 3]), 4)
    assert parts == [slice(0, 1), slice(1, 4), slice(4, 6), slice(6, 8)]  # the last one may be short
    assert shard_docs(np.array([3, 3]), 1) == [slice(0, 1), slice(1, 2)]
    whole, sharded = estimate(10**6, 256, "SQfp16"), estimate(10**6, 256, "SQfp16", 10**5)
    assert sharded["memory"] < whole["memory"] / 5 and sharded["index"] == whole["index"]
    assert sharded["disk"] < whole["disk"] and sharded["keys"] == 0
    with pytest.raises(ValueError, match="shard_keys=0"):
        shard_docs(np.array([3]), 0)


def test_bad_shard_keys_is_a_one_line_error(tmp_path, rlm_cache, rlm_main):
    from rlm.eval.datastore import build_datastore

    with pytest.raises(ValueError, match="shard_keys=-2"):
        build_datastore("nowhere.ckpt", tmp_path / "ds", shard_keys=-2)
    out = rlm_main(["knnlm", "build", "--ckpt", tmp_path / "x.ckpt", "--out", tmp_path / "ds", "--shard-keys", "0"],
                   tmp_path, rlm_cache)  # fmt: skip
    assert out.returncode == 2 and "--shard-keys=0" in out.stderr and "Traceback" not in out.stderr, (
        out.stderr
    )


@pytest.fixture(scope="module")
def sharded(tiny):
    """The tiny fixture's datastore built again in shards of about a fifth of its keys (>= 3 shards)."""
    from rlm.eval.knnlm import build

    work, ckpt, meta = tiny
    out = work / "sharded"
    build(str(ckpt), out, factory="SQfp16", k=8, tune_tokens=512, max_documents=6, progress=False,
          shard_keys=max(1, meta["entries"] // 5))  # fmt: skip
    return out, json.loads((out / "meta.json").read_text())


# slow: reads what its module fixture trains (and builds) with real `rlm` subprocesses
@pytest.mark.slow
def test_a_sharded_datastore_finds_the_same_neighbours(tiny, sharded):
    """Shards of whole documents, index-000.faiss, ..., their offsets in meta.json; the merged top-k equals the
    single index's, with and without each document's exclusion range (given in global entry ids)."""
    from rlm.eval.datastore import Datastore

    work, _, meta = tiny
    path, smeta = sharded
    shards = smeta["shards"]
    assert len(shards) >= 3 and not (path / "index.faiss").exists()
    assert [sh["file"] for sh in shards] == [f"index-{i:03d}.faiss" for i in range(len(shards))]
    assert [sh["offset"] for sh in shards] == list(np.cumsum([0] + [sh["entries"] for sh in shards])[:-1])
    assert smeta["entries"] == meta["entries"] == sum(sh["entries"] for sh in shards)
    ranges = np.load(path / "docs.npy")
    assert (ranges == np.load(work / "ds" / "docs.npy")).all()
    assert (np.load(path / "values.npy") == np.load(work / "ds" / "values.npy")).all()
    starts = {sh["offset"] for sh in shards}
    ends = {sh["offset"] + sh["entries"] for sh in shards}
    assert all(any(lo >= s for s in starts) and any(hi <= e for e in ends) for lo, hi in ranges)
    assert smeta["doc_ids"] == meta["doc_ids"]
    one, many = Datastore(work / "ds"), Datastore(path)
    assert len(many.indexes) == len(shards) and many.offsets == [sh["offset"] for sh in shards]
    index = one.indexes[0]
    keys = index.reconstruct_n(0, index.ntotal)  # the datastore's own keys (exact fp16) as queries
    rng = np.random.default_rng(0)
    for doc, (lo, hi) in one.doc_ids.items():
        q = keys[lo:hi][:: max(1, (hi - lo) // 40)] + rng.normal(0, 0.01, (1, keys.shape[1])).astype(
            np.float32
        )
        assert many.doc_ids[doc] == (lo, hi)
        for excl in (None, (lo, hi)):
            d1, v1 = one.search(q, 8, excl)
            d2, v2 = many.search(q, 8, excl)
            np.testing.assert_allclose(d2, d1, rtol=1e-6)
            np.testing.assert_array_equal(v2, v1)
            if excl is not None:  # nothing of the document: the datastore's keys outside it
                _, ids = many._search_shards(q, 8, excl, {})
                assert not ((ids >= lo) & (ids < hi)).any()


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_rlm_eval_gives_the_same_knnlm_loss_with_a_sharded_datastore(tiny, sharded, tmp_path, rlm_cache):
    """`rlm eval --datastore` over copies of two datastore documents in different shards (each excluded by its
    tokens): the same kNN-LM loss from the sharded and the single-index datastore."""
    from rlm.data.store import TokenStore

    work, ckpt, meta = tiny
    path, smeta = sharded
    assert smeta["tuning"]["lam"] == meta["tuning"]["lam"]
    store = TokenStore(meta["store"])
    (tmp_path / "c").mkdir()
    for i in (0, len(meta["doc_ids"]) - 1):
        tokens = store.doc_tokens(int(meta["doc_ids"][i]))[1:-1]
        (tmp_path / "c" / f"copy{i}.py").write_text(store.tokenizer.decode(tokens.tolist()))
    losses = []
    for ds in (work / "ds", path):
        res = tmp_path / f"{ds.name}.json"
        run_rlm(["eval", "--ckpt", ckpt, "--datastore", ds, "--corpus", tmp_path / "c", "--lam", "0.4",
                 "--temperature", "5", "--json", res], tmp_path, rlm_cache)  # fmt: skip
        losses.append(json.loads(res.read_text())["knnlm"]["loss"])
    assert math.isclose(losses[0], losses[1], rel_tol=1e-5), losses


# slow: reads what its module fixture trains (and builds) with real `rlm` subprocesses
@pytest.mark.slow
def test_a_single_index_datastore_still_loads(tiny):
    """The layout of datastores built before shards (index.faiss, no "shards" in meta.json) loads and searches
    as one shard at offset 0."""
    from rlm.eval.datastore import Datastore

    work, _, meta = tiny
    assert (work / "ds" / "index.faiss").is_file() and "shards" not in meta
    assert not list((work / "ds").glob("index-*.faiss"))
    ds = Datastore(work / "ds")
    assert ds.offsets == [0] and len(ds.indexes) == 1 and ds.indexes[0].ntotal == meta["entries"]
    d, v = ds.search(np.zeros((2, meta["dim"]), np.float32), 4, None)
    assert d.shape == (2, 4) and (v >= 0).all()


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_knnlm_build_shards_an_ivf_pq_index_trained_once(tiny, tmp_path, rlm_cache):
    """`rlm knnlm build --shard-keys` with IVF-PQ: one training on a sample, so every shard has the same
    centroids; nprobe tuned (on the first shard); an excluded range is never found in any shard."""
    from rlm.eval.datastore import Datastore
    from rlm.index._faiss import faiss

    work, ckpt, meta = tiny
    out = tmp_path / "ivf"
    run_rlm(["knnlm", "build", "--ckpt", ckpt, "--out", out, "--factory", "IVF4,PQ4", "--k", "8",
             "--max-documents", "6", "--tune-tokens", "0", "--target-recall", "0.5",
             "--shard-keys", str(meta["entries"] // 5)], tmp_path, rlm_cache)  # fmt: skip
    ds = Datastore(out)
    assert len(ds.indexes) >= 3 and ds.meta["search_params"]["nprobe"] >= 1
    cents = [faiss.extract_index_ivf(ix).quantizer.reconstruct_n(0, 4) for ix in ds.indexes]
    assert all((c == cents[0]).all() for c in cents[1:])
    lo, hi = ds.offsets[1] - 5, ds.offsets[2] + 5  # across shard boundaries
    q = np.random.default_rng(0).normal(size=(16, meta["dim"])).astype(np.float32)
    _, ids = ds._search_shards(q, 8, (lo, hi), ds.meta["search_params"])
    assert (ids >= 0).all() and not ((ids >= lo) & (ids < hi)).any()


# slow: runs the benchmark script end to end at its smoke size
@pytest.mark.slow
def test_narrow_embedding_benchmark_keeps_every_neighbour_at_full_width(tiny, capsys):
    """benchmarks/narrow_embedding.py on the tiny checkpoint: at the full width every narrowing (random, PCA, the PCA
    rlm.index builds) keeps the exact top 10 (recall 1 up to float rounding among equal scores), narrower widths print a recall in [0, 1] for each."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "narrow_embedding.py"
    spec = importlib.util.spec_from_file_location("narrow_embedding", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    _, ckpt, _ = tiny
    bench.main(["--ckpt", str(ckpt), "--widths", "8", "--queries", "100"])
    out = capsys.readouterr().out
    rows = {
        int(r.split("|")[1]): r.split("|")[2:5]
        for r in out.splitlines()
        if r.startswith("| ") and "width" not in r
    }
    assert sorted(rows) == [8, 64]  # 64: the tiny model's d_model, the control
    assert all(float(v) >= 0.99 for v in rows[64])  # a rotation keeps every cosine (equal scores may swap)
    assert len(rows[8]) == 3 and all(0.0 <= float(v) <= 1.0 for v in rows[8])
