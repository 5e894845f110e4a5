"""Product key memory speed: the layer from 16k to 1M slots against a dense FFN and the `product-key-memory`
package measured in the same run, and the default model with one memory layer (the paper's Table 4 claim:
inference speed barely depends on the number of slots; training cost should grow little).

    python benchmarks/pkm.py                                   # d=256, H=4, k=32, 8 x 128 tokens, n=128..1024
    python benchmarks/pkm.py --n 32 64 --batch 2 --seq 32 --repeat 1 --model-seq 32   # a quick smoke run
    python benchmarks/pkm.py --clock cpu       # one thread, CPU time: stable numbers on a busy shared machine

Layer rows: forward; and a training step of the layer = forward + backward (input gradient included, as
inside a model) + values update. 'sparse' is the plugin's default on one process (row gradients and a
row-wise lazy Adam on the touched rows); 'dense' is pkm.sparse: false (a dense value gradient and
torch's fused Adam over the whole table; FSDP2's own path for the values). The dense FFN (4d, GELU) row
includes its Adam step. The peer
(`pip install product-key-memory`, in `rlm[bench]`) is timed at the same shapes, forward + backward as its
README trains it; its rows are skipped with a note when the package is absent. The options table times
the layer and the default model with each of OPTIONS at --option-n (512: pkm.yaml's slots) against the memory
as shipped, the dense FFN and the model without memory, all in the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table, time_fn  # noqa: E402

from rlm.model import ModelConfig, Transformer  # noqa: E402
from rlm.model.layers import FeedForward  # noqa: E402
from rlm.plugin import Context  # noqa: E402
from rlm.plugins.pkm import PKMConfig, PKMPlugin  # noqa: E402


def cpu_time_fn(fn: Callable[[], object], repeat: int = 10, warmup: int = 2) -> float:
    """Median CPU seconds of the calling thread for ``fn()`` (use with 1 torch thread).

    On a machine shared with other jobs, wall-clock time mostly measures waiting for a core; the thread's
    CPU time (user + system, page faults included) measures the work, which is what the ratios compare.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


OPTIONS: dict[str, dict[str, object]] = {
    "pkm.yaml as shipped": {},
    "key_norm": {"key_norm": True},
    "gated": {"gated": True},
    "PEER values": {"values": "peer"},
    "PEER values + key_norm (pkm_peer.yaml)": {"values": "peer", "key_norm": True},
}
"""The later memory-layer options against the memory as shipped: qk-norm and the gated output (Berges et al.),
single-neuron PEER experts (He 2024) in the same number of slots."""


def memory(a: argparse.Namespace, n: int, sparse: str, **options: object) -> PKMPlugin:
    """A plugin whose single memory layer is at layer 0 of a d-wide model."""
    mc = ModelConfig(d_model=a.d, n_layers=1, n_heads=4)
    cfg = PKMConfig(
        layers=[0], n_keys=n, heads=a.heads, topk=a.k, k_dim=a.k_dim, sparse=sparse == "true", **options
    )
    plugin = PKMPlugin(cfg, mc)
    plugin.build(plugin.claims()[0], 0, None)
    plugin.resolve_sparse(distributed=False)
    return plugin


def layer_fns(
    a: argparse.Namespace, n: int, sparse: str, **options: object
) -> tuple[Callable[[], None], Callable[[], None]]:
    """(forward, forward + backward + values update) of one memory layer."""
    plugin = memory(a, n, sparse, **options)
    layer = plugin.memories[0]
    x = torch.randn(a.batch, a.seq, a.d, requires_grad=True)
    tokens = torch.zeros(a.batch, a.seq, dtype=torch.long)
    grad = torch.randn_like(x)
    params = [p for p in [*layer.parameters(), *plugin.values.values()] if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-3, fused=True)

    def forward() -> None:
        with torch.no_grad():
            layer(x, Context(tokens=tokens))

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        x.grad = None
        (layer(x, Context(tokens=tokens)) * grad).sum().backward()
        opt.step()
        plugin.row_optimizer.step()

    return forward, train_step


def ffn_fns(a: argparse.Namespace) -> tuple[Callable[[], None], Callable[[], None]]:
    """(forward, forward + backward + Adam) of a dense 4d GELU FFN."""
    ffn = FeedForward(ModelConfig(d_model=a.d, n_layers=1, n_heads=4, ffn="plain", d_ff=4 * a.d))
    x = torch.randn(a.batch, a.seq, a.d, requires_grad=True)
    grad = torch.randn_like(x)
    opt = torch.optim.Adam(ffn.parameters(), lr=1e-3, fused=True)

    def forward() -> None:
        with torch.no_grad():
            ffn(x)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        x.grad = None
        (ffn(x) * grad).sum().backward()
        opt.step()

    return forward, train_step


def peer_fn(a: argparse.Namespace, n: int) -> Callable[[], None]:
    """product-key-memory's PKM at the same shapes (k_dim/2 per sub-key), forward + backward."""
    from product_key_memory import PKM

    pkm = PKM(dim=a.d, heads=a.heads, num_keys=n, topk=a.k, dim_head=a.k_dim // 2)
    x = torch.randn(a.batch, a.seq, a.d, requires_grad=True)
    grad = torch.randn_like(x)

    def run() -> None:
        pkm.zero_grad(set_to_none=True)
        x.grad = None
        (pkm(x) * grad).sum().backward()

    return run


def layer_rows(a: argparse.Namespace) -> tuple[list[list[object]], list[list[object]]]:
    """The layer table (relative to n = min and to the dense FFN) and the peer table."""
    ffn_fwd, ffn_step = (a.timer(f, a.repeat) for f in ffn_fns(a))
    rows: list[list[object]] = [["dense FFN 4d", "-", ffn_fwd * 1e3, ffn_step * 1e3, "", "", 1.0, 1.0]]
    peers: list[list[object]] = []
    have_peer = importlib.util.find_spec("product_key_memory") is not None
    for sparse in a.paths:
        base = None
        for n in a.n:
            fwd, step = (a.timer(f, a.repeat) for f in layer_fns(a, n, sparse))
            base = base or (fwd, step)
            label = "sparse" if sparse == "true" else "dense"
            rows.append(
                [f"pkm {label} n={n}", f"{n * n:,}", fwd * 1e3, step * 1e3, fwd / base[0], step / base[1],
                 fwd / ffn_fwd, step / ffn_step]
            )  # fmt: skip
            print(f"  pkm {label} n={n}: fwd {fwd * 1e3:.1f} ms, step {step * 1e3:.1f} ms", file=sys.stderr)
            if sparse == "true" and have_peer:
                peer = a.timer(peer_fn(a, n), a.repeat)
                peers.append([f"n={n}", f"{n * n:,}", step * 1e3, peer * 1e3, peer / step])
                print(f"  peer n={n}: {peer * 1e3:.1f} ms", file=sys.stderr)
    if not have_peer:
        peers.append(["peer product-key-memory: skipped (pip install product-key-memory)", "", "", "", ""])
    return rows, peers


def model_fns(a: argparse.Namespace, pkm: dict | None) -> tuple[Callable[[], None], Callable[[], None]]:
    """(inference, training step) of the default model with the memory ``pkm`` in the middle (or none)."""
    mc = ModelConfig(
        vocab_size=a.vocab, d_model=256, n_layers=4, n_heads=4, max_seq_len=max(1024, a.model_seq)
    )
    tokens = torch.randint(0, a.vocab, (a.model_batch, a.model_seq + 1))
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    model = Transformer(mc, None if pkm is None else {"pkm": pkm})
    for plugin in model.plugins.values():
        plugin.resolve_sparse(distributed=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)

    def infer() -> None:
        model.eval()
        with torch.no_grad():
            model(inp, Context(tokens=inp, stage="val"))

    def step() -> None:
        model.train()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inp, Context(tokens=inp)).flatten(0, 1), tgt.flatten())
        loss.backward()
        opt.step()
        for plugin in model.plugins.values():
            plugin.row_optimizer.step()

    return infer, step


def model_rows(a: argparse.Namespace) -> list[list[object]]:
    """The default model with one memory layer in the middle: inference tokens/s and training step time."""
    n_tokens = a.model_batch * a.model_seq
    variants = [("default model, no memory", None)] + [
        (f"pkm at layer 2, n={n} ({n * n:,} slots)", n) for n in (min(a.n), max(a.n))
    ]
    rows, base = [], None
    for name, n in variants:
        pkm = None if n is None else dict(n_keys=n, heads=a.heads, topk=a.k, k_dim=a.k_dim)
        t_inf, t_step = (a.timer(f, a.repeat) for f in model_fns(a, pkm))
        if n == min(a.n):
            base = (t_inf, t_step)
        speed = n_tokens / t_inf
        rel = ("", "") if base is None or n is None else (base[0] / t_inf, t_step / base[1])  # speed, cost
        rows.append([name, speed, t_step * 1e3, *rel])
        print(f"  {name}: {speed:.0f} tok/s, step {t_step * 1e3:.1f} ms", file=sys.stderr)
    return rows


def option_rows(a: argparse.Namespace) -> list[list[object]]:
    """Each of OPTIONS at n = a.option_n: the layer's training step and the default model's, each against the
    memory as shipped and against the dense FFN / the model without memory, all measured in this run."""
    n = a.option_n
    ffn_step = a.timer(ffn_fns(a)[1], a.repeat)
    dense_model = a.timer(model_fns(a, None)[1], a.repeat) if not a.no_model else float("nan")
    rows, shipped = [], None
    # The memory as shipped once more at the end: how far two measurements of one thing differ here.
    for name, options in [*OPTIONS.items(), ("pkm.yaml as shipped, again", {})]:
        step = a.timer(layer_fns(a, n, "true", **options)[1], a.repeat)
        pkm = dict(n_keys=n, heads=a.heads, topk=a.k, k_dim=a.k_dim, **options)
        model = a.timer(model_fns(a, pkm)[1], a.repeat) if not a.no_model else float("nan")
        shipped = shipped or (step, model)
        rows.append(
            [name, f"{n * n:,}", step * 1e3, step / shipped[0], step / ffn_step,
             model * 1e3, model / shipped[1], model / dense_model]
        )  # fmt: skip
        print(
            f"  {name} n={n}: layer step {step * 1e3:.1f} ms, model step {model * 1e3:.1f} ms",
            file=sys.stderr,
        )
    rows.append(
        [
            "dense FFN 4d / default model without memory",
            "-",
            ffn_step * 1e3,
            "",
            1.0,
            dense_model * 1e3,
            "",
            1.0,
        ]
    )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print the layer, peer and model tables."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=256, help="model width")
    p.add_argument("--heads", type=int, default=4, help="memory heads H")
    p.add_argument("--k", type=int, default=32, help="top-k per head")
    p.add_argument("--k-dim", type=int, default=256, help="query width per head (two halves)")
    p.add_argument(
        "--n", type=int, nargs="+", default=[128, 256, 512, 1024], help="sub-keys per half (n^2 slots)"
    )
    p.add_argument(
        "--paths",
        nargs="+",
        choices=["true", "false"],
        default=["true", "false"],
        help="true=sparse false=dense",
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--model-batch", type=int, default=4, help="batch of the model rows")
    p.add_argument("--model-seq", type=int, default=256, help="sequence length of the model rows")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per row (median reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-model", action="store_true", help="skip the whole-model rows")
    p.add_argument("--option-n", type=int, default=512, help="sub-keys per half of the options table")
    p.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="wall: median wall-clock time; cpu: median CPU time of one thread (1 torch thread; for shared machines)",
    )  # fmt: skip
    a = p.parse_args(argv)
    a.timer = time_fn
    if a.clock == "cpu":
        a.threads, a.timer = 1, cpu_time_fn
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(
        f"d={a.d}, H={a.heads}, k={a.k}, k_dim={a.k_dim}, {a.batch} x {a.seq} = {a.batch * a.seq} tokens, "
        f"{torch.get_num_threads()} threads, {a.clock} clock, torch {torch.__version__}\n"
    )
    rows, peers = layer_rows(a)
    headers = [
        "layer",
        "slots",
        "fwd ms",
        "step ms",
        "fwd x n_min",
        "step x n_min",
        "fwd x FFN",
        "step x FFN",
    ]
    print(table(headers, rows))
    print()
    print(table(["peer at", "slots", "ours step ms", "peer fwd+bwd ms", "peer / ours"], peers))
    if not a.no_model:
        print()
        headers = ["default model", "inference tok/s", "train step ms", "speed x n_min", "step x n_min"]
        print(table(headers, model_rows(a)))
    print()
    headers = [
        f"option (sparse values, n={a.option_n})",
        "slots",
        "layer step ms",
        "x shipped",
        "x FFN",
        "model step ms",
        "x shipped",
        "x no memory",
    ]
    print(table(headers, option_rows(a)))


if __name__ == "__main__":
    main()
