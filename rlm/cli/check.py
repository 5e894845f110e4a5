"""Checks of a parsed ``rlm fit`` config before anything is built (an unwritable folder, a run that trains
nothing), the run locks, and the cleanup of a failed run's folders."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from rlm.train.resume import _as_list, _get, _init_args


def output_dirs(trainer_cfg: Any) -> dict[Path, str]:
    """The folders a fit writes to (the root, each logger's save_dir/name, each checkpoint dirpath), each with the
    setting that names it."""
    dirs = {Path(_get(trainer_cfg, "default_root_dir") or "."): "--trainer.default_root_dir"}
    loggers = _get(trainer_cfg, "logger")
    for lg in _as_list(loggers) if loggers not in (True, False) else []:
        args = _init_args(lg)
        if save_dir := _get(args, "save_dir"):
            dirs.setdefault(
                Path(save_dir) / str(_get(args, "name", "lightning_logs")), "logger save_dir or name"
            )
    for cb in _as_list(_get(trainer_cfg, "callbacks")):
        if dirpath := _get(_init_args(cb), "dirpath"):
            dirs.setdefault(Path(dirpath), "ModelCheckpoint dirpath")
    return dirs


def check_writable(
    directory: str | Path,
    what: str = "output folder",
    hint: str = "give a folder you can write to (e.g. --trainer.default_root_dir)",
) -> None:
    """Write and remove a probe file in ``directory``, or its nearest existing ancestor (creating nothing); OSError
    naming the path when that fails."""
    directory = Path(directory)
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, f"{existing} is a file")
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".rlm-write-probe-"):
            pass
    except OSError as err:
        raise OSError(f"{what} {str(directory)!r} is not writable ({err.strerror or err}); {hint}") from err


def check_fit(cfg: Any) -> None:
    """All checks of a parsed ``fit`` config (the subcommand's namespace)."""
    trainer = _get(cfg, "trainer")
    for name, what in (("max_steps", "a positive number of steps (or -1: no limit)"),
                       ("max_epochs", "a positive number of epochs (or -1: no limit)")):  # fmt: skip
        value = _get(trainer, name)
        if value == 0 or (isinstance(value, int) and value < -1):
            raise ValueError(f"--trainer.{name} {value} trains nothing; give {what}")
    # Lightning rejects these with a traceback, or (a limit of 0) trains nothing and exits 0. jsonargparse may
    # read an integer of an int-or-float setting as a float, so only the sign is checked here.
    epoch = "a fraction of the epoch in (0, 1]"
    for name, said in (("limit_train_batches", f" trains nothing; give a positive number of batches or {epoch}"),
                       ("val_check_interval", f"; accepted: a number of batches >= 1, or {epoch}")):  # fmt: skip
        value = _get(trainer, name)
        if value is not None and value <= 0:
            raise ValueError(f"--trainer.{name} {value:g}{said}")
    accumulate = _get(trainer, "accumulate_grad_batches")
    if accumulate is not None and accumulate < 1:
        raise ValueError(f"--trainer.accumulate_grad_batches {accumulate}; accepted: an integer >= 1")
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        for d in output_dirs(trainer):
            check_writable(d)


RUN_LOCK = ".rlm-fit.lock"  # in each folder a running fit writes, held locked, holding its pid
_held: list[Any] = []  # the open lock files: held until the fit ends (release_run_locks) or the process does
_quieted: list[Any] = []  # warning filters that last as long as the locks


def lock_fit(cfg: Any) -> None:
    """Hold the run lock of every folder a parsed ``fit`` config writes (on the first process of the first node:
    the other ranks are this run's own)."""
    ranks = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_NODEID")
    if not all(int(os.environ.get(v, "0") or 0) == 0 for v in ranks):
        return
    trainer = _get(cfg, "trainer")
    dirpaths = [_get(_init_args(cb), "dirpath") for cb in _as_list(_get(trainer, "callbacks"))]
    checkpoints = [Path(d).resolve() for d in dirpaths if d]
    for folder, setting in output_dirs(trainer).items():
        folder = folder.resolve()
        if any(folder == held for _, _, held in _held):  # one folder under two settings: locked once
            continue
        fresh = not folder.is_dir() or not any(folder.iterdir())
        hold_run_lock(folder, setting)
        if fresh and folder in checkpoints:
            # the lock file alone would make Lightning warn that the checkpoint folder "exists and is not empty"
            warnings.filterwarnings(
                "ignore", re.escape(f"Checkpoint directory {folder} exists and is not empty")
            )
            _quieted.append(warnings.filters[0])


def hold_run_lock(root: Path, setting: str = "--trainer.default_root_dir") -> None:
    """Lock ``root`` for this process (released when it ends, however it ends), or ValueError naming the run holding
    it and the ``setting`` to change."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): no lock
        return
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    f = open(root / RUN_LOCK, "a+")  # noqa: SIM115 (kept open: the lock lives as long as the file)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        other = f.read().strip() or "?"
        f.close()
        raise ValueError(
            f"another rlm fit (pid {other}) is running in {root}: two runs writing one folder would mix their "
            f"logs and overwrite each other's checkpoints; wait for it to end, or give this run its own {setting}"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _held.append((f, root if created else None, root.resolve()))


def release_run_locks() -> None:
    """Release the locks this process holds (the end of an in-process ``rlm fit``)."""
    while _quieted:
        entry = _quieted.pop()
        if entry in warnings.filters:
            warnings.filters.remove(entry)
    while _held:
        f, created, _ = _held.pop()
        f.close()
        # a run that failed before writing anything leaves no folder behind (only the lock file was in it)
        if created is not None and [p.name for p in created.iterdir()] == [RUN_LOCK]:
            (created / RUN_LOCK).unlink(missing_ok=True)
            created.rmdir()


# What Lightning's loggers and the config callback write into a run's folder before the first step
STARTUP_FILES = ("config.yaml", "hparams.yaml", "events.out.tfevents.*")


def new_dirs(dirs: list[Path]) -> list[Path]:
    """Each of ``dirs`` not existing yet, with its missing ancestors, deepest first: what a run will create."""
    out: list[Path] = []
    for d in dirs:
        d = Path(d).absolute()
        while not d.exists() and d != d.parent and d not in out:
            out.append(d)
            d = d.parent
    return sorted(out, key=lambda p: len(p.parts), reverse=True)


def _startup_only(directory: Path) -> bool:
    return all(
        (p.is_dir() and _startup_only(p)) or (p.is_file() and any(p.match(g) for g in STARTUP_FILES))
        for p in directory.iterdir()
    )


def remove_unused_dirs(created: list[Path]) -> list[Path]:
    """Remove the folders of ``created`` (new_dirs) holding only what loggers write at a run's start, so a fit
    failing before its first step leaves no empty ``version_N`` to push the next run's number on; the ones removed."""
    removed = []
    for d in created:  # deepest first
        if not d.is_dir() or not _startup_only(d):
            continue
        shutil.rmtree(d)
        removed.append(d)
    return removed
