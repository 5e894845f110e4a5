"""Forward + backward time of the routed memory layers against the dense FFN measured in the same run, and the
whole default model's training step with MoE in every other layer against the dense model.

    python benchmarks/experts.py                          # d=256, experts 4d wide, 8 x 512 tokens
    python benchmarks/experts.py --batch 2 --seq 64 --experts 4 8 --repeat 2   # a quick smoke run

Every layer row times forward and backward (input gradient included, as inside a model), alternating with the
dense FFN so both see the same machine load, and reports the fastest of --repeat runs of each. The 'add' rows
(partial experts, tokenid and its hashed n-grams) run the dense FFN plus the added module, as the FFN slot does.
The peer row (st-moe-pytorch, `pip install rlm[bench]`) is skipped with a note when the package is absent.

Results: RESULTS.md, "MoE / Switch".
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

from rlm.model import ModelConfig, Transformer  # noqa: E402
from rlm.model.layers import FeedForward  # noqa: E402
from rlm.plugin import Context  # noqa: E402
from rlm.plugins.moe import MoEConfig, MoELayer  # noqa: E402
from rlm.plugins.partial_experts import PartialExpertsConfig, PartialExpertsLayer  # noqa: E402
from rlm.plugins.tokenid import NGramMemory, TokenIDConfig, TokenIDTable  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def step_fn(modules: list[nn.Module], x: torch.Tensor, tokens: torch.Tensor) -> Callable[[], None]:
    """Forward + backward of the sum of ``modules`` on x (B, T, d), aux losses included."""
    params = [p for m in modules for p in m.parameters()]
    grad = torch.randn_like(x)

    def run() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        ctx = Context(tokens=tokens, stage="train")
        y = sum(m(x, ctx) for m in modules)  # (B, T, d)
        loss = (y * grad).sum()
        aux = ctx.total_aux_loss()
        (loss if aux is None else loss + aux).backward()

    return run


def paired(
    fn: Callable[[], None], base: Callable[[], None], repeat: int, warmup: int = 2
) -> tuple[float, float]:
    """Fastest seconds of ``fn`` and of ``base``, run alternately so both see the same machine load.

    The minimum, not the median: on a shared CPU, other processes only ever add time.
    """
    for _ in range(warmup):
        fn(), base()
    t, b = [], []
    for _ in range(repeat):
        for f, out in ((fn, t), (base, b)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return min(t), min(b)


def peer_fn(d: int, n: int, batch: int, seq: int) -> Callable[[], None]:
    """st-moe-pytorch's MoE, top-2, GEGLU experts of 2/3 * 4d hidden (the parameters of a 4d MLP)."""
    from st_moe_pytorch import MoE

    moe = MoE(dim=d, num_experts=n, gating_top_n=2, expert_hidden_mult=4)
    x = torch.randn(batch, seq, d, requires_grad=True)

    def run() -> None:
        moe.zero_grad(set_to_none=True)
        out = moe(x)
        (out.outputs.sum() + out.total_aux_loss).backward()

    return run


def layer_rows(a: argparse.Namespace) -> list[list[object]]:
    """Every layer variant's time, relative to the dense FFN."""
    mc = ModelConfig(vocab_size=a.vocab, d_model=a.d, n_layers=4, n_heads=4, ffn=a.ffn, d_ff=a.mult * a.d)
    x = torch.randn(a.batch, a.seq, a.d, requires_grad=True)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq))
    ffn = FeedForward(mc)
    dense_fn = step_fn([ffn], x, tokens)
    rows = []

    def add(name: str, active: str, fn: Callable[[], None]) -> None:
        t, dense = paired(fn, dense_fn, a.repeat)
        rows.append([name, active, dense * 1e3, t * 1e3, t / dense])
        print(f"  {name}: {t * 1e3:.1f} ms, dense {dense * 1e3:.1f} ms", file=sys.stderr)

    add("dense FFN (against itself)", f"1 x {mc.hidden}", step_fn([FeedForward(mc)], x, tokens))

    for n in a.experts:
        for lookup, cf, dispatch in [
            ("softmax", 1.25, "grouped"),
            ("softmax", 1.25, "bmm"),
            ("softmax", 0.0, "grouped"),
            ("softmax", 0.0, "bmm"),
            ("token_id", 1.25, "auto"),
            ("lsh", 1.25, "auto"),
        ]:
            cfg = MoEConfig(layers=[0], num_experts=n, lookup=lookup, capacity_factor=cf, dispatch=dispatch)
            drop = "dropless" if cf == 0 else f"cf {cf}"
            add(
                f"moe N={n} top-1 {lookup} {drop} {dispatch}",
                f"1 x {mc.hidden}",
                step_fn([MoELayer(cfg, mc, 0)], x, tokens),
            )
    if importlib.util.find_spec("st_moe_pytorch") is None:
        rows.append(["peer st-moe-pytorch: skipped (pip install st-moe-pytorch)", "", "", "", ""])
    else:
        hidden = int(a.d * 4 * 2 / 3)
        for n in a.experts:
            peer = peer_fn(a.d, n, a.batch, a.seq)
            add(f"peer st-moe-pytorch N={n} top-2 cf 1.25", f"<=2 x {hidden} GEGLU", peer)
    for rank in (0, 4):
        for lookup, buckets in (("lsh", a.vocab), ("token_id", a.vocab), ("softmax", 64)):
            cfg = PartialExpertsConfig(layers=[0], lookup=lookup, buckets=buckets, rank=rank, init_std=0.02)
            added = PartialExpertsLayer(cfg, mc)
            name = f"FFN + partial experts {lookup} {buckets} buckets rank {rank}"
            add(name, f"FFN + rank {rank}", step_fn([ffn, added], x, tokens))
        tokenid = TokenIDTable(a.vocab, a.d, rank, 0.02)
        add(
            f"FFN + tokenid rank {rank} (vocab {a.vocab})",
            f"FFN + rank {rank}",
            step_fn([ffn, tokenid], x, tokens),
        )
    for rows_ in a.ngram_rows:
        for gate in (True, False):
            cfg = TokenIDConfig(layers=[0], ngram_orders=[2, 3], ngram_rows=rows_, ngram_gate=gate)
            add(
                f"FFN + tokenid n-grams [2, 3] x 4 heads x {rows_} rows{' gated' if gate else ''}",
                "FFN + 8 rows",
                step_fn([ffn, NGramMemory(a.vocab, a.d, cfg)], x, tokens),
            )
    return rows


def default_shape() -> dict[str, object]:
    """The default model's shape from configs/model/small.yaml (d=256, 4 layers, 4 heads when absent)."""
    path = REPO / "configs" / "model" / "small.yaml"
    if path.is_file():
        from omegaconf import OmegaConf

        shape = OmegaConf.to_container(OmegaConf.load(path)).get("model", {}).get("model", {})
        keys = ("d_model", "n_layers", "n_heads", "ffn", "d_ff", "tie_embeddings")
        return {k: v for k, v in shape.items() if k in keys}
    return {"d_model": 256, "n_layers": 4, "n_heads": 4}


def model_rows(a: argparse.Namespace) -> list[list[object]]:
    """Training step (forward, backward, AdamW) of the default model, dense vs MoE in every other layer."""
    mc = ModelConfig(vocab_size=a.vocab, max_seq_len=max(1024, a.seq), **default_shape())
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1))
    every_other = list(range(1, mc.n_layers, 2))
    variants = [("default model, dense", None)] + [
        (
            f"default model, moe N={n} top-1 cf 1.25 at layers {every_other}",
            {"moe": {"layers": every_other, "num_experts": n}},
        )
        for n in (min(a.experts), max(a.experts))
    ]
    variants.append(
        ("default model, tokenid.yaml (one vector per id at layer 0)", {"tokenid": {"layers": [0]}})
    )
    variants += [
        (
            f"default model, tokenid n-grams [2, 3] x 4 heads x {r} rows, gated, at layer 1",
            {"tokenid": {"layers": [1], "ngram_orders": [2, 3], "ngram_rows": r}},
        )
        for r in a.ngram_rows
    ]
    steps = {}
    for name, plugins in variants:
        model = Transformer(mc, plugins)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt) -> None:
            opt.zero_grad(set_to_none=True)
            ctx = Context(tokens=tokens[:, :-1], stage="train")
            logits = model(tokens[:, :-1], ctx)
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            aux = ctx.total_aux_loss()
            (loss if aux is None else loss + aux).backward()
            opt.step()

        active = f"{model.active_parameters() / 1e6:.2f}M of {model.num_parameters() / 1e6:.2f}M"
        steps[name] = (step, active)
    dense_step = steps[variants[0][0]][0]
    rows = []
    for name, (step, active) in steps.items():
        t, dense = paired(step, dense_step, a.repeat)
        rows.append([name, active, dense * 1e3, t * 1e3, t / dense])
        print(f"  {name}: {t * 1e3:.1f} ms, dense {dense * 1e3:.1f} ms", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print the layer table and the model table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=256, help="model width")
    p.add_argument("--mult", type=int, default=4, help="FFN / expert hidden width as a multiple of d")
    p.add_argument("--ffn", default="plain", choices=["plain", "gated"], help="FFN kind of the layer rows")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument(
        "--ngram-rows",
        type=int,
        nargs="+",
        default=[512, 65536],
        help="rows per hash head of the n-gram rows (512: Token-ID's parameters at vocabulary 4096; 65536: shipped)",
    )
    p.add_argument(
        "--repeat", type=int, default=7, help="timed runs per row, alternating with the baseline (min)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-model", action="store_true", help="skip the whole-model training-step rows")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(
        f"d={a.d}, hidden={a.mult * a.d} ({a.ffn}), {a.batch} x {a.seq} = {a.batch * a.seq} tokens per step, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}\n"
    )
    headers = ["layer (forward + backward)", "active per token", "dense FFN ms", "ms", "x dense FFN"]
    print(table(headers, layer_rows(a)))
    if not a.no_model:
        print()
        print(
            table(
                [
                    "training step (fwd + bwd + AdamW)",
                    "active params",
                    "dense model ms",
                    "ms",
                    "x dense model",
                ],
                model_rows(a),
            )
        )


if __name__ == "__main__":
    main()
