"""``--ckpt_path``: finding a run's newest loadable checkpoint in every folder the config writes checkpoints to
(Lightning looks only in the new run's logger version), and refusing one written by another model."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlm.train.checkpoint import config_diff, dict_diff, load_checkpoint_file


def _get(ns: Any, key: str, default: Any = None) -> Any:
    if ns is None:
        return default
    try:
        value = ns.get(key, default) if hasattr(ns, "get") else getattr(ns, key, default)
    except (KeyError, AttributeError):
        return default
    return default if value is None else value


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _init_args(entry: Any) -> Any:
    """A ``{class_path, init_args}`` entry's init_args, or the object's attributes when instantiated."""
    return _get(entry, "init_args", entry)


def checkpoint_roots(trainer_cfg: Any) -> list[Path]:
    """Every folder under which a run with this trainer config writes checkpoints."""
    roots: list[Path] = []
    root_dir = _get(trainer_cfg, "default_root_dir")
    for cb in _as_list(_get(trainer_cfg, "callbacks")):
        if "Checkpoint" in str(_get(cb, "class_path", type(cb).__name__)):
            dirpath = _get(_init_args(cb), "dirpath")
            if dirpath:
                roots.append(Path(dirpath))
    loggers = _get(trainer_cfg, "logger")
    for lg in _as_list(loggers) if loggers is not True else []:
        args = _init_args(lg)
        save_dir, name = _get(args, "save_dir", root_dir), _get(args, "name", "lightning_logs")
        if save_dir:
            roots.append(Path(save_dir) / str(name))
    roots.append(Path(root_dir or "."))
    if root_dir is None:  # Lightning's default logger writes under ./lightning_logs
        roots = [r if r != Path(".") else Path("lightning_logs") for r in roots]
    return list(dict.fromkeys(roots))  # in order, without repeats


def newest_loadable(
    roots: list[Path], say: Any = None, remove_damaged: bool = False
) -> tuple[Path, dict[str, Any]]:
    """The checkpoint under ``roots`` of the highest training step that loads (the newest file among equal
    steps: a copy or a ``touch`` makes an old file the newest), and its contents; ValueError when there is none.
    ``remove_damaged`` deletes files that do not load."""
    say = say or (lambda msg: print(msg, file=sys.stderr))
    found = {p.resolve() for r in roots if r.is_dir() for p in r.rglob("*.ckpt") if p.is_file()}
    candidates = sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)
    best: tuple[int, Path, dict[str, Any]] | None = None
    for path in candidates:  # newest file first: the first of the highest step wins ties
        try:
            ckpt = load_checkpoint_file(path)
        except ValueError as err:
            say(f"rlm: skipping {path}: {err}")
            if remove_damaged:
                path.unlink(missing_ok=True)
            continue
        step = int(ckpt.get("global_step", -1)) if isinstance(ckpt, dict) else -1
        if best is None or step > best[0]:
            best = (step, path, ckpt)
    if best is not None:
        return best[1], best[2]
    where = ", ".join(str(r) for r in roots)
    if candidates:
        raise ValueError(f"--ckpt_path last: none of the {len(candidates)} checkpoints under {where} loads")
    raise ValueError(
        f"--ckpt_path last: no checkpoint under {where}; train first, or give a checkpoint file's path"
    )


def prepare_ckpt_path(config: Any) -> dict[str, Any]:
    """Resolve ``--ckpt_path last`` in LightningCLI's parsed ``config``, check the file loads, and refuse resuming
    ``fit`` under another model. Returns the ``model.optim`` settings a resume honours (``total_steps``)."""
    from rlm.model.config import ModelConfig
    from rlm.train.module import OptimConfig

    command = config.get("subcommand")
    if not command:
        return {}
    cfg = config[command]
    path = cfg.get("ckpt_path")
    if not path:
        return {}
    if path == "last":
        found, ckpt = newest_loadable(checkpoint_roots(cfg.get("trainer")))
        print(f"rlm {command}: resuming from {found} (step {ckpt.get('global_step', '?')})", file=sys.stderr)
        cfg.ckpt_path = path = str(found)
    elif path in ("best", "hpc", "registry") or str(path).startswith("registry:"):
        return {}  # Lightning's own names
    else:
        ckpt = load_checkpoint_file(path)
    if not isinstance(ckpt, dict) or "pytorch-lightning_version" not in ckpt or "state_dict" not in ckpt:
        raise ValueError(
            f"--ckpt_path {path} is not a checkpoint written by rlm fit (a Lightning checkpoint holds "
            "'pytorch-lightning_version' and 'state_dict'; this file has "
            f"{sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__})"
        )
    if command != "fit":
        return {}
    from rlm.data.carried import data_settings, tokenizer_file
    from rlm.data.pretrained import TRAIN, resolve_vocab_size

    if cfg.data.get("tokenizer") not in (None, TRAIN):  # the checkpoint's copy: the file may be gone
        cfg.data.tokenizer = tokenizer_file(ckpt, path, data_settings(ckpt, path))
    saved = ckpt.get("hyper_parameters", {})
    current = cfg.model.as_dict()
    if current.get("model") is not None:
        current["model"]["vocab_size"] = resolve_vocab_size(cfg.data.vocab_size, cfg.data.get("tokenizer"))
    current["model"] = asdict(ModelConfig(**(current.get("model") or {})))
    diffs = config_diff(saved, current)
    if diffs:
        raise ValueError(f"--ckpt_path {path} was written by a different config:\n  " + "\n  ".join(diffs))
    # The optimizer state comes from the checkpoint, so a changed optim setting would be dropped silently: warn
    optim = current.get("optim")
    optim = asdict(OptimConfig(**optim)) if isinstance(optim, dict) else asdict(OptimConfig())
    saved_optim = saved.get("optim") or {}
    honoured = {
        k: optim[k] for k in ("total_steps",) if optim[k] is not None and optim[k] != saved_optim.get(k)
    }
    kept = {k: v for k, v in saved_optim.items() if k not in honoured}
    changed = dict_diff(kept, {k: v for k, v in optim.items() if k not in honoured}, "model.optim.")
    if changed:
        print(
            "rlm fit: warning: resuming keeps the checkpoint's optimizer settings; ignored:\n  "
            + "\n  ".join(changed),
            file=sys.stderr,
        )
    return honoured
