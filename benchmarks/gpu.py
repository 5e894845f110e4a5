"""One command that measures a GPU: GPT-2 small's training throughput and MFU, each memory plugin's step against
it, peak memory against rlm/train/memory.py's estimate, and the CUDA-only tests.

    python benchmarks/gpu.py                 # one CUDA GPU: ~5-8 minutes on an H100; writes OUT/gpu.md, OUT/gpu.json
    python benchmarks/gpu.py --smoke         # the same code on CPU, tiny shapes (d=64, 2 layers), ~10 s (CI)
    python benchmarks/gpu.py --estimate --config configs/model/gpt2_small.yaml --config ... [--vocab-size 50257]

Without a CUDA device (and without --smoke) it says so and exits 0, measuring nothing.

1. gpt2_small (configs/model/gpt2_small.yaml, GPT-2's 50,257 ids, random tokens) in bf16 autocast with fp32
   AdamW, batch 16 x 1024 (configs/data/fineweb_edu.yaml), eager and compiled (torch.compile, Inductor, each
   block as LMModule compiles it):
   tokens/s and MFU = 6 N + 12 L T d FLOPs per token (PaLM App. B, rlm/train/throughput.py: N the matmul
   parameters, attention's T x T credited in full) x tokens/s / the GPU's dense bf16 peak (H100 SXM: 989e12).
   Goal: MFU >= 0.45 compiled (nanoGPT and llm.c reach 0.4-0.6 at this size).
2. Each plugin's training step / the dense step, both eager, measured in this run (with --rounds N, N rounds
   over the rows, one model on the device at a time, the median kept): Switch MoE with 8 and 64 experts (grouped GEMM and bmm dispatch), PKM at
   128^2 = 16k and 1024^2 = 1M slots, AltUp K=2, Token-ID, and retrieval k=2 (with the time of its faiss
   build on --index-segments random segments and of a step's online search). Goals: PKM 1M <= 1.3x, 64
   experts <= 1.5x, retrieval <= 1.2x.
3. Peak memory (torch.cuda.max_memory_allocated over the variant's steps) beside the estimate of its config.
4. ``pytest -m gpu`` in a subprocess: its passed / skipped / failed counts.

A step: make_context (plugins' prepare: retrieval's search), forward, cross-entropy + aux losses, backward,
clip, the plugins' pre-step hooks (PKM's row-wise Adam), AdamW, as LMModule trains (benchmarks/compile.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

from rlm.data.segments import SegmentTable  # noqa: E402
from rlm.data.windows import Windows  # noqa: E402
from rlm.index.build import IndexConfig  # noqa: E402
from rlm.index.memory import build_memory, embed_rows, indexed_rows  # noqa: E402
from rlm.train.compile import CompileConfig, compile_blocks  # noqa: E402
from rlm.train.memory import estimate  # noqa: E402
from rlm.train.module import LMModule  # noqa: E402
from rlm.train.throughput import cpu_matmul_flops, gpu_peak_flops, train_flops_per_token  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPT2_VOCAB = 50257
GOALS = {"dense compiled MFU": 0.45, "pkm 1M": 1.3, "moe 64": 1.5, "retrieval": 1.2}
"""The issue's goals on an H100: a minimum MFU, and maxima of the step ratio to the dense eager step."""


@dataclass
class Shape:
    """Model and batch of one run (full: GPT-2 small; smoke: tiny)."""

    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    vocab: int
    batch: int
    seq: int
    segment: int
    pkm_keys: tuple[int, int]
    pkm_layer: int
    moe_layers: list[int] = field(default_factory=list)


FULL = Shape(768, 12, 12, 3072, GPT2_VOCAB, 16, 1024, 64, (128, 1024), 6, [1, 3, 5, 7, 9, 11])
SMOKE = Shape(64, 2, 2, 256, 256, 2, 64, 16, (16, 32), 1, [1])


def variants(s: Shape) -> dict[str, dict[str, Any]]:
    """model.plugins of each row after the dense one: configs/plugins/gpt2/*.yaml's settings at shape s."""
    moe = {"layers": s.moe_layers, "top_k": 1, "capacity_factor": 1.25, "log_per_expert": False}
    pkm = {"layers": [s.pkm_layer], "heads": 4, "topk": 32, "k_dim": 512, "query_norm": "layernorm"}
    if s is SMOKE:
        pkm.update(topk=4, k_dim=32)
    small, large = s.pkm_keys
    return {
        "moe 8 grouped": {"moe": {**moe, "num_experts": 8, "dispatch": "grouped"}},
        "moe 8 bmm": {"moe": {**moe, "num_experts": 8, "dispatch": "bmm"}},
        "moe 64 grouped": {"moe": {**moe, "num_experts": 64, "dispatch": "grouped"}},
        "moe 64 bmm": {"moe": {**moe, "num_experts": 64, "dispatch": "bmm"}},
        f"pkm {small}^2": {"pkm": {**pkm, "n_keys": small}},
        f"pkm {large}^2": {"pkm": {**pkm, "n_keys": large}},
        "altup K=2": {"altup": {"k": 2}},
        "tokenid": {"tokenid": {"layers": [0]}},
        "retrieval k=2": {"retrieval": {"layers": [-1], "k": 2, "progress": False, "mode": "blocking"}},
    }


def goal_of(name: str, s: Shape) -> float | None:
    """The step-ratio goal of a row, if the issue sets one."""
    if name.startswith("moe 64"):
        return GOALS["moe 64"]
    if name == f"pkm {s.pkm_keys[1]}^2":
        return GOALS["pkm 1M"]
    if name.startswith("retrieval"):
        return GOALS["retrieval"]
    return None


def model_fields(s: Shape) -> dict[str, Any]:
    return dict(
        vocab_size=s.vocab,
        vocab_multiple=128,  # as configs/model/gpt2_*.yaml
        d_model=s.d_model,
        n_layers=s.n_layers,
        n_heads=s.n_heads,
        ffn="plain",
        d_ff=s.d_ff,
        max_seq_len=s.seq,
        tie_embeddings=True,
    )


def corpus(s: Shape, segments: int) -> tuple[SegmentTable, Windows]:
    """Random-token documents of 4 windows each, as a SegmentTable and its training windows."""
    doc_len = 4 * s.seq
    n_docs = max(2, -(-segments * s.segment // doc_len))
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, s.vocab, size=n_docs * doc_len).astype(np.int64)
    offsets = np.arange(n_docs + 1, dtype=np.int64) * doc_len
    table_ = SegmentTable(tokens, offsets, s.segment, 0, f"gpu-bench-{n_docs}-{doc_len}-{s.segment}")
    return table_, Windows(table_, offsets, np.arange(n_docs), s.seq)


class Run:
    """One model's training steps on the device, with its optimizer and the plugins' pre-step hooks."""

    def __init__(self, s: Shape, plugins: dict[str, Any], device: torch.device, windows: Windows) -> None:
        torch.manual_seed(0)
        self.module = LMModule(model_fields(s), plugins, {"warmup_steps": 2}).to(device)
        for plugin in self.module.model.plugins.values():
            plugin.param_groups()  # resolves PKM's sparse update (one process: row-wise) before the groups
        groups = self.module.parameter_groups()
        for g in groups:
            g.pop("schedule")
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), fused=fused)
        # the plugins' own hooks (PKM's row-wise Adam), not the core's, which read the Lightning trainer
        self.callbacks = [cb for plugin in self.module.model.plugins.values() for cb in plugin.callbacks()]
        self.device, self.windows, self.batch = device, windows, s.batch
        self.rng = np.random.default_rng(0)
        self.search_s = 0.0

    def step(self) -> float:
        """One training step; returns the loss."""
        b = self.windows.collate(self.rng.choice(len(self.windows), self.batch, replace=False))
        b = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        # all under autocast, as Lightning's bf16-mixed runs training_step (the plugins' prepare included)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            t0 = time.perf_counter()
            ctx = self.module.make_context(b, "train", segments=self.windows.segments)
            self.search_s += time.perf_counter() - t0
            logits = self.module.model(b["tokens"], ctx)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), b["targets"].flatten(), ignore_index=-100)
        aux = ctx.total_aux_loss()
        (loss if aux is None else loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
        for cb in self.callbacks:
            cb.on_before_optimizer_step(None, self.module, self.opt)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_step(run: Run, steps: int) -> float:
    """Mean seconds of ``steps`` consecutive steps (one synchronisation at each end)."""
    sync(run.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        run.step()
    sync(run.device)
    return (time.perf_counter() - t0) / steps


def build_retrieval(run: Run, index_segments: SegmentTable, smoke: bool) -> dict[str, float | str]:
    """Embed every segment with the current embedder, build the index the plugin's config asks for (IVF on the
    GPU when faiss-gpu sees one) and hand it to the plugin; the build's seconds and the factory chosen."""
    plugin = run.module.model.plugins["retrieval"]
    c = plugin.config
    rows = indexed_rows(index_segments, np.arange(len(index_segments.first) - 1))
    t0 = time.perf_counter()
    embedder = plugin.snapshot(0)
    vectors = embed_rows(embedder, index_segments, rows, 1024, 0, 1, False)
    t1 = time.perf_counter()
    flat_below = 0 if smoke else 32768  # configs/plugins/gpt2/retrieval.yaml; the smoke run builds an IVF too
    cfg = IndexConfig(factory=c.index_factory, target_recall=c.target_recall, flat_below=flat_below)
    memory = build_memory(
        vectors, index_segments, rows, c.k, embedder.embedder_identity(), 0, cfg, None, False
    )
    t2 = time.perf_counter()
    plugin.use_memory(memory)
    built = memory.index if hasattr(memory, "index") else None
    factory = getattr(built, "factory", "?")
    on_gpu = getattr(built, "on_gpu", False)
    return {"embed_s": t1 - t0, "build_s": t2 - t1, "factory": f"{factory}{' (GPU)' if on_gpu else ''}"}


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(a: argparse.Namespace, s: Shape, device: torch.device) -> dict[str, Any]:
    """Every row of parts 1-3."""
    # one corpus: the windows trained on, and every segment of it in retrieval's index
    index_segments, windows = corpus(s, max(a.index_segments, 4 * s.batch * (s.seq // s.segment)))
    cfg_of = lambda plugins: {  # noqa: E731
        "model": {"model": model_fields(s), "plugins": plugins},
        "data": {"batch_size": s.batch, "seq_len": s.seq},
        "trainer": {"precision": "bf16-mixed"},
    }
    tokens = s.batch * s.seq
    if device.type == "cuda":
        peak, peak_source = (
            gpu_peak_flops(device, torch.bfloat16),
            f"{torch.cuda.get_device_name(device)} bf16",
        )
    else:
        peak, peak_source = cpu_matmul_flops(), "this CPU's fp32 1024^3 matmul (smoke run)"
    out: dict[str, Any] = {"device": str(device), "peak_flops": peak, "peak_source": peak_source, "dense": {}}

    # 1. the dense model, eager and compiled
    for mode in ("eager", "compiled"):
        free(device)
        torch._dynamo.reset()
        run = Run(s, {}, device, windows)
        if mode == "compiled":
            # as LMModule(compile=True) sets the model up, backend chosen
            compile_blocks(run.module.model, CompileConfig(backend=a.compile_backend))
        t0 = time.perf_counter()
        for _ in range(a.warmup):
            run.step()
        sync(device)
        first = time.perf_counter() - t0
        step_s = statistics.median(seconds_per_step(run, a.steps) for _ in range(a.rounds))
        flops = train_flops_per_token(run.module.model, s.seq) * tokens
        est = estimate(cfg_of({}))
        out["dense"][mode] = {
            "step_s": step_s,
            "warmup_s": first,
            "tokens_per_s": tokens / step_s,
            "flops_per_step": flops,
            "mfu": flops / step_s / peak if peak else None,
            "peak_bytes": peak_bytes(device),
            "estimate_bytes": est["total_bytes"],
        }
        del run
    torch._dynamo.reset()

    # 2-3. each plugin against the dense model, eager, in interleaved rounds
    names = ["dense", *variants(s)] if a.only is None else ["dense", *a.only]
    specs = {"dense": {}, **variants(s)}
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        free(device)
        run = Run(s, specs[name], device, windows)
        info: dict[str, Any] = {}
        if "retrieval" in specs[name]:
            info.update(build_retrieval(run, index_segments, a.smoke))
        for _ in range(a.warmup):
            run.step()
        run.search_s = 0.0
        times = [seconds_per_step(run, a.steps)]
        info["peak_bytes"] = peak_bytes(device)
        info["estimate_bytes"] = estimate(cfg_of(specs[name]))["total_bytes"]
        info["params"] = sum(p.numel() for p in run.module.parameters())
        if "retrieval" in specs[name]:
            info["search_s"] = run.search_s / a.steps
        rows[name] = {"times": times, **info}
        del run
    for _ in range(
        a.rounds - 1
    ):  # further rounds, each model rebuilt: keeps only one on the device at a time
        for name in names:
            free(device)
            run = Run(s, specs[name], device, windows)
            if "retrieval" in specs[name]:
                build_retrieval(run, index_segments, a.smoke)
            for _ in range(a.warmup):
                run.step()
            rows[name]["times"].append(seconds_per_step(run, a.steps))
            del run
    base = statistics.median(rows["dense"]["times"])
    for name, r in rows.items():
        r["step_s"] = statistics.median(r.pop("times"))
        r["ratio"] = r["step_s"] / base
        r["goal"] = goal_of(name, s)
    out["plugins"] = rows
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


def markdown(res: dict[str, Any], s: Shape) -> str:
    """The report: the dense table, the plugins' table, the tests' counts, the goals beside the numbers."""
    unit, smoke = ("MiB", True) if res["smoke"] else ("GiB", False)
    lines = [
        f"# rlm GPU benchmark ({'smoke run, CPU' if res['smoke'] else res['device_name']})",
        "",
        f"Model d={s.d_model}, {s.n_layers} layers, {s.n_heads} heads, FFN {s.d_ff}, vocab {s.vocab}; batch "
        f"{s.batch} x {s.seq} tokens, bf16 autocast, fp32 AdamW; torch {torch.__version__}. MFU = (6 N + 12 L T d) "
        f"x tokens/s / {res['peak_flops']:.3g} FLOP/s ({res['peak_source']}).",
        "",
    ]
    rows = []
    for mode, r in res["dense"].items():
        goal = f">= {GOALS['dense compiled MFU']}" if mode == "compiled" else ""
        mfu = r["mfu"]
        ok = "" if mfu is None or not goal else verdict(mfu >= GOALS["dense compiled MFU"], smoke)
        rows.append(
            [mode, 1e3 * r["step_s"], f"{r['tokens_per_s']:,.0f}", f"{mfu:.3f}" if mfu else "n/a", goal, ok,
             size(r["peak_bytes"], unit), size(r["estimate_bytes"], unit), f"{r['warmup_s']:.1f}"]
        )  # fmt: skip
    heads = [
        "dense",
        "ms/step",
        "tokens/s",
        "MFU",
        "goal",
        "",
        f"peak {unit}",
        f"estimate {unit}",
        "warm-up s",
    ]
    lines += [table(heads, rows), ""]
    rows = []
    for name, r in res["plugins"].items():
        goal = r["goal"]
        ok = "" if goal is None else verdict(r["ratio"] <= goal, smoke)
        note = []
        if "build_s" in r:
            note.append(f"index {r['factory']}: embed {r['embed_s']:.2f} s, build {r['build_s']:.2f} s")
            note.append(f"search+prepare {1e3 * r['search_s']:.1f} ms/step")
        rows.append(
            [name, f"{r['params']:,}", 1e3 * r["step_s"], f"{r['ratio']:.2f}", "" if goal is None else f"<= {goal}",
             ok, size(r["peak_bytes"], unit), size(r["estimate_bytes"], unit), "; ".join(note)]
        )  # fmt: skip
    heads = [
        "eager step",
        "params",
        "ms/step",
        "x dense",
        "goal",
        "",
        f"peak {unit}",
        f"estimate {unit}",
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
    p.add_argument("--steps", type=int, default=None, help="timed steps per round (default 10; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; smoke 1)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds over the rows, median taken (each round rebuilds every model)",
    )
    p.add_argument("--index-segments", type=int, default=None, help="retrieval index size (default 65536)")
    p.add_argument("--only", nargs="+", default=None, help="plugin rows to run (names as in the table)")
    p.add_argument(
        "--compile-backend", default=None, help="torch.compile backend (default inductor; smoke eager)"
    )
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
    smoke = a.smoke
    a.steps = a.steps or (2 if smoke else 10)
    a.warmup = a.warmup or (1 if smoke else 3)
    a.index_segments = a.index_segments or (256 if smoke else 65536)
    a.compile_backend = a.compile_backend or ("eager" if smoke else "inductor")
    known = list(variants(SMOKE if smoke else FULL))
    bad = [n for n in a.only or [] if n not in known]
    if bad:
        p.error(f"--only {bad}: unknown rows; known: {known}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.estimate:
        from rlm.cli.merge import merge_configs
        from rlm.train.memory import format_estimate

        if not a.config:
            raise SystemExit("--estimate needs --config FILE (repeatable)")
        print(format_estimate(estimate(merge_configs(a.config), a.vocab_size)))
        return 0
    if not a.smoke and not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py: no CUDA device, nothing measured (python benchmarks/gpu.py --smoke runs the same code on CPU)"
        )
        return 0
    s = SMOKE if a.smoke else FULL
    device = torch.device("cpu" if a.smoke else "cuda")
    if a.smoke:
        torch.set_num_threads(1)  # tiny shapes: threads only contend (CI's 2 cores are shared)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.perf_counter()
    res = measure(a, s, device)
    res["smoke"] = a.smoke
    res["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    res["shape"] = s.__dict__
    res["goals"] = GOALS
    res["tests"] = None if (a.smoke or a.no_tests) else gpu_tests(a.tests_timeout)
    res["seconds"] = time.perf_counter() - t0
    report = markdown(res, s)
    a.out.mkdir(parents=True, exist_ok=True)
    write_atomic(a.out / "gpu.json", json.dumps(res, indent=2, default=str))
    write_atomic(a.out / "gpu.md", report)
    print(report)
    print(f"wrote {a.out / 'gpu.md'} and {a.out / 'gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
