"""``rlm knnlm build`` as a long job sees it: progress lines in a log (not only a terminal bar), the size and time
estimate printed before the work, the options' defaults in --help, and keys that are the model's own states
whatever thread count key extraction settles on."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch.testing import assert_close


@pytest.fixture
def ckpt(trained, rlm_cache, monkeypatch):
    """The tiny in-process checkpoint, its token cache found through RLM_CACHE."""
    monkeypatch.setenv("RLM_CACHE", str(rlm_cache))
    return trained()


def test_a_build_logged_to_a_file_prints_progress_lines_and_its_estimate_first(
    ckpt, tmp_path, capsys, monkeypatch
):
    from rlm.eval import datastore
    from rlm.eval.datastore import build_datastore

    monkeypatch.setattr(datastore, "LOG_EVERY", 0.0)  # a line at every batch, not every 30 s
    meta = build_datastore(str(ckpt), tmp_path / "ds", factory="SQfp16", k=4, max_documents=3, batch_size=2)
    err = capsys.readouterr().err  # not a terminal: no tqdm bar, plain lines
    assert "\r" not in err, err
    lines = err.splitlines()
    size = next(i for i, line in enumerate(lines) if "a datastore of about" in line)
    timing = next(i for i, line in enumerate(lines) if re.search(r"datastore keys: about [\d,]+ s for", line))
    progress = [
        i for i, line in enumerate(lines) if re.match(r"datastore keys: [\d,]+/[\d,]+ keys \(\d+%\), ", line)
    ]
    assert size < timing < progress[-1] and len(progress) >= 2, err
    n = meta["entries"]
    assert f"datastore keys: {n:,}/{n:,} keys (100%)" in lines[progress[-1]]
    assert all("keys/s" in lines[i] and "ETA" in lines[i] for i in progress)
    assert any(line.startswith("rlm knnlm: index SQfp16: ") for line in lines)


def test_a_build_without_progress_prints_only_its_estimate(ckpt, tmp_path, capsys):
    from rlm.eval.datastore import build_datastore

    build_datastore(str(ckpt), tmp_path / "ds", factory="SQfp16", k=4, max_documents=2, progress=False)
    err = capsys.readouterr().err
    assert "a datastore of about" in err and "keys/s" not in err and "rlm knnlm: index" not in err, err


@pytest.mark.parametrize("factory", ["SQfp16", "IVF4,Flat"])  # not PQ: its k-means is slow for a unit test
def test_the_size_estimate_is_within_twice_the_files_written(ckpt, tmp_path, capsys, factory):
    from rlm.eval.datastore import build_datastore, estimate

    meta = build_datastore(
        str(ckpt), tmp_path / "ds", factory=factory, k=4, target_recall=None, max_documents=4, progress=False
    )
    files = sum(f.stat().st_size for f in (tmp_path / "ds").iterdir())
    want = estimate(meta["entries"], meta["dim"], factory)["files"]
    assert files / 2 <= want <= files * 2, (files, want)
    printed = float(
        re.search(r"a datastore of about ([\d.,]+) MiB", capsys.readouterr().err)[1].replace(",", "")
    )
    assert printed == pytest.approx(want / 2**20, abs=0.05)


def test_stored_keys_are_the_models_states_from_a_plain_forward_pass(ckpt, tmp_path):
    """The datastore's exact keys (faiss gives float16 keys back bit for bit) against the full forward pass, head
    included, at torch's thread count, hooked here independently of the build; with two threads the build also
    times one thread, and leaves torch's count as it found it."""
    from rlm.data.windows import IGNORE_INDEX, eval_loader
    from rlm.eval.datastore import Datastore, build_datastore, load_for_knn, windows_of

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the trial runs even where torch has one thread
    try:
        meta = build_datastore(str(ckpt), tmp_path / "ds", factory="SQfp16", k=4, max_documents=3, batch_size=1,
                               layer="ffn_input", progress=False)  # fmt: skip
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    index = Datastore(tmp_path / "ds").indexes[0]
    stored = torch.from_numpy(index.reconstruct_n(0, index.ntotal))  # (N, d) float16 values as float32
    module, data, store = load_for_knn(str(ckpt), None, "cpu", False)
    windows = windows_of(data, store, np.asarray(meta["doc_ids"]))
    seen: list[torch.Tensor] = []
    hook = module.model.blocks[-1].ffn_norm.register_forward_hook(lambda m, i, out: seen.append(out))
    want = []
    with torch.no_grad():
        for batch in eval_loader(windows, 4):
            module.model(batch["tokens"], module.make_context(batch, "test", segments=windows.segments))
            real = batch["targets"] != IGNORE_INDEX  # (B, T)
            want.append(seen.pop()[real])  # (n, d): windows in order, each its real positions
    hook.remove()
    want = torch.cat(want)
    assert stored.shape == want.shape == (meta["entries"], meta["dim"])
    # float16 storage: a float32 state that lands near a rounding boundary may round the other way
    assert_close(stored, want.half().float(), rtol=2e-3, atol=2e-3)
    values = np.load(tmp_path / "ds" / "values.npy")
    assert (values == np.concatenate([store.doc_tokens(int(d))[1:] for d in meta["doc_ids"]])).all()


def test_build_and_info_help_show_the_defaults(tmp_path, rlm_main):
    out = rlm_main(["knnlm", "build", "--help"], tmp_path)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())  # argparse wraps lines anywhere
    for option, default in [("--k", "32"), ("--layer", "final"), ("--factory", "auto"), ("--flat-below", "1000000"),
                            ("--target-recall", "0.9"), ("--tune-tokens", "16384"), ("--max-documents", "all"),
                            ("--shard-keys", "one index"), ("--batch-size", "the run's validation batch size")]:  # fmt: skip
        assert re.search(rf"{option} \S+ .*?\(default: {re.escape(default)}\)", text), (option, text)
    assert "(default: None)" not in text and "(default: False)" not in text
    info = rlm_main(["knnlm", "info", "--help"], tmp_path)
    assert info.returncode == 0 and "a datastore directory written by `rlm knnlm build`" in info.stdout


def test_the_build_benchmark_runs_and_its_keys_match_the_loop_it_replaced(ckpt, capsys):
    """benchmarks/knnlm_build.py at its smallest: a row per variant, and the keys of entries() equal to the old
    loop's (full forward, head included) up to float16 rounding."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "knnlm_build.py"
    spec = importlib.util.spec_from_file_location("knnlm_build", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--ckpt", str(ckpt), "--tokens", "200", "--repeat", "1"])
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if r.startswith("| ") and "variant" not in r]
    assert any(r.startswith("| now: entries()") for r in rows) and len(rows) >= 6, out
    # normed states of order 1: a float16 step there is 1e-3, where two thread counts' sums may round apart
    assert float(re.search(r"max \|key before - key now\| (\S+)", out)[1]) <= 4e-3, out
