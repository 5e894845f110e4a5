"""The ``rlm`` command: a small table of subcommands.

``fit``, ``validate`` and ``test`` run LightningCLI on the stacked ``--config`` files; ``generate``
samples from a checkpoint; ``index`` and ``experiment`` hand over to their own parsers; ``plugins`` lists the
plugins and their options. torch and Lightning are imported inside the commands, not at module level.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from rlm.extras import MissingExtra
from rlm.outdir import FORCE_HELP

# torch and Lightning are imported inside the commands: `rlm --help` and `rlm plugins` stay fast.


def limit_threads() -> None:
    """torch's intra-op threads for a command's CPU work, unless OMP_NUM_THREADS says otherwise: half the cores
    this process may use, at most 4. torch's default (every core) oversubscribes a machine shared with other
    work, where small models' steps then wait on each other's threads."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, min(4, cores // 2)))


def _help_file(command: str) -> Path:
    """Where ``rlm COMMAND --help``'s text is kept: keyed by the versions and the rlm sources it is built from, and
    the terminal's width, so any change to them writes it anew."""
    import hashlib
    import importlib.metadata
    import shutil

    h = hashlib.sha256(f"{command};{shutil.get_terminal_size().columns};{sys.version}".encode())
    for dist in ("rlm", "pytorch-lightning", "jsonargparse", "torch"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)};".encode())
        except importlib.metadata.PackageNotFoundError:
            pass
    for path in sorted(
        Path(__file__).resolve().parents[1].rglob("*.py")
    ):  # rlm/: the model's and data's options
        st = path.stat()
        h.update(f"{path}:{st.st_mtime_ns}:{st.st_size};".encode())
    cache = Path(os.environ.get("RLM_CACHE") or Path.home() / ".cache" / "rlm").expanduser()
    return cache / "help" / f"{command}-{h.hexdigest()[:16]}.txt"


def run_lightning(command: str, args: list[str]) -> int:
    """``rlm fit|validate|test``: merge the stacked configs, then run LightningCLI. A bare ``--help`` prints the
    text the last build of the same parser printed (building it imports Lightning, seconds before any output)."""
    if args in (["--help"], ["-h"]):
        saved = _help_file(command)
        if saved.is_file():
            print(saved.read_text(), end="")
            return 0
        import contextlib
        import io

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
    from rlm.cli.lightning_cli import RLMCLI
    from rlm.cli.support import (
        check_plugin_names,
        config_layers,
        help_formatter,
        quiet_known_noise,
        refuse_optimizer_options,
        require_class_extras,
    )
    from rlm.data.module import RLMDataModule
    from rlm.train.module import LMModule

    quiet_known_noise()
    limit_threads()
    layers = config_layers(
        args
    )  # each --config file read as YAML, for the checks below (a clear error first)
    refuse_optimizer_options(command, layers, args)
    check_plugin_names(layers, args)
    require_class_extras(layers, args)
    if command in ("validate", "test"):
        from rlm.eval.evaluate import checkpoint_layer

        args = checkpoint_layer(layers, args)
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    from rlm.cli.check import release_run_locks
    from rlm.train.checkpoint import PREEMPTED
    from rlm.train.strategy import release_process_group

    try:
        RLMCLI(
            LMModule,
            RLMDataModule,
            args=[command, *args],
            # omegaconf+: ${trainer.default_root_dir} resolves after every file and flag is merged
            parser_kwargs={
                "parser_mode": "omegaconf+",
                "formatter_class": help_formatter(),
                "exit_on_error": False,
            },
            save_config_kwargs={"overwrite": True},
            seed_everything_default=0,
        )
    except SIGTERMException:  # a SystemExit with code None: it would end a preempted run with exit code 0
        return PREEMPTED
    finally:  # joins gloo's worker threads before Python finalizes (see release_process_group)
        release_process_group()
        release_run_locks()
    return 0


def run_generate(command: str, args: list[str]) -> int:
    """``rlm generate --ckpt PATH --prompt TEXT``: sample a continuation of each prompt."""
    from rlm.eval.knnlm_cli import DEVICE_HELP, device_arg

    p = argparse.ArgumentParser(prog="rlm generate", description="Sample text from a checkpoint.")
    p.add_argument("--ckpt", required=True, help="checkpoint written by rlm fit (alias --ckpt_path)")
    p.add_argument("--prompt", action="append", default=None,
                   help="text to continue; repeat for a batch of prompts (default: 'def ')")  # fmt: skip
    p.add_argument("--prompts-file", default=None,
                   help="a text file of prompts, one per line, continued as a batch after any --prompt")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="tokens to sample after the prompt (default: %(default)s)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0 is greedy (default: %(default)s)")  # fmt: skip
    p.add_argument("--top-k", type=int, default=50,
                   help="sample among the k most likely tokens; 0: all (default: %(default)s)")  # fmt: skip
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probabilities sum to p (nucleus); 1: all "
                        "(default: %(default)s)")  # fmt: skip
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the positive logits of tokens already in the text by this, multiply the negative "
                        "ones (CTRL's rule); 1: none (default: %(default)s)")  # fmt: skip
    p.add_argument("--stop", action="append", default=[],
                   help="end a sequence once its text contains this string, which is cut; repeatable")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling (default: %(default)s)")
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole window for every token instead of the key/value cache")  # fmt: skip
    p.add_argument(
        "--datastore", default=None, help="sample from kNN-LM with this datastore (rlm knnlm build)"
    )
    p.add_argument("--knn-k", type=int, default=None, help="neighbours per token (default: the datastore's)")
    p.add_argument("--lam", type=float, default=None, help="kNN-LM interpolation weight (default: tuned)")
    a = p.parse_args(args)
    for flag, value, low in (("--max-new-tokens", a.max_new_tokens, 1), ("--top-k", a.top_k, 0)):
        if value < low:
            p.error(
                f"{flag} {value}; accepted: an integer >= {low}" + (" (0: no top-k cut)" if low == 0 else "")
            )
    if not 0 <= a.temperature < float("inf"):  # nan fails every comparison
        p.error(f"--temperature {a.temperature}; accepted: a finite number >= 0 (0: greedy)")
    if not 0 < a.top_p <= 1:
        p.error(f"--top-p {a.top_p}; accepted: 0 < p <= 1 (1: no top-p cut)")
    if not 0 < a.repetition_penalty < float("inf"):
        p.error(f"--repetition-penalty {a.repetition_penalty}; accepted: a finite number > 0 (1: none)")
    if "" in a.stop:
        p.error("--stop ''; accepted: a non-empty string")
    prompts = a.prompt or ([] if a.prompts_file else ["def "])
    if a.prompts_file:
        if not os.path.isfile(a.prompts_file):
            p.error(f"--prompts-file {a.prompts_file!r} does not exist")
        with open(a.prompts_file, encoding="utf-8") as f:
            prompts += f.read().splitlines()
    import torch

    from rlm.data.carried import data_settings, tokenizer_file
    from rlm.data.pretrained import load_tokenizer
    from rlm.eval.generate import cut_at, sample_batch, stop_at
    from rlm.train.module import LMModule

    limit_threads()
    device = torch.device(device_arg(a.device))
    if not os.path.isfile(a.ckpt):
        p.error(f"--ckpt {a.ckpt!r} does not exist")
    from rlm.train.checkpoint import load_checkpoint_file

    ckpt = load_checkpoint_file(a.ckpt)  # a damaged file is named, not a traceback
    # the tokenizer the checkpoint carries: generating needs neither the corpus nor its token cache
    tok = load_tokenizer(tokenizer_file(ckpt, a.ckpt, data_settings(ckpt, a.ckpt)))
    module = LMModule.load_from_checkpoint(a.ckpt, map_location=device)
    gen = torch.Generator(device=device).manual_seed(a.seed)
    mixer = None
    if a.datastore:
        from rlm.eval.datastore import Datastore
        from rlm.eval.knnlm import Mixer

        ds = Datastore(a.datastore)
        ds.check_model(module)
        tuned = ds.meta.get("tuning") or {}
        lam = a.lam if a.lam is not None else tuned.get("lam", 0.25)
        if not 0 <= lam < 1:
            p.error(f"--lam {lam}; accepted: 0 <= lam < 1")
        mixer = Mixer(ds, lam, tuned.get("temperature", 1.0), a.knn_k or ds.meta["k"])
    outs = sample_batch(
        module, [[tok.bos_id, *tok.encode(text)] for text in prompts], a.max_new_tokens, a.temperature, a.top_k,
        tok.eos_id, gen, mixer, cache=not a.no_cache, stop=stop_at(tok.decode, a.stop) if a.stop else None,
        top_p=a.top_p, repetition_penalty=a.repetition_penalty,
    )  # fmt: skip
    texts = [text + cut_at(tok.decode(out), a.stop) for text, out in zip(prompts, outs, strict=True)]
    print("\n\n".join(texts))  # several prompts: their samples in order, a blank line between two
    return 0


def run_eval(command: str, args: list[str]) -> int:
    """``rlm eval --ckpt PATH [--corpus X | --tasks T1,T2]``: loss, perplexity and bits per byte with the model's
    tokenizer, or lm-evaluation-harness tasks."""
    # eval_main: plain; kNN-LM with --datastore; lm-eval with --tasks
    from rlm.eval.knnlm_cli import eval_main, eval_parser

    a = eval_parser().parse_args(args)  # --help and usage errors before torch is imported
    limit_threads()
    code = eval_main(args)
    if code == 0:  # the results are printed above; then the checkpoint and what to run next
        from rlm.cli.summary import eval_summary

        print(eval_summary(a.ckpt, a.json))
    return code


def run_knnlm(command: str, args: list[str]) -> int:
    """``rlm knnlm build|info``."""
    from rlm.eval.knnlm_cli import main as knnlm_main
    from rlm.eval.knnlm_cli import parser

    if parser().parse_args(args).action == "build":  # --help and usage errors first, without torch
        limit_threads()
    return knnlm_main(args)


def run_export(command: str, args: list[str]) -> int:
    """``rlm export --ckpt PATH --out DIR [--force]``: a folder transformers loads (after ``import rlm.hf``)."""
    p = argparse.ArgumentParser(
        prog="rlm export",
        description="Write a checkpoint as model.safetensors + config.json + tokenizer + README.md (and a "
        "retriever's index) that transformers' AutoModelForCausalLM loads after `import rlm.hf`.",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint written by rlm fit")
    p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    a = p.parse_args(args)
    if not os.path.isfile(a.ckpt):
        p.error(f"--ckpt {a.ckpt!r} does not exist")
    from rlm.hf.export import export

    export(a.ckpt, a.out, a.force)
    return 0


def run_index(command: str, args: list[str]) -> int:
    """``rlm index build|search|eval|info``."""
    from rlm.index.cli import main as index_main

    return index_main(args) or 0


def run_experiment(command: str, args: list[str]) -> int:
    """``rlm experiment run|report``."""
    from rlm.experiment import main as experiment_main

    return experiment_main(args) or 0


def run_plugins(command: str, args: list[str]) -> int:
    """``rlm plugins [NAME]``: list the plugins, or print one plugin's options."""
    from rlm.plugin.catalog import describe_plugin, plugin_table

    p = argparse.ArgumentParser(prog="rlm plugins", description="List the plugins, or show one's options.")
    p.add_argument("name", nargs="?", help="a plugin name: print its options with their defaults and docs")
    a = p.parse_args(args)
    if a.name:
        print(describe_plugin(a.name))
    else:
        rows = plugin_table()
        width = max((len(name) for name, _, _ in rows), default=0)
        print("\n".join(f"{name:<{width}}  {desc}  [{source}]" for name, source, desc in rows))
        print("\n`rlm plugins NAME` for a plugin's options; enable one with model.plugins.NAME: {...}.")
    return 0


COMMANDS: dict[str, tuple[Callable[[str, list[str]], int], str]] = {
    "fit": (run_lightning, "train a model (LightningCLI; stack --config files)"),
    "validate": (run_lightning, "evaluate on the validation split"),
    "test": (run_lightning, "evaluate on the test split"),
    "eval": (
        run_eval,
        "loss, perplexity and bits per byte of a checkpoint on any text, its own tokenizer; "
        "lm-eval tasks (--tasks)",
    ),
    "generate": (run_generate, "sample text from a checkpoint"),
    "export": (run_export, "a checkpoint as a transformers folder (safetensors, config, tokenizer, card)"),
    "index": (run_index, "build, search, evaluate and inspect retrieval indices"),
    "knnlm": (
        run_knnlm,
        "build a kNN-LM datastore from a checkpoint (rlm eval / generate --datastore use it)",
    ),
    "experiment": (run_experiment, "run plugin comparisons and report them"),
    "plugins": (run_plugins, "list the plugins, or show one plugin's options"),
}


def usage() -> str:
    """The top-level help text."""
    lines = ["usage: rlm [--version] COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`rlm COMMAND --help` for a command's options."]
    return "\n".join(lines)


def version() -> str:
    """The installed distribution's version (the package's own when run from a source tree)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("rlm")
    except PackageNotFoundError:
        from rlm import __version__

        return __version__


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
    from rlm.cli.support import canonical_flags

    try:
        return COMMANDS[command][0](command, canonical_flags(command, rest))
    except (
        ValueError,
        OSError,
        MissingExtra,
    ) as err:  # OSError: disk full, read-only folder (the path is named)
        if os.environ.get("RLM_DEBUG"):
            raise
        print(f"rlm {command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
