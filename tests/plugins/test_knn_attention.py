"""The kNN attention plugin (plugins/knn_attention.py): its neighbours against brute-force loops over the queue and the
window's own past, its output against the equations by hand, causality and batch independence by perturbation, and
the datastore path (a datastore of attn_input keys searched inside the forward pass) against exact search."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from cli_helpers import CONFIGS, read_metrics, run_rlm
from torch.testing import assert_close

from rlm.model import ModelConfig, Transformer
from rlm.plugin import Context
from rlm.plugins.knn_attention import KnnAttentionConfig, KnnAttentionPlugin

D, V = 16, 23
TINY = ["--config", CONFIGS / "default.yaml", "--config", CONFIGS / "data" / "tiny.yaml", "--config",
        CONFIGS / "model" / "tiny.yaml"]  # fmt: skip


def model(**options) -> tuple[Transformer, KnnAttentionPlugin]:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=2, max_seq_len=64)
    m = Transformer(config, {"knn_attention": {"k": 3, "own_k": 2, "memory_tokens": 40, **options}})
    p = m.plugins["knn_attention"]
    with torch.no_grad():  # a working module: non-zero output projection, gate and biases
        mod = m.blocks[-1].attn_add[0]
        mod.out.weight.normal_(0, 0.3)
        mod.gate.weight.normal_(0, 0.3)
        p.bias.copy_(torch.tensor([0.5, -0.3]))
    return m.eval(), p


def fill_queue(p: KnnAttentionPlugin, n: int = 30, docs=(7, 8, 9)) -> None:
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(n, D, generator=g)
    p.clear_queue()
    p.push(keys, torch.randint(0, V, (n,), generator=g), torch.tensor(docs).repeat(n)[:n])


def test_neighbours_match_brute_force_loops():
    """Memory: the k nearest queue entries of another document; own past: the own_k nearest j < t of the window,
    each with the token x_{j+1}; distances squared L2."""
    _, p = model()
    fill_queue(p)
    torch.manual_seed(1)
    B, T = 2, 9
    y = torch.randn(B, T, D)
    tokens = torch.randint(0, V, (B, T))
    ctx = Context(tokens=tokens, doc_ids=torch.tensor([7, 1]), stage="val")
    dist, vals = p.neighbours(y, ctx)
    qk, qv, qd = p.queue()
    for b in range(B):
        for t in range(T):
            cand = sorted((float(((y[b, t] - qk[m]) ** 2).sum()), int(qv[m]))
                          for m in range(len(qk)) if int(qd[m]) != int(ctx.doc_ids[b]))  # fmt: skip
            got = sorted(zip(dist[b, t, :3].tolist(), vals[b, t, :3].tolist()))
            assert_close(torch.tensor([c[0] for c in cand[:3]]), torch.tensor([g[0] for g in got]))
            assert [c[1] for c in cand[:3]] == [g[1] for g in got]
            own = sorted((float(((y[b, t] - y[b, j]) ** 2).sum()), int(tokens[b, j + 1])) for j in range(t))[
                :2
            ]
            got_own = [(d, v) for d, v in zip(dist[b, t, 3:].tolist(), vals[b, t, 3:].tolist()) if v >= 0]
            assert len(got_own) == len(own)
            if own:
                assert_close(torch.tensor([o[0] for o in own]), torch.tensor(sorted(g[0] for g in got_own)))
                assert sorted(o[1] for o in own) == sorted(g[1] for g in got_own)


def test_output_matches_the_equations_by_hand():
    m, p = model()
    fill_queue(p)
    mod = m.blocks[-1].attn_add[0]
    torch.manual_seed(2)
    y = torch.randn(1, 5, D)
    ctx = Context(tokens=torch.randint(0, V, (1, 5)), doc_ids=torch.tensor([1]), stage="val")
    out = mod(y, ctx)
    dist, vals = p.neighbours(y, ctx)
    E, tau = m.token_embedding.weight, p.log_tau.exp()
    for t in range(5):
        s, emb = [], []
        for j in range(vals.shape[-1]):
            if vals[0, t, j] >= 0:
                s.append(-dist[0, t, j] / tau + p.bias[0 if j < 3 else 1])
                emb.append(E[vals[0, t, j]])
        a = torch.softmax(torch.stack(s), 0)
        r = sum(w * e for w, e in zip(a, emb))
        ref = torch.sigmoid(mod.gate(y[0, t])) * mod.out(r)
        assert_close(out[0, t], ref)


def test_gradients_reach_the_states_and_the_scalars():
    m, p = model()
    fill_queue(p)
    tokens = torch.randint(0, V, (2, 8))
    ctx = Context(tokens=tokens, doc_ids=torch.tensor([1, 2]), stage="train")
    m.train()
    m(tokens, ctx).square().mean().backward()
    assert p.log_tau.grad.abs() > 0 and (p.bias.grad.abs() > 0).all()
    assert (
        m.blocks[0].attn.parameters().__next__().grad.abs().sum() > 0
    )  # through the distances and the residual


def test_neighbour_distance_gradient_matches_autograd_through_the_gathered_keys():
    """The search's distances carry the gradient of ||y_i - table[idx_ij]||^2 into y, computed without gathering
    the (N, n, d) keys: against autograd through the gathered keys, the plain formula."""
    from rlm.plugins.knn_attention import neighbour_distance

    g = torch.Generator().manual_seed(6)
    y = torch.randn(5, D, generator=g, requires_grad=True)
    table = torch.randn(11, D, generator=g)
    idx = torch.randint(0, 11, (5, 4), generator=g)
    w = torch.randn(5, 4, generator=g)
    ref = (y[:, None, :] - table[idx]).square().sum(-1)
    (ref * w).sum().backward()
    want, y.grad = y.grad, None
    got = neighbour_distance(y, table, idx, ref.detach())
    (got * w).sum().backward()
    assert_close(got, ref.detach())
    assert_close(y.grad, want)


def test_training_steps_with_backward_keep_the_queue_consistent():
    """A step's states enter the ring only at the next search, so its backward reads the keys it searched; an
    in-place write before the backward would fail autograd's version check."""
    m, p = model(memory_tokens=20)
    m.train()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for doc in range(4):
        x = torch.randint(0, V, (2, 8))
        m(
            x, Context(tokens=x, doc_ids=torch.tensor([2 * doc, 2 * doc + 1]), stage="train")
        ).square().mean().backward()
        opt.step()
        opt.zero_grad()
    qk, qv, qd = p.queue()
    assert len(qd) == 20 and set(qd.tolist()) <= {4, 5, 6, 7}  # the latest 20 of 7 + 7 + 7 + 7 entries


def test_the_queue_travels_in_the_checkpoint():
    """A loaded model searches the memory the saved one searched: the same entries (the latest memory_tokens, a
    step's pending ones included), the same validation logits; reading the state writes nothing into the ring."""
    m, p = model()
    fill_queue(p)
    p.push(
        torch.randn(25, D), torch.randint(0, V, (25,)), torch.full((25,), 9)
    )  # 55 pushed: the ring (40) wrapped
    x = torch.randint(0, V, (1, 9))
    m.train()(x, Context(tokens=x, doc_ids=torch.tensor([3]), stage="train"))  # 8 entries pending
    m.eval()
    state = m.state_dict()
    assert p._pending
    m2, p2 = model()
    assert p2.queue() is None
    m2.load_state_dict(state)

    def entries(queue):  # order-free: the ring's order is where it wrapped
        keys, vals, docs = queue
        return sorted(zip(keys.tolist(), vals.tolist(), docs.tolist()))

    assert entries(p.queue()) == entries(p2.queue()) and len(p2.queue()[0]) == 40
    ctx = Context(tokens=x, doc_ids=torch.tensor([1]), stage="val")
    with torch.no_grad():
        assert_close(m2(x, ctx), m(x, ctx))


def test_changing_later_tokens_never_moves_an_earlier_logit():
    """In training (the queue) and at validation: perturb tokens after t, logits at or before t stay."""
    for stage in ("train", "val"):
        m, p = model()
        fill_queue(p)
        torch.manual_seed(4)
        a = torch.randint(0, V, (1, 12))
        b = a.clone()
        b[0, 7:] = (b[0, 7:] + 5) % V
        outs = []
        for x in (a, b):
            ctx = Context(tokens=x, doc_ids=torch.tensor([1]), stage=stage)
            with torch.no_grad():
                outs.append(m(x, ctx))
            fill_queue(p)  # training pushed the step's states; compare against the same memory
        assert_close(outs[0][0, :7], outs[1][0, :7])
        assert not torch.allclose(outs[0][0, 7:], outs[1][0, 7:])


def test_at_validation_a_window_does_not_depend_on_the_rest_of_its_batch():
    m, p = model()
    fill_queue(p)
    torch.manual_seed(5)
    x = torch.randint(0, V, (3, 10))
    with torch.no_grad():
        full = m(x, Context(tokens=x, doc_ids=torch.tensor([1, 2, 3]), stage="val"))
        alone = m(x[1:2], Context(tokens=x[1:2], doc_ids=torch.tensor([2]), stage="val"))
    assert_close(full[1:2], alone)


def test_training_queue_keeps_the_latest_states_and_never_offers_the_querys_own_document():
    m, p = model(memory_tokens=15)
    m.train()
    for doc in (1, 2, 3, 4):
        x = torch.randint(0, V, (1, 8))
        m(x, Context(tokens=x, doc_ids=torch.tensor([doc]), stage="train"))
    # 7 entries a step (the last position has no next token here); the ring keeps the latest 15: all of documents
    # 4 and 3, the last of document 2
    qk, _, qd = p.queue()
    assert sorted(qd.tolist()) == [2] + [3] * 7 + [4] * 7
    keys3 = qk[qd == 3][None]  # doc 3's stored states, as queries
    own = Context(tokens=torch.zeros(1, 7, dtype=torch.long), doc_ids=torch.tensor([3]), stage="val")
    other = Context(tokens=torch.zeros(1, 7, dtype=torch.long), doc_ids=torch.tensor([5]), stage="val")
    d_own, _ = p.neighbours(keys3, own)
    d_other, _ = p.neighbours(keys3, other)
    assert_close(
        d_other[0, :, :3].min(-1).values, torch.zeros(7), atol=1e-4, rtol=0
    )  # another document finds these very states (the k neighbours come in no particular order)
    assert (d_own[0, :, :3] > 1e-3).all()  # document 3 itself never does


def test_bad_options_name_the_value():
    with pytest.raises(ValueError, match="own_k"):
        KnnAttentionConfig(own_k=-1)
    with pytest.raises(ValueError, match="both 0"):
        KnnAttentionConfig(k=0, own_k=0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, rlm_cache):
    """A 6-step tiny checkpoint with the plugin, and an exact attn_input datastore over its first 6 documents."""
    from rlm.eval.knnlm import build

    work = tmp_path_factory.mktemp("knn_attention")
    run_rlm(["fit", *TINY, "--config", CONFIGS / "plugins" / "knn_attention.yaml", "--model.plugins.knn_attention.k=16",
             "--trainer.max_steps=6",
             "--trainer.val_check_interval=3", "--trainer.enable_progress_bar=false",
             f"--trainer.default_root_dir={work / 'run'}"], work, rlm_cache)  # fmt: skip
    ckpt = work / "run" / "version_0" / "checkpoints" / "last.ckpt"
    import os

    os.environ["RLM_CACHE"] = str(rlm_cache)
    meta = build(str(ckpt), work / "ds", layer="attn_input", factory="SQfp16", k=16, tune_tokens=0,
                 max_documents=6, progress=False)  # fmt: skip
    return work, ckpt, meta


# slow: reads what its module fixture trains (and builds) with real `rlm` subprocesses
@pytest.mark.slow
def test_fit_logs_the_random_neighbour_ablation(trained):
    work, _, _ = trained
    rows = read_metrics(work / "run" / "version_0")
    val = [r for r in rows if r.get("val/knn_attention_random/loss")]
    assert val and all(math.isfinite(float(r["val/knn_attention_random/loss"])) for r in val)
    assert all(0 <= float(r["val/knn_attention/gate"]) <= 1 for r in val)


# slow: reads what its module fixture trains (and builds) with real `rlm` subprocesses
@pytest.mark.slow
def test_the_datastore_is_searched_inside_the_forward_pass_like_exact_search(trained):
    """With a datastore attached, each position's memory neighbours are the exact k nearest attn_input states of
    other documents (the datastore's keys are the same model's states, computed here again)."""
    from rlm.data.store import TokenStore
    from rlm.data.windows import eval_loader
    from rlm.eval.datastore import Datastore, load_for_knn, reading_keys, windows_of
    from rlm.eval.knnlm import attach_datastore

    work, ckpt, meta = trained
    module, data, store = load_for_knn(str(ckpt), None, "cpu", False)
    ds = Datastore(work / "ds")
    ds.check_model(module)
    docs = np.asarray(meta["doc_ids"])
    keys, values = [], []
    windows = windows_of(data, store, docs)
    with reading_keys(module, "attn_input") as hooked, torch.no_grad():
        for batch in eval_loader(windows, 4):
            ctx = module.make_context(batch, "test", segments=windows.segments)
            module.model(batch["tokens"], ctx)
            n = (batch["targets"] != -100).sum(1)
            for b in range(len(n)):
                keys.append(hooked["keys"][b, : n[b]])
                values.append(batch["targets"][b, : n[b]])
    keys, values = torch.cat(keys), torch.cat(values)
    assert len(keys) == meta["entries"]
    attach_datastore(module, ds, store, str(TokenStore(meta["store"]).root))
    plugin = module.model.plugins["knn_attention"]
    assert plugin.datastore is ds
    val = windows_of(data, store, store.val_docs[:2])
    batch = next(iter(eval_loader(val, 2)))
    ctx = module.make_context(batch, "test", segments=val.segments)
    with reading_keys(module, "attn_input") as hooked, torch.no_grad():
        module.model(batch["tokens"], ctx)
        y = hooked["keys"]
        dist, vals = plugin.neighbours(y, ctx)
    k = plugin.config.k
    for b in range(y.shape[0]):
        for t in (0, 5, 40):
            exact = ((keys - y[b, t]) ** 2).sum(-1)
            order = torch.argsort(exact)[:k]
            assert_close(dist[b, t, :k], exact[order], rtol=1e-2, atol=1e-2)  # fp16 keys in the index
            for j in range(
                k
            ):  # each value is that of an entry at its distance (ties among equal states aside)
                near = (exact - dist[b, t, j]).abs() <= 1e-2 * (1 + dist[b, t, j])
                assert int(vals[b, t, j]) in set(values[near].tolist())


# slow: reads what its module fixture trains (and builds) with real `rlm` subprocesses
@pytest.mark.slow
def test_rlm_eval_with_an_attn_input_datastore_scores_the_model_retrieving(trained, tmp_path):
    """`rlm eval --datastore` of a knn_attention checkpoint: the model's own loss is scored with the datastore
    searched inside its forward pass, and differs from the loss without it; a datastore of other keys is refused
    by the plugin with the layer named."""
    from rlm.eval.datastore import Datastore, load_for_knn
    from rlm.eval.knnlm import evaluate_knn

    work, ckpt, _ = trained
    with_ds = evaluate_knn(str(ckpt), work / "ds", split="val", lam=0.2, temperature=1.0)
    assert math.isfinite(with_ds["lm"]["loss"])
    module, _, store = load_for_knn(str(ckpt), None, "cpu", False)
    plugin = module.model.plugins["knn_attention"]
    ds = Datastore(work / "ds")
    ds.meta["layer"] = "final"
    with pytest.raises(ValueError, match="attn_input"):
        plugin.use_datastore(ds, store, "x")


def test_own_past_alone_keeps_no_queue_and_matches_the_equations_by_hand():
    """k 0 (the window's own past alone, the trained continuous cache): training keeps no queue; the output is the
    softmax over the own_k nearest j < t of -||y_t - y_j||^2 / tau, the tokens x_{j+1} read from the embedding, by
    hand; later tokens never move an earlier logit; a window does not depend on the rest of its batch."""
    m, p = model(k=0)
    m.train()
    x = torch.randint(0, V, (2, 8))
    m(x, Context(tokens=x, doc_ids=torch.tensor([1, 2]), stage="train")).square().mean().backward()
    assert p.queue() is None
    m.eval()
    mod = m.blocks[-1].attn_add[0]
    torch.manual_seed(7)
    T = 7
    y = torch.randn(1, T, D)
    tokens = torch.randint(0, V, (1, T))
    with torch.no_grad():
        out = mod(y, Context(tokens=tokens, doc_ids=torch.tensor([1]), stage="val"))
        E, tau = m.token_embedding.weight, p.log_tau.exp()
        for t in range(T):
            own = sorted((float(((y[0, t] - y[0, j]) ** 2).sum()), int(tokens[0, j + 1])) for j in range(t))[
                :2
            ]
            if not own:
                assert_close(out[0, t], torch.zeros(D))
                continue
            a = torch.softmax(torch.tensor([-d / tau for d, _ in own]), 0)
            r = sum(w * E[v] for w, (_, v) in zip(a, own))
            assert_close(out[0, t], torch.sigmoid(mod.gate(y[0, t])) * mod.out(r))
    a = torch.randint(0, V, (3, 12))
    b = a.clone()
    b[0, 7:] = (b[0, 7:] + 5) % V
    with torch.no_grad():
        outs = [m(x, Context(tokens=x, doc_ids=torch.tensor([1, 2, 3]), stage="val")) for x in (a, b)]
        alone = m(a[1:2], Context(tokens=a[1:2], doc_ids=torch.tensor([2]), stage="val"))
    assert_close(outs[0][0, :7], outs[1][0, :7])
    assert not torch.allclose(outs[0][0, 7:], outs[1][0, 7:])
    assert_close(outs[0][1:2], alone)


def test_benchmark_script_smoke():
    """benchmarks/knn_attention.py runs at a tiny size and prints a row per variant, the base's ratio exactly 1."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        from knn_attention import VARIANTS
    finally:
        sys.path.pop(0)
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "knn_attention.py"), "--steps", "1", "--rounds", "1", "--batch",
         "2", "--seq", "16", "--d-model", "32", "--layers", "2", "--vocab", "50"],
        capture_output=True, text=True, check=True, cwd=root,
    ).stdout  # fmt: skip
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in out.splitlines()
        if line.startswith("| ")
    }
    assert set(VARIANTS) <= set(rows), (set(VARIANTS) - set(rows), out)
    assert float(rows["base (no plugin)"][2]) == 1.0
    for name in VARIANTS:
        assert float(rows[name][0]) > 0 and float(rows[name][2]) > 0, (name, rows[name])


def test_distances_stay_float32_under_bf16_autocast():
    """sq_dist_mm is ||q - k||^2 - ||q||^2: by hand in float64, and float32 under autocast (bfloat16's cancellation
    in the expanded square reorders near neighbours)."""
    from rlm.plugins.knn_attention import sq_dist_mm

    q, keys = torch.randn(7, 16) * 30, torch.randn(11, 16) * 30
    want = ((q.double()[:, None] - keys.double()[None]) ** 2).sum(-1) - q.double().square().sum(
        -1, keepdim=True
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = sq_dist_mm(q, keys)
    assert got.dtype == torch.float32
    assert_close(got.double(), want, rtol=1e-4, atol=0.5)
