"""The index rebuild callback: re-embed every training segment with the current embedder, rebuild the
index and the neighbour table on a schedule (MARGE-style retrieval, Komatsuzaki 2020 section 5.4:
the embeddings go stale as the embedder trains, so the index is rebuilt every I steps).

Modes: 'blocking' (training waits) and 'background' (a frozen snapshot of the embedder embeds and
indexes in a thread while training continues on the old table; the new one is swapped in at a step
boundary with one reference assignment). In the background mode the first table is built the same way:
the first steps train without retrieval until it lands. With ``defer_first`` no table is built at fit start
(the owner has a warm start of its own); the first comes when the schedule is due. Under DDP each rank embeds its contiguous share of the segments,
the shares are all-gathered, rank 0 builds and writes the index directory and every rank loads that
same directory, so all ranks train on the same table. The state (last rebuild step, embedder identity,
index path) is checkpointed; on resume the index is reused only if it is the one the checkpoint names.
With sharded=True (and more than one rank; 'auto': from shard_above indexed segments) no rank gathers the
vectors: each keeps and writes its own part of the index, searches are collectives and the parts' top-k merge
(index/sharded.py); in the background mode without a table each rank's whole build runs in its thread.
With ``index_dim`` the vectors are narrowed by a PCA fitted at each rebuild on the vectors about to be indexed
(index/projection.py; under DDP on a sample gathered from every rank, the same projection on every rank) before
they are gathered, indexed or written; the projection is stored with the index and narrows every query.

This module knows no plugin: it talks to a ``MemoryOwner`` (snapshot an embedder, take a new memory).
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from rlm.index.build import IndexConfig
from rlm.index.memory import (
    MemoryOwner,
    RetrievalMemory,
    build_memory,
    embed_rows,
    indexed_rows,
    load_memory,
    load_part_memory,
)
from rlm.index.projection import Projection, check_index_dim, fit_projection, index_width, with_projection
from rlm.index.sharded import (
    check_same_table,
    fit_projection_across_ranks,
    gather_shards,
    load_parts_for_search,
)
from rlm.index.store import IndexMismatchError, IndexNotFoundError, load_index_dir


def shards(sharded: bool | str, world: int, rows: int, shard_above: int) -> bool:
    """Whether a rebuild over `rows` indexed segments on `world` processes keeps one part per rank (index/sharded.py):
    never with one process; sharded True or False decides; 'auto' from shard_above rows."""
    if world <= 1:
        return False
    return rows >= shard_above if sharded == "auto" else bool(sharded)


# ----- the schedule -----


@dataclass(frozen=True)
class Schedule:
    """When to rebuild: piecewise intervals [(start, stop, every)], 'every N' is [(0, inf, N)], 'never' is []."""

    pieces: tuple[tuple[int, float, int], ...]

    GRAMMAR = "'never', 'every N', or piecewise 'A-B:N,B-C:M' (every N steps while A <= step < B, ...)"

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """Parse the schedule grammar; a ValueError names the bad text and the grammar."""
        if not isinstance(text, str):
            raise ValueError(f"rebuild schedule must be a string: {cls.GRAMMAR}; got {text!r}")
        s = text.strip().lower()
        if s == "never":
            return cls(())
        try:
            if s.startswith("every"):
                every = int(s[len("every") :].strip())
                if every <= 0:
                    raise ValueError
                return cls(((0, float("inf"), every),))
            pieces = []
            for part in s.split(","):
                span, every = part.split(":")
                lo, hi = span.split("-")
                lo, hi, every = int(lo), int(hi), int(every)
                if lo < 0 or hi <= lo or every <= 0:
                    raise ValueError
                pieces.append((lo, hi, every))
        except ValueError:
            raise ValueError(f"bad rebuild schedule {text!r}; accepted: {cls.GRAMMAR}") from None
        pieces.sort()
        for (_, hi, _), (lo, _, _) in zip(pieces, pieces[1:]):
            if lo < hi:
                raise ValueError(f"bad rebuild schedule {text!r}: ranges overlap; accepted: {cls.GRAMMAR}")
        return cls(tuple(pieces))

    def interval(self, step: int) -> int | None:
        """The rebuild interval in force at `step`, None where no range covers it."""
        return next((every for lo, hi, every in self.pieces if lo <= step < hi), None)

    def due(self, step: int, last: int) -> bool:
        """Whether to rebuild at `step` when the last rebuild was at `last` (robust to resuming anywhere)."""
        every = self.interval(step)
        return every is not None and step - last >= every


def rebuild_stream() -> torch.cuda.Stream | None:
    """A CUDA stream for the background rebuild, so that its embedding forward neither queues behind the training
    step's kernels nor makes the step's syncs wait for its own (a thread otherwise shares the default stream); it
    starts after the work queued so far (the snapshot's copy of the weights). On this process's GPU (Lightning sets
    each rank's current device); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return stream


# ----- what the plugin reads -----


def load_memory_for_search(path: str | Path) -> RetrievalMemory:
    """Load a written memory with its own segment table, for online search (validation, generation); a part of
    a sharded index is loaded with every other part (index/sharded.py)."""
    path = Path(path)
    if "shard" in load_index_dir(path).meta:
        return load_parts_for_search(path)
    return load_part_memory(path)


# ----- the callback -----


class RebuildCallback(pl.Callback):
    """Rebuilds the retriever's index and neighbour table on a schedule (see the module docstring)."""

    def __init__(
        self,
        owner: MemoryOwner,
        k: int,
        schedule: str = "every 1000",
        mode: str = "blocking",
        index_config: IndexConfig | None = None,
        index_dir: str | None = None,
        batch_size: int = 256,
        progress: bool = True,
        label: str = "retrieval",
        keep: int = 2,
        defer_first: bool = False,
        sharded: bool | str = False,
        table: bool = True,
        shard_above: int = 1_048_576,
        index_dim: int | str | None = None,
    ) -> None:
        if mode not in ("blocking", "background"):
            raise ValueError(f"rebuild mode={mode!r}; accepted: 'blocking', 'background'")
        self.owner, self.k, self.mode, self.label = owner, k, mode, label
        self.schedule = Schedule.parse(schedule)
        self.index_config = index_config or IndexConfig(target_recall=None)
        self.index_dir, self.batch_size, self.progress, self.keep = index_dir, batch_size, progress, keep
        self.defer_first = defer_first
        """No table at fit start (unless a checkpoint's is reused): the first comes when the schedule is due; the
        owner retrieves otherwise meanwhile (the retriever's warm start from the document's own past)."""
        if sharded not in (True, False, "auto"):
            raise ValueError(f"rebuild sharded={sharded!r}; accepted: True, False, 'auto'")
        self.sharded, self.shard_above = sharded, shard_above
        """Under DDP, each rank keeps its own part of the index (index/sharded.py) instead of the whole; 'auto':
        from shard_above indexed segments."""
        check_index_dim(index_dim)  # a bad setting is a ValueError now, not at the first rebuild
        self.index_dim = index_dim
        """Narrow the indexed vectors by a PCA to this width (index/projection.py.index_width: None full width;
        'auto' from shard_above indexed segments)."""
        self.table = table
        """Each rebuild also finds every indexed segment's k neighbours (the table a training step reads); False:
        index only, and the owner searches each step's queries online."""
        self.parts: list[str] | None = None
        """The part directories of every rank when the table in use is from a sharded index."""
        self.last_step = -1
        """Step of the rebuild whose table is in use (-1: none yet)."""
        self.identity: dict[str, Any] | None = None
        """Identity of the embedder that produced the table in use."""
        self.path: str | None = None
        """Index directory of the table in use."""
        self.history: list[tuple[int, str]] = []
        """(step, 'built' | 'reused') of every table taken, in order (for logs and tests)."""
        self.recall: float | None = None
        """Recall against exact search of the index in use (logged as train/<label>/index_recall)."""
        self.last_seconds = 0.0
        """Duration of the last rebuild (in the background: the thread's time)."""
        self.blocked_seconds = 0.0
        """Seconds the last rebuild held up training: the whole of a blocking one; in the background, the part
        that ran on the training thread (under DDP unsharded, the gather and rank 0's build; sharded without a
        table, or one process: none)."""
        self._job: threading.Thread | None = None
        self._job_result: dict[str, Any] = {}
        self._step_start: float | None = None

    @property
    def state_key(self) -> str:
        return f"RebuildCallback[{self.label}]"

    # ----- checkpoint state -----

    def state_dict(self) -> dict[str, Any]:
        state = {"last_step": self.last_step, "identity": self.identity, "index_dir": self.path, "k": self.k}
        return {**state, "parts": self.parts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step, self.identity, self.path = state["last_step"], state["identity"], state["index_dir"]
        self._restored_k = state.get("k")
        self.parts = state.get("parts")

    # ----- hooks -----

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._root = Path(self.index_dir or Path(trainer.default_root_dir) / "retrieval_index").resolve()
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
        """Reuse the checkpoint's table, else build one: blocking, or in the background, where training runs
        without retrieval (the owner has no memory) until the first table is swapped in."""
        if self._ready:
            return
        self._ready = True
        if (self._reuse_parts(trainer) if self._sharded(trainer) else self._try_reuse()) or self.defer_first:
            return
        if self.mode == "blocking":
            self._rebuild_blocking(trainer, trainer.global_step)
        else:
            self._start_background(trainer, trainer.global_step)

    def _try_reuse(self) -> bool:
        """Load the index directory the checkpoint names, when it exists and matches; else False."""
        if self.path is None or self.identity is None or getattr(self, "_restored_k", None) != self.k:
            return False
        if not self._same_width():
            return False
        if self.parts is not None:  # a sharded index, now resumed on one process: rebuild
            return False
        try:
            memory = load_memory(Path(self.path), self.segments, self.identity, self.k)
            if self.table and memory.neighbours is None:
                raise IndexMismatchError(
                    f"index at {self.path} has no neighbour table (built for lookup 'search')"
                )
        except (IndexNotFoundError, IndexMismatchError, FileNotFoundError) as err:
            print(f"rlm: not reusing the checkpoint's index ({err}); building a new one", file=sys.stderr)
            return False
        self._take(memory, "reused")
        return True

    def _width(self, width: int | None = None) -> int | None:
        """The width the index narrows to at this corpus size (None: full width); `width` of the vectors if known."""
        return index_width(self.index_dim, width, len(self.rows), self.shard_above)

    def _same_width(self) -> bool:
        """Whether the checkpoint's index was narrowed as index_dim asks now (else it is rebuilt, with a log line):
        its projection identity against the width this configuration wants."""
        have = self.identity.get("projection")
        want = self._width(have["in_dim"] if have else None)
        if (have["dim"] if have else None) == want:
            return True
        print(
            f"rlm: not reusing the checkpoint's index (its vectors are {have['dim'] if have else 'full'} wide, "
            f"index_dim={self.index_dim!r} wants {want or 'full'}); building a new one",
            file=sys.stderr,
        )
        return False

    def _narrow(
        self, shard: np.ndarray, identity: dict[str, Any], collective: bool
    ) -> tuple[np.ndarray, dict[str, Any], Projection | None]:
        """(this rank's vectors in the index's width, the identity that records the projection, the projection):
        the PCA is fitted on the vectors about to be indexed (collective: on a sample of every rank's, the same on
        every rank); none when the index stays full width."""
        if self._width() is None:
            return shard, with_projection(identity, None), None
        if collective:
            projection = fit_projection_across_ranks(shard, self._width)
        else:
            projection = fit_projection(shard, self._width(shard.shape[1]))
        return projection.apply(shard), with_projection(identity, projection), projection

    def _sharded(self, trainer: pl.Trainer) -> bool:
        return shards(self.sharded, trainer.world_size, len(self.rows), self.shard_above)

    def _reuse_parts(self, trainer: pl.Trainer) -> bool:
        """Each rank reloads its own part of the checkpoint's sharded index; all ranks reuse, or all rebuild."""
        from rlm.index.sharded import load_sharded_memory

        memory = None
        restored = self.parts is not None and self.identity is not None and self._same_width()
        if restored and getattr(self, "_restored_k", None) == self.k:
            try:
                memory = load_sharded_memory(self.parts, self.segments, self.rows, self.identity, self.k)
            except (IndexNotFoundError, IndexMismatchError, FileNotFoundError):
                memory = None
            if memory is not None and self.table and memory.neighbours is None:
                memory = None  # built without a table (lookup 'search'): rebuild
        if not trainer.strategy.reduce_boolean_decision(memory is not None, all=True):
            return False
        check_same_table(trainer, memory.neighbours)
        self._take(memory, "reused")
        return True

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._job is not None:
            self._collect(trainer, wait=False)
        if self._job is None and self.schedule.due(step, self.last_step):
            if self.mode == "blocking":
                self._rebuild_blocking(trainer, step)
            else:
                self._start_background(trainer, step)
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

    # ----- rebuilding -----

    def _path_for(self, step: int) -> Path:
        return self._root / f"step-{step:09d}"

    def _rebuild_blocking(self, trainer: pl.Trainer, step: int) -> None:
        start = time.perf_counter()
        embedder = self.owner.snapshot(step)
        rank, world = trainer.global_rank, trainer.world_size
        shard = embed_rows(embedder, self.segments, self.rows, self.batch_size, rank, world, self.progress)
        memory = self._finish(trainer, shard, embedder.embedder_identity(), step)
        self.last_seconds = self.blocked_seconds = time.perf_counter() - start
        self._take(memory, "built")

    def _finish(
        self, trainer: pl.Trainer, shard: np.ndarray, identity: dict[str, Any], step: int
    ) -> RetrievalMemory:
        """Narrow the vectors (index_dim), gather the shards, build on rank 0, and give every rank the memory rank 0
        wrote."""
        path = self._path_for(step)
        shard, identity, projection = self._narrow(shard, identity, trainer.world_size > 1)
        args = (self.segments, self.rows, self.k, identity, step, self.index_config, path, self.table)
        if self._sharded(trainer):  # each rank keeps its part; the table is merged from every part
            from rlm.index.sharded import build_sharded_memory

            memory = build_sharded_memory(shard, *args, projection)
            check_same_table(trainer, memory.neighbours)
            return memory
        if trainer.world_size == 1:
            return build_memory(shard, *args, projection)
        vectors = gather_shards(trainer, shard, len(self.rows))  # narrowed first: m wide, not D
        if trainer.global_rank == 0:
            build_memory(vectors, *args, projection)
        trainer.strategy.barrier("retrieval-rebuild")
        memory = load_memory(path, self.segments, identity, self.k)
        check_same_table(trainer, memory.neighbours)
        return memory

    def _start_background(self, trainer: pl.Trainer, step: int) -> None:
        embedder = self.owner.snapshot(step)  # copied now, on the main thread, at a step boundary
        rank, world = trainer.global_rank, trainer.world_size
        result: dict[str, Any] = {"step": step, "start": time.perf_counter()}
        # a sharded build without a table needs no collective: each rank indexes and writes its own part here; with
        # a projection to fit (a collective under DDP) the thread embeds, the training thread fits (_collect), and a
        # second thread indexes and writes
        alone = self._sharded(trainer) and not self.table
        fit_first = alone and self._width() is not None

        def work() -> None:
            shard = embed_rows(embedder, self.segments, self.rows, self.batch_size, rank, world, False)
            result["identity"] = embedder.embedder_identity()
            # no collective is needed: the whole rebuild (one process) or this rank's part runs here
            if (alone or world == 1) and not fit_first:
                shard, identity, projection = self._narrow(shard, result["identity"], collective=False)
                self._build_alone(result, shard, identity, projection, alone)
            else:
                result["shard"] = shard
                result["then_alone"] = fit_first

        self._run_job(result, work)

    def _build_alone(
        self,
        result: dict[str, Any],
        shard: np.ndarray,
        identity: dict[str, Any],
        projection: Projection | None,
        part: bool,
    ) -> None:
        """The non-collective build of the thread: the whole index (one process) or this rank's part (sharded,
        without a table), into result["memory"]."""
        from rlm.index.sharded import build_sharded_memory

        build = build_sharded_memory if part else build_memory
        args = (self.segments, self.rows, self.k, identity, result["step"], self.index_config)
        result["memory"] = build(shard, *args, self._path_for(result["step"]), self.table, projection)

    def _run_job(self, result: dict[str, Any], work: Any) -> None:
        """Run work() in the rebuild thread, on a CUDA stream of its own; its error is reported on the training thread
        (_collect)."""
        stream = rebuild_stream()

        def guarded() -> None:
            try:
                with torch.cuda.stream(stream):  # None: no CUDA, nothing to switch
                    work()
            except BaseException as err:  # reported on the main thread
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
        if isinstance(result.get("error"), OSError):  # a full disk: the path is named, one error line
            raise result["error"]
        if "error" in result:
            raise RuntimeError(f"background index rebuild of step {result['step']} failed") from result[
                "error"
            ]
        memory, start = result.get("memory"), time.perf_counter()
        if memory is None and result.pop("then_alone", False):  # fit the projection here (a collective), then
            shard, identity, projection = self._narrow(
                result.pop("shard"), result["identity"], collective=True
            )
            result["blocked"] = time.perf_counter() - start
            self._run_job(result, lambda: self._build_alone(result, shard, identity, projection, part=True))
            return  # the part is indexed and written in the thread; collected like any other
        if memory is None:  # the collective part, on the training thread
            memory = self._finish(trainer, result["shard"], result["identity"], result["step"])
        elif memory.collective:
            check_same_table(trainer, memory.neighbours)  # the ranks agree: no table on any
        blocked = time.perf_counter() - start if "shard" in result else 0.0
        self.blocked_seconds = blocked + result.get("blocked", 0.0)
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
        """Delete all but the newest `keep` rebuild directories (the current one always stays)."""
        if current is None or not self._root.exists():
            return
        if self.parts is not None:  # every rank prunes (its filesystem may be its own), whole rebuilds
            current = current.parent
        elif not self._writer:
            return
        old = sorted(p for p in self._root.glob("step-*") if p.is_dir() and p.resolve() != current.resolve())
        for p in old[: max(0, len(old) - (self.keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
