"""The module paths issue 27 moved stay importable for one release: a DeprecationWarning naming the new path,
and the very same objects (saved configs' class_path, checkpoints' hyperparameters and pickles name them)."""

from __future__ import annotations

import importlib
import pickle
import sys

import pytest

# old path -> (new path, a name it held, private names included where tests or users reach them)
MOVED = {
    "rlm.lightning": ("rlm.train.module", "LMModule"),
    "rlm.checkpoint": ("rlm.train.checkpoint", "load_checkpoint_file"),
    "rlm.resume": ("rlm.train.resume", "_get"),
    "rlm.guard": ("rlm.train.guard", "NonFiniteGuard"),
    "rlm.throughput": ("rlm.train.throughput", "Throughput"),
    "rlm.parallel": ("rlm.train.parallel", "parallelize"),
    "rlm.strategy": ("rlm.train.strategy", "prepare_trainer"),
    "rlm.evaluate": ("rlm.eval.evaluate", "with_checkpoint_settings"),
    "rlm.generate": ("rlm.eval.generate", "sample"),
    "rlm.config_merge": ("rlm.cli.merge", "merge_configs"),
    "rlm.config_override": ("rlm.cli.override", "apply_plugin_flags"),
    "rlm.config_check": ("rlm.cli.check", "check_writable"),
    "rlm.cli_support": ("rlm.cli.support", "link_vocab"),
    "rlm.lightning_cli": ("rlm.cli.lightning_cli", "RLMCLI"),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_warns_and_gives_the_same_object(old):
    new, name = MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated .* moved to {new}"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    assert name in dir(module)
    with pytest.raises(AttributeError, match=f"moved to {new}"):
        module.no_such_name  # noqa: B018


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_config_diffing_resolves_from_both_old_homes():
    import rlm.lightning
    import rlm.resume
    from rlm.train import diff

    assert rlm.lightning.config_diff is diff.config_diff and rlm.lightning._normalise is diff._normalise
    assert rlm.resume.dict_diff is diff.dict_diff and rlm.resume._plain is diff._plain


def test_old_class_paths_and_pickles_load():
    from jsonargparse import ArgumentParser

    from rlm.train.module import LMModule, OptimConfig

    parser = ArgumentParser()
    parser.add_argument("--module", type=type)
    assert parser.parse_args(["--module", "rlm.lightning.LMModule"]).module is LMModule
    # A pickle written before the move names rlm.lightning.OptimConfig.
    # Protocol 0 writes the module name as a line of text, so it can be swapped here.
    data = pickle.dumps(OptimConfig(lr=1e-3), protocol=0).replace(b"rlm.train.module", b"rlm.lightning")
    assert b"rlm.lightning" in data
    assert pickle.loads(data) == OptimConfig(lr=1e-3)


def test_rlm_cli_names_still_resolve():
    import rlm.cli
    from rlm.cli import commands, lightning_cli

    assert rlm.cli.main is commands.main and rlm.cli.COMMANDS is commands.COMMANDS
    assert rlm.cli.RLMCLI is lightning_cli.RLMCLI
    with pytest.raises(AttributeError):
        rlm.cli.no_such_name  # noqa: B018
