"""The light ``rlm`` front: help, version and the plugin listing import neither torch nor Lightning."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import json
import os
import re
import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest
import torch
from cli_helpers import CONFIGS, TINY

from rlm.cli import main
from rlm.plugin import registry
from rlm.plugin.catalog import field_docs, plugin_table

HEAVY = ("torch", "pytorch_lightning", "lightning", "datasets", "matplotlib")


def test_help_version_and_plugin_list_import_no_torch():
    # A fresh interpreter: this test process has torch imported already.
    code = (
        "import sys\n"
        "from rlm.cli import main\n"
        "assert main(['--help']) == 0 and main(['--version']) == 0 and main(['plugins']) == 0\n"
        f"print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out, out
    assert "plugins" in out and "tokenid" in out


def test_subcommand_help_and_experiment_status_import_no_torch(tmp_path):
    # A fresh interpreter; every command below stops before its work, so none needs torch, Lightning or faiss.
    heavy = (*HEAVY, "faiss")
    commands = [["eval", "--help"], ["generate", "--help"], ["knnlm", "build", "--help"], ["export", "--help"],
                ["index", "--help"], ["index", "build", "--help"], ["experiment", "--help"], ["experiment", "check", "--help"], ["experiment", "status", str(tmp_path)],
                ["generate", "--ckpt", "x.ckpt", "--top-p", "0"]]  # fmt: skip
    code = (
        "import sys\n"
        "from rlm.cli import main\n"
        f"for args in {commands!r}:\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in run.stdout, run.stdout
    assert "usage: rlm generate" in run.stdout and "usage: rlm experiment check" in run.stdout
    assert (
        "is not an experiment directory" in run.stderr and "--top-p 0.0; accepted: 0 < p <= 1" in run.stderr
    )


def test_plugin_options_experiment_check_and_status_import_no_torch(tmp_path):
    # A fresh interpreter. A built-in plugin's options are read from its source: no torch. The structure pass of
    # `experiment check` needs neither Lightning nor what it pulls in (torchmetrics -> transformers), nor faiss.
    from rlm.experiment.spec import load_experiment

    (tmp_path / "e.yaml").write_text(
        json.dumps({"base": [str(p) for p in TINY], "variants": {"baseline": {}}})
    )
    exp = load_experiment(tmp_path / "e.yaml")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "experiment.json").write_text(json.dumps(exp.to_json()))
    (tmp_path / "bad.yaml").write_text("variants: [a, b]\n")
    heavy = (
        "torch",
        "pytorch_lightning",
        "lightning",
        "lightning_fabric",
        "torchmetrics",
        "transformers",
        "faiss",
    )
    names = sorted(registry.BUILTIN)
    commands = [*(["plugins", n] for n in names), ["experiment", "status", str(tmp_path / "out")],
                ["experiment", "check", str(tmp_path / "bad.yaml")]]  # fmt: skip
    code = (
        "import sys\n"
        "from rlm.cli import main\n"
        f"codes = [main(args) for args in {commands!r}]\n"
        f"print('CODES', codes, 'HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert f"CODES {[0] * (len(names) + 1) + [2]} HEAVY []" in run.stdout, run.stdout[-2000:] + run.stderr
    assert "baseline" in run.stdout and "variants: expected a non-empty mapping" in run.stderr


def typed_commands() -> list[tuple[str, object]]:
    """Every command of the table that is not LightningCLI's, subcommands apart: (its prog, its function)."""
    from rlm.cli.commands import COMMANDS, command_target, run_lightning

    found = []
    for name in COMMANDS:
        target = command_target(name)
        if target is run_lightning:
            continue
        for sub, fn in target.items() if isinstance(target, dict) else [("", target)]:
            found.append((f"rlm {name} {sub}".strip(), fn))
    return found


TYPED = typed_commands()


@pytest.mark.parametrize(("prog", "fn"), TYPED, ids=[prog for prog, _ in TYPED])
def test_every_command_help_lists_every_parameter_of_its_function(prog, fn, capsys):
    """The table and the parsers cannot drift: each command's --help shows each parameter of its function, as a
    positional or as the flag users type, with the description its docstring gives."""
    with pytest.raises(SystemExit) as stop:
        main([*prog.split()[1:], "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and out.startswith(f"usage: {prog} ")
    doc = inspect.getdoc(fn)
    for name, param in inspect.signature(fn).parameters.items():
        positional = param.kind is param.POSITIONAL_OR_KEYWORD and param.default is param.empty
        shown = name if positional else "--" + name.replace("_", "-")
        assert re.search(rf"(?<![\w-]){re.escape(shown)}(?![\w-])", out), (prog, shown)
        assert re.search(rf"^ +{name}: \S", doc, re.MULTILINE), f"{prog}: {name} has no description"


def test_every_group_help_lists_its_subcommands(capsys):
    from rlm.cli.commands import COMMANDS, command_target

    groups = {name: command_target(name) for name in COMMANDS if isinstance(command_target(name), dict)}
    assert sorted(groups) == ["experiment", "index", "knnlm"]
    for name, group in groups.items():
        assert main([name, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: rlm {name} COMMAND") and all(f"\n  {sub} " in out for sub in group)
        assert main([name, "nope"]) == 2
        assert (
            f"rlm {name}: error: unknown command 'nope'; known commands: {', '.join(group)}"
            in capsys.readouterr().err
        )


def test_a_device_left_out_is_the_gpu_when_torch_sees_one(monkeypatch):
    from rlm.cli.commands import cmd_eval, function_parser
    from rlm.eval.knnlm_cli import cmd_build, device_arg

    assert function_parser("rlm eval", cmd_eval).parse_args(["--ckpt", "x"]).device is None
    assert (
        function_parser("rlm knnlm build", cmd_build).parse_args(["--ckpt", "x", "--out", "y"]).device is None
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_arg(None) == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_arg(None) == "cpu"


def test_threads_are_limited_unless_omp_num_threads_is_set(monkeypatch):
    from rlm.cli.commands import limit_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(7)
        limit_threads()
        assert torch.get_num_threads() == 7  # the user's setting wins
        monkeypatch.delenv("OMP_NUM_THREADS")
        limit_threads()
        assert torch.get_num_threads() == 4
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
        limit_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_version_is_the_distribution_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rlm {importlib.metadata.version('rlm')}"


def test_plugins_lists_every_builtin_with_its_docstring(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for name, target in registry.BUILTIN.items():
        first = registry.load_class(target).__doc__.strip().split("\n")[0]
        assert any(line.startswith(name) and first in line for line in out.splitlines()), name


@pytest.mark.parametrize("name", sorted(registry.BUILTIN))
def test_plugin_options_show_type_default_and_docstring(name, capsys):
    assert main(["plugins", name]) == 0
    out = capsys.readouterr().out
    config = registry.resolve(name).Config
    docs = field_docs(config)
    for f in dataclasses.fields(config):
        assert f.name in docs, f"{name}.{f.name} has no docstring"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert f"  {f.name}: {f.type} = {default!r}\n      {docs[f.name]}" in out


def test_field_docs_include_inherited_fields():
    moe = registry.resolve("moe").Config
    docs = field_docs(moe)
    assert docs["num_experts"] == "Number of experts N."
    assert docs["top_k"].startswith("Entries per token")  # declared on the base LookupOptions


def test_entry_point_plugins_are_listed_and_described(monkeypatch, capsys):
    eps = {
        "everyslot": EntryPoint("everyslot", "everyslot_plugin:EverySlotPlugin", registry.ENTRY_POINT_GROUP),
        "broken": EntryPoint("broken", "no_such_module_xyz:Plugin", registry.ENTRY_POINT_GROUP),
    }
    monkeypatch.setattr(registry, "_entry_points", lambda: eps)
    rows = {name: (source, desc) for name, source, desc in plugin_table()}
    assert rows["everyslot"][0] == "entry point everyslot_plugin:EverySlotPlugin"
    assert rows["everyslot"][1].startswith("Claims embed (replace, add)")
    assert rows["broken"][1].startswith("(cannot be imported:")
    assert "tokenid" in rows
    assert main(["plugins", "everyslot"]) == 0
    out = capsys.readouterr().out
    assert "aux_weight: float = 0.5\n      Weight of the plugin's aux loss." in out


def test_unknown_plugin_names_the_known_ones(capsys):
    assert main(["plugins", "nope"]) == 2
    assert "unknown plugin 'nope'; known plugins: [" in capsys.readouterr().err


def test_rlm_cli_main_is_the_command_tables_main():
    import rlm.cli
    from rlm.cli import commands

    assert rlm.cli.main is commands.main
    with pytest.raises(AttributeError):
        rlm.cli.no_such_name  # noqa: B018


def test_fit_help_is_built_once_and_then_printed_without_lightning(tmp_path, monkeypatch, capsys):
    """The first `rlm fit --help` builds LightningCLI's parser (Lightning's import, seconds) and keeps its text; a
    later one, in a fresh interpreter, prints the same text importing neither torch nor Lightning."""
    monkeypatch.setenv("RLM_CACHE", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "100")  # the key holds the terminal's width: the same in both processes
    assert main(["fit", "--help"]) == 0
    built = capsys.readouterr().out
    assert "--trainer.max_steps" in built and "--model.plugins" in built
    assert len(list((tmp_path / "help").glob("fit-*.txt"))) == 1
    code = (
        "import sys\nfrom rlm.cli import main\ncode = main(['fit', '--help'])\n"
        f"print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}), code, file=sys.stderr)\n"
    )
    env = {**os.environ, "RLM_CACHE": str(tmp_path), "COLUMNS": "100"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert run.stdout == built and "HEAVY [] 0" in run.stderr


def test_the_kept_fit_help_is_keyed_by_the_plugins_sources_too(tmp_path, monkeypatch):
    """The help lists every plugin's options, and a source checkout keeps plugins/ beside rlm/: a change there
    must write the help anew."""
    import importlib.util
    import types

    from rlm.cli.commands import _help_file

    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "p.py").write_text("x = 1\n")
    real = importlib.util.find_spec
    fake = types.SimpleNamespace(submodule_search_locations=[str(plugins)])
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: fake if name == "rlm.plugins" else real(name, *a)
    )
    before = _help_file("fit")
    assert _help_file("fit") == before
    (plugins / "p.py").write_text("x = 22\n")
    assert _help_file("fit") != before


# slow: a fresh interpreter checks a valid experiment file, every variant through the real rlm fit parser
@pytest.mark.slow
def test_experiment_check_says_what_it_checks_before_importing_lightning():
    hook = (
        "import sys\n"
        "class Mark:\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'pytorch_lightning':\n"
        "            print('LIGHTNING', file=sys.stderr, flush=True)\n"
        "            sys.meta_path.remove(self)\n"
        "sys.meta_path.insert(0, Mark())\n"
        "from rlm.cli import main\n"
        f"sys.exit(main(['experiment', 'check', {str(CONFIGS / 'experiments' / 'altup.yaml')!r}]))\n"
    )
    run = subprocess.run([sys.executable, "-c", hook], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    said = run.stderr.index("rlm experiment check: 5 variants (baseline, sum, sameup, altup, recycled)")
    assert said < run.stderr.index("LIGHTNING")  # the slow part comes after the first line
    assert "altup" in run.stdout  # the plan, as before


def test_fit_paths_reads_every_checkpoint_callback_even_one_without_model_paths(tmp_path):
    """Lightning's OnExceptionCheckpoint is a Checkpoint without last/best_model_path: the summary skips it."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    from rlm.cli.summary import fit_paths

    saved = ModelCheckpoint(dirpath=tmp_path)
    saved.last_model_path = str(tmp_path / "last.ckpt")
    (tmp_path / "last.ckpt").write_bytes(b"")
    trainer = pl.Trainer(callbacks=[OnExceptionCheckpoint(tmp_path), saved], logger=False, accelerator="cpu")
    assert [type(cb) for cb in trainer.checkpoint_callbacks] == [OnExceptionCheckpoint, ModelCheckpoint]
    assert fit_paths(trainer)["checkpoint"] == tmp_path / "last.ckpt"
