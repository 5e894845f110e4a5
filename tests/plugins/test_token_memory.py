"""The token memory (TRIME): the mixture of the LM head and a memory of the LM's own states, against loops written
here; which entries a query may see, by perturbation; the joint rule at evaluation."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cli_helpers import CONFIGS, column, fit_args, read_metrics, run_rlm
from torch.testing import assert_close

from rlm.model import ModelConfig
from rlm.plugin import Context
from rlm.plugins.token_memory import TokenMemoryConfig, TokenMemoryPlugin, joint_nll

D, V = 16, 11


def plugin(**options) -> TokenMemoryPlugin:
    return TokenMemoryPlugin(
        TokenMemoryConfig(**options), ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=2)
    )


def naive_loss(z, y, h, entries):
    """-log p(y) with p(w) = (e^{z_w} + sum_{j: v_j = w} e^{s_j}) / (sum e^z + sum_j e^{s_j}), one query."""
    num, den = z[y].exp(), z.exp().sum()
    for key, value, tau, b in entries:
        e = torch.exp(-((h - key) ** 2).sum() / tau + b)
        den = den + e
        if value == y:
            num = num + e
    return -torch.log(num / den)


def test_joint_nll_matches_the_equation_by_hand():
    torch.manual_seed(0)
    z, y, s, v = torch.randn(5, V), torch.randint(0, V, (5,)), torch.randn(5, 4), torch.randint(0, V, (4,))
    s[0] = float("-inf")  # an empty memory: the LM alone
    ref = []
    for n in range(5):
        num = z[n, y[n]].exp() + sum(s[n, m].exp() for m in range(4) if v[m] == y[n])
        ref.append(-torch.log(num / (z[n].exp().sum() + s[n].exp().sum())))
    assert_close(joint_nll(z, y, s, v), torch.stack(ref))
    assert_close(joint_nll(z, y, s, v)[0], F.cross_entropy(z[:1], y[:1]))


def _batch(B=3, T=6, docs=(0, 1, 0)):
    torch.manual_seed(1)
    hidden = torch.randn(B, T, D)
    logits = torch.randn(B, T, V)
    targets = torch.randint(0, V, (B, T))
    targets[2, -1] = -100
    ctx = Context(tokens=targets.clamp_min(0), doc_ids=torch.tensor(docs), stage="train")
    return ctx, hidden, logits, targets


def test_training_loss_matches_a_loop_over_the_allowed_entries():
    """Own window: j < t; other windows: other documents only; the queue: other documents; ignored targets are
    neither queries nor entries."""
    p = plugin(temperature=3.0, bias=0.5, memory_batches=1, ce_weight=0.0)
    ctx, hidden, logits, targets = _batch()
    qk, qv, qd = torch.randn(4, D), torch.randint(0, V, (4,)), torch.tensor([0, 1, 2, 2])
    p._queue = [(qk, qv, qd)]
    loss = p.objective(ctx, hidden, logits, targets)
    tau, b = 3.0, 0.5
    docs = ctx.doc_ids.tolist()
    ref = []
    for r in range(3):
        for t in range(6):
            if targets[r, t] < 0:
                continue
            entries = []
            for r2 in range(3):
                for j in range(6):
                    if targets[r2, j] < 0:
                        continue
                    if (r2 == r and j < t) or docs[r2] != docs[r]:
                        entries.append((hidden[r2, j], int(targets[r2, j]), tau, b))
            entries += [(qk[m], int(qv[m]), tau, b) for m in range(4) if int(qd[m]) != docs[r]]
            ref.append(naive_loss(logits[r, t], int(targets[r, t]), hidden[r, t], entries))
    assert_close(loss, torch.stack(ref).mean())
    p2 = plugin(temperature=3.0, bias=0.5, memory_batches=1, ce_weight=0.5)
    p2._queue = [(qk, qv, qd)]
    valid = targets.flatten() >= 0
    ce = F.cross_entropy(logits.flatten(0, 1)[valid], targets.flatten()[valid])
    assert_close(p2.objective(ctx, hidden, logits, targets), torch.stack(ref).mean() + 0.5 * ce)
    assert len(p._queue) == 1 and len(p._queue[0][0]) == 17  # this batch replaced the older one, valid only


def test_changing_later_tokens_never_moves_an_earlier_position():
    """Per-position mixture loss of row 0 at t <= 3 does not move when row 0's states and targets after t change
    (its own-window memory is j < t); other documents' rows are memory, a later position of one's own is not."""
    p = plugin(memory_batches=0)
    ctx, hidden, logits, targets = _batch()

    def per_position(h, y):
        s, vals = p.memory(ctx, h, y)
        return joint_nll(logits.flatten(0, 1), y.flatten().clamp_min(0), s, vals).view(3, 6)

    base = per_position(hidden, targets)
    h2, y2 = hidden.clone(), targets.clone()
    h2[0, 4:] += 5.0
    y2[0, 4:] = (y2[0, 4:] + 1) % V
    h2[2, :] += 3.0  # row 2 is the same document as row 0: never row 0's memory
    moved = per_position(h2, y2)
    assert_close(moved[0, :4], base[0, :4])
    assert not torch.allclose(moved[1], base[1])  # row 1 (another document) sees row 0's entries


def test_at_validation_a_window_does_not_depend_on_the_rest_of_its_batch():
    p = plugin(memory_batches=0)
    ctx, hidden, logits, targets = _batch()
    ctx.stage = "val"
    s, vals = p.memory(ctx, hidden, targets)
    alone_ctx = Context(tokens=ctx.tokens[1:2], doc_ids=ctx.doc_ids[1:2], stage="val")
    s1, vals1 = p.memory(alone_ctx, hidden[1:2], targets[1:2])
    full = joint_nll(logits.flatten(0, 1), targets.flatten().clamp_min(0), s, vals).view(3, 6)[1]
    alone = joint_nll(logits[1], targets[1].clamp_min(0), s1, vals1)
    assert_close(full, alone)
    assert p.objective(ctx, hidden, logits, targets) is None
    assert {"token_memory/loss", "token_memory_random/loss", "token_memory/memory_share"} <= set(ctx.metrics)


def test_bad_options_name_the_value():
    with pytest.raises(ValueError, match="temperature"):
        TokenMemoryConfig(temperature=0.0)
    with pytest.raises(ValueError, match="memory_batches"):
        TokenMemoryConfig(memory_batches=-1)


def test_joint_rule_at_evaluation_matches_the_mixture():
    """rlm.eval.knnlm's joint rule over k found neighbours equals the plugin's mixture over the same entries."""
    from rlm.eval.knnlm import Scored, joint_log_prob, tune_joint

    torch.manual_seed(2)
    z, y = torch.randn(6, V).double(), torch.randint(0, V, (6,))
    d = torch.rand(6, 4).double() * 10
    vals = torch.randint(0, V, (6, 4))
    d[1, 2:] = float("inf")  # fewer than k found
    tau, b = 2.5, -0.5
    s = (-d / tau + b).masked_fill(~torch.isfinite(d), float("-inf"))
    ref = -joint_nll(z, y, s, vals)
    lm_logp = torch.log_softmax(z, -1)[torch.arange(6), y]
    logz = torch.logsumexp(z, -1)
    got = joint_log_prob(
        lm_logp.numpy(), logz.numpy(), d.float().numpy(), (vals == y[:, None]).numpy(), tau, b
    )
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5)
    scored = Scored(lm_logp.numpy(), d.float().numpy(), (vals == y[:, None]).numpy(), lm_logz=logz.numpy())
    best = tune_joint(scored, trained=(tau, b))
    assert best["loss"] <= best["trained"]["loss"] + 1e-12
    assert math.isclose(best["trained"]["loss"], float(-got.mean()), rel_tol=1e-9)


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_fit_trains_with_the_mixture_and_logs_the_ablation(tmp_path, rlm_cache):
    """A few steps of `rlm fit` with the fragment: train/loss is the mixture (the queue fills), val/loss stays the
    plain cross-entropy, the memory's and the shuffled-value losses are logged."""
    run_rlm(
        fit_args(CONFIGS / "plugins" / "token_memory.yaml") + ["--trainer.max_steps=3"], tmp_path, rlm_cache
    )
    rows = read_metrics(tmp_path / "runs/test/version_0")
    assert len(column(rows, "train/loss")) == 3
    mem, rand = column(rows, "val/token_memory/loss"), column(rows, "val/token_memory_random/loss")
    assert mem and rand and all(math.isfinite(x) for x in mem + rand)
    state = torch.load(tmp_path / "runs/test/ckpt/last.ckpt", map_location="cpu", weights_only=False)
    assert any(k.endswith("token_memory.log_tau") for k in state["state_dict"])


def test_the_objective_replaces_cross_entropy_in_training_only_and_one_plugin_at_most():
    """LMModule: in training the loss is the plugin's objective (train/loss stays the cross-entropy); at validation
    the loss is the cross-entropy; a second plugin with an objective is an error naming both."""
    from rlm.train.module import LMModule

    torch.manual_seed(0)
    module = LMModule(model={"vocab_size": V, "d_model": D, "n_layers": 2, "n_heads": 2, "max_seq_len": 8},
                      plugins={"token_memory": {"ce_weight": 0.0}})  # fmt: skip
    tokens = torch.randint(0, V, (2, 8))
    batch = {"tokens": tokens, "targets": torch.roll(tokens, -1, 1), "doc_ids": torch.tensor([0, 1])}
    lm, loss, ctx, _ = module._loss(batch, "train")
    s, vals = module.model.plugins["token_memory"].memory(ctx, ctx.hidden, batch["targets"])
    logits = module.model.head(ctx.hidden)
    assert_close(loss, joint_nll(logits.flatten(0, 1).float(), batch["targets"].flatten(), s, vals).mean())
    assert_close(lm, F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten()))
    lm_val, loss_val, _, _ = module._loss(batch, "val")
    assert loss_val is lm_val
    module.model.plugins["second"] = TokenMemoryPlugin(TokenMemoryConfig(), module.model_config)
    with pytest.raises(ValueError, match="'token_memory' and 'second' both replace the training loss"):
        module._loss(batch, "train")


def test_scores_are_float32_distances_under_bf16_autocast():
    """-||q - k||^2 / tau + b by hand in float64: autocast must not run the distance's q @ k.T in bfloat16."""
    p = plugin()
    q, k = torch.randn(6, D) * 30, torch.randn(9, D) * 30  # large norms: bfloat16's cancellation shows
    want = (
        -((q.double()[:, None] - k.double()[None]) ** 2).sum(-1) / p.log_tau.exp().double() + p.bias.double()
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = p.scores(q, k)
    assert got.dtype == torch.float32
    assert_close(got.double(), want.detach(), rtol=1e-4, atol=1e-2)
