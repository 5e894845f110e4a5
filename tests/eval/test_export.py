"""``rlm export`` and rlm.hf: the plain gated model becomes transformers' LlamaForCausalLM; every plugin's checkpoint
round-trips through AutoModelForCausalLM with the checkpoint's own logits, and transformers' greedy generate()
(cache or not) gives rlm generate's tokens; the folders load without rlm installed; config.json holds each
plugin's options; the tokenizer and a retriever's index travel with the weights (or the folder says there is
none)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch.testing import assert_close

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import rlm.hf  # noqa: E402,F401  (registers model_type 'rlm')
from rlm.cli import main  # noqa: E402
from rlm.data.pretrained import load_tokenizer  # noqa: E402
from rlm.data.segments import SegmentTable  # noqa: E402
from rlm.data.tokenizer import Tokenizer  # noqa: E402
from rlm.hf.export import export  # noqa: E402
from rlm.index.build import IndexConfig  # noqa: E402
from rlm.index.memory import build_memory, embed_rows, indexed_rows  # noqa: E402
from rlm.train.module import LMModule  # noqa: E402

VOCAB = 400
MODEL = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_seq_len=64)
PLUGINS = {
    "base": {},
    "moe": {"moe": {"layers": [1], "num_experts": 4}},
    "partial_experts": {"partial_experts": {"layers": [1], "buckets": 8, "rank": 2}},
    "pkm": {"pkm": {"layers": [0], "n_keys": 8, "heads": 2, "topk": 4, "k_dim": 16}},
    "altup": {"altup": {"k": 2}},
    "tokenid": {"tokenid": {"layers": [0, 1], "rank": 2}},
    "retrieval": {"retrieval": {"layers": [1], "k": 2, "progress": False}},
    "tokenid_ngram": {"tokenid": {"layers": [1], "ngram_orders": [2, 3], "ngram_heads": 2, "ngram_rows": 64}},
    "pkm_peer": {"pkm": {"layers": [1], "n_keys": 8, "heads": 2, "topk": 4, "k_dim": 16, "values": "peer"}},
    "knn_attention": {"knn_attention": {"k": 4, "own_k": 3}},
    "token_memory": {"token_memory": {"memory_batches": 2}},
}
PLAIN = {"ffn": "plain"}  # the GELU FFN: no standard architecture has it with RMSNorm and rotary positions
L = 8  # the retrieval index's segment length


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> bytes:
    """A small sentencepiece model's bytes (trained on a stdlib file), as checkpoints carry them."""
    path = tmp_path_factory.mktemp("tok") / "sp.model"
    text = Path(json.__file__).read_text()
    Tokenizer.train([text], path, vocab_size=VOCAB)
    return path.read_bytes()


def _perturb(module: LMModule, noise: float) -> None:
    """Noise on every parameter, so zero-initialised parts (retrieval's output, routers) reach the logits."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))


def _index(module: LMModule, folder: Path) -> Path:
    """A Flat index over 12 random documents, its corpus tokens in a memory-mapped file (as a data cache's)."""
    rng = np.random.default_rng(0)
    docs = [np.concatenate([[2], rng.integers(4, VOCAB, size=38), [3]]) for _ in range(12)]
    flat = np.concatenate(docs).astype(np.int32)
    tokens = np.memmap(folder / "tokens.bin", dtype=np.int32, mode="w+", shape=flat.shape)
    tokens[:] = flat
    tokens.flush()
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    segments = SegmentTable(np.memmap(folder / "tokens.bin", dtype=np.int32, mode="r"), offsets, L, 0, "exp")
    plugin = module.model.plugins["retrieval"]
    rows = indexed_rows(segments, np.arange(len(docs)))
    embedder = plugin.snapshot(0)
    vectors = embed_rows(embedder, segments, rows, 64, 0, 1, False)
    index = folder / "retrieval_index"
    config = IndexConfig(factory="Flat", target_recall=None)
    memory = build_memory(
        vectors, segments, rows, 2, embedder.embedder_identity(), 0, config, index, table=False
    )
    plugin.use_memory(memory)  # checkpointed as the plugin's extra state {'index_dir': ...}
    return index


def make_checkpoint(
    folder: Path,
    plugins: dict,
    sp_model: bytes | None,
    with_index: bool = False,
    tokenizer: str | None = None,
    noise: float = 0.05,
    **model: Any,
) -> Path:
    """A checkpoint as rlm fit writes it (LMModule weights and hyper-parameters, data settings, tokenizer: the
    sentencepiece model's bytes, or the data.tokenizer it names)."""
    torch.manual_seed(0)
    module = LMModule(model={**MODEL, **model}, plugins=plugins)
    _perturb(module, noise)
    if with_index:
        _index(module, folder)
    ckpt = {
        "state_dict": module.state_dict(),
        "hyper_parameters": dict(module.hparams),
        "global_step": 2,
        "epoch": 0,
        "pytorch-lightning_version": pl.__version__,
        "datamodule_hyper_parameters": {
            "corpus": "stdlib",
            "vocab_size": VOCAB,
            "cache_dir": str(folder / "c"),
            "tokenizer": tokenizer or "train",
        },
        "RLMDataModule": {"tokenizer_model": sp_model} if sp_model else {},
    }
    path = folder / "ckpt" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(ckpt, path)
    return path


def reference_logits(ckpt: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The checkpoint's LMModule logits, its context as rlm generate builds it (eval mode)."""
    module = LMModule.load_from_checkpoint(ckpt, map_location="cpu").eval()
    with torch.no_grad():
        return module.model(tokens, module.make_context({"tokens": tokens}, "predict"))


def _tokens(n: int = 2, T: int = 24) -> torch.Tensor:
    return torch.randint(4, VOCAB, (n, T), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", [*(n for n in PLUGINS if n != "base"), "plain_ffn"])
def test_every_plugin_round_trips_through_auto_model(tmp_path, sp_model, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = make_checkpoint(
        tmp_path, PLUGINS.get(name, {}), sp_model, **(PLAIN if name == "plain_ffn" else {})
    )
    out = tmp_path / "hf"
    said: list[str] = []
    export(ckpt, out, say=said.append)
    assert {"model.safetensors", "config.json", "tokenizer.model", "README.md"} <= {
        p.name for p in out.iterdir()
    }
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.tmp")]  # written aside, then renamed

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "rlm" and config["rlm_model"]["d_model"] == MODEL["d_model"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_rlm.RLMForCausalLM"
    assert set(config["plugins"]) == set(PLUGINS.get(name, {}))
    for label, options in PLUGINS.get(name, {}).items():  # every option, the given ones with their values
        args = config["plugins"][label]["init_args"]
        assert {k: args[k] for k in options} == options
        assert len(args) > len(options)  # the defaults too
    assert isinstance(AutoConfig.from_pretrained(out), rlm.hf.RLMConfig)

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(model, rlm.hf.RLMForCausalLM)
    tokens = _tokens()
    with torch.no_grad():
        got = model(tokens).logits
    assert_close(got, reference_logits(ckpt, tokens), rtol=1e-5, atol=1e-5)

    tok = load_tokenizer(str(out / "tokenizer.model"))
    assert (
        tok.vocab_size == VOCAB
        and tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x):\n    return x"
    )
    readme = (out / "README.md").read_text()
    assert "steps: 2" in readme and "kNN-LM datastores" in readme
    if name == "retrieval":  # no index was built before this checkpoint: the folder says so
        assert config["indices"] == {"retrieval": None} and not (out / "index").exists()
        assert any("has no index" in line for line in said)
        assert "no index was exported" in readme


def test_retrieval_index_travels_with_the_weights(tmp_path, sp_model):
    """The index is copied beside the weights (with its corpus tokens, which lived in a cache file), the path in
    config.json is relative, and the loaded model retrieves from it: the checkpoint's logits, and other logits
    than without neighbours."""
    from transformers import AutoModelForCausalLM

    ckpt = make_checkpoint(tmp_path, PLUGINS["retrieval"], sp_model, with_index=True)
    tokens = _tokens(1, 32)
    want = reference_logits(ckpt, tokens)
    export(ckpt, tmp_path / "hf", say=lambda _: None)
    out = tmp_path / "moved"
    shutil.move(tmp_path / "hf", out)  # the folder is relocatable
    shutil.rmtree(tmp_path / "retrieval_index")
    os.remove(tmp_path / "tokens.bin")
    config = json.loads((out / "config.json").read_text())
    assert config["indices"] == {"retrieval": "index"}
    assert config["plugins"]["retrieval"]["init_args"]["index_dir"] is None
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        got = model(tokens).logits
        assert_close(got, want, rtol=1e-5, atol=1e-5)
        model.model.plugins["retrieval"].use_memory(None)
        without = model(tokens).logits
    assert (got[:, L:] - without[:, L:]).abs().max() > 1e-3  # the neighbours reach the logits after segment 0
    assert_close(got[:, :L], without[:, :L])  # the first segment has no earlier segment to retrieve with
    said: list[str] = []
    export(ckpt, tmp_path / "again", say=said.append)  # the checkpoint's index is gone now: said, not copied
    assert any("is gone: exported without one" in line for line in said)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["indices"] == {"retrieval": None}


def test_loss_shift_and_greedy_generate_match_rlm(tmp_path, sp_model):
    from transformers import AutoModelForCausalLM

    from rlm.eval.generate import sample

    ckpt = make_checkpoint(tmp_path, PLUGINS["moe"], sp_model, max_seq_len=16)
    export(ckpt, tmp_path / "hf", say=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = _tokens(2, 16)
    with torch.no_grad():
        out = model(tokens, labels=tokens)
    naive = torch.stack(  # position t predicts token t+1
        [-torch.log_softmax(out.logits[b, t], -1)[tokens[b, t + 1]] for b in range(2) for t in range(15)]
    ).mean()
    assert_close(out.loss, naive)
    prompt = tokens[:1, :10]
    ids = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)  # past max_seq_len
    module = LMModule.load_from_checkpoint(ckpt, map_location="cpu")
    assert ids[0, 10:].tolist() == sample(module, prompt[0].tolist(), 12, temperature=0.0)


LLAMA = {"n_kv_heads": 1, "vocab_multiple": 128}  # grouped-query attention, a padded head


@pytest.mark.parametrize("tied", [True, False])
def test_the_plain_gated_model_is_a_llama(tmp_path, sp_model, tied):
    """No plugins and the SwiGLU FFN: transformers' own LlamaForCausalLM, the checkpoint's logits at every position
    of 24 (so the rotary layouts agree), the padded head cut back to the tokenizer's vocabulary."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    ckpt = make_checkpoint(tmp_path, {}, sp_model, tie_embeddings=tied, **LLAMA)
    said: list[str] = []
    export(ckpt, tmp_path / "hf", say=said.append)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == VOCAB and "auto_map" not in config
    assert config["num_key_value_heads"] == 1 and config["tie_word_embeddings"] is tied
    assert not (tmp_path / "hf" / "rlm_src").exists() and "exported as LlamaForCausalLM" in said
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model) is LlamaForCausalLM
    tokens = _tokens()
    with torch.no_grad():
        assert_close(model(tokens).logits, reference_logits(ckpt, tokens), rtol=1e-5, atol=1e-5)


def _rlm_greedy(ckpt: Path, prompts: torch.Tensor, steps: int, cache: bool) -> list[list[int]]:
    from rlm.eval.generate import sample_batch

    module = LMModule.load_from_checkpoint(ckpt, map_location="cpu")
    return sample_batch(module, prompts.tolist(), steps, temperature=0, top_k=None, eos_id=3, cache=cache)


def _hf_greedy(model: Any, prompts: torch.Tensor, steps: int, cache: bool) -> list[list[int]]:
    """transformers' greedy generate(): each row's new ids up to and including its eos (id 3), as rlm's."""
    ids = model.generate(prompts, max_new_tokens=steps, do_sample=False, use_cache=cache)[
        :, prompts.shape[1] :
    ]
    rows = [row.tolist() for row in ids]
    return [row[: row.index(3) + 1] if 3 in row else row for row in rows]


@pytest.mark.parametrize("name", [*PLUGINS, "plain_ffn"])
def test_transformers_greedy_generate_is_rlm_generate(tmp_path, sp_model, name):
    """Token for token, with transformers' cache (rlm's KVCache for rlm's model, transformers' for the Llama) and
    without; rlm's model past max_seq_len too, where both restart the window the same way."""
    from transformers import AutoModelForCausalLM

    shape = PLAIN if name == "plain_ffn" else LLAMA if name == "base" else {}
    # untied: a tied head, perturbed, mostly repeats the last token, and greedy decoding would show little
    ckpt = make_checkpoint(
        tmp_path, PLUGINS.get(name, {}), sp_model, noise=0.3, tie_embeddings=False, **shape
    )
    export(ckpt, tmp_path / "hf", say=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    prompts = _tokens(2, 10)
    steps = 40 if name == "base" else 70  # transformers' Llama has no window past max_seq_len=64
    for cache in (True, False):
        want = _rlm_greedy(ckpt, prompts, steps, cache)
        assert len(set(want[0])) > 3, f"degenerate generation {want[0]}: the test would show little"
        assert _hf_greedy(model, prompts, steps, cache) == want, f"use_cache={cache}"


NO_RLM = """
import json, sys
# rlm as if not installed: its editable finder off the import system, the repository off the path
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path[:] = [p for p in sys.path if p not in ("", sys.argv[1])]
try:
    import rlm
    raise SystemExit("rlm is importable")
except ModuleNotFoundError:
    pass
import torch
from transformers import AutoModelForCausalLM
out = {}
for folder in sys.argv[3:]:
    kwargs = {} if folder.endswith("llama") else {"trust_remote_code": True}
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    prompts = torch.tensor(json.loads(sys.argv[2]))
    ids = model.generate(prompts, max_new_tokens=30, do_sample=False)[:, prompts.shape[1]:]
    rlm_file = getattr(sys.modules.get("rlm"), "__file__", None)
    out[folder] = {"ids": ids.tolist(), "class": type(model).__name__, "rlm": rlm_file}
print(json.dumps(out))
"""


def test_exports_load_and_generate_where_rlm_is_not_installed(tmp_path, sp_model):
    """Plain transformers loads the Llama (no rlm imported at all) and, with trust_remote_code, a model with a
    plugin from the rlm source its folder carries; both generate what they generate where rlm is installed."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    repo = str(Path(__file__).resolve().parents[2])
    folders = {}
    for name, plugins, shape in (("llama", {}, LLAMA), ("pkm", PLUGINS["pkm"], {})):
        ckpt = make_checkpoint(tmp_path / name, plugins, sp_model, noise=0.3, tie_embeddings=False, **shape)
        export(ckpt, tmp_path / name / name, say=lambda _: None)
        folders[name] = str(tmp_path / name / name)
    prompts = _tokens(2, 10)
    run = subprocess.run(
        [sys.executable, "-c", NO_RLM, repo, json.dumps(prompts.tolist()), *folders.values()],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got[folders["llama"]]["class"] == "LlamaForCausalLM" and got[folders["llama"]]["rlm"] is None
    assert got[folders["pkm"]]["rlm"].startswith(folders["pkm"])  # the folder's own copy of rlm
    for name, folder in folders.items():
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        here = model.generate(prompts, max_new_tokens=30, do_sample=False)[:, 10:].tolist()
        assert got[folder]["ids"] == here, name


def test_cli_export_refuses_bad_input_and_replaces_with_force(tmp_path, sp_model, capsys):
    ckpt = make_checkpoint(tmp_path, PLUGINS["retrieval"], sp_model)
    out = tmp_path / "hf"
    assert main(["export", "--ckpt", str(ckpt), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "plugin 'retrieval' has no index" in printed and f"wrote {out}" in printed
    assert main(["export", "--ckpt", str(ckpt), "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    (out / "stale.txt").write_text("x")
    assert main(["export", "--ckpt", str(ckpt), "--out", str(out), "--force"]) == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(ckpt.read_bytes()[:1000])
    assert main(["export", "--ckpt", str(damaged), "--out", str(tmp_path / "x")]) == 2
    assert "cannot be loaded" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["export", "--ckpt", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "x")]) == 2
    assert f"rlm export: error: --ckpt '{tmp_path / 'missing.ckpt'}' does not exist" in capsys.readouterr().err


def test_card_reads_the_runs_final_losses(tmp_path, sp_model):
    """metrics.csv of the run (CSVLogger, version_N beside the checkpoint folder): the last value of each loss
    column up to the checkpoint's step, not past it."""
    ckpt = make_checkpoint(tmp_path, PLUGINS["base"], sp_model)
    (tmp_path / "version_0").mkdir()
    (tmp_path / "version_0" / "metrics.csv").write_text(
        "epoch,step,train/loss,val/loss,lr-AdamW\n0,0,5.5,,0.001\n0,1,5.25,,0.001\n0,1,,5.125,\n0,2,4.75,,0.001\n"
        "0,3,4.0,,0.001\n"
    )
    export(ckpt, tmp_path / "hf", say=lambda _: None)
    readme = (tmp_path / "hf" / "README.md").read_text()
    assert "train/loss: 4.7500 (step 2)" in readme and "val/loss: 5.1250 (step 1)" in readme
    assert '"vocab_size": 400' in readme and '"corpus": "stdlib"' in readme  # model and data settings
    assert "lr-AdamW" not in readme


def test_a_hugging_face_tokenizer_is_exported_for_auto_tokenizer(tmp_path):
    """A run that used a tokenizer.json (data.tokenizer): it is copied, with a tokenizer_config.json so that
    AutoTokenizer loads it, and encodes as the original does."""
    from tokenizers import Tokenizer as HFTokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    raw = HFTokenizers(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=350,
        special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator([Path(json.__file__).read_text()], trainer)
    (tmp_path / "tok").mkdir()
    raw.save(str(tmp_path / "tok" / "tokenizer.json"))
    ckpt = make_checkpoint(
        tmp_path, PLUGINS["base"], None, tokenizer=str(tmp_path / "tok" / "tokenizer.json")
    )
    export(ckpt, tmp_path / "hf", say=lambda _: None)
    out = tmp_path / "hf"
    assert not (out / "tokenizer.model").exists()
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 3, 0)
    text = "def f(x):\n    return x + 12"
    auto = AutoTokenizer.from_pretrained(out)
    assert (
        auto(text)["input_ids"]
        == raw.encode(text).ids
        == load_tokenizer(str(out / "tokenizer.json")).encode(text)
    )
    assert (auto.bos_token, auto.eos_token, auto.pad_token) == ("<s>", "</s>", "<pad>")
    assert "tokenizer.json" in (out / "README.md").read_text()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, sp_model) -> Path:
    """A Token-ID model exported once (rlm's own model class, whose loader checks the manifest); tests damage
    copies of it."""
    work = tmp_path_factory.mktemp("exported")
    export(make_checkpoint(work, PLUGINS["tokenid"], sp_model), work / "hf", say=lambda _: None)
    return work / "hf"


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= (
        0x01  # inside the tensors of model.safetensors: the size is kept, the header valid
    )
    path.write_bytes(bytes(data))


DAMAGE = {"flip": _flip, "truncate": lambda p: p.write_bytes(p.read_bytes()[:-9]), "delete": Path.unlink}


def test_a_fresh_export_lists_its_files_and_a_saved_model_loads_again(exported, tmp_path):
    from transformers import AutoModelForCausalLM

    manifest = json.loads((exported / "manifest.json").read_text())
    assert {"model.safetensors", "config.json", "tokenizer.model", "README.md"} <= set(manifest["sha256"])
    model = AutoModelForCausalLM.from_pretrained(exported)
    model.save_pretrained(tmp_path / "again")  # save_pretrained writes the manifest too
    assert "model.safetensors" in json.loads((tmp_path / "again" / "manifest.json").read_text())["sha256"]
    AutoModelForCausalLM.from_pretrained(tmp_path / "again")


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("victim", ["model.safetensors", "config.json", "manifest.json"])
def test_a_damaged_export_is_refused_naming_the_file(exported, tmp_path, victim, damage):
    """Before, a byte changed inside model.safetensors loaded through AutoModelForCausalLM with NaN or wrong
    logits and no warning. transformers reads config.json before rlm.hf is asked: an unreadable one is its own
    error, which names the file and the folder too."""
    from transformers import AutoModelForCausalLM

    hf = tmp_path / "hf"
    shutil.copytree(exported, hf)
    DAMAGE[damage](hf / victim)
    with pytest.raises(OSError) as err:
        rlm.hf.RLMForCausalLM.from_pretrained(hf)
    assert victim in str(err.value) and str(hf) in str(err.value), err.value
    with pytest.raises((OSError, ValueError)) as err:
        AutoModelForCausalLM.from_pretrained(hf)
    assert victim in str(err.value) and str(hf) in str(err.value), err.value


@pytest.mark.parametrize("kind", ["llama", "rlm"])
def test_a_full_disk_during_export_is_one_line_naming_the_folder(
    tmp_path, sp_model, capsys, monkeypatch, kind
):
    """safetensors reports ENOSPC as a SafetensorError (not an OSError), which was a traceback."""
    import safetensors.torch
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    if kind == "llama":  # written by safetensors itself
        monkeypatch.setattr(safetensors.torch, "save_file", full)
    else:  # by transformers' save_pretrained
        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    ckpt = make_checkpoint(tmp_path, {} if kind == "llama" else PLUGINS["tokenid"], sp_model)
    assert main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"rlm export: error: cannot write '{tmp_path / 'hf'}': No space left on device" in err, err
    assert "Traceback" not in err  # (above it, transformers' progress bar)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "ckpt"]  # no folder, whole or half-written
