"""Crash-safe checkpoint files: written beside their target, fsynced and renamed, so a reader sees the old file
or the new one (Lightning's writer goes through ``$TMPDIR``, whose move to another filesystem is a copy); and what
differs between the config a checkpoint was written under and this run's."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities.exceptions import SIGTERMException

from rlm.plugin.registry import full_specs, plain

PREEMPTED = 143  # rlm fit's exit code after SIGTERM and a saved last.ckpt (128 + 15, as a shell reports it)
TMP_PATTERN = re.compile(r"^\..+\.tmp-\d+$")  # atomic_save's temporary files: .last.ckpt.tmp-PID


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems do not open directories; the rename is still atomic
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, rename; OSError naming ``path`` on failure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # torch.save reports a short write as RuntimeError
        tmp.unlink(missing_ok=True)
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise OSError(
            f"cannot write checkpoint {str(path)!r}: {reason} "
            "(a full disk or an unwritable folder; the previous checkpoint is intact)",
        ) from err
    _fsync_dir(path.parent)


def load_checkpoint_file(path: str | Path, map_location: Any = "cpu", weights_only: bool = False) -> Any:
    """``torch.load`` of a checkpoint, raising ValueError that names the file when it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=True)
    except Exception as err:  # zip, pickle and storage errors alike: the file is damaged
        raise ValueError(
            f"checkpoint {str(path)!r} cannot be loaded ({type(err).__name__}: {err}); it is truncated or "
            "damaged: resume from another checkpoint, or `--ckpt_path last` to pick the newest loadable one"
        ) from err


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO that writes with :func:`atomic_save` and names the file when loading fails."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        atomic_save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        return load_checkpoint_file(path, map_location or "cpu", bool(weights_only))


def remove_tmp_files(directory: str | Path, stale: bool = False) -> list[Path]:
    """Delete the temporary files of interrupted :func:`atomic_save` calls in ``directory``; with ``stale``, those
    anywhere under it whose process is gone."""
    if stale:
        from rlm.index.store import process_alive

    directory, removed = Path(directory), []
    found = directory.rglob(".*.tmp-*") if stale else directory.iterdir()
    for p in found if directory.is_dir() else []:
        if not TMP_PATTERN.match(p.name) or not p.is_file():
            continue
        if stale and process_alive(int(p.name.rsplit("-", 1)[1])):
            continue
        p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def dict_diff(saved: Any, current: Any, prefix: str = "") -> list[str]:
    """``key: a -> b`` for every dotted key whose value differs between two nested configs."""
    if isinstance(saved, dict) and isinstance(current, dict) and saved and current:
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            out += dict_diff(saved.get(key), current.get(key), f"{prefix}{key}.")
        return out
    if plain(saved) != plain(current):
        return [f"{prefix.rstrip('.')}: checkpoint has {saved!r}, this run has {current!r}"]
    return []


def config_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two LMModule hyperparameter dicts in the parts that shape the model."""
    diffs = []
    for key in ("model", "plugins"):
        if key in saved:
            old, new = saved[key], current.get(key)
            if key == "plugins":  # None and {} alike; options left at their defaults count as given
                old, new = full_specs(old), full_specs(new)
            diffs += dict_diff({key: _normalise(old)}, {key: _normalise(new)})
    return diffs


def _normalise(value: Any) -> Any:
    """Plain containers for comparing configs (tuples and lists alike, disabled plugins dropped)."""
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items() if v is not None and v is not False}
    if isinstance(value, list | tuple):
        return [_normalise(v) for v in value]
    return value


class CheckpointHygiene(pl.Callback):
    """Installs :class:`AtomicCheckpointIO`, clears what killed runs left in the checkpoint folders, and saves
    ``last.ckpt`` at the end of training and at SIGTERM."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:  # leave a user's own CheckpointIO alone
            strategy.checkpoint_io = AtomicCheckpointIO()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # every rank: saving is collective under DDP and FSDP
        for cb in trainer.checkpoint_callbacks:
            if not isinstance(cb, ModelCheckpoint) or not cb.save_last or not cb.dirpath:
                continue
            # Lightning keeps the step of its last save privately; without it, save anyway (one more write)
            if getattr(cb, "_last_global_step_saved", None) == trainer.global_step:
                continue
            # Lightning >= 2.6 saves last.ckpt in its own on_train_end when the run saved none yet: saving here
            # too would make its file a second one, last-v1.ckpt. Older versions lack the attribute: save.
            if not getattr(cb, "_last_checkpoint_saved", "no such save"):
                continue
            trainer.save_checkpoint(os.path.join(cb.dirpath, cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION))

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Preemption (SIGTERM, raised by Lightning at a batch boundary on every rank): save last.ckpt; rlm fit
        then exits PREEMPTED."""
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != "fit":
            return
        where = "no checkpoint callback"
        for cb in trainer.checkpoint_callbacks:  # the first that writes; on every rank: saving is collective
            if isinstance(cb, ModelCheckpoint) and cb.dirpath:
                path = os.path.join(cb.dirpath, cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
                trainer.save_checkpoint(path)
                where = f"saved {path}; rerun with --ckpt_path last to resume"
                break
        if trainer.is_global_zero:
            print(f"rlm fit: stopped by SIGTERM at step {trainer.global_step} ({where})", file=sys.stderr)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        recount_resumed_batch(trainer)
        if not trainer.is_global_zero:
            return
        resumed = trainer.ckpt_path
        for p in remove_tmp_files(trainer.default_root_dir, stale=True):
            print(f"rlm: removed {p}, a partial checkpoint of an interrupted run", file=sys.stderr)
        for cb in trainer.checkpoint_callbacks:
            if not isinstance(cb, ModelCheckpoint) or not cb.dirpath:
                continue
            for p in remove_tmp_files(cb.dirpath):
                print(f"rlm: removed {p}, a partial checkpoint of an interrupted run", file=sys.stderr)
            if resumed is None or cb.save_top_k < 0:
                continue
            # A kill between writing a top-k checkpoint and deleting the one it displaced, or after the one we
            # resume from, leaves files no restored state tracks, kept forever beyond save_top_k. Those written
            # after the resumed step are trained again anyway.
            tracked = {os.path.abspath(p) for p in [*cb.best_k_models, cb.last_model_path, resumed] if p}
            for p in Path(cb.dirpath).glob("*" + cb.FILE_EXTENSION):
                m = re.search(r"step=(\d+)", p.name)
                if os.path.abspath(p) in tracked or m is None or int(m.group(1)) <= trainer.global_step:
                    continue
                p.unlink(missing_ok=True)
                print(
                    f"rlm: removed {p}: written after step {trainer.global_step}, which this run resumes from",
                    file=sys.stderr,
                )


def recount_resumed_batch(trainer: pl.Trainer) -> bool:
    """Undo Lightning's second count of the last batch on resuming a checkpoint saved after the count (SIGTERM's
    last.ckpt) at a step where validation is due: Lightning assumes it was saved at the end of the validation,
    before the count, and every metric would be logged at global_step + 1. Returns whether it did."""
    epoch_loop = trainer.fit_loop.epoch_loop
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is None or not (epoch_loop.restarting and epoch_loop.restarted_on_last):
        return False
    if epoch_loop.val_loop.restarted_mid_evaluation or not epoch_loop._should_check_val_fx(fetcher):
        return False  # Lightning trains the next batch (or finishes the validation) first: no second count
    if epoch_loop._batches_that_stepped != trainer.global_step:
        return False  # saved before the count (ModelCheckpoint at the end of validation): Lightning is right
    epoch_loop._batches_that_stepped -= 1
    return True
