"""Training an experiment's runs resumably, each an ordinary ``rlm fit`` subprocess, here (:func:`run_experiment`)
or in a SLURM job (:func:`execute`); a SIGTERM to the runner goes on to its subprocesses (rlm fit then saves)."""

from __future__ import annotations

import json
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
from pathlib import Path
from queue import Queue
from typing import Any

import torch
import yaml
from tqdm import tqdm

from rlm.cli.summary import val_subset
from rlm.experiment.check import count_parameters
from rlm.experiment.runs import (
    FINGERPRINT,
    JOB_JSON,
    LAST_CKPT,
    METRICS_CSV,
    SUMMARY,
    TEST_JSON,
    Run,
    begin,
    log_tail,
    read_json,
    run_metrics,
    series,
)
from rlm.experiment.spec import Experiment, run_config, write_atomic
from rlm.train.checkpoint import PREEMPTED, load_checkpoint_file
from rlm.train.resume import newest_loadable

KNNLM_JSON = "test_knnlm.json"  # rlm eval --datastore of the last checkpoint on the test split
DATASTORE = "datastore"  # removed after evaluation; its meta.json stays as datastore_meta.json
# a run's own files, not taken over when an equal run is reused
NOT_REUSED = (SUMMARY, KNNLM_JSON, DATASTORE, "datastore_meta.json", "knnlm.log", JOB_JSON)

# metrics.csv columns that are not plugin metrics
CORE_METRICS = {
    "epoch", "step", "train/loss", "train/ppl", "train/total_loss", "train/tokens_per_s",
    "val/loss", "val/ppl", "time/train_s", "time/load",
}  # fmt: skip


class Preempted(Exception):
    """The running rlm subprocess was stopped by SIGTERM: the experiment stops, its run stays unfinished."""


_LIVE: set[subprocess.Popen] = set()  # the rlm subprocesses running now: a SIGTERM to the runner goes to each
_THREAD = threading.local()  # .env: what a job thread adds to its subprocesses' environment


def _child_env() -> dict[str, str]:
    return {**os.environ, **getattr(_THREAD, "env", {}), "PYTHONUNBUFFERED": "1"}


@contextmanager
def _forwarding_sigterm() -> Iterator[None]:
    """While inside, a SIGTERM to this process is passed on to every live rlm subprocess, so a scheduler
    that signals only the runner still gets its training saved; off the main thread, which forwards, nothing."""
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop_children())
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_children(wait_s: float = 0) -> None:
    """SIGTERM to every live rlm subprocess (rlm fit then saves), and wait up to ``wait_s`` s for them to exit."""
    procs = list(_LIVE)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
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
    """Run ``cmd`` and return its exit code, passing a SIGTERM to this process on to it. Under submitit
    the child ignores SLURM's warning signal (USR2), so that only the job's checkpoint stops it (with SIGTERM)."""
    preexec = _ignore_usr2 if os.environ.get("SUBMITIT_EXECUTOR") else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec)
    _LIVE.add(proc)
    try:
        with _forwarding_sigterm():
            return proc.wait()
    finally:
        _LIVE.discard(proc)


def _rlm(run: Run, args: list[str], log_name: str, what: str) -> bool:
    """``python -m rlm ARGS`` into the run's log; whether it succeeded (:class:`Preempted` on SIGTERM)."""
    with open(run.dir / log_name, "a") as log:
        code = _run_forwarding_sigterm([sys.executable, "-m", "rlm", *args], log, _child_env())
    if code in (PREEMPTED, -signal.SIGTERM):
        raise Preempted(f"{run.label}: {what} was stopped by SIGTERM; the next run repeats it")
    return code == 0


def _last(rows: list[dict[str, float]], name: str) -> float | None:
    values = series(rows, name)
    return values[-1][1] if values else None


def _keep_metrics(run: Run) -> None:
    """Move the last attempt's metrics.csv aside before a resume, for :func:`run_metrics` to stitch."""
    current = run.dir / METRICS_CSV
    if current.is_file():
        k = len(list(current.parent.glob("metrics.part-*.csv")))
        os.replace(current, current.with_name(f"metrics.part-{k}.csv"))


def _late_median(rows: list[dict[str, Any]], key: str) -> float | None:
    """The median over the second half of the steps: the first pay for warm-up, allocation and caching."""
    values = [v for _, v in series(rows, key)]
    return statistics.median(values[len(values) // 2 :]) if values else None


def summarize(run: Run, wall_s: float, jobs: int = 1) -> dict[str, Any]:
    """The per-run summary: losses, parameter counts, speed beside the machine's load, times, plugin metrics."""
    rows = run_metrics(run.dir)
    val_series = series(rows, "val/loss")
    val = [v for _, v in val_series]
    ckpt = torch.load(run.dir / LAST_CKPT, map_location="cpu", weights_only=False, mmap=True)
    counts = count_parameters(ckpt["hyper_parameters"]["model"], ckpt["hyper_parameters"].get("plugins"))
    plugin_metrics = sorted({k for r in rows for k in r} - CORE_METRICS)
    test = json.loads((run.dir / TEST_JSON).read_text()) if (run.dir / TEST_JSON).is_file() else {}
    return {
        "variant": run.variant, "seed": run.seed, "fingerprint": run.fingerprint, "val_loss": val[-1] if val else None,
        # batches each validation read (trainer.limit_val_batches; None: the whole split), for the loss's label
        "val_batches": (run.config.get("trainer") or {}).get("limit_val_batches"),
        "val_ppl": _last(rows, "val/ppl"), "best_val_loss": min(val) if val else None,
        "val_step": int(val_series[-1][0]) + 1 if val_series else None,
        "test_loss": test.get("loss"), "test_ppl": test.get("ppl"), "test_bpb": test.get("bpb"),
        "steps": int(max((r["step"] for r in rows if "step" in r), default=-1)) + 1,
        "params_total": counts.total, "params_added": counts.added, "params_active": counts.active,
        "tokens_per_s": _late_median(rows, "train/tokens_per_s"),
        "load": _late_median(rows, "time/load"),  # the 1-minute load average at the same steps (TrainClock)
        "cores": _cpu_count(), "jobs": jobs, "train_s": _last(rows, "time/train_s"), "wall_s": wall_s,
        "metrics": {k: _last(rows, k) for k in plugin_metrics if not k.startswith("lr-")},
    }  # fmt: skip


def _reached_end(run: Run, ckpt: dict[str, Any]) -> bool:
    """Whether ``ckpt`` was saved at trainer.max_steps: resuming it trains and saves nothing."""
    max_steps = (run.config.get("trainer") or {}).get("max_steps")
    return isinstance(max_steps, int) and 0 < max_steps <= int(ckpt.get("global_step", -1))


def _use_as_last(run: Run, path: Path) -> None:
    """Make ``path`` the run's last.ckpt, the one its evaluation and summary read."""
    last = run.dir / LAST_CKPT
    if path.resolve() != last.resolve():
        tmp = last.with_name(last.name + ".restore-tmp")
        tmp.unlink(missing_ok=True)
        _link_or_copy(str(path), str(tmp))  # checkpoints are replaced, never written in place: a link is safe
        os.replace(tmp, last)


def _prepare_dir(run: Run) -> list[str] | None:
    """Make the run directory ready; the extra ``rlm fit`` arguments (a checkpoint to resume from), or None when
    a checkpoint of the run's last step loads: it becomes last.ckpt, and there is nothing left to train."""
    saved = run.dir / FINGERPRINT
    if run.dir.exists():
        run.check_dir()
        same = saved.is_file() and saved.read_text().strip() == run.fingerprint
        if same and (run.dir / LAST_CKPT).parent.is_dir():
            try:  # the newest checkpoint that loads; damaged ones are skipped with a line in the output
                path, ckpt = newest_loadable(
                    [run.dir / LAST_CKPT.parent], say=tqdm.write, remove_damaged=True
                )
            except ValueError as err:
                tqdm.write(f"{run.label}: {err}; starting afresh")
            else:
                if not _reached_end(run, ckpt):
                    _keep_metrics(run)
                    return ["--ckpt_path", str(path)]
                if run_metrics(run.dir):
                    _use_as_last(run, path)
                    tqdm.write(f"{run.label}: trained to its last step earlier ({path.name})")
                    return None
                tqdm.write(f"{run.label}: trained earlier, but its metrics are gone; starting afresh")
        job = (run.dir / JOB_JSON).read_text() if (run.dir / JOB_JSON).is_file() else None
        shutil.rmtree(run.dir)  # an unfinished run of another config, or one that saved nothing loadable
        if job is not None:
            write_atomic(run.dir / JOB_JSON, job)
    write_atomic(saved, run.fingerprint + "\n")  # makes the directory
    return []


def train(run: Run) -> tuple[bool, float]:
    """Train one run with ``python -m rlm fit``; (succeeded, wall seconds including earlier attempts)."""
    extra = _prepare_dir(run)
    config_path = run.dir / "config.yaml"
    write_atomic(config_path, yaml.safe_dump(run_config(run.config, run.seed, run.dir), sort_keys=False))
    wall_file = run.dir / "wall_s"
    try:
        before = float(wall_file.read_text())
    except (OSError, ValueError):
        before = 0.0
    if extra is None:
        return True, before
    start = time.perf_counter()
    try:
        ok, stopped = _rlm(run, ["fit", "--config", str(config_path), *extra], "fit.log", "training"), False
    except Preempted:
        ok, stopped = False, True
    wall = before + time.perf_counter() - start  # a stopped run's time counts too: the next run resumes it
    write_atomic(wall_file, f"{wall}\n")
    if stopped:
        raise Preempted(f"{run.label}: stopped by SIGTERM after {wall:.0f}s; its last.ckpt is kept, and the next "
                        "`rlm experiment run` resumes it")  # fmt: skip
    if ok and extra and not (run.dir / LAST_CKPT).is_file():
        # it resumed at the end of training (of max_epochs, say), so it trained and saved nothing
        _use_as_last(run, Path(extra[1]))
    return ok, wall


def evaluate_test(run: Run) -> bool:
    """``rlm eval`` of last.ckpt on the whole test split (test.json; none if data.test_fraction is 0); success."""
    if (run.config.get("data") or {}).get("test_fraction", 1) == 0:
        return True
    args = ["eval", "--ckpt", str(run.dir / LAST_CKPT), "--split", "test", "--json", str(run.dir / TEST_JSON)]
    return _rlm(run, args, "fit.log", "the test evaluation")


def find_equal_run(run: Run, out: Path) -> Path | None:
    """A finished run of the same config and seed in a sibling directory of ``out`` (runs/experiments/*): the
    base models of most experiment files are the same run."""
    for summary in sorted(out.parent.glob(f"*/*/seed{run.seed}/{SUMMARY}")):
        same = read_json(summary).get("fingerprint") == run.fingerprint
        if same and summary.parent.resolve() != run.dir.resolve():
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
    shutil.copytree(source, tmp, copy_function=_link_or_copy, ignore=shutil.ignore_patterns(*NOT_REUSED))
    write_atomic(tmp / SUMMARY, json.dumps(summary, indent=2) + "\n")
    if run.dir.exists():
        shutil.rmtree(run.dir)
    os.replace(tmp, run.dir)  # the run appears finished in one step
    return summary


def write_job(run_dir: Path, **fields: Any) -> None:
    """Update the run's job.json with ``fields`` (and the time of this update)."""
    job = {**read_json(run_dir / JOB_JSON), **fields, "updated": time.time()}
    write_atomic(run_dir / JOB_JSON, json.dumps(job, indent=2) + "\n")


def execute(
    run: Run, out: Path, reuse_equal: bool = True, env: dict[str, str] | None = None, jobs: int = 1
) -> dict[str, Any] | None:
    """Train (or reuse an equal finished run), test, the kNN-LM stage if any, then summary.json; the summary, or
    None if a step failed. ``env``: added to its subprocesses' environment; ``jobs``: runs training at once."""
    run.check_dir()
    _THREAD.env = env or {}
    try:
        return _execute(run, out, reuse_equal, jobs)
    except BaseException as err:
        if run.dir.is_dir() and run.summary() is None:
            # Preempted, a submitit checkpoint's exit or Ctrl-C leave a resumable run; anything else is a bug
            stopped = isinstance(err, (Preempted, SystemExit, KeyboardInterrupt))
            write_job(run.dir, state="stopped" if stopped else "failed", ended=time.time(),
                      reason=f"{type(err).__name__}: {err}")  # fmt: skip
        raise
    finally:
        _THREAD.env = {}


def _failed(run: Run, step: str, log_name: str, what: str) -> None:
    """Record the failed step in job.json and print the end of its log."""
    log = run.dir / log_name
    write_job(run.dir, state="failed", step=step, log=str(log), ended=time.time())
    tqdm.write(f"{run.label}: {what}; end of {log}:\n{log_tail(log)}")


def _execute(run: Run, out: Path, reuse_equal: bool, jobs: int) -> dict[str, Any] | None:
    summary = run.summary()
    try:
        if summary is not None:
            load_checkpoint_file(run.dir / LAST_CKPT)
    except (OSError, ValueError):
        # its results stand, but not the model they were measured on: rebuilt (from a checkpoint of the last step
        # when one loads), then evaluated again
        tqdm.write(f"{run.label}: finished earlier, but its {LAST_CKPT} is missing or damaged; rebuilding it")
        for name in (SUMMARY, TEST_JSON):
            (run.dir / name).unlink(missing_ok=True)
        summary = None
    if summary is not None:
        if run.knnlm is None or summary.get("knnlm"):
            changed = summary.get("fingerprint") != run.fingerprint
            note = " (its config has changed since: delete the directory to rerun)" if changed else ""
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
            return _failed(run, step, "fit.log", f"{step} failed after {wall:.0f}s")
        summary = summarize(run, wall, jobs)
        write_atomic(run.dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    if run.knnlm is not None:
        if not knnlm_stage(run):
            return _failed(run, "kNN-LM", "knnlm.log", "the kNN-LM stage failed")
        summary = with_knnlm(summary, run)
        write_atomic(run.dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    write_job(run.dir, state="done", ended=time.time())
    loss, test = summary.get("val_loss"), summary.get("test_loss")
    subset = val_subset(summary.get("val_batches"))
    tqdm.write(
        f"{run.label}: val loss {loss if loss is None else round(loss, 4)}{f' on {subset}' if subset else ''}, "
        f"test loss {test if test is None else round(test, 4)}"
        + (" (kNN-LM)" if run.knnlm is not None else "")
        + (f" in {summary['wall_s']:.0f}s" if summary.get("wall_s") is not None else "")
    )
    return summary


def knnlm_stage(run: Run) -> bool:
    """``rlm knnlm build`` over the training split, ``rlm eval --datastore`` on the test split; success."""
    options, ckpt, ds = run.knnlm or {}, str(run.dir / LAST_CKPT), run.dir / DATASTORE
    build = ["knnlm", "build", "--ckpt", ckpt, "--out", str(ds)]
    for key in ("layer", "factory", "k", "flat_below", "target_recall", "tune_tokens", "max_documents"):
        if key in options:
            build += [f"--{key.replace('_', '-')}", str(options[key])]
    evaluate = ["eval", "--ckpt", ckpt, "--split", "test", "--datastore", str(ds),
                "--json", str(run.dir / KNNLM_JSON), *(["--knn-cache"] if options.get("cache") else [])]  # fmt: skip
    for args in (build, evaluate):
        if not _rlm(run, args, "knnlm.log", "the kNN-LM stage"):
            return False
    shutil.copy2(ds / "meta.json", run.dir / "datastore_meta.json")
    shutil.rmtree(ds)
    return True


def with_knnlm(summary: dict[str, Any], run: Run) -> dict[str, Any]:
    """The summary of a run with a kNN-LM stage: test_* are the kNN-LM's, lm_test the model's alone, and knnlm
    says how (lam, temperature, k, the datastore's size and build time)."""
    r = json.loads((run.dir / KNNLM_JSON).read_text())
    meta = json.loads((run.dir / "datastore_meta.json").read_text())
    rule = (run.knnlm or {}).get("rule", "interpolate")
    if rule == "joint" and not r.get("joint"):
        raise ValueError(
            f"{run.label}: rule 'joint' but the datastore was not tuned for it (no validation split)"
        )
    if rule == "model" and (meta.get("layer") != "attn_input"):
        raise ValueError(f"{run.label}: rule 'model' scores a knn_attention model searching its own datastore; "
                         f"give knnlm: {{layer: attn_input}} (this datastore's keys: {meta.get('layer')!r})")  # fmt: skip
    scored = rule if rule in ("joint", "model") else "knnlm"  # evaluate_knn's name for the rule's scores
    lm = r["lm"]  # under rule 'model' the model with its datastore: test_loss and lm_test are the same number
    knn = lm if rule == "model" else r[scored]
    random = (r.get("random_neighbours") or {}).get(scored)
    out = dict(summary)
    out["lm_test"] = {"loss": lm["loss"], "ppl": lm["ppl"], "bpb": lm["bpb"]}
    out.update(test_loss=knn["loss"], test_ppl=knn["ppl"], test_bpb=knn["bpb"])
    out["knnlm"] = {
        "options": run.knnlm, "lam": r["lam"], "temperature": r["temperature"], "k": r["k"], "cache": r["cache"],
        "keys": meta.get("entries"), "factory": meta.get("factory"), "build_s": sum((meta.get("seconds") or {}).values()) or None,
        "eval_s": r.get("seconds"), "target_in_neighbours": r.get("target_in_neighbours"), "rule": rule,
        "random_loss": random["loss"] if random else None, "bias": knn.get("bias"),
    }  # fmt: skip
    if rule == "joint":
        out["knnlm"].update(temperature=knn["temperature"], lam=None, interpolate_loss=r["knnlm"]["loss"])
    return out


def without_knnlm(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary as the model alone scored it (for a run that reuses this one's training)."""
    out = dict(summary)
    if out.pop("knnlm", None) is not None:
        lm = out.pop("lm_test")
        out.update(test_loss=lm["loss"], test_ppl=lm["ppl"], test_bpb=lm["bpb"])
    return out


def groups(runs: list[Run]) -> list[list[Run]]:
    """Runs of the same fingerprint (config and seed), to execute one after another in one job, so that the later
    ones reuse the first instead of training the same model at the same time; in the order of their first run."""
    by_print: dict[str, list[Run]] = {}
    for run in runs:
        by_print.setdefault(run.fingerprint, []).append(run)
    return list(by_print.values())


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_slots(jobs: int) -> list[dict[str, str]]:
    """The environment of each of ``jobs`` concurrent runs on this machine: a GPU of its own
    (CUDA_VISIBLE_DEVICES) when there are GPUs, otherwise an equal share of the CPU cores (OMP_NUM_THREADS)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))
    gpus = [d.strip() for d in visible.split(",") if d.strip()]
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
                if execute(run, out, reuse_equal, env, jobs) is None:
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
    """Execute every unfinished run, ``jobs`` at once; the labels of the runs that failed. With ``reuse_equal``,
    a run equal to a finished run of a sibling experiment directory is taken from there, not trained again."""
    runs = begin(exp, out, variants)
    if jobs > 1:
        return _run_pool(runs, out, reuse_equal, jobs, desc=f"experiment {exp.name}")
    failed = []
    bar = tqdm(runs, desc=f"experiment {exp.name}", unit="run")
    for run in bar:
        bar.set_postfix_str(run.label)
        if execute(run, out, reuse_equal) is None:
            failed.append(run.label)
    return failed
