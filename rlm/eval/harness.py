"""EleutherAI's lm-evaluation-harness on rlm checkpoints: the ``rlm`` model type and ``rlm eval --tasks``
(docs/CLI.md), with the checkpoint's own tokenizer. Every text is ``[bos] + encode(context + continuation)``, as
documents were in training, so a word is scored as it is tokenized in running text (a context's trailing spaces
move to the continuation); a text longer than max_seq_len loses its context from the left. Rolling loglikelihoods
use disjoint windows of max_seq_len (lm-eval's ``get_rolling_token_windows``, context_len 1). Requests are batched
longest first, right-padded: causal attention keeps padding from scored positions.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlm.extras import require

GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")  # top_p: greedy only


@dataclass
class Scorer:
    """Scores lm-eval's requests with an rlm model and its tokenizer; ``mixer`` (knnlm.Mixer) makes them kNN-LM's."""

    module: Any
    tokenizer: Any
    batch_size: int = 8
    mixer: Any = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}; accepted: a positive integer")
        self.max_len = int(self.module.model.config.max_seq_len)
        self.module.eval()

    def loglikelihood(self, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy?) of every (context, continuation)."""
        encoded = []
        for context, continuation in pairs:
            spaces = len(context) - len(context.rstrip())
            if spaces:  # "a word" is scored as " word": the space belongs to the continuation's first token
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole, n_ctx = self.tokenizer.encode(context + continuation), len(self.tokenizer.encode(context))
            encoded.append(([self.tokenizer.bos_id, *whole[:n_ctx]], whole[n_ctx:]))
        return self.score_tokens(encoded)

    def loglikelihood_rolling(self, texts: list[str]) -> list[float]:
        """log p of every text, conditioned on bos, in disjoint windows of max_seq_len tokens."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for i, text in enumerate(texts):
            for pair in get_rolling_token_windows(
                self.tokenizer.encode(text), self.tokenizer.bos_id, self.max_len, context_len=1
            ):
                windows.append(make_disjoint_window(pair))
                owner.append(i)
        totals = [0.0] * len(texts)
        for i, (logp, _) in zip(owner, self.score_tokens(windows)):
            totals[i] += logp
        return totals

    @torch.no_grad()
    def score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p, greedy?) of each continuation's tokens after its context's (cut from the left to fit)."""
        from rlm.eval.datastore import reading_keys

        inputs: list[list[int]] = []
        for ctx, cont in pairs:
            if len(cont) > self.max_len:
                raise ValueError(f"a continuation of {len(cont)} tokens; accepted: at most the model's "
                                 f"max_seq_len={self.max_len}")  # fmt: skip
            if not ctx:
                raise ValueError("a request without context tokens; the context starts with bos")
            inputs.append([*ctx, *cont][-(self.max_len + 1) : -1])  # the last token is only a target
        out: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)  # an empty continuation: log 1, greedy
        order = sorted((i for i in range(len(pairs)) if pairs[i][1]), key=lambda i: -len(inputs[i]))
        with contextlib.ExitStack() as stack:
            hooked = None
            if self.mixer is not None:
                hooked = stack.enter_context(reading_keys(self.module, self.mixer.ds.meta["layer"]))
            for lo in range(0, len(order), self.batch_size):
                rows = order[lo : lo + self.batch_size]
                width = len(inputs[rows[0]])
                tokens = torch.full((len(rows), width), self.tokenizer.pad_id, dtype=torch.long)  # (B, T)
                for b, i in enumerate(rows):
                    tokens[b, : len(inputs[i])] = torch.tensor(inputs[i])
                tokens = tokens.to(self.module.device)
                ctx = self.module.make_context({"tokens": tokens}, "predict")
                logits = self.module.model(tokens, ctx)  # (B, T, V)
                for b, i in enumerate(rows):
                    cont = torch.tensor(pairs[i][1], device=tokens.device)  # (n,)
                    n, end = len(cont), len(inputs[i])
                    row = logits[b, end - n : end].float()  # (n, V): the positions that predict cont
                    if hooked is not None:
                        logp = self.mixer(row, hooked["keys"][b, end - n : end])
                    else:
                        logp = torch.log_softmax(row, -1)
                    picked = logp.gather(1, cont[:, None])[:, 0]  # (n,)
                    greedy = bool((logp.argmax(-1) == cont).all())
                    out[i] = (float(picked.double().sum()), greedy)
        return out

    def generate_until(self, requests: list[tuple[str, dict[str, Any]]]) -> list[str]:
        """Each context's continuation (rlm.eval.generate.sample), cut at the first of its ``until`` strings."""
        from rlm.eval.generate import cut_at, sample, stop_at

        results = []
        for i, (context, kwargs) in enumerate(requests):
            kwargs = dict(kwargs or {})
            unknown = sorted(set(kwargs) - set(GEN_KWARGS))
            if unknown:
                raise ValueError(f"generation arguments {unknown}; accepted: {list(GEN_KWARGS)}")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            do_sample = bool(kwargs.get("do_sample", False))
            temperature = float(kwargs.get("temperature", 1.0)) if do_sample else 0.0
            if do_sample and kwargs.get("top_p") not in (None, 1, 1.0):
                raise ValueError(f"top_p={kwargs['top_p']} with do_sample; accepted: top_k sampling only")
            max_new = int(kwargs.get("max_gen_toks", 256))
            ids = sample(
                self.module, [self.tokenizer.bos_id, *self.tokenizer.encode(context)], max_new, temperature,
                kwargs.get("top_k"), eos_id=self.tokenizer.eos_id,
                generator=torch.Generator().manual_seed(i), mixer=self.mixer,
                stop=stop_at(self.tokenizer.decode, until) if until else None,
            )  # fmt: skip
            results.append(cut_at(self.tokenizer.decode(ids), until))
        return results


@functools.cache
def model_class() -> type:
    """The ``lm_eval.api.model.LM`` subclass for rlm checkpoints, registered as the model type ``rlm``."""
    require("lm_eval", "eval", "lm-evaluation-harness tasks (rlm eval --tasks)")
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model

    @register_model("rlm")
    class RLMHarnessLM(LM):
        """An rlm checkpoint (``ckpt=PATH``; kNN-LM with ``datastore=DIR``, ``lam``, ``temperature``, ``knn_k``)
        or a ready :class:`Scorer`; max_batch_size is unused."""

        def __init__(self, ckpt: str | None = None, scorer: Scorer | None = None, batch_size: int | str = 8,
                     device: str | None = None, datastore: str | None = None, lam: float | None = None,
                     temperature: float | None = None, knn_k: int | None = None,
                     max_batch_size: int | None = None) -> None:  # fmt: skip
            super().__init__()
            if scorer is None:
                if ckpt is None:
                    raise ValueError("the rlm model type needs ckpt=PATH (a checkpoint written by rlm fit)")
                if not str(batch_size).isdigit():
                    raise ValueError(f"batch_size={batch_size!r}; accepted: a positive integer ('auto' is not "
                                     "supported)")  # fmt: skip
                scorer = load_scorer(
                    ckpt, int(batch_size), device or "cpu", datastore, lam, temperature, knn_k
                )
            self.scorer = scorer
            self._device = scorer.module.device

        def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
            return self.scorer.loglikelihood([tuple(r.args) for r in requests])

        def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
            return self.scorer.loglikelihood_rolling([r.args[0] for r in requests])

        def generate_until(self, requests: list[Any]) -> list[str]:
            return self.scorer.generate_until([tuple(r.args) for r in requests])

    return RLMHarnessLM


def load_scorer(
    ckpt_path: str,
    batch_size: int = 8,
    device: str = "cpu",
    datastore: str | os.PathLike[str] | None = None,
    lam: float | None = None,
    temperature: float | None = None,
    k: int | None = None,
) -> Scorer:
    """A Scorer for a checkpoint and its own tokenizer; with ``datastore``, kNN-LM."""
    from rlm.data.carried import data_settings, tokenizer_file
    from rlm.data.pretrained import load_tokenizer
    from rlm.eval.evaluate import load_module
    from rlm.train.checkpoint import load_checkpoint_file

    ckpt = load_checkpoint_file(ckpt_path)
    tokenizer = load_tokenizer(tokenizer_file(ckpt, ckpt_path, data_settings(ckpt, ckpt_path)))
    module = load_module(ckpt_path, device, tokenizer)
    mixer = None
    if datastore is not None:
        from rlm.eval.knnlm import Mixer, open_datastore

        mixer = Mixer(*open_datastore(datastore, module, lam, temperature, k))
    return Scorer(module, tokenizer, batch_size, mixer)


def task_manager(tasks: list[str], tasks_path: str | None = None) -> Any:
    """An ``lm_eval.tasks.TaskManager`` that knows every name in ``tasks``; ValueError naming those it does not."""
    model_class()
    from lm_eval.tasks import TaskManager

    # indexing all of lm-eval's tasks is slow: only the folder's own when it holds every name
    manager = TaskManager(include_path=tasks_path, include_defaults=False) if tasks_path else None
    broken = {}
    if manager is None or not set(tasks) <= set(manager.all_tasks):
        # lm-eval skips a task file it cannot parse, so its task is only "unknown": name the file and the problem
        broken = unreadable_task_files(tasks_path) if tasks_path else {}
        for name in [t for t in tasks if manager is None or t not in manager.all_tasks]:
            for path, (text, problem) in broken.items():
                if re.search(rf"^task:\s*['\"]?{re.escape(name)}['\"]?\s*$", text, re.MULTILINE):
                    raise ValueError(
                        f"lm-eval task {name!r}: its file {path!r} is not valid YAML ({problem})"
                    )
        manager = TaskManager(include_path=tasks_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        near = {t: difflib.get_close_matches(t, manager.all_tasks, 3) for t in unknown}
        raise ValueError(f"unknown lm-eval tasks {unknown} (close: {near}); accepted: the names `lm-eval ls tasks` "
                         "lists" + (f", or tasks defined under {tasks_path}" if tasks_path else ", or your own "
                         "task YAML under --tasks-path DIR")
                         + (f"; task files there that are not valid YAML: {list(broken)}" if broken else ""))  # fmt: skip
    return manager


def unreadable_task_files(tasks_path: str) -> dict[str, tuple[str, str]]:
    """The .yaml files under ``tasks_path`` that are not valid YAML: path -> (text, problem). Only the syntax is
    read (yaml.compose), so lm-eval's own tags such as ``!function`` pass."""
    import yaml

    broken = {}
    for path in sorted(Path(tasks_path).glob("**/*.yaml")):
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            yaml.compose(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            broken[str(path)] = (text, where + (getattr(err, "problem", None) or str(err)))
    return broken


def load_tasks(manager: Any, tasks: list[str]) -> list[Any]:
    """lm-eval's Task (or Group) of each name, loaded one at a time (lm-eval reads its data and templates then),
    so a broken task fails before the model loads, naming the task, its file and the problem."""
    loaded = []
    for name in tasks:
        try:
            got = manager.load(name)
        except Exception as err:  # a user's task: its data files, templates and !function code run here
            raise ValueError(task_problem(manager, name, err)) from err
        top = got["groups"].get(name) or got["tasks"].get(name)
        loaded.extend([top] if top is not None else got["tasks"].values())  # a tag: its tasks
    return loaded


def task_problem(manager: Any, name: str, err: Exception) -> str:
    """One line for a task that failed to load: its name, its YAML file and the problem (a data file's bad JSON
    line, which datasets does not name)."""
    from rlm.data.corpus import json_file_problem

    entry = manager.task_index.get(name)
    files = ((entry.cfg or {}).get("dataset_kwargs") or {}).get("data_files") if entry else None
    files = list(files.values()) if isinstance(files, dict) else files if isinstance(files, list) else [files]
    paths = [Path(p) for f in files for p in (f if isinstance(f, list) else [f]) if isinstance(p, str)]
    json_files = [p for p in paths if p.suffix in (".json", ".jsonl") and p.is_file()]
    located = next((e for e in map(json_file_problem, json_files) if e is not None), None)
    cause = err.__cause__ or err
    problem = str(located) if located else " ".join(f"{type(cause).__name__}: {cause}".split())
    where = f" ({entry.yaml_path})" if entry and entry.yaml_path else ""
    return f"lm-eval task {name!r}{where} cannot be loaded: {problem}"


def evaluate_tasks(
    scorer: Scorer,
    tasks: list[Any],
    limit: float | None = None,
    num_fewshot: int | None = None,
    tasks_path: str | None = None,
    bootstrap_iters: int = 100000,
    log_samples: bool = False,
    manager: Any = None,
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of ``tasks``: names, or what load_tasks made of them (with their ``manager``)."""
    import lm_eval

    if all(isinstance(t, str) for t in tasks):
        manager = manager or task_manager(tasks, tasks_path)
        tasks = load_tasks(manager, tasks)
    return lm_eval.simple_evaluate(
        model=model_class()(scorer=scorer), tasks=tasks, num_fewshot=num_fewshot, limit=limit,
        task_manager=manager, bootstrap_iters=bootstrap_iters, log_samples=log_samples,
    )  # fmt: skip


def main(a: Any) -> int:
    """``rlm eval --tasks``: the options of rlm.cli.commands.cmd_eval; prints lm-eval's table."""
    from rlm.eval.evaluate import write_json

    if a.corpus or a.knn_cache:
        raise ValueError("--tasks scores lm-eval's tasks: --corpus and --knn-cache do not apply")
    if a.limit is not None and a.limit <= 0:
        raise ValueError(f"--limit={a.limit}; accepted: a positive number (below 1: a fraction)")
    if a.num_fewshot is not None and a.num_fewshot < 0:
        raise ValueError(f"--num-fewshot={a.num_fewshot}; accepted: an integer >= 0")
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError(f"--tasks {a.tasks!r}; accepted: comma-separated lm-eval task names")
    require("lm_eval", "eval", "lm-evaluation-harness tasks (rlm eval --tasks)")
    manager = task_manager(tasks, a.tasks_path)  # a misspelt or broken task fails before the model loads
    loaded = load_tasks(manager, tasks)
    scorer = load_scorer(a.ckpt, a.batch_size or 8, a.device, a.datastore, a.lam, a.temperature, a.knn_k)
    limit = int(a.limit) if a.limit is not None and a.limit >= 1 else a.limit
    results = evaluate_tasks(
        scorer, loaded, limit, a.num_fewshot, a.tasks_path, a.bootstrap_iters, manager=manager
    )
    from lm_eval.utils import make_table

    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    write_json(a.json, {k: results[k] for k in ("results", "versions", "n-shot") if k in results})
    return 0
