"""The retriever's index rebuild callback: the embeddings go stale as the embedder trains, so the index is rebuilt
on the schedule (Komatsuzaki 2020, sec. 5.4). Under DDP rank 0 builds from the gathered vectors, or sharded each rank
keeps its own part (index/sharded.py). Apart from plugins/retrieval.py so that its options do not import Lightning."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from rlm.index.build import IndexConfig
from rlm.index.memory import MemoryOwner, RetrievalMemory, build_memory, embed_rows, indexed_rows, load_memory
from rlm.index.projection import Projection, fit_projection, index_width, with_projection
from rlm.index.sharded import (
    all_gather_rows,
    build_sharded_memory,
    check_same_table,
    fit_projection_across_ranks,
    load_sharded_memory,
)
from rlm.index.store import IndexMismatchError, IndexNotFoundError
from rlm.plugins._retrieval_config import RetrievalConfig, Schedule

EMBED_BATCH = 256  # segments per embedder call: amortises it, keeps a shared embedder's activations small
Narrowed = tuple[np.ndarray, dict[str, Any], Projection | None]  # vectors, identity, projection
KEEP = 2  # rebuild directories kept: the one in use, and the one before it that an older checkpoint may name


def shards(sharded: bool | str, world: int, rows: int, shard_above: int) -> bool:
    """Whether a rebuild over `rows` segments on `world` processes keeps a part per rank ('auto': from shard_above)."""
    return world > 1 and (rows >= shard_above if sharded == "auto" else bool(sharded))


def rebuild_stream() -> torch.cuda.Stream | None:
    """A CUDA stream for the background rebuild's embedding (None without CUDA), so it neither queues behind the
    training step's kernels nor holds up its syncs; it starts after the work queued so far (the weights' copy)."""
    if not torch.cuda.is_available():
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return stream


class RebuildCallback(pl.Callback):
    """Rebuilds the index of `owner` (the plugin: snapshot, use_memory) on its schedule."""

    def __init__(self, owner: MemoryOwner, config: RetrievalConfig, label: str = "retrieval") -> None:
        self.owner, self.config, self.label = owner, config, label  # config: read where used, never copied
        self.schedule = Schedule.parse(config.schedule)
        self.index_config = IndexConfig(
            factory=config.index_factory, target_recall=config.target_recall, flat_below=config.flat_below
        )
        self.table = config.lookup == "table"  # each rebuild also finds every indexed segment's k neighbours
        # the index in use: every rank's part directories (sharded), rebuild step (-1: none), embedder, directory
        self.parts: list[str] | None = None
        self.last_step = -1
        self.identity: dict[str, Any] | None = None
        self.path: str | None = None
        self.history: list[tuple[int, str]] = []  # (step, 'built' | 'reused') of every index taken
        self.recall: float | None = None  # of the index in use against exact search
        self.last_seconds = 0.0  # the last rebuild's duration (in the background: the thread's)
        self.blocked_seconds = 0.0  # how long the last rebuild held up the training thread
        self._job: threading.Thread | None = None
        self._job_result: dict[str, Any] = {}
        self._step_start: float | None = None

    @property
    def state_key(self) -> str:
        return f"RebuildCallback[{self.label}]"

    def state_dict(self) -> dict[str, Any]:
        # no k: the module's hyperparameters hold it (a resume refuses another), and so does the index's meta.json
        return dict(last_step=self.last_step, identity=self.identity, index_dir=self.path, parts=self.parts)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step, self.identity, self.path = state["last_step"], state["identity"], state["index_dir"]
        self.parts = state.get("parts")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        root = self.config.index_dir or Path(trainer.default_root_dir) / "retrieval_index"
        self._root = Path(root).resolve()
        dm = trainer.datamodule
        if dm is None:
            raise ValueError(
                "the retrieval rebuild callback needs a datamodule (trainer.fit(model, datamodule=...))"
            )
        self.segments, self.rows = dm.segments, indexed_rows(dm.segments, dm.store.train_docs)
        self._writer = trainer.global_rank == 0
        self._ready = False

    # The first table is made once the training state (global_step) is restored, i.e. not in on_fit_start
    # (Lightning 2.6 restores it after that hook) but before the sanity check and the first step.
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_table(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_table(trainer)

    def _first_table(self, trainer: pl.Trainer) -> None:
        """Reuse the checkpoint's index, else build one (in the background, training runs without retrieval until
        it lands)."""
        if self._ready:
            return
        self._ready = True
        # with a warm start the owner retrieves from the document's past until the schedule is due
        if not self._try_reuse(trainer) and self.config.warm_start == "none":
            self._rebuild(trainer, trainer.global_step)

    def _try_reuse(self, trainer: pl.Trainer | None = None) -> bool:
        """Load the index the checkpoint names when it exists and matches; sharded, each rank reloads its own part,
        and all ranks reuse or all rebuild."""
        sharded = trainer is not None and self._sharded(trainer)
        memory = None
        # a sharded index (parts) now resumed unsharded, or the other way round: rebuild
        if self.path and self.identity and (self.parts is not None) == sharded and self._same_width():
            try:
                if sharded:
                    memory = load_sharded_memory(
                        self.parts, self.segments, self.rows, self.identity, self.config.k
                    )
                else:
                    memory = load_memory(Path(self.path), self.segments, self.identity, self.config.k)
                if self.table and memory.neighbours is None:
                    raise IndexMismatchError(
                        f"index at {self.path} has no neighbour table (built for lookup 'search')"
                    )
            except (IndexNotFoundError, IndexMismatchError, FileNotFoundError) as err:
                print(f"rlm: not reusing the checkpoint's index ({err}); building a new one", file=sys.stderr)
                memory = None
        if sharded:
            if not trainer.strategy.reduce_boolean_decision(memory is not None, all=True):
                return False
            check_same_table(memory.neighbours)
        if memory is None:
            return False
        self._take(memory, "reused")
        return True

    def _width(self, width: int | None = None) -> int | None:
        """The index's width at this corpus size (None: full width); `width` of the vectors if known."""
        return index_width(self.config.index_dim, width, len(self.rows), self.config.shard_above)

    def _same_width(self) -> bool:
        """Whether the checkpoint's index was narrowed as index_dim asks now (else a log line)."""
        have = self.identity.get("projection")
        want = self._width(have["in_dim"] if have else None)
        if (have["dim"] if have else None) == want:
            return True
        print(
            f"rlm: not reusing the checkpoint's index (its vectors are {have['dim'] if have else 'full'} wide, "
            f"index_dim={self.config.index_dim!r} wants {want or 'full'}); building a new one",
            file=sys.stderr,
        )
        return False

    def _narrow(self, shard: np.ndarray, identity: dict[str, Any], collective: bool) -> Narrowed:
        """(this rank's vectors in the index's width, the identity with the projection, the projection): a PCA of
        the vectors about to be indexed (collective: of a sample of every rank's); None at full width."""
        if self._width() is None:
            return shard, with_projection(identity, None), None
        if collective:
            projection = fit_projection_across_ranks(shard, self._width)
        else:
            projection = fit_projection(shard, self._width(shard.shape[1]))
        return projection.apply(shard), with_projection(identity, projection), projection

    def _sharded(self, trainer: pl.Trainer) -> bool:
        return shards(self.config.sharded, trainer.world_size, len(self.rows), self.config.shard_above)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._job is not None:
            self._collect(trainer, wait=False)
        if self._job is None and self.schedule.due(step, self.last_step):
            self._rebuild(trainer, step)
        self._step_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._step_start is None:
            return
        step_s = time.perf_counter() - self._step_start
        p = self.label
        pl_module.log(f"train/{p}/retrieval_fraction", float(self.owner.prepare_seconds) / max(step_s, 1e-9))
        pl_module.log(f"train/{p}/steps_since_rebuild", float(trainer.global_step - self.last_step))
        pl_module.log(f"train/{p}/rebuild_s", float(self.last_seconds))
        pl_module.log(f"train/{p}/rebuild_blocked_s", float(self.blocked_seconds))
        if self.recall is not None:  # recall@k of the table in use against exact search
            pl_module.log(f"train/{p}/index_recall", float(self.recall))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # finish (and keep) a rebuild still running, both its stages, so nothing dangles
        while self._job is not None:
            self._collect(trainer, wait=True)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self._job is not None:
            self._job.join()
            self._job = None

    def _rebuild(self, trainer: pl.Trainer, step: int) -> None:
        (self._rebuild_blocking if self.config.mode == "blocking" else self._start_background)(trainer, step)

    def _rebuild_blocking(self, trainer: pl.Trainer, step: int) -> None:
        start = time.perf_counter()
        embedder = self.owner.snapshot(step)
        rank, world = trainer.global_rank, trainer.world_size
        shard = embed_rows(embedder, self.segments, self.rows, EMBED_BATCH, rank, world, self.config.progress)
        memory = self._build(trainer, self._narrow(shard, embedder.embedder_identity(), world > 1), step)
        if world > 1:
            check_same_table(memory.neighbours)
        self.last_seconds = self.blocked_seconds = time.perf_counter() - start
        self._take(memory, "built")

    def _build(self, trainer: pl.Trainer, narrowed: Narrowed, step: int) -> RetrievalMemory:
        """Each rank its part (sharded; a table is merged from every part), the whole (one process), or rank 0 the
        whole from the gathered vectors for every rank to load."""
        shard, identity, projection = narrowed
        path = self._root / f"step-{step:09d}"
        args = (self.segments, self.rows, self.config.k, identity, step, self.index_config, path, self.table)
        if self._sharded(trainer):
            return build_sharded_memory(shard, *args, projection)
        if trainer.world_size == 1:
            return build_memory(shard, *args, projection)
        vectors = np.concatenate(all_gather_rows(shard))  # narrowed first: m wide, not D
        if trainer.global_rank == 0:
            build_memory(vectors, *args, projection)
        trainer.strategy.barrier("retrieval-rebuild")
        return load_memory(path, self.segments, identity, self.config.k)

    def _start_background(self, trainer: pl.Trainer, step: int) -> None:
        embedder = self.owner.snapshot(step)  # copied now, on the main thread, at a step boundary
        rank, world = trainer.global_rank, trainer.world_size
        # the thread builds where that needs no collective: one process, or sharded without a table (each rank its
        # part); a projection to fit under DDP (a collective) is fitted on the training thread between two threads
        local = world == 1 or (self._sharded(trainer) and not self.table)
        result: dict[str, Any] = {"step": step, "start": time.perf_counter(), "local": local}

        def work() -> None:
            shard = embed_rows(embedder, self.segments, self.rows, EMBED_BATCH, rank, world, False)
            result["identity"] = embedder.embedder_identity()
            if local and (world == 1 or self._width() is None):
                result["memory"] = self._build(trainer, self._narrow(shard, result["identity"], False), step)
            else:
                result["shard"] = shard

        self._run_job(result, work)

    def _run_job(self, result: dict[str, Any], work: Any) -> None:
        """Run work() in the rebuild thread, on a CUDA stream of its own; its error is raised by _collect."""
        stream = rebuild_stream()

        def guarded() -> None:
            try:
                with torch.cuda.stream(stream):  # None: no CUDA, nothing to switch
                    work()
            except BaseException as err:
                result["error"] = err
            result["end"] = time.perf_counter()

        self._job_result = result
        self._job = threading.Thread(target=guarded, name=f"{self.label}-rebuild", daemon=True)
        self._job.start()

    def _collect(self, trainer: pl.Trainer, wait: bool) -> None:
        """Swap in a finished background rebuild (all ranks agree it finished before any collective)."""
        if wait:
            self._job.join()
        done = not self._job.is_alive()
        if trainer.world_size > 1:
            done = trainer.strategy.reduce_boolean_decision(done, all=True)
        if not done:
            return
        self._job.join()
        self._job, result = None, self._job_result
        err = result.get("error")
        if isinstance(err, OSError):  # a full disk: the path is named, one error line
            raise err
        if err is not None:
            raise RuntimeError(f"background index rebuild of step {result['step']} failed") from err
        memory, start = result.get("memory"), time.perf_counter()
        # on the training thread: the narrowing (a collective under DDP), and a collective build
        if memory is None:
            narrowed = self._narrow(result.pop("shard"), result["identity"], trainer.world_size > 1)
            if result["local"]:  # the part is indexed and written in a thread again; collected like any other
                result["blocked"] = time.perf_counter() - start
                self._run_job(
                    result, lambda: result.update(memory=self._build(trainer, narrowed, result["step"]))
                )
                return
            memory = self._build(trainer, narrowed, result["step"])
            result["blocked"] = time.perf_counter() - start
        if trainer.world_size > 1:
            check_same_table(memory.neighbours)
        self.blocked_seconds = result.get("blocked", 0.0)
        self.last_seconds = result["end"] - result["start"]
        self._take(memory, "built")

    def _take(self, memory: RetrievalMemory, how: str) -> None:
        self.owner.use_memory(memory)
        self.last_step, self.identity = memory.step, memory.identity
        self.path = str(memory.path) if memory.path is not None else None
        self.recall = memory.recall
        self.parts = memory.parts
        self.history.append((memory.step, how))
        self._prune(memory.path)

    def _prune(self, current: Path | None) -> None:
        """Delete all but the newest KEEP rebuild directories (the current one always stays)."""
        if current is None or not self._root.exists():
            return
        if self.parts is not None:  # every rank prunes (its filesystem may be its own), whole rebuilds
            current = current.parent
        elif not self._writer:
            return
        old = sorted(p for p in self._root.glob("step-*") if p.is_dir() and p.resolve() != current.resolve())
        for p in old[: max(0, len(old) - (KEEP - 1))]:
            shutil.rmtree(p, ignore_errors=True)
