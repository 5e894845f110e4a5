"""Training an experiment's runs, each an ordinary ``rlm fit`` subprocess, resumably: one after another, or
``jobs`` at once on this machine (:func:`run_experiment`); :func:`execute` is one run's whole work, the same
in a SLURM job (rlm.experiment.submit)."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from queue import Queue
from typing import Any

import torch
import yaml
from tqdm import tqdm

from rlm.experiment.check import count_parameters
from rlm.experiment.spec import Experiment, config_hash, run_config, variant_config, write_atomic
from rlm.train.checkpoint import PREEMPTED
from rlm.train.resume import newest_loadable

SUMMARY = "summary.json"
"""The finished marker of a run, written last."""
METRICS_CSV = Path("logs") / "version_0" / "metrics.csv"
LAST_CKPT = Path("ckpt") / "last.ckpt"
TEST_JSON = "test.json"
"""``rlm eval`` of the last checkpoint on the test split, written when training has finished."""
KNNLM_JSON = "test_knnlm.json"
"""``rlm eval --datastore`` of the last checkpoint on the test split (a variant with a ``knnlm`` stage)."""
DATASTORE = "datastore"
"""The kNN-LM stage's datastore directory; removed after evaluation unless the variant keeps it (its meta.json
stays as datastore_meta.json)."""
JOB_JSON = "job.json"
"""Where a run is executed and how it went: ``state`` (queued, running, done, failed, stopped), pid, host, job
id, times, and the log to read on failure; ``rlm experiment status`` reads it."""
CORE_METRICS = {
    "epoch", "step", "train/loss", "train/ppl", "train/total_loss", "train/tokens_per_s",
    "val/loss", "val/ppl", "time/train_s",
}  # fmt: skip
"""metrics.csv columns that are not plugin metrics."""


@dataclass
class Run:
    """One (variant, seed) of an experiment."""

    variant: str
    seed: int
    dir: Path
    config: dict[str, Any]
    """The merged config before the runner's own keys."""
    knnlm: dict[str, Any] | None = None
    """The variant's kNN-LM stage options (rlm.experiment.spec.KNNLM_OPTIONS), or None; not in the fingerprint."""

    @property
    def label(self) -> str:
        return f"{self.variant}/seed{self.seed}"

    @property
    def fingerprint(self) -> str:
        return config_hash({"config": self.config, "seed": self.seed})

    def finished(self) -> bool:
        return (self.dir / SUMMARY).is_file()

    def complete(self) -> bool:
        """Finished, with the kNN-LM stage too when the variant has one: nothing left to do."""
        if not self.finished():
            return False
        return self.knnlm is None or bool(json.loads((self.dir / SUMMARY).read_text()).get("knnlm"))


def plan(exp: Experiment, out: Path, variants: list[str] | None = None) -> list[Run]:
    """Every run of the experiment (restricted to ``variants`` when given), in file order, seeds inner."""
    names = list(exp.variants)
    if variants:
        unknown = sorted(set(variants) - set(names))
        if unknown:
            raise ValueError(f"unknown variant(s) {unknown}; the experiment has {names}")
        names = [n for n in names if n in variants]
    return [
        Run(
            name,
            seed,
            out / name / f"seed{seed}",
            variant_config(exp, exp.variants[name]),
            exp.variants[name].knnlm,
        )
        for name in names
        for seed in exp.seeds
    ]


def read_metrics(path: Path) -> list[dict[str, float]]:
    """metrics.csv rows with their non-empty cells as floats."""
    if not path.is_file():
        return []
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v not in (None, "")} for row in csv.DictReader(f)]


def series(rows: list[dict[str, float]], name: str) -> list[tuple[float, float]]:
    """(step, value) of one metric, in logging order."""
    return [(r.get("step", float("nan")), r[name]) for r in rows if name in r]


def _last(rows: list[dict[str, float]], name: str) -> float | None:
    values = series(rows, name)
    return values[-1][1] if values else None


def summarize(run: Run, wall_s: float) -> dict[str, Any]:
    """The per-run summary: final validation loss, parameter counts, speed, time and plugin metrics."""
    rows = run_metrics(run.dir)
    val_series = series(rows, "val/loss")
    val = [v for _, v in val_series]
    speed = [v for _, v in series(rows, "train/tokens_per_s")]
    # The median of the second half: the first steps pay for warm-up, allocation and caching.
    tokens_per_s = statistics.median(speed[len(speed) // 2 :]) if speed else None
    hp = torch.load(run.dir / LAST_CKPT, map_location="cpu", weights_only=False, mmap=True)[
        "hyper_parameters"
    ]
    counts = count_parameters(hp["model"], hp.get("plugins"))
    plugin_metrics = sorted({k for r in rows for k in r} - CORE_METRICS)
    test = json.loads((run.dir / TEST_JSON).read_text()) if (run.dir / TEST_JSON).is_file() else {}
    return {
        "variant": run.variant,
        "seed": run.seed,
        "fingerprint": run.fingerprint,
        "val_loss": val[-1] if val else None,
        "val_ppl": _last(rows, "val/ppl"),
        "best_val_loss": min(val) if val else None,
        "val_step": int(val_series[-1][0]) + 1 if val_series else None,
        "test_loss": test.get("loss"),
        "test_ppl": test.get("ppl"),
        "test_bpb": test.get("bpb"),
        "steps": int(max((r["step"] for r in rows if "step" in r), default=-1)) + 1,
        "params_total": counts.total,
        "params_added": counts.added,
        "params_active": counts.active,
        "tokens_per_s": tokens_per_s,
        "train_s": _last(rows, "time/train_s"),
        "wall_s": wall_s,
        "metrics": {k: _last(rows, k) for k in plugin_metrics if not k.startswith("lr-")},
    }


def run_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The run's metrics.csv rows with the history of earlier attempts stitched in front.

    Each resume keeps the previous attempt's log as ``metrics.part-K.csv`` (the CSV logger would delete it);
    rows of an earlier part at or after the first step of the next one were trained again and are dropped."""
    current = run_dir / METRICS_CSV
    parts = sorted(current.parent.glob("metrics.part-*.csv"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    chunks = [read_metrics(p) for p in [*parts, current]]
    rows: list[dict[str, float]] = []
    for i, chunk in enumerate(chunks):
        later = [r["step"] for c in chunks[i + 1 :] for r in c if "step" in r]
        cut = min(later, default=math.inf)
        rows += [r for r in chunk if r.get("step", -1) < cut]
    return rows


def _keep_metrics(run: Run) -> None:
    """Move the last attempt's metrics.csv aside before a resume, for :func:`run_metrics` to stitch."""
    current = run.dir / METRICS_CSV
    if current.is_file():
        k = len(list(current.parent.glob("metrics.part-*.csv")))
        os.replace(current, current.with_name(f"metrics.part-{k}.csv"))


def _prepare_dir(run: Run) -> list[str]:
    """Make the run directory ready; the extra ``rlm fit`` arguments (a checkpoint to resume from)."""
    saved = run.dir / "fingerprint"
    if run.dir.exists():
        same = saved.is_file() and saved.read_text().strip() == run.fingerprint
        if same and (run.dir / LAST_CKPT).parent.is_dir():
            try:  # the newest checkpoint that loads; damaged ones are skipped with a line in the output
                path, _ = newest_loadable([run.dir / LAST_CKPT.parent], say=tqdm.write, remove_damaged=True)
            except ValueError as err:
                tqdm.write(f"{run.label}: {err}; starting afresh")
            else:
                _keep_metrics(run)
                return ["--ckpt_path", str(path)]
        job = (run.dir / JOB_JSON).read_text() if (run.dir / JOB_JSON).is_file() else None
        shutil.rmtree(run.dir)  # an unfinished run of another config, or one that saved nothing loadable
        if job is not None:
            write_atomic(run.dir / JOB_JSON, job)
    run.dir.mkdir(parents=True, exist_ok=True)
    write_atomic(saved, run.fingerprint + "\n")
    return []


def train(run: Run) -> tuple[bool, float]:
    """Train one run with ``python -m rlm fit``; (succeeded, wall seconds including earlier attempts)."""
    extra = _prepare_dir(run)
    config_path = run.dir / "config.yaml"
    write_atomic(config_path, yaml.safe_dump(run_config(run.config, run.seed, run.dir), sort_keys=False))
    wall_file = run.dir / "wall_s"
    before = float(wall_file.read_text()) if wall_file.is_file() else 0.0
    start = time.perf_counter()
    with open(run.dir / "fit.log", "a") as log:
        code = _run_forwarding_sigterm(
            [sys.executable, "-m", "rlm", "fit", "--config", str(config_path), *extra], log, _child_env()
        )
    wall = before + time.perf_counter() - start
    write_atomic(wall_file, f"{wall}\n")
    if code in (PREEMPTED, -signal.SIGTERM):
        raise Preempted(f"{run.label}: stopped by SIGTERM after {wall:.0f}s; its last.ckpt is kept, and the next "
                        "`rlm experiment run` resumes it")  # fmt: skip
    return code == 0, wall


class Preempted(Exception):
    """The running rlm fit was stopped by SIGTERM: the experiment stops, its run stays unfinished."""


_LIVE: set[subprocess.Popen] = set()
"""The rlm subprocesses running now (several under ``jobs`` > 1): a SIGTERM to the runner goes to each."""
_THREAD = threading.local()
"""``env``: the environment a job thread adds to its subprocesses (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS)."""


def _child_env() -> dict[str, str]:
    return {**os.environ, **getattr(_THREAD, "env", {}), "PYTHONUNBUFFERED": "1"}


@contextmanager
def _forwarding_sigterm() -> Iterator[None]:
    """While inside, a SIGTERM to this process is passed on to every live rlm subprocess (a scheduler that
    signals only the runner still gets its training saved). Outside the main thread it does nothing: there the
    main thread forwards."""
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop_children(signum, wait_s=0))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_children(signum: int = signal.SIGTERM, wait_s: float = 0) -> None:
    """Send ``signum`` to every live rlm subprocess and wait up to ``wait_s`` seconds for them to exit (rlm fit
    saves last.ckpt and exits 143 on SIGTERM)."""
    procs = list(_LIVE)
    for proc in procs:
        proc.send_signal(signum)
    deadline = time.monotonic() + wait_s
    while not all(exited(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)


def exited(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` has ended, without reaping it: a signal handler may run in the thread that waits for it
    (submitit's checkpoint does), holding Popen's wait lock, so Popen.wait and poll cannot tell."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def _ignore_usr2() -> None:  # pragma: no cover - runs in the child between fork and exec
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def _run_forwarding_sigterm(cmd: list[str], log: Any, env: dict[str, str]) -> int:
    """Run ``cmd`` and return its exit code, passing a SIGTERM to this process on to it.

    In a submitit job SLURM's warning signal (USR2) reaches every process of the job; the child ignores it,
    so that it stops only by the job's checkpoint (rlm.experiment.submit), which sends it SIGTERM."""
    preexec = _ignore_usr2 if os.environ.get("SUBMITIT_EXECUTOR") else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec)
    _LIVE.add(proc)
    try:
        with _forwarding_sigterm():
            return proc.wait()
    finally:
        _LIVE.discard(proc)


def evaluate_test(run: Run) -> bool:
    """``rlm eval`` of the run's last checkpoint on the whole test split (test.json); whether it succeeded.
    Nothing to do when the config sets data.test_fraction to 0 (no test split)."""
    if (run.config.get("data") or {}).get("test_fraction", 1) == 0:
        return True
    with open(run.dir / "fit.log", "a") as log:
        code = _run_forwarding_sigterm(
            [sys.executable, "-m", "rlm", "eval", "--ckpt", str(run.dir / LAST_CKPT), "--split", "test",
             "--json", str(run.dir / TEST_JSON)], log, _child_env(),
        )  # fmt: skip
    if code in (PREEMPTED, -signal.SIGTERM):
        raise Preempted(f"{run.label}: the test evaluation was stopped by SIGTERM; the next run repeats it")
    return code == 0


def find_equal_run(run: Run, out: Path) -> Path | None:
    """A finished run with the same fingerprint (merged config and seed) in a sibling experiment directory of
    ``out`` (e.g. runs/experiments/*): the base models of most experiment files are the same run."""
    for summary in sorted(out.parent.glob(f"*/*/seed{run.seed}/{SUMMARY}")):
        if summary.parent.resolve() == run.dir.resolve():
            continue
        try:
            stored = json.loads(summary.read_text())
        except (OSError, ValueError):
            continue
        if stored.get("fingerprint") == run.fingerprint:
            return summary.parent
    return None


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # finished runs are never written again: hard links cost no space
    except OSError:
        shutil.copy2(src, dst)


def reuse(run: Run, source: Path) -> dict[str, Any]:
    """Make run.dir a copy (hard links) of the equal finished run at ``source``; its summary names the source."""
    summary = without_knnlm(json.loads((source / SUMMARY).read_text()))
    summary.update(variant=run.variant, reused_from=summary.get("reused_from") or str(source.resolve()))
    tmp = run.dir.with_name(run.dir.name + ".reuse-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ignore = shutil.ignore_patterns(
        SUMMARY, KNNLM_JSON, DATASTORE, "datastore_meta.json", "knnlm.log", JOB_JSON
    )
    shutil.copytree(source, tmp, copy_function=_link_or_copy, ignore=ignore)
    write_atomic(tmp / SUMMARY, json.dumps(summary, indent=2) + "\n")
    if run.dir.exists():
        shutil.rmtree(run.dir)
    run.dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, run.dir)  # the run appears finished in one step
    return summary


def knnlm_stage(run: Run) -> bool:
    """``rlm knnlm build`` over the run's training split, then ``rlm eval --datastore`` on the test split
    (test_knnlm.json); whether both succeeded. The datastore is removed afterwards unless the variant keeps it."""
    options, ckpt, ds = run.knnlm or {}, str(run.dir / LAST_CKPT), run.dir / DATASTORE
    build = [sys.executable, "-m", "rlm", "knnlm", "build", "--ckpt", ckpt, "--out", str(ds)]
    for key in ("layer", "factory", "k", "flat_below", "target_recall", "tune_tokens", "max_documents"):
        if key in options:
            build += [f"--{key.replace('_', '-')}", str(options[key])]
    evaluate = [sys.executable, "-m", "rlm", "eval", "--ckpt", ckpt, "--split", "test", "--datastore", str(ds),
                "--json", str(run.dir / KNNLM_JSON), *(["--knn-cache"] if options.get("cache") else [])]  # fmt: skip
    with open(run.dir / "knnlm.log", "a") as log:
        for cmd in (build, evaluate):
            code = _run_forwarding_sigterm(cmd, log, _child_env())
            if code in (PREEMPTED, -signal.SIGTERM):
                raise Preempted(
                    f"{run.label}: the kNN-LM stage was stopped by SIGTERM; the next run repeats it"
                )
            if code != 0:
                return False
    if not options.get("keep"):
        shutil.copy2(ds / "meta.json", run.dir / "datastore_meta.json")
        shutil.rmtree(ds)
    return True


def with_knnlm(summary: dict[str, Any], run: Run) -> dict[str, Any]:
    """The summary of a run with a kNN-LM stage: test_* are the kNN-LM's, lm_test the model's alone, and knnlm
    says how (lam, temperature, k, the datastore's size and build time)."""
    r = json.loads((run.dir / KNNLM_JSON).read_text())
    meta_path = run.dir / DATASTORE / "meta.json"
    meta = json.loads((meta_path if meta_path.is_file() else run.dir / "datastore_meta.json").read_text())
    knn, lm = r["knnlm"], r["lm"]
    out = dict(summary)
    out["lm_test"] = {"loss": lm["loss"], "ppl": lm["ppl"], "bpb": lm["bpb"]}
    out.update(test_loss=knn["loss"], test_ppl=knn["ppl"], test_bpb=knn["bpb"])
    out["knnlm"] = {
        "options": run.knnlm, "lam": r["lam"], "temperature": r["temperature"], "k": r["k"], "cache": r["cache"],
        "keys": meta.get("entries"), "factory": meta.get("factory"), "build_s": sum((meta.get("seconds") or {}).values()) or None,
        "eval_s": r.get("seconds"), "target_in_neighbours": r.get("target_in_neighbours"),
    }  # fmt: skip
    return out


def without_knnlm(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary as the model alone scored it (for a run that reuses this one's training)."""
    out = dict(summary)
    if out.pop("knnlm", None) is not None:
        lm = out.pop("lm_test")
        out.update(test_loss=lm["loss"], test_ppl=lm["ppl"], test_bpb=lm["bpb"])
    return out


def log_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(f"    {ln}" for ln in text[-lines:])


def write_job(run_dir: Path, **fields: Any) -> None:
    """Update the run's job.json with ``fields`` (and the time of this update)."""
    path = run_dir / JOB_JSON
    try:
        job = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        job = {}
    job.update(fields, updated=time.time())
    write_atomic(path, json.dumps(job, indent=2) + "\n")


def execute(
    run: Run, out: Path, reuse_equal: bool = True, env: dict[str, str] | None = None
) -> dict[str, Any] | None:
    """One run's whole work: train (or reuse an equal finished run), evaluate on the test split, the kNN-LM
    stage when the variant has one, then summary.json. Returns the summary, or None if a step failed; a
    finished run is skipped. ``env`` is added to the environment of its subprocesses. Raises
    :class:`Preempted` when SIGTERM stopped it (the run stays unfinished and resumes next time)."""
    _THREAD.env = env or {}
    try:
        return _execute(run, out, reuse_equal)
    except BaseException as err:
        if run.dir.is_dir() and not run.finished():
            # Preempted, a submitit checkpoint's exit or Ctrl-C leave a resumable run; anything else is a bug
            stopped = isinstance(err, (Preempted, SystemExit, KeyboardInterrupt))
            write_job(run.dir, state="stopped" if stopped else "failed", ended=time.time(),
                      reason=f"{type(err).__name__}: {err}")  # fmt: skip
        raise
    finally:
        _THREAD.env = {}


def _execute(run: Run, out: Path, reuse_equal: bool) -> dict[str, Any] | None:
    if run.finished():
        summary = json.loads((run.dir / SUMMARY).read_text())
        if run.knnlm is None or summary.get("knnlm"):
            note = (
                ""
                if summary.get("fingerprint") == run.fingerprint
                else " (its config has changed since: delete the directory to rerun)"
            )
            tqdm.write(f"{run.label}: finished earlier, skipped{note}")
            return summary
    elif (source := find_equal_run(run, out) if reuse_equal else None) is not None:
        summary = reuse(run, source)
        tqdm.write(f"{run.label}: same config and seed as {source}, reused")
    else:
        slurm = {"job_id": os.environ["SLURM_JOB_ID"]} if "SLURM_JOB_ID" in os.environ else {}
        write_job(run.dir, state="running", pid=os.getpid(), host=socket.gethostname(), started=time.time(),
                  ended=None, **slurm, **_THREAD.env)  # fmt: skip
        ok, wall = train(run)
        step = "rlm fit"
        if ok:  # validation during training; the test split once, at the end
            ok, step = evaluate_test(run), "rlm eval"
        if not ok:
            write_job(run.dir, state="failed", step=step, log=str(run.dir / "fit.log"), ended=time.time())
            tqdm.write(
                f"{run.label}: {step} failed after {wall:.0f}s; end of {run.dir / 'fit.log'}:\n{log_tail(run.dir / 'fit.log')}"
            )
            return None
        summary = summarize(run, wall)
        write_atomic(run.dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    if run.knnlm is not None:
        if not knnlm_stage(run):
            write_job(
                run.dir, state="failed", step="kNN-LM", log=str(run.dir / "knnlm.log"), ended=time.time()
            )
            tqdm.write(f"{run.label}: the kNN-LM stage failed; end of {run.dir / 'knnlm.log'}:\n"
                       f"{log_tail(run.dir / 'knnlm.log')}")  # fmt: skip
            return None
        summary = with_knnlm(summary, run)
        write_atomic(run.dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    write_job(run.dir, state="done", ended=time.time())
    loss, test = summary.get("val_loss"), summary.get("test_loss")
    tqdm.write(
        f"{run.label}: val loss {loss if loss is None else round(loss, 4)}, "
        f"test loss {test if test is None else round(test, 4)}"
        + (" (kNN-LM)" if run.knnlm is not None else "")
        + (f" in {summary['wall_s']:.0f}s" if summary.get("wall_s") is not None else "")
    )
    return summary


def groups(runs: list[Run]) -> list[list[Run]]:
    """Runs to execute one after another within one job: those with the same fingerprint (config and seed)
    share a job, so that the later ones reuse the first instead of training the same model at the same time.
    Groups are in the order of their first run."""
    by_print: dict[str, list[Run]] = {}
    for run in runs:
        by_print.setdefault(run.fingerprint, []).append(run)
    return list(by_print.values())


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_slots(jobs: int) -> list[dict[str, str]]:
    """The environment of each of ``jobs`` concurrent runs on this machine: a GPU of its own
    (CUDA_VISIBLE_DEVICES) when there are GPUs, otherwise an equal share of the CPU cores (OMP_NUM_THREADS)."""
    if jobs < 1:
        raise ValueError(f"--jobs {jobs}: expected a positive number of runs at once")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        gpus = [str(i) for i in range(torch.cuda.device_count())]
    if gpus:
        if jobs > len(gpus):
            raise ValueError(
                f"--jobs {jobs}: only {len(gpus)} GPU(s) visible ({','.join(gpus)}), and each run gets one; "
                f"use --jobs {len(gpus)} or fewer"
            )
        return [{"CUDA_VISIBLE_DEVICES": gpu} for gpu in gpus[:jobs]]
    return [{"OMP_NUM_THREADS": str(max(1, _cpu_count() // jobs))} for _ in range(jobs)]


def _run_pool(runs: list[Run], out: Path, reuse_equal: bool, jobs: int, desc: str) -> list[str]:
    """Execute the runs ``jobs`` at once, each group of equal runs in one thread that waits on its rlm
    subprocesses; returns the failed labels. After a SIGTERM no further run starts."""
    free: Queue[dict[str, str]] = Queue()
    for slot in local_slots(jobs):
        free.put(slot)
    stop = threading.Event()

    def work(group: list[Run]) -> list[str]:
        failed = []
        env = free.get()
        try:
            for run in group:
                if stop.is_set():
                    break
                if execute(run, out, reuse_equal, env) is None:
                    failed.append(run.label)
        except Preempted:
            stop.set()
            raise
        finally:
            free.put(env)
        return failed

    failed: set[str] = set()
    stopped: Preempted | None = None
    with _forwarding_sigterm(), ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(work, group) for group in groups(runs)]
        for future in tqdm(as_completed(futures), total=len(futures), desc=desc, unit="job"):
            try:
                failed.update(future.result())
            except Preempted as err:
                stopped = stopped or err
    if stopped is not None:
        raise stopped
    return [run.label for run in runs if run.label in failed]


def run_experiment(
    exp: Experiment, out: Path, variants: list[str] | None = None, reuse_equal: bool = True, jobs: int = 1
) -> list[str]:
    """Train every unfinished run, write each one's summary; returns the labels of the runs that failed.

    With ``reuse_equal``, a run whose config and seed equal a finished run of a sibling experiment directory
    is taken from there (hard links) instead of being trained again. ``jobs`` > 1 runs that many at once."""
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "experiment.json", json.dumps(exp.to_json(), indent=2) + "\n")
    runs = plan(exp, out, variants)
    if jobs > 1:
        return _run_pool(runs, out, reuse_equal, jobs, desc=f"experiment {exp.name}")
    failed = []
    bar = tqdm(runs, desc=f"experiment {exp.name}", unit="run")
    for run in bar:
        bar.set_postfix_str(run.label)
        if execute(run, out, reuse_equal) is None:
            failed.append(run.label)
    return failed
