"""Numbers a researcher can trust (issue 14): evaluation with the checkpoint's own tokenizer (loss, perplexity,
bits per byte against a by-hand reference), ``rlm validate|test --ckpt_path`` without the training configs, the
test split, and the CLI traps (optimizer options, default_root_dir, --print_config, the sys.argv warning)."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
import yaml
from cli_helpers import CONFIGS, run_rlm
from torch.testing import assert_close

from rlm.data.tokenizer import Tokenizer
from rlm.eval.evaluate import evaluate
from rlm.train.module import LMModule

# The shipped loggers and checkpoint callback (configs/trainer/cpu.yaml), the tiny corpus and model.
BASE = ["--config", CONFIGS / "default.yaml", "--config", CONFIGS / "data" / "tiny.yaml"]
TINY = [*BASE, "--config", CONFIGS / "model" / "tiny.yaml"]
QUICK = ["--trainer.max_steps=3", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2"]
TEXT = {"a.py": 'def hello():\n    return "héllo ☃"\n', "b.txt": "plain words, never seen in training\n" * 3}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, rlm_cache):
    """One tiny fit with the shipped trainer config and --trainer.default_root_dir: (workdir, root, output)."""
    work = tmp_path_factory.mktemp("fit")
    root = work / "elsewhere"
    out = run_rlm(["fit", *TINY, *QUICK, "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={root}"],
                  work, rlm_cache)  # fmt: skip
    return work, root, out


def ckpt_of(root):
    return root / "version_0" / "checkpoints" / "last.ckpt"


# slow: reads what its module fixture trains (and builds) with real `rlm` subprocesses
@pytest.mark.slow
def test_default_root_dir_receives_logs_and_checkpoints_and_no_argv_warning(trained):
    work, root, out = trained
    assert (root / "version_0" / "metrics.csv").is_file() and ckpt_of(root).is_file()
    assert any((root / "tensorboard").rglob("events.out.tfevents.*"))
    assert not (work / "runs").exists()  # nothing went to the config's runs/default
    assert "sys.argv" not in out.stdout + out.stderr


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_test_without_training_configs_uses_the_test_split_and_matches_rlm_eval(trained, tmp_path, rlm_cache):
    _, root, _ = trained
    ckpt = torch.load(ckpt_of(root), map_location="cpu", weights_only=False)
    assert ckpt["RLMDataModule"]["tokenizer_model"]  # the checkpoint carries its tokenizer
    out = run_rlm(
        ["test", "--ckpt_path", ckpt_of(root), "--trainer.enable_progress_bar=false"], tmp_path, rlm_cache
    )
    assert "test/loss" in out.stdout and "training a" not in out.stdout + out.stderr
    # Lightning's results table, plain or drawn with rich's box characters when rich is installed
    lightning_loss = float(re.search(r"test/loss[^0-9]*([0-9][0-9.e+-]*)", out.stdout).group(1))
    report = tmp_path / "test.json"
    run_rlm(["eval", "--ckpt", ckpt_of(root), "--json", report], tmp_path, rlm_cache)
    result = json.loads(report.read_text())
    # 5% of the tiny corpus's 300 documents less its 21 near-duplicates (in no split): round(0.05 * 279) = 14
    assert result["split"] == "test" and result["documents"] == 14
    assert math.isclose(result["loss"], lightning_loss, rel_tol=1e-5)


# slow: reads what its module fixture trains (and builds) with real `rlm` subprocesses
@pytest.mark.slow
def test_eval_on_new_text_uses_the_checkpoint_tokenizer_and_matches_a_by_hand_reference(trained, tmp_path, monkeypatch, rlm_cache):  # fmt: skip
    _, root, _ = trained
    monkeypatch.setenv("RLM_CACHE", str(rlm_cache))
    corpus = tmp_path / "new"
    corpus.mkdir()
    for name, text in TEXT.items():
        (corpus / name).write_text(text)
    got = evaluate(str(ckpt_of(root)), [str(corpus)])
    # By hand: the checkpoint's tokenizer, each (short) document as [bos] + ids + [eos] in one window, every
    # next token scored; bits per byte over the documents' UTF-8 bytes.
    ckpt = torch.load(ckpt_of(root), map_location="cpu", weights_only=False)
    (tmp_path / "tok.model").write_bytes(ckpt["RLMDataModule"]["tokenizer_model"])
    tok = Tokenizer(tmp_path / "tok.model")
    module = LMModule.load_from_checkpoint(ckpt_of(root), map_location="cpu").eval()
    nll, tokens = torch.zeros((), dtype=torch.float64), 0
    for name in sorted(TEXT):
        ids = torch.tensor([[tok.bos_id, *tok.encode(TEXT[name]), tok.eos_id]])
        with torch.no_grad():
            logits = module.model(ids[:, :-1], module.make_context({"tokens": ids[:, :-1]}, "test"))
        nll += F.cross_entropy(logits[0].double(), ids[0, 1:], reduction="sum")
        tokens += ids.shape[1] - 1
    n_bytes = sum(len(t.encode("utf-8")) for t in TEXT.values())
    assert (got["documents"], got["tokens"], got["bytes"]) == (2, tokens, n_bytes)
    assert_close(got["nll_sum"], float(nll), rtol=1e-5, atol=1e-4)
    assert_close(got["bpb"], float(nll) / (math.log(2) * n_bytes), rtol=1e-5, atol=0)
    assert_close(got["loss"], float(nll) / tokens, rtol=1e-5, atol=0)
    assert_close(got["ppl"], math.exp(float(nll) / tokens), rtol=1e-5, atol=0)


# slow: reads what its module fixture trains (and builds) with real `rlm` subprocesses
@pytest.mark.slow
def test_a_checkpoint_without_its_tokenizer_is_a_clear_error(trained, tmp_path, monkeypatch):
    _, root, _ = trained
    ckpt = torch.load(ckpt_of(root), map_location="cpu", weights_only=False)
    del ckpt["RLMDataModule"]  # as written before checkpoints carried the tokenizer
    ckpt["datamodule_hyper_parameters"]["cache_dir"] = str(tmp_path / "empty_cache")  # its cache is gone
    torch.save(ckpt, tmp_path / "old.ckpt")
    with pytest.raises(ValueError, match="carries no tokenizer and its token cache .* is missing"):
        evaluate(str(tmp_path / "old.ckpt"))


# slow: a real `rlm validate` subprocess on a new corpus, tokenized with the checkpoint's tokenizer
@pytest.mark.slow
def test_validate_on_another_corpus_keeps_the_checkpoint_tokenizer(trained, tmp_path, rlm_cache):
    _, root, _ = trained
    corpus = tmp_path / "new"
    corpus.mkdir()
    # four different files: copies of one file would be near-duplicates, three of them removed at the split
    for i, name in enumerate(["eval/evaluate.py", "eval/knnlm.py", "data/module.py", "train/module.py"]):
        shutil.copy(CONFIGS.parent / "rlm" / name, corpus / f"file{i}.py")
    out = run_rlm(["validate", "--ckpt_path", ckpt_of(root), f"--data.corpus={corpus}", "--data.seq_len=64",
                   "--trainer.enable_progress_bar=false"], tmp_path, rlm_cache)  # fmt: skip
    assert "val/loss" in out.stdout and "training a" not in out.stdout + out.stderr


def test_optimizer_options_are_refused_with_a_clear_error(tmp_path, rlm_main):
    for flag in (["--optimizer", "SGD"], ["--optimizer=SGD"], ["--lr_scheduler.class_path=StepLR"]):
        out = rlm_main(["fit", *TINY, *flag], tmp_path)
        assert out.returncode == 2
        assert out.stderr.startswith("rlm fit: error:") and "model.optim.lr" in out.stderr
    config = tmp_path / "sgd.yaml"
    config.write_text(yaml.safe_dump({"optimizer": {"class_path": "torch.optim.SGD"}}))
    out = rlm_main(["fit", *TINY, "--config", config], tmp_path)
    assert out.returncode == 2 and "rlm fit: error:" in out.stderr
    help_text = rlm_main(["fit", "--help"], tmp_path).stdout
    assert "--optimizer" not in help_text and "--lr_scheduler" not in help_text
    # Lightning's docstrings carry Sphinx roles; the help prints their names plainly
    assert ":paramref:" not in help_text and "--trainer.enable_checkpointing" in help_text


def test_print_config_shows_the_vocabulary_that_runs(tmp_path, rlm_main):
    out = rlm_main(["fit", *BASE, "--print_config", "--trainer.default_root_dir=somewhere"], tmp_path)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["data"]["vocab_size"] == 1024 and cfg["model"]["model"]["vocab_size"] == 1024
    assert cfg["trainer"]["logger"][0]["init_args"]["save_dir"] == "somewhere"
    assert "sys.argv" not in out.stderr


# slow: reads what its module fixture trains (and builds) with real `rlm` subprocesses
@pytest.mark.slow
def test_restored_settings_reuse_the_training_cache_when_it_holds_the_checkpoint_tokenizer(trained, monkeypatch, rlm_cache, tmp_path):  # fmt: skip
    from rlm.eval.evaluate import checkpoint_layer

    def data_layer(layers, args):
        args = checkpoint_layer(layers, args)
        return yaml.safe_load(args[args.index("--config") + 1])["data"]

    _, root, _ = trained
    monkeypatch.setenv("RLM_CACHE", str(rlm_cache))
    data = data_layer([], ["--ckpt_path", str(ckpt_of(root))])
    assert (
        data["corpus"] == "stdlib" and data["vocab_size"] == 1024 and data.get("tokenizer") in (None, "train")
    )
    other = data_layer([{"data": {"corpus": str(tmp_path)}}], [f"--ckpt_path={ckpt_of(root)}"])
    assert (
        other["corpus"] == str(tmp_path)
        and open(other["tokenizer"], "rb").read()
        == torch.load(ckpt_of(root), map_location="cpu", weights_only=False)["RLMDataModule"][
            "tokenizer_model"
        ]
    )


def test_sphinx_roles_are_printed_as_plain_names():
    from rlm.cli.support import plain_help

    text = "If :paramref:`~pytorch_lightning.trainer.trainer.Trainer.max_steps` is set, see :class:`~rlm.model.X`."
    assert plain_help(text) == "If `max_steps` is set, see `X`."
