"""``model.plugins`` is typed from the registry: stacked config files and ``--model.plugins...`` flags merge plugin
by plugin and key by key in jsonargparse itself, typed by each plugin's Config; bad values name the option."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import typing

import pytest
import torch
import yaml
from cli_helpers import CONFIGS, TINY, fit_args, run_rlm

from rlm.cli import main
from rlm.plugin.registry import known_plugins, plugins_config

PKM = CONFIGS / "plugins" / "pkm.yaml"
BASE = [a for p in TINY for a in ("--config", str(p))]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLM_DEBUG", raising=False)


def printed(*args: str) -> dict:
    """The config ``rlm fit ... --print_config`` prints, as a mapping."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        main(["fit", *BASE, *args, "--print_config"])
    assert stop.value.code in (0, None)
    return yaml.safe_load(out.getvalue())


def plugins(*args: str) -> dict:
    return {k: v for k, v in (printed(*args)["model"]["plugins"] or {}).items() if v is not None}


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_fragments_merge_by_name_in_any_order_later_keys_win_and_null_disables(tmp_path):
    a = _write(tmp_path, "a.yaml", "model:\n  plugins:\n    tokenid: {layers: [0], rank: 0}\n")
    b = _write(tmp_path, "b.yaml", "model:\n  plugins:\n    moe: {layers: [1]}\n    tokenid: {rank: 2}\n")
    off = _write(tmp_path, "off.yaml", "model:\n  plugins:\n    tokenid: null\n")
    both = [plugins(*(x for f in order for x in ("--config", f))) for order in itertools.permutations([a, b])]
    assert set(both[0]) == set(both[1]) == {"tokenid", "moe"}
    assert both[0]["moe"] == both[1]["moe"] and both[0]["moe"]["layers"] == [1]
    assert both[0]["tokenid"]["layers"] == both[1]["tokenid"]["layers"] == [0]
    assert [p["tokenid"]["rank"] for p in both] == [2, 0]  # the later file's key wins
    assert set(plugins("--config", a, "--config", b, "--config", off)) == {"moe"}


def test_flags_merge_into_the_files_plugins_typed_by_the_plugin_config():
    got = plugins(
        "--config", str(PKM),
        "--model.plugins.pkm.mode=add", "--model.plugins.pkm.topk", "8",
        "--model.plugins", '{"tokenid": {"rank": 2}}',
        "--model.plugins.moe", "{expert_hidden: null}", "--model.plugins.moe.capacity_factor=1.5",
        "--model.plugins.pkm.gated=false", "--model.plugins.pkm.layers=[0, 1]",
    )  # fmt: skip
    shipped = yaml.safe_load(PKM.read_text())["model"]["plugins"]["pkm"]
    assert got["pkm"] == {**got["pkm"], **shipped, "mode": "add", "topk": 8, "gated": False, "layers": [0, 1]}
    assert got["tokenid"]["rank"] == 2 and type(got["tokenid"]["rank"]) is int
    assert got["moe"]["capacity_factor"] == 1.5 and got["moe"].get("expert_hidden") is None
    assert set(plugins("--config", str(PKM), "--model.plugins.pkm=null")) == set()
    assert plugins("--model.plugins.pkm.sparse=auto")["pkm"]["sparse"] == "auto"


def test_fit_help_lists_every_plugin_option_typed_with_its_choices(tmp_path, monkeypatch, capsys):
    """jsonargparse alone lists a plugin's options two help levels down (--model.plugins.NAME.help)."""
    monkeypatch.setenv("RLM_CACHE", str(tmp_path))  # the help built here, not a kept copy
    assert main(["fit", "--help"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert [f.name for f in dataclasses.fields(plugins_config())] == known_plugins()
    choices = []
    for name in known_plugins():
        hints = typing.get_type_hints(plugins_config().__dataclass_fields__[name].type.__args__[0])
        for option, tp in hints.items():
            line = lines[f"--model.plugins.{name}.{option}"]
            for arm in (tp, *typing.get_args(tp)):
                if typing.get_origin(arm) is typing.Literal:
                    choices.append("{" + ",".join(map(str, typing.get_args(arm))) + "}")
                    assert choices[-1] in line, line
    # pkm.values, and pkm.sparse's bool | Literal["auto"]
    assert "{embedding,peer}" in choices and "{auto}" in choices


def test_the_command_line_root_reaches_the_configs_interpolations():
    cfg = printed("--config", str(CONFIGS / "default.yaml"), "--trainer.default_root_dir=elsewhere")
    assert [lg["init_args"]["save_dir"] for lg in cfg["trainer"]["logger"]] == [
        "elsewhere",
        "elsewhere/tensorboard",
    ]


def test_the_wandb_fragment_keeps_checkpoints_under_the_csv_logger():
    """configs/logger/wandb.yaml adds W&B after the CSV and TensorBoard loggers: Lightning puts checkpoints under
    the first logger, so they stay in DIR/version_N/checkpoints; W&B uploads no checkpoint."""
    # read as files: the wandb package is an extra, and a later file's list replaces the earlier one's
    plain = yaml.safe_load((CONFIGS / "default.yaml").read_text())["trainer"]["logger"]
    cfg = yaml.safe_load((CONFIGS / "logger" / "wandb.yaml").read_text())["trainer"]["logger"]
    assert cfg[:2] == plain and len(cfg) == 3
    assert cfg[2]["class_path"] == "pytorch_lightning.loggers.WandbLogger"
    assert cfg[2]["init_args"]["log_model"] is False


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--model.plugins.tokenid.rank=two", "model.plugins.tokenid.rank: must be an integer, got 'two'"),
        (
            "--model.plugins.moe.capacity_factor=big",
            "model.plugins.moe.capacity_factor: must be a number, got 'big'",
        ),
        ("--model.plugins.pkm.colour=red", "model.plugins.pkm: unknown key 'colour'; accepted: ['layers', "),
        (
            "--model.plugins.pkm.query_norm=bad",
            "model.plugins.pkm.query_norm: must be one of 'layernorm', 'batchnorm', 'none', got 'bad'",
        ),
        (
            "--model.plugins.pkm.sparse=maybe",
            "model.plugins.pkm.sparse: must be a bool (true/false) or 'auto', got",
        ),
        (
            "--model.plugins.retrieval.index_dim=wide",
            "model.plugins.retrieval.index_dim: must be an integer or 'auto' or null, got 'wide'",
        ),
        ("--model.model.ffn=bad", "model.model.ffn: must be one of 'gated', 'plain', got 'bad'"),
        (
            "--data.tokenizer_model_type=bad",
            "data.tokenizer_model_type: must be one of 'bpe', 'unigram', 'char',",
        ),
        ("--model.plugins.tokenid.rank=-1", "tokenid.rank must be a non-negative integer, got -1"),
        ("--model.optim.lr=abc", "model.optim.lr: must be a number, got 'abc'"),
        ("--model.optim.lrr=1", "model.optim: unknown key 'lrr'; accepted: ['lr', "),
        ("--model.model.d_modl=8", "model.model: unknown key 'd_modl'; accepted: ['vocab_size', "),
    ],
)
def test_bad_values_are_one_line_naming_the_option_and_what_is_accepted(flag, message, capsys):
    assert main(["fit", *BASE, flag]) == 2
    err = capsys.readouterr().err
    assert f"rlm fit: error: {message}" in err and "Traceback" not in err and "Union" not in err, err


# slow: real `rlm` subprocesses (fit, then the commands that read its checkpoint), the path users take
@pytest.mark.slow
def test_fit_trains_and_saves_what_the_flags_built(tmp_path, rlm_cache):
    args = fit_args(PKM) + [
        "--model.plugins.pkm.layers=[1]",
        "--model.plugins.pkm.n_keys=16",
        "--model.plugins",
        '{"tokenid": {"rank": 2}}',
        "--model.plugins.pkm.topk=4",
        "--model.plugins.pkm.query_norm=none",
        "--model.plugins.pkm.mode=add",
        "--trainer.max_steps=1",
    ]
    run_rlm(args, tmp_path, rlm_cache)
    hp = torch.load(tmp_path / "runs/test/ckpt/last.ckpt", map_location="cpu", weights_only=False)
    pkm = hp["hyper_parameters"]["plugins"]["pkm"]
    assert {k: pkm[k] for k in ("layers", "n_keys", "topk", "query_norm", "mode")} == {
        "layers": [1], "n_keys": 16, "topk": 4, "query_norm": "none", "mode": "add"}  # fmt: skip
    assert hp["hyper_parameters"]["plugins"]["tokenid"]["rank"] == 2
    saved = yaml.safe_load((tmp_path / "runs/test/version_0/config.yaml").read_text())
    assert {k: v for k, v in saved["model"]["plugins"].items() if v} == hp["hyper_parameters"]["plugins"]
    pkm_keys = [k for k in hp["state_dict"] if ".ffn_add.0." in k]  # mode add on layer 1
    assert pkm_keys and not any(".norm." in k for k in pkm_keys), pkm_keys  # trained without batch norm
