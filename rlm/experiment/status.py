"""``rlm experiment status DIR``: the state of every (variant, seed) of an experiment, read from its files:
done, failed, running, queued, stopped (resumes from ckpt/last.ckpt next time) or pending.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlm.cli.summary import val_subset
from rlm.experiment.runs import JOB_JSON, LAST_CKPT, SUMMARY, log_tail

STATES = ("done", "running", "queued", "stopped", "failed", "pending")


@dataclass
class RunState:
    """One run's state and a line (and, for a failed run, the end of its log) saying more."""

    label: str
    state: str
    detail: str = ""
    tail: str = ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def run_state(run_dir: Path, label: str, knnlm: bool) -> RunState:
    """The state of the run in ``run_dir`` from its summary.json and job.json."""
    summary_path = run_dir / SUMMARY
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        if not knnlm or summary.get("knnlm"):
            loss, test = summary.get("val_loss"), summary.get("test_loss")
            subset = val_subset(summary.get("val_batches"))
            parts = [
                f"val loss {loss:.4f}" + (f" on {subset}" if subset else "") if loss is not None else "",
                f"test loss {test:.4f}" if test is not None else "",
            ]
            if summary.get("reused_from"):
                parts.append(f"reused from {summary['reused_from']}")
            return RunState(label, "done", ", ".join(p for p in parts if p))
    job: dict[str, Any] = {}
    if (run_dir / JOB_JSON).is_file():
        try:
            job = json.loads((run_dir / JOB_JSON).read_text())
        except ValueError:
            job = {}
    state, job_id = job.get("state"), job.get("job_id")
    where = f" (job {job_id})" if job_id else ""
    resumes = "; resumes from ckpt/last.ckpt" if (run_dir / LAST_CKPT).is_file() else ""
    if state == "failed":
        log = Path(job.get("log") or run_dir / "fit.log")
        return RunState(
            label, "failed", f"{job.get('step', 'the run')} failed{where}; end of {log}:", log_tail(log)
        )
    if state == "running":
        host, pid = job.get("host"), job.get("pid")
        if host and host != socket.gethostname():
            return RunState(label, "running", f"on {host}{where}")
        if isinstance(pid, int) and _alive(pid):
            return RunState(label, "running", f"pid {pid}{where}")
        return RunState(label, "stopped", f"pid {pid} is gone without finishing{resumes}")
    if state == "queued":
        return RunState(label, "queued", f"submitted through {job.get('launcher')}{where}")
    if state == "stopped":
        return RunState(label, "stopped", f"{job.get('reason', 'interrupted')}{resumes}")
    return RunState(label, "pending", resumes.removeprefix("; "))


def experiment_states(out: Path) -> list[RunState]:
    """Every run of the experiment whose resolved file (experiment.json) is in ``out``, in file order."""
    info_path = out / "experiment.json"
    if not info_path.is_file():
        raise ValueError(f"{str(out)!r} is not an experiment directory: it has no experiment.json")
    info = json.loads(info_path.read_text())
    return [
        run_state(out / name / f"seed{seed}", f"{name}/seed{seed}", variant.get("knnlm") is not None)
        for name, variant in info["variants"].items()
        for seed in info["seeds"]
    ]


def format_states(states: list[RunState]) -> str:
    """A table of the runs' states, a line of counts under it."""
    width = max((len(s.label) for s in states), default=5)
    lines = [f"{'run':<{width}}  {'state':<8} detail"]
    for s in states:
        lines.append(f"{s.label:<{width}}  {s.state:<8} {s.detail}".rstrip())
        if s.tail:
            lines.append(s.tail)
    counts = {name: sum(s.state == name for s in states) for name in STATES}
    lines.append(", ".join(f"{n} {name}" for name, n in counts.items() if n))
    return "\n".join(lines)
