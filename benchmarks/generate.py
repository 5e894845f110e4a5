"""Generation speed with the key/value cache against the full recompute, both in this run (rlm.eval.generate).

    python benchmarks/generate.py [--new 256 1024] [--repeat 3] [--threads 1 --clock cpu] [--plugin moe]
    python benchmarks/generate.py --smoke          # a tiny model, a few tokens: checks the script runs

The model is the default one (configs/model/small.yaml: d=256, 4 layers, max_seq_len 1024), random weights,
vocab --vocab, greedy decoding (temperature 0) from a --prompt-token random prompt. Both paths use a window of
max_seq_len tokens: the recompute runs the model over the last max_seq_len tokens at every step (sliding once
the sequence is longer); the cached path feeds one token per step and, when the window is full, restarts from
its last max_seq_len // 2 tokens (one forward over them). So with the default 16-token prompt, 256 new tokens
stay inside the window and the two give the same tokens; 1024 new tokens cross max_seq_len once (at 1009 new
tokens), after which the cached path sees 512-1024 tokens of context and the recompute 1024, and the tokens
may differ from there on ("same tokens" counts the agreeing prefix). tokens/s = new tokens / seconds, the
median over --repeat runs; ratio = cached / recomputed tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CONFIGS, plugin_specs, table  # noqa: E402

from rlm.eval.generate import sample  # noqa: E402
from rlm.train.module import LMModule  # noqa: E402

SMOKE_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options: new-token counts, model, timing effort, device."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new", type=int, nargs="+", default=[256, 1024], help="new tokens per generation")
    p.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--plugin", action="append", default=[], help="configs/plugins/NAME.yaml (repeatable)")
    p.add_argument("--repeat", type=int, default=3, help="timed generations per path and length (median)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall", help="cpu: process CPU time (with --threads 1)"
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny model (d=32, max_seq_len 32), 8 and 40 new tokens, 1 run"
    )
    a = p.parse_args(argv)
    if a.smoke:
        a.new, a.prompt, a.vocab, a.repeat = [8, 40], 4, 64, 1
    for flag, value in (("--prompt", a.prompt), ("--repeat", a.repeat), *(("--new", n) for n in a.new)):
        if value < 1:
            p.error(f"{flag} {value}; accepted: a positive integer")
    return a


def model_config(a: argparse.Namespace) -> dict:
    """The model's shape: configs/model/small.yaml (or the smoke model), with --vocab."""
    if a.smoke:
        return {**SMOKE_MODEL, "vocab_size": a.vocab}
    shape = yaml.safe_load((CONFIGS / "model" / "small.yaml").read_text())["model"]["model"]
    return {**shape, "vocab_size": a.vocab}


def timed(fn, device: str, clock) -> tuple[float, list[int]]:
    """(seconds, result) of one call."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = clock()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return clock() - t0, out


def main(argv: list[str] | None = None) -> list[list[object]]:
    """Time both paths at every length and print the markdown table; returns its rows."""
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    torch.manual_seed(0)
    module = LMModule(model=model_config(a), plugins=plugin_specs(a.plugin)).to(a.device).eval()
    window = module.model.config.max_seq_len
    prompt = torch.randint(0, a.vocab, (a.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    sample(module, prompt, 2, temperature=0, cache=True)  # warm up both paths
    sample(module, prompt, 2, temperature=0, cache=False)
    rows = []
    for n in a.new:
        runs: dict[bool, list[float]] = {True: [], False: []}
        out: dict[bool, list[int]] = {}
        for _ in range(a.repeat):
            for cache in (True, False):  # interleaved, so a noisy neighbour slows both alike
                seconds, out[cache] = timed(
                    lambda c=cache, n=n: sample(module, prompt, n, temperature=0, cache=c), a.device, clock
                )
                runs[cache].append(seconds)
        cached, full = (n / statistics.median(runs[c]) for c in (True, False))
        same = next((i for i, (x, y) in enumerate(zip(out[True], out[False])) if x != y), n)
        crosses = "yes" if a.prompt + n > window else "no"
        rows.append([n, crosses, f"{same}/{n}", full, cached, f"{cached / full:.2f}x"])
    print(
        f"\nGreedy generation, d={module.model.config.d_model}, layers={module.model.config.n_layers}, "
        f"window (max_seq_len)={window}, prompt={a.prompt}, vocab={a.vocab}, plugins={a.plugin or 'none'}, "
        f"{a.device}, {torch.get_num_threads()} threads, {a.clock} clock, median of {a.repeat}\n"
    )
    headers = ["new tokens", "past max_seq_len", "same tokens", "recompute tok/s", "cached tok/s", "ratio"]
    print(table(headers, rows))
    return rows


if __name__ == "__main__":
    main()
