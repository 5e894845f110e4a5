"""Stacked config files compose: plugin dicts merge by name, in any order, with includes."""

import itertools
from pathlib import Path

import pytest

from rlm.cli.merge import merge_configs, split_config_args

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_plugin_fragments_merge_by_name_in_any_order(tmp_path):
    base = _write(tmp_path, "base.yaml", "model:\n  model:\n    d_model: 64\n")
    a = _write(tmp_path, "a.yaml", "model:\n  plugins:\n    tokenid:\n      layers: [0]\n")
    b = _write(tmp_path, "b.yaml", "model:\n  plugins:\n    moe:\n      layers: [1]\n")
    results = [merge_configs([base, *order]) for order in itertools.permutations([a, b])]
    assert results[0] == results[1]
    assert results[0]["model"]["plugins"] == {"tokenid": {"layers": [0]}, "moe": {"layers": [1]}}
    assert results[0]["model"]["model"]["d_model"] == 64


def test_later_file_overrides_and_null_disables(tmp_path):
    a = _write(tmp_path, "a.yaml", "model:\n  plugins:\n    tokenid:\n      layers: [0]\n      rank: 0\n")
    b = _write(tmp_path, "b.yaml", "model:\n  plugins:\n    tokenid:\n      rank: 2\n")
    off = _write(tmp_path, "off.yaml", "model:\n  plugins:\n    tokenid: null\n")
    assert merge_configs([a, b])["model"]["plugins"]["tokenid"] == {"layers": [0], "rank": 2}
    assert merge_configs([a, off])["model"]["plugins"]["tokenid"] is None


def test_include_and_interpolation(tmp_path):
    (tmp_path / "sub").mkdir()
    _write(tmp_path, "sub/data.yaml", "data:\n  seq_len: 128\n")
    top = _write(tmp_path, "top.yaml", "include: [sub/data.yaml]\ntrainer:\n  max_steps: ${data.seq_len}\n")
    assert merge_configs([top]) == {"data": {"seq_len": 128}, "trainer": {"max_steps": 128}}


def test_include_cycle_and_missing_file(tmp_path):
    _write(tmp_path, "x.yaml", "include: [y.yaml]\n")
    _write(tmp_path, "y.yaml", "include: [x.yaml]\n")
    with pytest.raises(ValueError, match="config include cycle"):
        merge_configs([tmp_path / "x.yaml"])
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        merge_configs([tmp_path / "nope.yaml"])


def test_split_config_args():
    configs, rest = split_config_args(
        ["--config", "a.yaml", "--trainer.max_steps=3", "-c", "b.yaml", "--config=c.yaml"]
    )
    assert configs == ["a.yaml", "b.yaml", "c.yaml"]
    assert rest == ["--trainer.max_steps=3"]


def test_shipped_default_config_resolves():
    cfg = merge_configs([REPO / "configs" / "default.yaml"])
    assert {"model", "data", "trainer"} <= set(cfg)
    assert cfg["model"]["model"]["d_model"] == 256


def test_the_wandb_fragment_keeps_checkpoints_under_the_csv_logger():
    """configs/logger/wandb.yaml adds W&B after the CSV and TensorBoard loggers: Lightning puts checkpoints under
    the first logger, so they stay in DIR/version_N/checkpoints; W&B uploads no checkpoint."""
    from rlm.cli.merge import merge_configs

    root = Path(__file__).resolve().parents[2] / "configs"
    plain = merge_configs([root / "default.yaml"])["trainer"]["logger"]
    cfg = merge_configs([root / "default.yaml", root / "logger" / "wandb.yaml"])["trainer"]["logger"]
    assert cfg[:2] == plain and len(cfg) == 3
    assert cfg[2]["class_path"] == "pytorch_lightning.loggers.WandbLogger"
    assert cfg[2]["init_args"]["log_model"] is False
