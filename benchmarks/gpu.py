"""One command that measures a GPU: ``rlm fit``'s own training step on the shipped configs (GPT-2 small, each
memory plugin), timed by CUDA events, beside transformers' GPT-2 at the same shape, and the CUDA-only tests.

    python benchmarks/gpu.py                 # one CUDA GPU: ~6-9 minutes on an H100; writes OUT/gpu.md, OUT/gpu.json
    python benchmarks/gpu.py --smoke         # the same code on CPU, tiny shapes, a few steps (CI)
    python benchmarks/gpu.py --estimate --config configs/model/gpt2_small.yaml --config ... [--vocab-size 50257]

Without a CUDA device (and without --smoke) it says so and exits 0, measuring nothing.

Every row is one in-process ``rlm fit`` (rlm.cli) of configs/model/gpt2_small.yaml on the stdlib corpus (real
text; a tokenizer rlm trains, --vocab ids, cached after the first row) with configs/trainer/gpu.yaml (bf16-mixed,
the fused AdamW with clipping, each block compiled) and the row's plugin config: the step Lightning runs, data
loading, the plugins' prepare (retrieval's search), their hooks and callbacks (the index rebuilds) included.
``_common.StepTimer`` records a CUDA event at each batch's start and reads them at the end: no synchronisation is
added to the loop. Warm-up steps (compilation, the first index) are left out; the median step is kept.

1. Dense GPT-2 small, eager and compiled: tokens/s and MFU = (6 N + 12 L T d) FLOPs per token (PaLM App. B,
   rlm/train/throughput.py) x tokens/s / the GPU's dense bf16 peak (H100 SXM: 989e12). Beside it, transformers'
   GPT2LMHeadModel (sdpa attention, compiled, bf16 autocast, fused AdamW, clipping) at the same shape, timed the
   same way in a loop of its own, credited with the same FLOPs per token. Goals: compiled MFU >= 0.45, eager
   >= 0.30 (llm.c: about 0.40 by this formula).
2. Each plugin's step / the dense compiled step, as shipped (configs/plugins/gpt2/*.yaml, kNN attention and
   Token-ID from configs/plugins/): goals PKM 1M <= 1.3x, retrieval k=2 <= 1.2x (its index built on the training
   text at the first step, then rebuilt as configured), kNN attention <= 1.1x, 64 experts <= 1.5x, AltUp K=2
   <= 1.3x.
3. Peak memory (torch.cuda.max_memory_allocated) beside rlm/model/memory.py's estimate of the row's config.
4. ``pytest -m gpu`` in a subprocess: its passed / skipped / failed counts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

from rlm.model.memory import estimate  # noqa: E402
from rlm.train.throughput import cpu_matmul_flops, gpu_peak_flops  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
GOALS = {"dense compiled MFU": 0.45, "dense eager MFU": 0.30}
"""The issue's goals on an H100: minimum MFUs (rows' maximum step ratios are in ROWS)."""


@dataclass
class Shape:
    """The base run of every row (full: GPT-2 small on the GPU; smoke: a tiny model on the CPU)."""

    configs: list[str]
    flags: list[str]
    batch: int
    seq: int
    vocab: int


def full_shape(vocab: int) -> Shape:
    flags = ["--data.seq_len", "1024", "--data.batch_size", "16", "--data.vocab_size", str(vocab),
             "--data.num_workers", "4"]  # fmt: skip
    return Shape(["model/gpt2_small.yaml", "data/stdlib.yaml", "trainer/cpu.yaml", "trainer/gpu.yaml"], flags,
                 16, 1024, vocab)  # fmt: skip


SMOKE = Shape(
    ["model/tiny.yaml", "data/tiny.yaml", "trainer/cpu.yaml"],
    ["--model.model.n_layers", "12", "--model.model.d_model", "32", "--model.model.max_seq_len", "64",
     "--data.seq_len", "64", "--data.batch_size", "2", "--trainer.precision", "bf16-mixed",
     "--model.compile", '{"backend": "eager"}'],
    2, 64, 1024,
)  # fmt: skip
"""12 layers, so the shipped GPT-2 plugin configs' layers exist; the compiled rows trace without generating code."""

# name -> (plugin config files, flags, smoke-only flags, goal: the maximum ratio to the dense compiled step)
ROWS: dict[str, tuple[list[str], list[str], list[str], float | None]] = {
    "dense eager": ([], ["--model.compile", "false"], [], None),
    "dense compiled": ([], [], [], None),
    "moe 8": (["plugins/gpt2/switch.yaml"], [], [], None),
    "moe 64": (["plugins/gpt2/switch.yaml"], ["--model.plugins.moe.num_experts", "64"], [], 1.5),
    "pkm 512^2": (["plugins/gpt2/pkm.yaml"], [], ["--model.plugins.pkm.n_keys", "16", "--model.plugins.pkm.k_dim",
                                                 "32", "--model.plugins.pkm.topk", "4"], None),
    "pkm 1024^2": (["plugins/gpt2/pkm.yaml"], ["--model.plugins.pkm.n_keys", "1024"],
                   ["--model.plugins.pkm.n_keys", "32", "--model.plugins.pkm.k_dim", "32",
                    "--model.plugins.pkm.topk", "4"], 1.3),
    "altup K=2": (["plugins/gpt2/altup.yaml"], [], [], 1.3),
    "tokenid": (["plugins/tokenid.yaml"], [], [], None),
    "knn attention": (["plugins/knn_attention.yaml"], [], [], 1.1),
    # the first index at step 0, waited for (the timed steps search it; no rebuild falls in them), then the shipped
    # rebuild schedule
    "retrieval k=2": (["plugins/gpt2/retrieval.yaml"],
                      ["--model.plugins.retrieval.schedule", "0-1:1,1-2000:150,2000-1000000000:2000",
                       "--model.plugins.retrieval.mode", "blocking"],
                      ["--model.plugins.retrieval.flat_below", "0"], 1.2),
}  # fmt: skip


def fit_row(name: str, s: Shape, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One row: ``rlm fit`` in this process with the StepTimer; its stats, or the error that stopped it."""
    from rlm.cli import main as rlm

    files, flags, smoke_flags, _ = ROWS[name]
    out = work / f"{name.replace(' ', '_').replace('^', '')}.json"
    timer = {"class_path": "_common.StepTimer", "init_args": {"out": str(out), "skip": a.warmup}}
    argv = ["fit", *(f"--config={CONFIGS / f}" for f in [*s.configs, *files]), *s.flags, *flags,
            *(smoke_flags if a.smoke else []), "--trainer.max_steps", str(a.warmup + a.steps + 1),
            "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
            "--trainer.default_root_dir", str(work / "runs" / out.stem), "--data.cache_dir", str(a.cache),
            f"--trainer.callbacks+={json.dumps(timer)}"]  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()
    t0 = time.perf_counter()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        code = rlm(argv)
    if code != 0 or not out.is_file():
        tail = printed.getvalue().strip().splitlines()[-3:]
        return {"error": f"rlm fit exited {code}: " + " / ".join(tail)}
    stats = json.loads(out.read_text())
    stats["seconds"] = time.perf_counter() - t0
    # the memory estimate of the config the run saved (every file and flag applied), where rlm has a formula
    saved = next((work / "runs" / out.stem).rglob("config.yaml"), None)
    try:
        stats["estimate_bytes"] = (
            estimate(yaml.safe_load(saved.read_text()))["total_bytes"] if saved else None
        )
    except ValueError:  # a plugin without a memory formula
        stats["estimate_bytes"] = None
    return stats


def gpt2_peer(s: Shape, a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """transformers' GPT2LMHeadModel at the dense row's shape (sdpa, compiled, bf16 autocast, fused AdamW, clipping
    at 1.0), random tokens: median seconds of a step timed by events as StepTimer times rlm's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    d, layers = (32, 12) if a.smoke else (768, 12)
    heads, ff = (2, 128) if a.smoke else (12, 3072)
    cfg = GPT2Config(vocab_size=s.vocab, n_positions=s.seq, n_embd=d, n_layer=layers, n_head=heads, n_inner=ff,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").to(device)
    step_model = torch.compile(model, backend="eager" if a.smoke else "inductor")
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    x = torch.randint(0, s.vocab, (s.batch, s.seq), device=device)
    marks: list[Any] = []
    for _ in range(a.warmup + a.steps + 1):
        if device.type == "cuda":
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        else:
            marks.append(time.perf_counter())
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    marks = marks[a.warmup :]
    if device.type == "cuda":
        torch.cuda.synchronize()
        steps = [x0.elapsed_time(x1) / 1e3 for x0, x1 in zip(marks, marks[1:])]
    else:
        steps = [x1 - x0 for x0, x1 in zip(marks, marks[1:])]
    return {"step_s": statistics.median(steps), "params": sum(p.numel() for p in model.parameters())}


def measure(a: argparse.Namespace, s: Shape, device: torch.device) -> dict[str, Any]:
    """Every row of parts 1-3."""
    if device.type == "cuda":
        peak, source = gpu_peak_flops(device, torch.bfloat16), f"{torch.cuda.get_device_name(device)} bf16"
    else:
        peak, source = cpu_matmul_flops(), "this CPU's fp32 1024^3 matmul (smoke run)"
    out: dict[str, Any] = {"device": str(device), "peak_flops": peak, "peak_source": source, "rows": {}}
    names = [n for n in ROWS if a.only is None or n in ("dense eager", "dense compiled", *a.only)]
    with tempfile.TemporaryDirectory(prefix="rlm-gpu-bench-") as work:
        for name in names:
            t0 = time.perf_counter()
            r = fit_row(name, s, a, Path(work))
            said = r.get("error") or f"{1e3 * r['step_s']:.1f} ms/step"
            print(f"{name}: {said} ({time.perf_counter() - t0:.0f} s)", flush=True)
            out["rows"][name] = r
    base = out["rows"]["dense compiled"].get("step_s")
    for name, r in out["rows"].items():
        if "step_s" not in r:
            continue
        r["tokens_per_s"] = r["tokens"] / r["step_s"]
        r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / peak if peak else None
        r["ratio"] = r["step_s"] / base if base else None
        r["goal"] = ROWS[name][3]
    if not a.no_peer:
        try:
            peer = gpt2_peer(s, a, device)
        except Exception as err:  # a missing or older transformers: the row says why
            peer = {"error": f"{type(err).__name__}: {err}"}
        dense = out["rows"]["dense compiled"]
        if "step_s" in peer and "flops_per_token" in dense:
            peer["tokens_per_s"] = s.batch * s.seq / peer["step_s"]
            peer["mfu"] = dense["flops_per_token"] * peer["tokens_per_s"] / peak if peak else None
        out["peer"] = peer
    return out


def summary_counts(line: str) -> dict[str, int]:
    """{'passed': 3, 'skipped': 2, ...} from pytest's last line ('3 passed, 2 skipped, 900 deselected in 9.1s')."""
    found = re.findall(r"(\d+) (passed|skipped|failed|errors?|deselected|xfailed|xpassed)\b", line)
    return {("error" if k.startswith("error") else k): int(n) for n, k in found}


def gpu_tests(timeout: int) -> dict[str, Any]:
    """``pytest -m gpu`` in a subprocess: counts from its summary line."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", str(ROOT / "tests")]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"command": "pytest -m gpu", "problem": f"timed out after {timeout} s"}
    tail = (done.stdout.strip().splitlines() or [""])[-1]
    counts = summary_counts(tail)
    return {
        "command": "pytest -m gpu",
        "returncode": done.returncode,
        "summary": tail,
        "seconds": time.perf_counter() - t0,
        **counts,
    }


def size(n: int | None, unit: str) -> str:
    """Bytes in GiB (or MiB for the smoke run's tiny models); n/a where nothing was measured (CPU)."""
    return "n/a" if n is None else f"{n / 2 ** (30 if unit == 'GiB' else 20):.2f}"


def verdict(ok: bool, smoke: bool) -> str:
    """Whether a goal was met; a smoke run's numbers mean nothing for the H100 goals."""
    return "(smoke)" if smoke else ("met" if ok else "missed")


def markdown(res: dict[str, Any]) -> str:
    """The report: one table of every row with its goal, the tests' counts."""
    unit, smoke = ("MiB", True) if res["smoke"] else ("GiB", False)
    lines = [
        f"# rlm GPU benchmark ({'smoke run, CPU' if smoke else res['device_name']})",
        "",
        f"`rlm fit` steps timed by CUDA events: {res['shape']}; torch {torch.__version__}. MFU = (6 N + 12 L T d) x "
        f"tokens/s / {res['peak_flops']:.3g} FLOP/s ({res['peak_source']}); x dense: the step over the dense "
        "compiled step of this run.",
        "",
    ]
    rows = []
    for name, r in res["rows"].items():
        if "error" in r:
            rows.append([name, "", "", "", "", "", "", "", "", r["error"]])
            continue
        goal, ok = "", ""
        if name.startswith("dense"):
            want = GOALS[f"{name} MFU"]
            goal = f"MFU >= {want}"
            ok = "" if r["mfu"] is None else verdict(r["mfu"] >= want, smoke)
        elif r["goal"] is not None:
            goal, ok = f"<= {r['goal']}x", verdict(r["ratio"] <= r["goal"], smoke)
        rows.append(
            [name, f"{r['params']:,}", 1e3 * r["step_s"], f"{r['tokens_per_s']:,.0f}",
             "n/a" if r["mfu"] is None else f"{r['mfu']:.3f}", f"{r['ratio']:.2f}", goal, ok,
             f"{size(r.get('peak_bytes'), unit)} / {size(r.get('estimate_bytes'), unit)}", ""]
        )  # fmt: skip
    peer = res.get("peer")
    if peer is not None:
        if "error" in peer:
            rows.append(["transformers GPT2LMHeadModel", "", "", "", "", "", "", "", "", peer["error"]])
        else:
            dense = res["rows"]["dense compiled"]
            ratio = f"{peer['step_s'] / dense['step_s']:.2f}" if "step_s" in dense else ""
            mfu = peer.get("mfu")
            rows.append(["transformers GPT2LMHeadModel (peer, compiled)", f"{peer['params']:,}", 1e3 * peer["step_s"],
                         f"{peer['tokens_per_s']:,.0f}", "n/a" if mfu is None else f"{mfu:.3f}", ratio, "", "",
                         "", "same shape, random tokens, its own loop"])  # fmt: skip
    heads = [
        "row",
        "params",
        "ms/step",
        "tokens/s",
        "MFU",
        "x dense",
        "goal",
        "",
        f"peak / estimate {unit}",
        "note",
    ]
    lines += [table(heads, rows), ""]
    t = res.get("tests")
    if t:
        counts = ", ".join(f"{t.get(k, 0)} {k}" for k in ("passed", "skipped", "failed", "error"))
        extra = t.get("problem") or (
            "" if t.get("returncode") in (0, None) else f"pytest said: {t['summary']}"
        )
        lines.append(f"CUDA-only tests (`pytest -m gpu`): {counts}" + (f"; {extra}" if extra else ""))
    else:
        lines.append("CUDA-only tests: not run (--no-tests, or a smoke run)")
    lines += ["", f"Total {res['seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes on CPU: the code path, no meaningful numbers"
    )
    p.add_argument(
        "--out", type=Path, default=ROOT / "runs" / "gpu_bench", help="folder of gpu.md and gpu.json"
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (default 10; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 4; smoke 1)")
    p.add_argument("--vocab", type=int, default=50257, help="ids of the tokenizer rlm trains on the corpus")
    p.add_argument("--cache", type=Path, default=None, help="data cache (default: rlm's)")
    p.add_argument("--only", nargs="+", default=None, help="plugin rows to run besides the dense ones")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' GPT-2 row")
    p.add_argument("--no-tests", action="store_true", help="skip pytest -m gpu")
    p.add_argument("--tests-timeout", type=int, default=240)
    p.add_argument(
        "--estimate", action="store_true", help="print the memory estimate of --config files and exit"
    )
    p.add_argument(
        "--config", action="append", default=[], help="with --estimate: config files, merged in order"
    )
    p.add_argument("--vocab-size", type=int, default=None, help="with --estimate: when no config sets it")
    a = p.parse_args(argv)
    a.steps = a.steps or (2 if a.smoke else 10)
    a.warmup = a.warmup or (1 if a.smoke else 4)
    a.cache = a.cache or Path(os.environ.get("RLM_CACHE") or Path.home() / ".cache" / "rlm")
    bad = [n for n in a.only or [] if n not in ROWS]
    if bad:
        p.error(f"--only {bad}: unknown rows; known: {list(ROWS)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.estimate:
        from rlm.experiment.spec import merge
        from rlm.model.memory import format_estimate

        if not a.config:
            raise SystemExit("--estimate needs --config FILE (repeatable)")
        print(format_estimate(estimate(merge([Path(c) for c in a.config]), a.vocab_size)))
        return 0
    if not a.smoke and not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py: no CUDA device, nothing measured (python benchmarks/gpu.py --smoke runs the same code on CPU)"
        )
        return 0
    s = SMOKE if a.smoke else full_shape(a.vocab)
    device = torch.device("cpu" if a.smoke else "cuda")
    t0 = time.perf_counter()
    res = measure(a, s, device)
    res["smoke"] = a.smoke
    res["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    res["shape"] = " ".join([*s.configs, *s.flags])
    res["tests"] = None if (a.smoke or a.no_tests) else gpu_tests(a.tests_timeout)
    res["seconds"] = time.perf_counter() - t0
    report = markdown(res)
    a.out.mkdir(parents=True, exist_ok=True)
    write_atomic(a.out / "gpu.json", json.dumps(res, indent=2, default=str))
    write_atomic(a.out / "gpu.md", report)
    print(report)
    print(f"wrote {a.out / 'gpu.md'} and {a.out / 'gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
