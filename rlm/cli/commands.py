"""The ``rlm`` command: a small table of subcommands.

``fit``, ``validate`` and ``test`` run LightningCLI on the stacked ``--config`` files; every other command is a
typed function whose signature and docstring are its parser (``function_parser``), or a dict of them. torch and
Lightning are imported inside the commands, so ``--help`` and bad arguments cost neither.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import os
import re
import shutil
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from rlm.cli.support import canonical_flags, check_configs, plain_parse_error, quiet_known_noise
from rlm.extras import MissingExtra


def limit_threads() -> None:
    """torch's intra-op threads, unless OMP_NUM_THREADS says otherwise: half the cores this process may use, at
    most 4 (torch's default, every core, oversubscribes a shared machine)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, min(4, cores // 2)))


def _help_file(command: str) -> Path:
    """Where ``rlm COMMAND --help``'s text is kept, keyed by the versions and sources it is built from and the
    terminal's width."""
    import importlib.metadata
    import importlib.util

    h = hashlib.sha256(f"{command};{shutil.get_terminal_size().columns};{sys.version}".encode())
    for dist in ("rlm", "pytorch-lightning", "jsonargparse", "torch"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)};".encode())
        except importlib.metadata.PackageNotFoundError:
            pass
    # the help lists every plugin's options: the plugins' sources (their own folder in a source checkout) count
    roots = {Path(__file__).resolve().parents[1]}
    spec = importlib.util.find_spec("rlm.plugins")
    roots |= {Path(p) for p in (spec.submodule_search_locations or [])} if spec else set()
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        st = path.stat()
        h.update(f"{path}:{st.st_mtime_ns}:{st.st_size};".encode())
    for ep in importlib.metadata.entry_points(group="rlm.plugins"):
        h.update(f"{ep.name}={ep.value}@{ep.dist.version if ep.dist else ''};".encode())
    cache = Path(os.environ.get("RLM_CACHE") or Path.home() / ".cache" / "rlm").expanduser()
    return cache / "help" / f"{command}-{h.hexdigest()[:16]}.txt"


def run_lightning(command: str, args: list[str]) -> int:
    """``rlm fit|validate|test``: check the stacked configs, then run LightningCLI. A bare ``--help`` prints the
    text kept from the last build of the parser (building it imports Lightning: seconds)."""
    if args in (["--help"], ["-h"]):
        saved = _help_file(command)
        if saved.is_file():
            print(saved.read_text(), end="")
            return 0
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            try:
                code = run_lightning(command, ["--help", "--"])  # "--": not this shortcut again
            except SystemExit as stop:
                code = stop.code or 0
        print(text.getvalue(), end="")
        if code == 0 and text.getvalue():
            with contextlib.suppress(OSError):  # a cache that cannot be written: the help is printed anyway
                saved.parent.mkdir(parents=True, exist_ok=True)
                tmp = saved.with_name(f".{saved.name}.{os.getpid()}")
                tmp.write_text(text.getvalue())
                os.replace(tmp, saved)
        return code
    if args == ["--help", "--"]:
        args = ["--help"]
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    from rlm.cli.check import release_run_locks
    from rlm.cli.lightning_cli import RLMCLI
    from rlm.cli.support import help_formatter
    from rlm.data.module import RLMDataModule
    from rlm.train.checkpoint import PREEMPTED
    from rlm.train.module import LMModule
    from rlm.train.strategy import release_process_group

    quiet_known_noise()
    limit_threads()
    layers = check_configs(command, args)
    if command in ("validate", "test"):
        from rlm.eval.evaluate import checkpoint_layer

        args = checkpoint_layer(layers, args)
    try:
        RLMCLI(
            LMModule,
            RLMDataModule,
            args=[command, *args],
            # omegaconf+: ${trainer.default_root_dir} resolves after every file and flag is merged
            parser_kwargs=dict(
                parser_mode="omegaconf+", formatter_class=help_formatter(), exit_on_error=False
            ),
            save_config_kwargs={"overwrite": True},
            seed_everything_default=0,
        )
    except SIGTERMException:  # a SystemExit with code None: it would end a preempted run with exit code 0
        return PREEMPTED
    finally:  # joins gloo's worker threads before Python finalizes (see release_process_group)
        release_process_group()
        release_run_locks()
    return 0


def cmd_generate(
    *,
    ckpt: str,
    prompt: list[str] | None = None,
    prompts_file: str | None = None,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    stop: list[str] | None = None,
    seed: int = 0,
    device: str | None = None,
    no_cache: bool = False,
    datastore: str | None = None,
    knn_k: int | None = None,
    lam: float | None = None,
) -> int:
    """Sample text from a checkpoint.

    Args:
        ckpt: checkpoint written by rlm fit (alias --ckpt_path)
        prompt: text to continue; repeat for a batch of prompts (default: 'def ')
        prompts_file: a text file of prompts, one per line, continued as a batch after any --prompt
        max_new_tokens: tokens to sample after the prompt
        temperature: softmax temperature; 0 is greedy
        top_k: sample among the k most likely tokens; 0: all
        top_p: sample among the most likely tokens whose probabilities sum to p (nucleus); 1: all
        repetition_penalty: tokens already in the text: positive logits / this, negative ones * this; 1: none
        stop: end a sequence once its text contains this string, which is cut; repeatable
        seed: random seed of the sampling
        device: torch device, e.g. cpu or cuda:1 (default: cuda when torch sees a GPU, else cpu)
        no_cache: recompute the whole window for every token instead of the key/value cache
        datastore: sample from kNN-LM with this datastore (rlm knnlm build)
        knn_k: neighbours per token (default: the datastore's)
        lam: kNN-LM interpolation weight (default: tuned)
    """
    stop = stop or []
    for flag, value, low in (("--max-new-tokens", max_new_tokens, 1), ("--top-k", top_k, 0)):
        if value < low:
            raise ValueError(
                f"{flag} {value}; accepted: an integer >= {low}" + (" (0: no top-k cut)" if low == 0 else "")
            )
    if not 0 <= temperature < float("inf"):  # nan fails every comparison
        raise ValueError(f"--temperature {temperature}; accepted: a finite number >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p {top_p}; accepted: 0 < p <= 1 (1: no top-p cut)")
    if not 0 < repetition_penalty < float("inf"):
        raise ValueError(
            f"--repetition-penalty {repetition_penalty}; accepted: a finite number > 0 (1: none)"
        )
    if "" in stop:
        raise ValueError("--stop ''; accepted: a non-empty string")
    prompts = prompt or ([] if prompts_file else ["def "])
    if prompts_file:
        if not os.path.isfile(prompts_file):
            raise ValueError(f"--prompts-file {prompts_file!r} does not exist")
        with open(prompts_file, encoding="utf-8") as f:
            prompts += f.read().splitlines()
    import torch

    from rlm.data.carried import data_settings, tokenizer_file
    from rlm.data.pretrained import load_tokenizer
    from rlm.eval.generate import cut_at, sample_batch, stop_at
    from rlm.eval.knnlm_cli import device_arg
    from rlm.train.checkpoint import load_checkpoint_file
    from rlm.train.module import LMModule

    where = torch.device(device_arg(device))
    if not os.path.isfile(ckpt):
        raise ValueError(f"--ckpt {ckpt!r} does not exist")
    state = load_checkpoint_file(ckpt)  # a damaged file is named, not a traceback
    # the tokenizer the checkpoint carries: generating needs neither the corpus nor its token cache
    tok = load_tokenizer(tokenizer_file(state, ckpt, data_settings(state, ckpt)))
    module = LMModule.load_from_checkpoint(ckpt, map_location=where)
    gen = torch.Generator(device=where).manual_seed(seed)
    mixer = None
    if datastore:
        from rlm.eval.datastore import Datastore
        from rlm.eval.knnlm import Mixer

        ds = Datastore(datastore)
        ds.check_model(module)
        tuned = ds.meta.get("tuning") or {}
        lam = lam if lam is not None else tuned.get("lam", 0.25)
        if not 0 <= lam < 1:
            raise ValueError(f"--lam {lam}; accepted: 0 <= lam < 1")
        mixer = Mixer(ds, lam, tuned.get("temperature", 1.0), knn_k or ds.meta["k"])
    outs = sample_batch(
        module, [[tok.bos_id, *tok.encode(text)] for text in prompts], max_new_tokens, temperature, top_k,
        tok.eos_id, gen, mixer, cache=not no_cache, stop=stop_at(tok.decode, stop) if stop else None,
        top_p=top_p, repetition_penalty=repetition_penalty,
    )  # fmt: skip
    texts = [text + cut_at(tok.decode(out), stop) for text, out in zip(prompts, outs, strict=True)]
    print("\n\n".join(texts))  # several prompts: their samples in order, a blank line between two
    return 0


def cmd_eval(
    *,
    ckpt: str,
    corpus: list[str] | None = None,
    split: Literal["test", "val", "train"] = "test",
    batch_size: int | None = None,
    device: str | None = None,
    json: str | None = None,
    tasks: str | None = None,
    limit: float | None = None,
    num_fewshot: int | None = None,
    tasks_path: str | None = None,
    bootstrap_iters: int = 100000,
    datastore: str | None = None,
    knn_k: int | None = None,
    lam: float | None = None,
    temperature: float | None = None,
    knn_cache: bool = False,
) -> int:
    """Loss, perplexity and bits per byte of a checkpoint with its own tokenizer, on its corpus's split or any text;
    or lm-evaluation-harness tasks (--tasks).

    Args:
        ckpt: checkpoint written by rlm fit
        corpus: evaluate every document of this text (a file, directory, glob, 'stdlib' or hf:NAME) instead
        split: the checkpoint corpus's split to evaluate
        batch_size: windows per batch (default: the run's); with --tasks, requests per batch (default 8)
        device: torch device, e.g. cpu or cuda:1 (default: cuda when torch sees a GPU, else cpu)
        json: also write the results to this JSON file
        tasks: lm-eval (pip install 'rlm[eval]'): comma-separated tasks, e.g. hellaswag,lambada_openai
        limit: lm-eval: examples per task (below 1: a fraction)
        num_fewshot: lm-eval: few-shot examples (default: the task's)
        tasks_path: lm-eval: a folder of your own task YAML files
        bootstrap_iters: lm-eval: bootstrap draws for the stderr of metrics such as perplexity (0: none)
        datastore: kNN-LM: also score kNN-LM with this datastore (rlm knnlm build)
        knn_k: kNN-LM: neighbours per token (default: the datastore's)
        lam: kNN-LM: interpolation weight (default: tuned at build)
        temperature: kNN-LM: softmax temperature (default: tuned)
        knn_cache: kNN-LM: add the evaluated document's own past (the continuous cache)
    """
    from rlm.cli.summary import eval_summary
    from rlm.eval.knnlm_cli import eval_main

    # plain; kNN-LM with --datastore; lm-eval with --tasks
    code = eval_main(types.SimpleNamespace(**locals()))
    if code == 0:  # after the results: the checkpoint and what to run next
        print(eval_summary(ckpt, json))
    return code


def cmd_export(*, ckpt: str, out: str, force: bool = False) -> int:
    """Write a checkpoint as a folder transformers' AutoModelForCausalLM loads after `import rlm.hf`.

    Args:
        ckpt: checkpoint written by rlm fit
        out: the folder to write (new or empty)
        force: replace --out even when it holds other files (never a folder holding --ckpt, nor the current one)
    """
    if not os.path.isfile(ckpt):
        raise ValueError(f"--ckpt {ckpt!r} does not exist")
    from rlm.hf.export import export

    export(ckpt, out, force)
    return 0


def cmd_plugins(name: str | None = None) -> int:
    """List the plugins, or show one's options (rlm plugins NAME).

    Args:
        name: a plugin name: print its options with their defaults and docs
    """
    from rlm.plugin.catalog import describe_plugin, plugin_table

    if name:
        print(describe_plugin(name))
        return 0
    rows = plugin_table()
    width = max((len(row[0]) for row in rows), default=0)
    print("\n".join(f"{name:<{width}}  {desc}  [{source}]" for name, source, desc in rows))
    print("\n`rlm plugins NAME` for a plugin's options; enable one with model.plugins.NAME: {...}.")
    return 0


COMMANDS: dict[str, tuple[Callable[..., int] | str | dict[str, Callable[..., int]], str]] = {
    "fit": (run_lightning, "train a model (LightningCLI; stack --config files)"),
    "validate": (run_lightning, "evaluate on the validation split"),
    "test": (run_lightning, "evaluate on the test split"),
    "eval": (
        cmd_eval,
        "loss, perplexity and bits per byte of a checkpoint on any text, its own tokenizer; "
        "lm-eval tasks (--tasks)",
    ),
    "generate": (cmd_generate, "sample text from a checkpoint"),
    "export": (cmd_export, "a checkpoint as a transformers folder (safetensors, config, tokenizer, card)"),
    "index": ("rlm.index.cli:COMMANDS", "build, search, evaluate and inspect retrieval indices"),
    "knnlm": (
        "rlm.eval.knnlm_cli:COMMANDS",
        "build a kNN-LM datastore from a checkpoint (rlm eval / generate --datastore use it)",
    ),
    "experiment": ("rlm.experiment.cli:COMMANDS", "run plugin comparisons and report them"),
    "plugins": (cmd_plugins, "list the plugins, or show one plugin's options"),
}
"""Each command: run_lightning, a typed function, a dict of them (subcommands), or "module:NAME" naming either."""

THREADED = ("rlm generate", "rlm eval", "rlm knnlm build")  # torch work in this process: limit_threads


def command_target(command: str) -> Any:
    """What COMMANDS runs for ``command``, a "module:NAME" entry imported."""
    target = COMMANDS[command][0]
    if isinstance(target, str):
        module, _, name = target.partition(":")
        target = getattr(importlib.import_module(module), name)
    return target


FLAG_ALIASES = {"ckpt_path": "ckpt"}  # rlm fit's spelling of a checkpoint


def _flag_kind(hint: Any) -> str:
    """'bool' or 'list' for a parameter's type, None left out of an Optional; else ''."""
    parts = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    parts = [p for p in parts if p is not type(None)]
    if parts == [bool]:
        return "bool"
    return "list" if any(typing.get_origin(p) is list for p in parts) else ""


def typed_argv(fn: Callable[..., int], args: list[str]) -> list[str]:
    """``args`` as ``fn``'s jsonargparse parser reads them, from the spellings users type: dashes or underscores
    (``--batch-size``), ``--ckpt_path`` for ``--ckpt``; a bool option alone (``--force``) or negated
    (``--no-gpu``); a list's values one after another (``--corpus a b``) or repeated (``--set x=1 --set y=2``);
    optional positional parameters (before ``*``) given as positionals."""
    params = inspect.signature(fn).parameters
    kinds = {name: _flag_kind(hint) for name, hint in typing.get_type_hints(fn).items()}
    needed = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty]
    optional = [
        n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty
    ]
    out, rest = [], list(args)
    while rest:
        arg = rest.pop(0)
        if arg == "--":  # everything after it is positional
            return out + [arg, *rest]
        positional = arg[:1] != "-" or arg[1:2].isdigit()  # a negative number is a value
        if positional and needed:
            needed.pop(0)
        elif positional and optional:
            arg = f"--{optional.pop(0)}={arg}"
        if positional or arg in ("-h", "--help"):
            out.append(arg)
            continue
        name, eq, value = arg.lstrip("-").partition("=")
        name = name.replace("-", "_")
        name = name if name in params else FLAG_ALIASES.get(name, name)
        if name in optional:
            optional.remove(name)
        if kinds.get(name) == "bool" or (name[:3] == "no_" and kinds.get(name[3:]) == "bool"):
            if not eq:  # --force, --force false
                eq, value = "=", rest.pop(0) if rest and rest[0].lower() in ("true", "false") else "true"
            if name not in params:  # --no-gpu
                name, value = name[3:], str(value.lower() == "false")
            out.append(f"--{name}={value}")
        elif kinds.get(name) == "list":
            values = [value] if eq else []
            while not eq and rest and (rest[0][:1] != "-" or rest[0][1:2].isdigit()):
                values.append(rest.pop(0))
            out += [f"--{name}+={v}" for v in values] or [f"--{name}"]
        else:
            out += [f"--{name}={value}"] if eq or not rest else [f"--{name}", rest.pop(0)]
    return out


def help_formatter() -> type:
    """jsonargparse's help formatter showing options as users type them (``--batch-size``, a bool with no value),
    and a default at the end of its help unless it is None, False or empty, or the help already says it."""
    from jsonargparse import DefaultHelpFormatter

    class Help(DefaultHelpFormatter):
        def _get_help_string(self, action: argparse.Action) -> str:
            text, d = action.help or "", action.default
            hide = d is None or d is False or d in ([], argparse.SUPPRESS) or "default" in text
            return text if hide or not action.option_strings else f"{text} (default: {d})"

        def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
            if _flag_kind(getattr(action, "_typehint", None)) == "bool":
                return ""
            return super()._format_args(action, default_metavar)

        def format_help(self) -> str:
            text = re.sub(r"(?<![\w-])--\w+", lambda m: m[0].replace("_", "-"), super().format_help())
            return text.replace(" ]", "]")  # a bool option's empty value in the usage line

    return Help


def function_parser(prog: str, fn: Callable[..., int]) -> Any:
    """The jsonargparse parser of ``fn``: its parameters, types, defaults and docstring descriptions."""
    from jsonargparse import ArgumentParser

    doc = inspect.getdoc(fn) or ""
    parser = ArgumentParser(
        prog=prog,
        description=doc.split("\nArgs:")[0].strip(),
        formatter_class=help_formatter(),
        exit_on_error=False,
    )
    parser.add_function_arguments(fn, as_group=False, as_positional=True)
    for action in parser._actions:  # --corpus+ (typed_argv's way to give a list) parses, but is not shown
        action.option_strings = [s for s in action.option_strings if not s.endswith("+")]
    return parser


def call(prog: str, fn: Callable[..., int], args: list[str]) -> int:
    """``fn`` on ``args`` parsed by its parser: ``--help`` and bad arguments stop before it runs (ValueError)."""
    try:
        cfg = function_parser(prog, fn).parse_args(typed_argv(fn, args))
    except argparse.ArgumentError as err:
        message = plain_parse_error(str(err))
        for name, p in inspect.signature(fn).parameters.items():  # as users type them: top_k -> --top-k
            if p.default is not p.empty or p.kind is p.KEYWORD_ONLY:
                message = re.sub(rf"(?<![\w-])(--)?{name}\b(?=:|,|$)", "--" + name.replace("_", "-"), message)
        raise ValueError(message) from None
    if prog in THREADED:
        limit_threads()
    return fn(**cfg.as_dict())


def usage(prog: str = "rlm", group: dict[str, Callable[..., int]] | None = None) -> str:
    """The help text of ``rlm``, or of a group of subcommands such as ``rlm index``."""
    if group is None:
        rows = {name: help_ for name, (_, help_) in COMMANDS.items()}
    else:
        rows = {name: (inspect.getdoc(fn) or "").split("\n")[0] for name, fn in group.items()}
    lines = [f"usage: {prog} {'[--version] ' if group is None else ''}COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, help_ in rows.items()]
    lines += ["", f"`{prog} COMMAND --help` for a command's options."]
    return "\n".join(lines)


def version() -> str:
    """The installed distribution's version, else (a checkout that is not installed) the package's own."""
    import importlib.metadata

    try:
        return importlib.metadata.version("rlm")
    except importlib.metadata.PackageNotFoundError:
        return importlib.import_module("rlm").__version__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rlm`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"rlm {version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"rlm: unknown command {command!r}; known commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    prog = f"rlm {command}"
    try:
        target = command_target(command)
        if target is run_lightning:
            return run_lightning(command, canonical_flags(command, rest))
        if isinstance(target, dict) and rest[:1] and rest[0] in target:  # a subcommand
            prog, target, rest = f"{prog} {rest[0]}", target[rest[0]], rest[1:]
        if not isinstance(target, dict):
            return call(prog, target, rest)
        if rest[:1] in (["-h"], ["--help"]):
            print(usage(prog, target))
            return 0
        given = f"unknown command {rest[0]!r}" if rest else "a command is needed"
        raise ValueError(f"{given}; known commands: {', '.join(target)}")
    except (ValueError, OSError, MissingExtra) as err:  # OSError: disk full, read-only folder (path named)
        if os.environ.get("RLM_DEBUG"):
            raise
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
