"""lm-evaluation-harness on rlm checkpoints (issue 26): the ``rlm`` model type's loglikelihood, loglikelihood_rolling
and generate_until against by-hand references from the model's logits; local tasks (tests/lm_eval_tasks) through
lm_eval.simple_evaluate with no network; the kNN-LM mixture; ``rlm eval --tasks``."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from cli_helpers import REPO
from torch.testing import assert_close

pytest.importorskip("lm_eval")

from rlm.eval import harness  # noqa: E402
from rlm.eval.generate import sample  # noqa: E402

TASKS = REPO / "tests" / "lm_eval_tasks"
LONG_CTX = "def total(xs):\n    s = 0\n" + "".join(f"    s = s + xs[{i}]  # item {i}\n" for i in range(60))


@pytest.fixture(scope="module")
def tiny(trained, rlm_cache):
    """A 2-step tiny checkpoint (max_seq_len 256) and its Scorer, 3 requests per batch (mixed lengths, padded)."""
    ckpt = trained()
    os.environ["RLM_CACHE"] = str(rlm_cache)  # the checkpoint's tokenizer is written there
    return ckpt, harness.load_scorer(str(ckpt), batch_size=3)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network for Hugging Face datasets, a scratch datasets cache, paths from the repository root."""
    import datasets

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    monkeypatch.chdir(REPO)


def split(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The documented tokenization: trailing spaces to the continuation, whose tokens are the whole text's after
    the context's."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, k = tok.encode(context + continuation), len(tok.encode(context))
    return [tok.bos_id, *whole[:k]], whole[k:]


@torch.no_grad()
def forward(module, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (T, V) in float64 and the final norm's states (T, d) of one unpadded sequence."""
    seen = {}
    hook = module.model.norm.register_forward_hook(lambda m, i, o: seen.update(keys=o))
    x = torch.tensor([ids])
    try:
        logits = module.model(x, module.make_context({"tokens": x}, "predict"))[0].double()
    finally:
        hook.remove()
    return logits, seen["keys"][0]


def by_hand(module, ids: list[int], n: int, max_len: int, mix=None) -> tuple[float, bool]:
    """(sum of log p, greedy?) of the last n tokens of ids, the model reading its last max_len + 1 tokens but the
    last; ``mix(logits, keys)`` gives the kNN-LM log-probabilities instead of log_softmax."""
    if n == 0:
        return 0.0, True
    ids = ids[-(max_len + 1) :]
    logits, keys = forward(module, ids[:-1])
    logp = torch.log_softmax(logits[-n:], -1) if mix is None else mix(logits[-n:], keys[-n:])
    target = torch.tensor(ids[-n:])
    return float(logp[torch.arange(n), target].sum()), bool((logp.argmax(-1) == target).all())


def ll_by_hand(scorer, pairs, mix=None) -> list[tuple[float, bool]]:
    out = []
    for context, continuation in pairs:
        ctx, cont = split(scorer.tokenizer, context, continuation)
        out.append(by_hand(scorer.module, ctx + cont, len(cont), scorer.max_len, mix))
    return out


def rolling_by_hand(scorer, text: str) -> tuple[float, int]:
    """log p of [bos] + tokens, each token predicted once in windows of max_seq_len: a window reads only its own
    tokens, except a shorter last one, which reads the max_seq_len tokens before its end; and the window count."""
    seq, size = [scorer.tokenizer.bos_id, *scorer.tokenizer.encode(text)], scorer.max_len
    total, windows = 0.0, 0
    for lo in range(0, len(seq) - 1, size):  # window predicts seq[lo + 1 : hi + 1]
        hi = min(lo + size, len(seq) - 1)
        total += by_hand(scorer.module, seq[max(0, hi - size) : hi + 1], hi - lo, size)[0]
        windows += 1
    return total, windows


def results_close(got, want) -> None:
    assert [g for _, g in got] == [w for _, w in want]
    assert_close(torch.tensor([x for x, _ in got]), torch.tensor([x for x, _ in want]), rtol=1e-5, atol=1e-4)


def test_loglikelihood_matches_the_logits_by_hand(tiny):
    """Batched (3 per batch, padded) scores equal each request alone: summed log_softmax over the continuation and
    the argmax check (true for the model's own greedy tokens); a context past max_seq_len loses its left; an empty
    continuation is log 1."""
    _, scorer = tiny
    pairs = [("import", " os"), ("", "def f(x):\n    return x\n"), ("def main():\n    ", "return 0"),
             (LONG_CTX, "    return s\n"), ("x = 1", ""), ("import os\nimport", " sys")]  # fmt: skip
    ctx, cont = split(scorer.tokenizer, *pairs[3])
    assert len(ctx) + len(cont) > scorer.max_len + 50  # truncation is exercised
    results_close(scorer.loglikelihood(pairs), ll_by_hand(scorer, pairs))
    tok, module, size = scorer.tokenizer, scorer.module, scorer.max_len
    prompt = [tok.bos_id, *tok.encode("def f(x):\n    ")]
    greedy = sample(module, prompt, 4, temperature=0.0, top_k=None)  # the model's own argmax tokens
    conts = [greedy, [*greedy[:3], (greedy[3] + 1) % tok.vocab_size]]
    got = scorer.score_tokens([(prompt, c) for c in conts])
    assert [g for _, g in got] == [True, False]
    results_close(got, [by_hand(module, prompt + c, 4, size) for c in conts])
    with pytest.raises(ValueError, match="max_seq_len=256"):
        scorer.loglikelihood([("a", " b" * 400)])


def test_generate_until_stops_at_the_until_string_and_equals_greedy_sample(tiny):
    _, scorer = tiny
    tok, prompt = scorer.tokenizer, "def f(x):\n    "
    ids = [tok.bos_id, *tok.encode(prompt)]
    ref = sample(scorer.module, ids, 20, temperature=0.0, top_k=None, eos_id=tok.eos_id)
    text = tok.decode(ref)
    assert len(ref) == 20 and len(text) > 6
    until = text[len(tok.decode(ref[:3])) :][:2]  # a string that first shows after at least 3 tokens
    needed = next(j for j in range(1, 21) if until in tok.decode(ref[:j]))
    calls = []
    hook = scorer.module.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        lm = harness.model_class()(scorer=scorer)
        from lm_eval.api.instance import Instance

        req = Instance("generate_until", {}, (prompt, {"until": [until, "@@never@@"], "max_gen_toks": 20}), 0)
        got = lm.generate_until([req])
    finally:
        hook.remove()
    assert got == [text[: text.index(until)]]
    assert len(calls) == needed < 20  # one forward per token, none after the until string appeared
    assert scorer.generate_until([(prompt, {"max_gen_toks": 20})]) == [text]  # no until: all 20 tokens
    with pytest.raises(ValueError, match=r"\['num_beams'\]; accepted"):
        scorer.generate_until([(prompt, {"num_beams": 4})])


def test_local_tasks_through_simple_evaluate_equal_the_by_hand_scores(tiny, offline):
    """Four local tasks offline: per-sample responses equal the by-hand ones; acc, perplexity, the multiple-choice
    argmax and bits per byte are the by-hand aggregates."""
    _, scorer = tiny
    names = ["rlm_tiny_ll", "rlm_tiny_mc", "rlm_tiny_rolling", "rlm_tiny_gen"]
    out = harness.evaluate_tasks(scorer, names, tasks_path=str(TASKS), bootstrap_iters=0, log_samples=True)
    res, samples = (
        out["results"],
        {t: sorted(s, key=lambda x: x["doc_id"]) for t, s in out["samples"].items()},
    )
    docs = {t: [json.loads(x) for x in (TASKS / f"{t[9:]}.jsonl").read_text().splitlines()] for t in names}

    pairs = [(d["context"], d["target"]) for d in docs["rlm_tiny_ll"]]
    assert [s["arguments"] for s in samples["rlm_tiny_ll"]] == [[p] for p in pairs]
    want = ll_by_hand(scorer, pairs)
    results_close([s["filtered_resps"][0] for s in samples["rlm_tiny_ll"]], want)
    assert_close(res["rlm_tiny_ll"]["acc,none"], sum(g for _, g in want) / len(want))
    assert_close(
        res["rlm_tiny_ll"]["perplexity,none"],
        math.exp(-sum(x for x, _ in want) / len(want)),
        rtol=1e-3,
        atol=0,
    )

    mc = docs["rlm_tiny_mc"]
    right = []
    for doc, s in zip(mc, samples["rlm_tiny_mc"]):
        pairs = [(doc["question"], " " + c) for c in doc["choices"]]
        assert s["arguments"] == pairs
        want = ll_by_hand(scorer, pairs)
        results_close(s["filtered_resps"], want)
        right.append(max(range(len(want)), key=lambda i: want[i][0]) == doc["label"])
    assert res["rlm_tiny_mc"]["acc,none"] == sum(right) / len(right)

    texts = [d["text"] for d in docs["rlm_tiny_rolling"]]
    want, windows = zip(*(rolling_by_hand(scorer, t) for t in texts))
    assert max(windows) >= 3  # a document longer than two windows
    assert_close(torch.tensor([s["filtered_resps"][0] for s in samples["rlm_tiny_rolling"]]), torch.tensor(want),
                 rtol=1e-5, atol=1e-4)  # fmt: skip
    n_bytes = sum(len(t.encode()) for t in texts)
    assert_close(
        res["rlm_tiny_rolling"]["bits_per_byte,none"], -sum(want) / (n_bytes * math.log(2)), rtol=1e-5, atol=0
    )

    tok = scorer.tokenizer
    for doc, s in zip(docs["rlm_tiny_gen"], samples["rlm_tiny_gen"]):
        text = tok.decode(
            sample(scorer.module, [tok.bos_id, *tok.encode(doc["prompt"])], 12, 0.0, None, tok.eos_id)
        )
        assert s["filtered_resps"] == [text.split("\n")[0]]


def test_a_datastore_makes_every_score_the_knnlm_mixture(tiny, tmp_path, monkeypatch, rlm_cache):
    """With a datastore, log p and the greedy check are of lam * p_kNN + (1 - lam) * p_LM (the paper's eq. 2)
    over the k neighbours of each position's state, computed here term by term."""
    from rlm.eval.knnlm import build

    ckpt, plain = tiny
    build(str(ckpt), tmp_path / "ds", factory="SQfp16", k=4, tune_tokens=300, max_documents=3, progress=False)
    scorer = harness.load_scorer(str(ckpt), batch_size=2, datastore=tmp_path / "ds")
    m = scorer.mixer
    assert m.lam > 0 and m.k == 4

    def mix(logits, keys):
        rows = []
        for row, key in zip(logits, keys):
            d, v = m.ds.search(key[None].float().numpy(), m.k, None)
            p = (1 - m.lam) * torch.softmax(row, -1)
            found = [(float(d[0, i]), int(v[0, i])) for i in range(m.k) if v[0, i] >= 0]
            z = sum(math.exp(-(di - found[0][0]) / m.temperature) for di, _ in found)
            for di, vi in found:
                p[vi] += m.lam * math.exp(-(di - found[0][0]) / m.temperature) / z
            rows.append(p.log())
        return torch.stack(rows)

    pairs = [("import", " os"), ("def main():\n    ", "return 0"), (LONG_CTX, "    return s\n")]
    got = scorer.loglikelihood(pairs)
    results_close(got, ll_by_hand(scorer, pairs, mix))
    assert max(abs(g - p) for (g, _), (p, _) in zip(got, plain.loglikelihood(pairs))) > 1e-3  # it mixed


def test_rlm_eval_tasks_prints_the_table_and_bad_values_are_named(
    tiny, offline, tmp_path, capsys, monkeypatch
):
    from rlm.cli.commands import main

    ckpt, scorer = tiny
    report = tmp_path / "r.json"
    args = ["eval", "--ckpt", str(ckpt), "--tasks-path", str(TASKS), "--bootstrap-iters", "0"]
    assert (
        main([*args, "--tasks", "rlm_tiny_mc", "--limit", "3", "--batch-size", "2", "--json", str(report)])
        == 0
    )
    table = capsys.readouterr().out
    assert "|rlm_tiny_mc|" in table and "|acc " in table
    got = json.loads(report.read_text())["results"]["rlm_tiny_mc"]
    row = next(line for line in table.splitlines() if line.startswith("|rlm_tiny_mc|")).split("|")
    docs = [json.loads(x) for x in (TASKS / "mc.jsonl").read_text().splitlines()[:3]]
    right = [max(range(len(d["choices"])), key=lambda i: ll_by_hand(scorer, [(d["question"], " " + d["choices"][i])])[0][0])
             == d["label"] for d in docs]  # fmt: skip
    assert got["sample_len"] == 3 and float(row[7]) == got["acc,none"] == sum(right) / 3
    import lm_eval  # the registered model type, built by lm-eval from its arguments

    by_name = lm_eval.simple_evaluate(model="rlm", model_args=f"ckpt={ckpt}", tasks=["rlm_tiny_mc"], limit=3,
                                      batch_size=2, bootstrap_iters=0,
                                      task_manager=harness.task_manager(["rlm_tiny_mc"], str(TASKS)))  # fmt: skip
    assert by_name["results"]["rlm_tiny_mc"]["acc,none"] == sum(right) / 3
    for bad, says in ((["--tasks", "rlm_tiny_mcq"], "unknown lm-eval tasks ['rlm_tiny_mcq']"),
                      (["--tasks", "rlm_tiny_mc", "--limit", "0"], "--limit=0"),
                      (["--tasks", " , "], "--tasks ' , '")):  # fmt: skip
        assert main([*args, *bad]) == 2
        assert says in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # an environment without the extra
    assert main([*args, "--tasks", "rlm_tiny_mc"]) == 2
    assert "pip install 'rlm[eval]'" in capsys.readouterr().err


def test_malformed_local_tasks_are_named_with_their_file_and_problem(offline, tmp_path, rlm_main):
    """A bad JSON line in a task's data, a template naming an undefined field, a task file that is not YAML: one
    error line naming the task, the file and the problem, before the model loads (the checkpoint is never read)."""
    ll = (TASKS / "rlm_tiny_ll.yaml").read_text()
    good = tmp_path / "ll.jsonl"
    good.write_text((TASKS / "ll.jsonl").read_text())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "target": " b"}\n{"context": oops}\n')
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, text in {
        "bad_json": ll.replace("tests/lm_eval_tasks/ll.jsonl", str(bad)),
        "bad_var": ll.replace("tests/lm_eval_tasks/ll.jsonl", str(good)).replace("{{context}}", "{{contxt}}"),
        "bad_yaml": ll.replace("tests/lm_eval_tasks/ll.jsonl", str(good)).replace(
            "test_split: test", "test_split: [test"
        ),
    }.items():
        (tasks / f"{name}.yaml").write_text(text.replace("task: rlm_tiny_ll", f"task: {name}"))
    args = ["eval", "--ckpt", tmp_path / "never_read.ckpt", "--tasks-path", tasks, "--tasks"]
    for name, says in (
        ("bad_json", f"lm-eval task 'bad_json' ({tasks / 'bad_json.yaml'}) cannot be loaded: corpus file '{bad}' "
                     "line 2 is not JSON"),
        ("bad_var", f"lm-eval task 'bad_var' ({tasks / 'bad_var.yaml'}) cannot be loaded: UndefinedError: "
                    "'contxt' is undefined"),
        ("bad_yaml", f"lm-eval task 'bad_yaml': its file '{tasks / 'bad_yaml.yaml'}' is not valid YAML (line 9"),
    ):  # fmt: skip
        proc = rlm_main([*args, name], tmp_path)
        assert proc.returncode == 2 and f"rlm eval: error: {says}" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
