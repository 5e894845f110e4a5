"""``--model.plugins...`` flags compose with the config files key by key, typed by the plugin's Config."""

from __future__ import annotations

import pytest
import torch
import yaml
from cli_helpers import CONFIGS, fit_args, run_rlm

from rlm.cli.merge import merge_configs
from rlm.cli.override import apply_plugin_flags, split_plugin_args
from rlm.plugin.base import make_config
from rlm.plugin.options import parse_option
from rlm.plugin.registry import resolve

PKM = CONFIGS / "plugins" / "pkm.yaml"


def _apply(cfg, argv):
    flags, rest = split_plugin_args(argv)
    assert rest == ["--trainer.max_steps=1"]
    return apply_plugin_flags(cfg, flags)["model"]["plugins"]


def test_dotted_flags_merge_key_by_key_into_the_fragment():
    cfg = merge_configs([PKM])
    plugins = _apply(
        cfg,
        ["--model.plugins.pkm.mode=add", "--trainer.max_steps=1", "--model.plugins.pkm.topk", "8"],
    )
    expected = {**cfg["model"]["plugins"]["pkm"], "mode": "add", "topk": 8}
    assert plugins == {"pkm": expected}
    assert cfg["model"]["plugins"]["pkm"]["mode"] == "replace"  # the input is not changed


def test_json_flag_keeps_the_plugins_of_the_config_files_and_flags_apply_in_order():
    cfg = merge_configs([PKM])
    plugins = _apply(
        cfg,
        [
            "--model.plugins.pkm.n_keys=64",
            "--model.plugins",
            '{"tokenid": {"rank": 2}, "pkm": {"heads": 2}}',
            "--trainer.max_steps=1",
            "--model.plugins.pkm.heads=1",
        ],
    )
    assert plugins["tokenid"] == {"rank": 2}
    assert plugins["pkm"] == {**cfg["model"]["plugins"]["pkm"], "n_keys": 64, "heads": 1}
    disabled = _apply(cfg, ["--model.plugins.pkm=null", "--trainer.max_steps=1"])
    assert disabled == {"pkm": None}


def test_flags_are_typed_by_the_plugin_config():
    plugins = _apply(
        {},
        [
            "--model.plugins.tokenid.rank=2",
            "--model.plugins.moe.capacity_factor=1.5",
            "--model.plugins.moe.expert_hidden=null",
            "--model.plugins.pkm.gated=no",
            "--model.plugins.pkm.sparse=true",
            "--model.plugins.pkm.layers=[0, 1]",
            "--trainer.max_steps=1",
        ],
    )
    assert plugins["tokenid"] == {"rank": 2} and type(plugins["tokenid"]["rank"]) is int
    assert plugins["moe"] == {"capacity_factor": 1.5, "expert_hidden": None}
    assert plugins["pkm"] == {"gated": False, "sparse": True, "layers": [0, 1]}
    assert _apply({}, ["--model.plugins.pkm.sparse=auto", "--trainer.max_steps=1"])["pkm"]["sparse"] == "auto"


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--model.plugins.pkm.gated=off", "gated must be a bool (true/false/1/0/yes/no)"),
        ("--model.plugins.tokenid.rank=two", "rank must be an integer, got 'two'"),
        ("--model.plugins.moe.capacity_factor=big", "capacity_factor must be a number, got 'big'"),
        ("--model.plugins.pkm.colour=red", "has no option 'colour'; accepted: "),
        ("--model.plugins={not json", "is not valid YAML/JSON"),
    ],
)
def test_bad_flags_name_the_option_and_what_is_accepted(flag, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        _apply({}, [flag, "--trainer.max_steps=1"])


@pytest.mark.parametrize(
    ("plugin", "options", "message"),
    [
        (
            "moe",
            {"capacity_factor": "big"},
            "plugin 'moe': option capacity_factor must be a number, got 'big'",
        ),
        (
            "retrieval",
            {"target_recall": "x"},
            "plugin 'retrieval': option target_recall must be a number or null, got 'x'",
        ),
        ("pkm", {"gated": "off"}, "option gated must be a bool"),
        ("tokenid", {"rank": "2"}, "option rank must be an integer, got '2'"),
    ],
)
def test_config_values_of_the_wrong_type_name_the_option(plugin, options, message):
    with pytest.raises(ValueError, match=message):
        make_config(resolve(plugin), options)


def test_parse_option_accepts_only_bool_words():
    for word, value in [
        ("true", True),
        ("Yes", True),
        ("1", True),
        ("false", False),
        ("no", False),
        ("0", False),
    ]:
        assert parse_option("p", "x", word, bool) is value
    for word in ("off", "on", "2", ""):
        with pytest.raises(ValueError, match="must be a bool"):
            parse_option("p", "x", word, bool)


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
        "--trainer.max_steps=1",
    ]
    run_rlm(args, tmp_path, rlm_cache)
    want = {**merge_configs([PKM])["model"]["plugins"]["pkm"], "layers": [1], "n_keys": 16, "topk": 4}
    want["query_norm"] = "none"
    hp = torch.load(tmp_path / "runs/test/ckpt/last.ckpt", map_location="cpu", weights_only=False)
    assert hp["hyper_parameters"]["plugins"] == {"pkm": want, "tokenid": {"rank": 2}}
    saved = yaml.safe_load((tmp_path / "runs/test/version_0/config.yaml").read_text())
    assert saved["model"]["plugins"] == {"pkm": want, "tokenid": {"rank": 2}}
    pkm_keys = [k for k in hp["state_dict"] if ".ffn_add.0." in k]  # mode add on layer 1
    assert pkm_keys and not any(".norm." in k for k in pkm_keys), pkm_keys  # trained without batch norm
