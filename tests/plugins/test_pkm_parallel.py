"""PKM values under data parallelism: the exchange of reads (plugins/_pkm_rows.py exchange_lookups), under DDP and
under FSDP2 (the value tables left out of fully_shard, replicated, and updated by the same row-wise Adam)."""

import pytest
import torch
import yaml
from cli_helpers import CONFIGS, DDP_2CPU, column, fit_args, read_metrics, run_rlm
from torch.testing import assert_close

from rlm.distributed.parallel import spawn_local
from rlm.model import ModelConfig
from rlm.plugin import Context
from rlm.plugins.pkm import PKMConfig, PKMPlugin

D, B, T, STEPS = 32, 2, 6, 3  # B rows per rank


def _memory(query_norm: str = "layernorm"):
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=50, d_model=D, n_layers=2, n_heads=2)
    config = PKMConfig(layers=[0], n_keys=8, heads=2, topk=4, k_dim=12, sparse="auto", query_norm=query_norm)
    plugin = PKMPlugin(config, mc)
    return plugin, plugin.build(plugin.claims()[0], 0, None)


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randn(2 * B, T, D, generator=g)
        mask = torch.ones(2 * B, T, dtype=torch.bool)
        mask[1, 4:] = False
        r = torch.randn(2 * B, T, D, generator=g)
        out.append((x, mask, r))
    return out


def _train(plugin, layer, batches, rows: slice) -> None:
    """STEPS row-Adam steps on the values; loss = sum(m * r) / rows of the (local) batch."""
    for x, mask, r in batches:
        x, mask, r = x[rows], mask[rows], r[rows]
        ctx = Context(tokens=torch.zeros(mask.shape, dtype=torch.long), mask=mask)
        ((layer(x, ctx) * r).sum() / x.shape[0]).backward()
        plugin.row_optimizer.step()


def _worker(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        plugin, layer = _memory()
        assert plugin.resolve_sparse(distributed=True, row_exchange=True)
        _train(plugin, layer, _batches(), slice(rank * B, (rank + 1) * B))
        st = plugin.row_optimizer.state["shared"]
        out[rank] = (plugin.values["shared"].detach().clone(), st["exp_avg_sq"].clone(), int(st["step"]))
        out[f"bytes{rank}"] = plugin.row_optimizer.sent_bytes
        _exchange_part(rank, out)
        _row_adam_part(rank, out)
        _fsdp_part(rank, out)
        _group_part(rank, out)
        # both ranks done with every collective before either tears gloo down (a rank that exits while
        # the other still has gloo work in flight aborted the benchmark once: "terminate called ...")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """One 2-process run for the tests below (each spawn costs ~20 s of process start on a loaded CI CPU)."""
    return spawn_local(_worker)


@pytest.mark.ddp
def test_two_processes_hold_the_values_of_one_process_on_the_global_batch(two_ranks):
    got = two_ranks
    plugin, layer = _memory()
    before = plugin.values["shared"].detach().clone()
    assert plugin.resolve_sparse(distributed=False)
    _train(plugin, layer, _batches(), slice(0, 2 * B))
    values = plugin.values["shared"].detach()
    st = plugin.row_optimizer.state["shared"]
    # The replicas are bitwise equal: every rank runs the same update on the same exchanged rows.
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert got[0][2] == got[1][2] == STEPS
    # And bitwise equal to one process: each rank's loss is the mean over its half, the exchange divides by W = 2
    # (exact), and every row sums the same lookups in the same order (rank 0's tokens, then rank 1's).
    assert torch.equal(got[0][0], values)
    assert torch.equal(got[0][1], st["exp_avg_sq"])
    assert not torch.equal(values, before)  # the steps did move rows
    # Sent: the (lookups, tokens) counts, then each of the B*T tokens' H*k = 8 lookups (int32 row and token) and its
    # output gradient, with the lookups' weights as 96 / D = 3 more rows of D floats: ~1/3 of 2 x 64 slots x D.
    assert got["bytes0"] == 16 + B * T * 8 * 8 + (B * T + 3) * D * 4


def _rank_reads(rank: int, slots: int, d: int):
    """One rank's reads of a table: flat (slots, weights, token of each) and the output gradients (R, d)."""
    g = torch.Generator().manual_seed(10 + rank)
    tokens, m = (2, 5)[rank], 4
    rows = torch.randint(0, slots, (tokens * m,), generator=g)
    weights = torch.rand(tokens * m, generator=g)
    grad = torch.randn(tokens, d, generator=g)
    if rank == 1:
        grad[0] = 0.0  # rows read only with a zero gradient still belong to the union
    return rows, weights, torch.arange(tokens).repeat_interleave(m), grad


def _exchange_part(rank: int, out: dict) -> None:
    """exchange_lookups on EXCHANGE_CASES (in _worker's process group)."""
    import torch.distributed as dist

    from rlm.plugins._pkm_rows import exchange_lookups

    for slots, d, _ in EXCHANGE_CASES:
        out[(slots, rank)] = exchange_lookups(*_rank_reads(rank, slots, d), dist.group.WORLD, rows=slots)
    # A step in which no rank read the table: only the counts travel, and nothing is updated.
    empty = torch.zeros(0, dtype=torch.int64)
    got = exchange_lookups(empty, torch.zeros(0), empty, torch.zeros(0, 4), dist.group.WORLD, rows=64)
    out[("no reads", rank)] = (got[0].numel(), got[1].tolist(), got[5])


# Rank 0 reads 2 tokens x 4 rows, rank 1 5 x 4, at d = 4. The lookups way receives 2 x (20 lookups x (4 + 4) +
# (5 tokens + 20 / 4 rows of weights) x 4 x 4) = 640 bytes and sums 28 x 4 x 4 bytes (counted as 56); a dense ring
# all-reduce of a 12 x (4 + 1) float table moves 480: dense. At 4096 slots dense is 163,840: lookups.
EXCHANGE_CASES = [(12, 4, "dense"), (4096, 4, "lookups")]


@pytest.mark.ddp
def test_the_exchange_gives_ddps_mean_gradient_and_takes_the_cheaper_way(two_ranks):
    from rlm.plugins._pkm_ops import row_gradients

    got = two_ranks
    assert got[("no reads", 0)] == got[("no reads", 1)] == (0, [0], 16)
    for slots, d, way in EXCHANGE_CASES:
        # The reference: DDP's mean of the two ranks' dense (slots, d) gradients, at the rows either read.
        dense, touched = torch.zeros(slots, d), torch.zeros(slots, dtype=torch.bool)
        for rank in (0, 1):
            rows, weights, tok, grad = _rank_reads(rank, slots, d)
            dense.index_add_(0, rows, weights[:, None] * grad[tok])
            touched[rows] = True
        want_rows = touched.nonzero().squeeze(1)
        for rank in (0, 1):
            rows, offsets, tok, w, grad, _ = got[(slots, rank)]
            assert torch.equal(rows, want_rows), (slots, way)
            assert_close(row_gradients(offsets, tok, w, grad), dense[want_rows] / 2)
        # The replicas receive the same lookups bit for bit.
        for a, b in zip(got[(slots, 0)][:5], got[(slots, 1)][:5]):
            assert torch.equal(a, b), (slots, way)
        sent0 = got[(slots, 0)][5]
        if way == "dense":
            assert sent0 == 16 + slots * (d + 1) * 4, slots
            assert torch.equal(got[(slots, 0)][1], torch.arange(want_rows.numel() + 1))  # one summed row each
        else:
            # (E, R) counts, then the largest rank's 20 lookups x (int32 row + int32 token), and its 5 gradient
            # rows plus 20 weights as 5 more rows of d floats.
            assert sent0 == 16 + 20 * 8 + (5 + 5) * d * 4, slots
            assert got[(slots, 0)][4].shape == (2 * 10, d)


def _two_reads(rank: int, rows: int):
    """A rank's two reads of one table (two layers, or two micro-batches), of 6 and 3 lookups per token."""
    g = torch.Generator().manual_seed(20 + rank)
    return [
        (
            torch.randint(0, rows, (n, m), generator=g),
            torch.rand(n, m, generator=g),
            torch.rand(n, 8, generator=g),
        )
        for n, m in ((5 + rank, 6), (3, 3))
    ]


def _row_adam_part(rank: int, out: dict) -> None:
    """Two RowAdam steps on a table read twice per step, exchanging over _worker's process group."""
    import torch.distributed as dist

    from rlm.plugins._pkm_rows import RowAdam

    for rows in ROW_ADAM_ROWS:
        table = torch.randn(rows, 8, generator=torch.Generator().manual_seed(3))
        opt = RowAdam(lr=0.01)
        opt.group = dist.group.WORLD
        opt.add_table("t", table)
        for _ in range(2):
            for read in _two_reads(rank, rows):
                opt.add_lookups("t", *read)
            opt.step()
        out[("row_adam", rows, rank)] = (table, opt.state["t"]["exp_avg_sq"])
        if rank == 0:
            out[("row_adam_sent", rows)] = opt.sent_bytes


ROW_ADAM_ROWS = (4096, 12)  # the lookups way, then the dense way (a table smaller than the reads)


@pytest.mark.ddp
def test_row_adam_over_two_processes_equals_one_process_with_several_reads_a_step(two_ranks):
    from rlm.plugins._pkm_rows import RowAdam

    for rows in ROW_ADAM_ROWS:
        table = torch.randn(rows, 8, generator=torch.Generator().manual_seed(3))
        opt = RowAdam(lr=0.01)
        opt.add_table("t", table)
        for _ in range(2):
            # One process on the global batch: both ranks' reads, rank 0's first; the loss is the mean over twice
            # the tokens, so each output gradient is half a rank's.
            for rank in (0, 1):
                for slots, weights, grad in _two_reads(rank, rows):
                    opt.add_lookups("t", slots, weights, grad / 2)
            opt.step()
        (t0, v0), (t1, v1) = (two_ranks[("row_adam", rows, r)] for r in (0, 1))
        assert torch.equal(t0, t1) and torch.equal(v0, v1)  # the replicas
        if rows == 4096:  # the same lookups summed in the same order: bit for bit
            assert torch.equal(t0, table) and torch.equal(v0, opt.state["t"]["exp_avg_sq"])
        else:  # the dense way sums each rank's rows first, then the ranks
            assert_close(t0, table)
            assert_close(v0, opt.state["t"]["exp_avg_sq"])
        # Which way each took: the dense way sends the (counts and) whole (12, 8 + 1) table.
        assert (two_ranks[("row_adam_sent", rows)] == 16 + 12 * 9 * 4) == (rows == 12), rows


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_fit_exchanges_rows_instead_of_a_dense_all_reduce(tmp_path, rlm_cache):
    spec = dict(layers=[1], n_keys=16, heads=2, topk=4, k_dim=32)
    (tmp_path / "pkm.yaml").write_text(yaml.safe_dump({"model": {"plugins": {"pkm": spec}}}))
    proc = run_rlm(fit_args(tmp_path / "pkm.yaml") + DDP_2CPU, tmp_path, rlm_cache)
    assert "distributed_backend=gloo" in proc.stdout + proc.stderr
    assert len(column(read_metrics(tmp_path / "runs/test/version_0"), "train/loss")) == 4
    # Sparse under DDP: the row-wise Adam state is in the checkpoint and the values are in no AdamW group.
    ckpt = torch.load(tmp_path / "runs/test/ckpt/last.ckpt", map_location="cpu", weights_only=False)
    assert int(ckpt["callbacks"]["PKMCallback[pkm]"]["state"]["shared"]["step"]) == ckpt["global_step"] >= 3
    names = [g.get("name") for opt in ckpt["optimizer_states"] for g in opt["param_groups"]]
    assert "pkm_values" not in names


# slow: runs the benchmark script end to end at its smoke size
@pytest.mark.slow
@pytest.mark.ddp
def test_benchmark_script_smoke():
    import subprocess
    import sys

    # A subprocess: torch.multiprocessing.spawn needs the script importable as __main__.
    bench = CONFIGS.parent / "benchmarks" / "pkm_parallel.py"
    args = ["--n", "16", "32", "--topk", "4", "--repeat", "1", "--batch", "1", "--seq", "16", "--k-dim", "32"]
    run = subprocess.run([sys.executable, bench, *args, "--strategy", "all"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]  # the benchmark's own error, not only its exit status
    one, rest = run.stdout.split("PKM layer under DDP")
    assert "| 256 slots, dense |" in one and "| 1,024 slots, rows |" in one
    assert "ONE step at 1,024 slots over 256: dense " in one
    ddp, fsdp = rest.split("PKM layer under FSDP2")
    for out in (ddp, fsdp):
        assert "| 256 slots, dense |" in out and "| 1,024 slots, rows |" in out
    assert "DDP step at 1,024 slots over 256: dense " in ddp
    assert "| FSDP-managed |" in fsdp and "FSDP2 step at 1,024 slots over 256: dense " in fsdp


# FSDP2: a 2-layer model with a memory at layer 0, 2 ranks of 2 sequences each against 1 process on all 4; each
# step accumulates two micro-batches and clips the gradient's norm at FSDP_CLIP (below the norms these steps have).
FSDP_STEPS, FSDP_VOCAB, FSDP_CLIP = 3, 50, 0.5
FSDP_TOKENS = torch.randint(0, FSDP_VOCAB, (FSDP_STEPS, 4, 12), generator=torch.Generator().manual_seed(2))
KEYS = "stack.blocks.0.ffn.keys"


def _fsdp_model(sparse: bool | str):
    from rlm.model import Transformer

    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=FSDP_VOCAB, d_model=D, n_layers=2, n_heads=2, max_seq_len=16)
    pkm = dict(layers=[0], n_keys=8, heads=2, topk=4, k_dim=12, sparse=sparse)
    return Transformer(mc, {"pkm": pkm})


def _fsdp_train(model, rank: int | None, sync=None) -> tuple[list[bool], list[float]]:
    """FSDP_STEPS steps of fused AdamW (the rest) and the plugin's row-wise Adam (values, when sparse) on the mean
    cross-entropy of the global batch, as rlm's trainer takes them: two accumulated micro-batches, ``sync`` (the
    synced parameters' all-reduce) armed on the second, the norm clipped, then the optimizers. ``rank`` None: one
    process on all 4 rows (micro-batch h: rows h and 2 + h); else this rank's row of each micro-batch (2 rank + h).
    Returns, per step, whether the value table had no .grad, and the gradient norm before clipping."""
    from rlm.distributed.parallel import synced_parameters
    from rlm.distributed.replicas import clip_grad_norm_

    plugin = model.plugins["pkm"]
    synced = {id(p) for p in synced_parameters(model)}
    params = [p for p in model.parameters() if p.requires_grad]
    # synced parameters in a group of their own, as LMModule.parameter_groups makes them (fused refuses a mix)
    groups = [[p for p in params if id(p) not in synced], [p for p in params if id(p) in synced]]
    optimizer = torch.optim.AdamW([{"params": g} for g in groups if g], lr=1e-2, fused=True)
    no_grad, norms = [], []
    for tokens in FSDP_TOKENS:
        for h in (0, 1):
            mine = tokens[h::2] if rank is None else tokens[2 * rank + h : 2 * rank + h + 1]
            if sync is not None:
                sync.armed = h == 1
            logits = model(mine[:, :-1], Context(tokens=mine[:, :-1], stage="train"))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
            (loss / 2).backward()
        if sync is not None:
            assert sync.finish()
        no_grad.append(all(v.grad is None for v in plugin.values.values()))
        if rank is None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, FSDP_CLIP)))
        else:
            norms.append(float(clip_grad_norm_(params, FSDP_CLIP)))
        if plugin.sparse_active:
            plugin.row_optimizer.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return no_grad, norms


def _fsdp_part(rank: int, out: dict) -> None:
    """Both value paths under FSDP2 (in _worker's process group): rows (sparse auto) and dense (sparse false)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from rlm.distributed.parallel import full_tensor, parallelize, synced_parameters
    from rlm.distributed.replicas import ReplicaSync

    for sparse in ("auto", False):
        model = _fsdp_model(sparse)
        plugin = model.plugins["pkm"]
        plugin.resolve_sparse(distributed=True, row_exchange=True)
        parallelize(model, init_device_mesh("cpu", (2,)))
        synced = synced_parameters(model)
        sync = ReplicaSync(synced, dist.group.WORLD, 0.5) if synced else None
        sharded = {n: isinstance(p, DTensor) for n, p in model.named_parameters()}
        no_grad, norms = _fsdp_train(model, rank, sync)
        params = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
        out[("fsdp", sparse, rank)] = (params, sharded, no_grad, plugin.row_optimizer.sent_bytes, norms)


@pytest.mark.ddp
@pytest.mark.parametrize("sparse", ["auto", False])
def test_fsdp2_two_processes_match_one_process_and_rows_replace_the_dense_value_gradient(two_ranks, sparse):
    model = _fsdp_model(sparse)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert model.plugins["pkm"].resolve_sparse(distributed=False) == (sparse == "auto")
    one_no_grad, one_norms = _fsdp_train(model, None)
    one = {n: p.detach() for n, p in model.named_parameters()}
    values = "plugins.pkm.values.shared"
    (two0, sharded, no_grad0, sent0, norms0), (two1, _, no_grad1, _, norms1) = (
        two_ranks[("fsdp", sparse, r)] for r in (0, 1)
    )
    assert set(two0) == set(one) and values in one and KEYS in one
    # the clipping acted (every step's norm above the threshold), by the same global norm on both ranks
    assert min(one_norms) > FSDP_CLIP and norms0 == norms1
    assert_close(torch.tensor(norms0), torch.tensor(one_norms), rtol=1e-4, atol=0)
    for name in one:
        # Same global batch, same start: equal but for the order of float32 sums (the gradients' reduction,
        # each rank's loss over half the tokens), which Adam's first steps scale up on near-zero components.
        assert_close(two0[name], one[name], rtol=1e-4, atol=1e-5, msg=name)
        assert not torch.equal(one[name], before[name]), name  # every parameter trained
    if sparse == "auto":
        # The values and sub-keys stay whole on every rank, and the replicas are equal bit for bit; the values get
        # no dense .grad (one process takes the same row-wise path); every other parameter is sharded.
        assert not sharded[values] and not sharded[KEYS]
        assert all(s for n, s in sharded.items() if n not in (values, KEYS))
        assert all(no_grad0) and all(no_grad1) and all(one_no_grad)
        assert torch.equal(two0[values], two1[values]) and torch.equal(two0[KEYS], two1[KEYS])
        assert sent0 > 0  # the touched rows were exchanged
    else:
        # The old dense path, still there with sparse: false: the values sharded with a dense gradient.
        assert all(sharded.values()) and not any(no_grad0) and not any(one_no_grad)
        assert sent0 == 0


# ----- the memory's collectives run over the group handed in (set_group), not the default group -----


def _eval_stats(plugin, layer, batch, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(usage, KL to uniform) of an evaluation pass over ``rows`` of ``batch``, through the plugin's statistics."""
    x, mask, _ = batch
    layer.eval()
    plugin.start_stats()
    with torch.no_grad():
        layer(x[rows], Context(tokens=torch.zeros(mask[rows].shape, dtype=torch.long), mask=mask[rows]))
    ((usage, kl),) = plugin.stop_stats().values()
    layer.train()
    return usage, kl


def _group_part(rank: int, out: dict) -> None:
    """A batch-norm memory trained and evaluated with its collectives over a singleton group, then the world."""
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(2)]  # every rank creates every group, in the same order
    for kind, group in (("own", singles[rank]), ("world", dist.group.WORLD)):
        plugin, layer = _memory("batchnorm")
        plugin.set_group(group)
        assert plugin.resolve_sparse(distributed=True, row_exchange=True)
        assert plugin.row_optimizer.group is group and layer.norm.group is group
        batches = _batches()
        _train(plugin, layer, batches, slice(rank * B, (rank + 1) * B))
        stats = _eval_stats(plugin, layer, batches[0], slice(rank * B, (rank + 1) * B))
        norm = layer.norm
        out[("group", kind, rank)] = (
            plugin.values["shared"].detach().clone(),
            norm.running_mean.clone(),
            norm.running_var.clone(),
            *stats,
        )


def _by_hand_running_stats(layer, batches, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch norm's running mean and unbiased variance over ``rows``' valid queries, step by step (momentum 0.1).

    _train steps only the values, so the query network is the one every step saw.
    """
    mean, var = torch.zeros(layer.norm.running_mean.shape, dtype=torch.float64), None
    var = torch.ones_like(mean)
    with torch.no_grad():
        for x, mask, _ in batches:
            q = layer.query(x[rows].reshape(-1, D)).double()[
                mask[rows].reshape(-1)
            ]  # (valid tokens, H*k_dim)
            mean = 0.9 * mean + 0.1 * q.mean(0)
            var = 0.9 * var + 0.1 * q.var(0, unbiased=True)
    return mean.float(), var.float()


@pytest.mark.ddp
def test_a_handed_in_group_bounds_the_batchnorm_slot_statistics_and_row_exchange(two_ranks):
    """Each rank in a group of its own gets one process's numbers on its own rows; the world group, the global ones."""
    batches = _batches()
    for kind, ranks in (
        ("own", ((0, slice(0, B)), (1, slice(B, 2 * B)))),
        ("world", ((None, slice(0, 2 * B)),)),
    ):
        for rank, rows in ranks:
            plugin, layer = _memory("batchnorm")
            want_mean, want_var = _by_hand_running_stats(layer, batches, rows)
            assert plugin.resolve_sparse(distributed=False)
            _train(plugin, layer, batches, rows)
            assert_close(layer.norm.running_mean, want_mean, rtol=1e-5, atol=1e-6)  # the reference itself
            usage, kl = _eval_stats(plugin, layer, batches[0], rows)
            for r in (rank,) if rank is not None else (0, 1):
                values, mean, var, got_usage, got_kl = two_ranks[("group", kind, r)]
                msg = f"{kind} group, rank {r}"
                assert_close(mean, want_mean, rtol=1e-5, atol=1e-6, msg=msg)
                assert_close(var, want_var, rtol=1e-5, atol=1e-6, msg=msg)
                assert_close(values, plugin.values["shared"].detach(), rtol=1e-5, atol=1e-6, msg=msg)
                assert_close(got_usage, usage, msg=msg)
                assert_close(got_kl, kl, rtol=1e-5, atol=1e-7, msg=msg)
    # The two groups do differ: a singleton group does not reduce over the other rank.
    own, world = two_ranks[("group", "own", 0)], two_ranks[("group", "world", 0)]
    assert not torch.allclose(own[1], world[1]) and not torch.allclose(own[0], world[0])
    assert not torch.allclose(own[4], world[4])
