"""Expert parallelism (plugins/_expert_parallel.py): 2 gloo processes against one process on the global batch."""

from types import SimpleNamespace

import pytest
import torch
import yaml
from cli_helpers import CONFIGS, DDP_2CPU, column, fit_args, read_metrics, run_rlm
from torch.testing import assert_close

from rlm.model import ModelConfig
from rlm.plugin import Context
from rlm.plugins._expert_parallel import ExpertParallelCallback, shard_experts
from rlm.plugins.moe import MoEConfig, MoELayer
from rlm.train.parallel import spawn_local

D, V, B, T = 32, 64, 2, 12  # B rows per rank
TOL = dict(rtol=1e-4, atol=1e-5)  # float32; sums over tokens run in another order


def _layer(capacity_factor: float, dispatch: str) -> MoELayer:
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=2, ffn="gated")
    c = MoEConfig(
        layers=[0], num_experts=4, top_k=2, capacity_factor=capacity_factor, router_jitter=0.0,
        balance_coef=0.0, z_coef=0.0, dispatch=dispatch, expert_parallel=True,
    )  # fmt: skip
    return MoELayer(c, mc, 0)  # float32: torch._grouped_mm takes no float64


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * B, T, D, generator=g, dtype=torch.float32)
    tokens = torch.randint(0, V, (2 * B, T), generator=g)
    mask = torch.ones(2 * B, T, dtype=torch.bool)
    mask[1, 9:] = False  # padding on rank 0
    mask[3, 5:] = False  # and on rank 1
    r = torch.randn(2 * B, T, D, generator=g, dtype=torch.float32)  # the loss is sum(y * r) / tokens
    return x, tokens, mask, r


def _loss(layer, x, tokens, mask, r):
    y = layer(x, Context(tokens=tokens, mask=mask, stage="train"))
    return y, (y * r).sum() / x.shape[0]


def _worker(rank: int, port: int, cases: list, out: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for name, cf, mode in cases:
            layer = _layer(cf, mode)
            shard_experts(layer.experts, rank, 2)
            layer.expert_group = dist.group.WORLD
            x, tokens, mask, r = (t[rank * B : (rank + 1) * B] for t in _batch())
            x = x.clone().requires_grad_(True)
            y, loss = _loss(layer, x, tokens, mask, r)
            loss.backward()
            grads = {}
            for n, p in layer.named_parameters():
                if n.startswith("experts."):
                    grads[n] = p.grad  # this rank's experts, already scaled by 1/W
                else:
                    g = p.grad.clone()
                    dist.all_reduce(g)  # what DDP does: the mean over ranks
                    grads[n] = g / 2
            out[(name, rank)] = (y.detach(), x.grad / 2, grads)
        # both ranks done with every collective before either tears gloo down (a rank that exits while
        # the other still has gloo work in flight aborted the benchmark once: "terminate called ...")
        dist.barrier()
    finally:
        dist.destroy_process_group()


CASES = [("capacity", 0.75, "grouped"), ("dropless", 0.0, "grouped"), ("capacity_bmm", 0.75, "bmm")]


@pytest.mark.ddp
def test_two_processes_equal_one_process_on_the_global_batch():
    got = spawn_local(_worker, CASES)
    for name, cf, mode in CASES:
        layer = _layer(cf, mode)
        x, tokens, mask, r = _batch()
        x.requires_grad_(True)
        y, loss = _loss(layer, x, tokens, mask, r)
        # The mean over 2*B rows: each rank's loss is the mean over its B rows, DDP averages the two.
        loss.backward()
        ctx = Context(tokens=tokens, mask=mask, stage="train")
        layer(x.detach(), ctx)
        assert (ctx.metrics["moe_dropped/l0"] > 0) == (cf > 0), name  # capacity bites where it is set
        (y0, gx0, g0), (y1, gx1, g1) = got[(name, 0)], got[(name, 1)]
        assert_close(torch.cat([y0, y1]), y.detach(), msg=name, **TOL)
        assert_close(torch.cat([gx0, gx1]), x.grad, msg=name, **TOL)
        for n, p in layer.named_parameters():
            want = p.grad
            if n.startswith("experts."):
                assert_close(torch.cat([g0[n], g1[n]]), want, msg=f"{name}: {n}", **TOL)
            else:
                assert_close(g0[n], want, msg=f"{name}: {n}", **TOL)
                assert_close(g1[n], want, msg=f"{name}: {n}", **TOL)


def test_shard_keeps_a_slice_and_loads_its_slice_of_full_tensors():
    layer = _layer(0.0, "grouped")
    full = {k: v.clone() for k, v in layer.experts.state_dict().items()}  # up (4, d, 2h), down (4, h, d)
    shard_experts(layer.experts, rank=1, world=2)
    assert_close(layer.experts.up.detach(), full["up"][2:])
    with torch.no_grad():
        layer.experts.up.zero_(), layer.experts.down.zero_()
    layer.experts.load_state_dict(full)  # a checkpoint's full tensors: rank 1 takes experts 2 and 3
    assert_close(layer.experts.up.detach(), full["up"][2:])
    assert_close(layer.experts.down.detach(), full["down"][2:])
    with pytest.raises(ValueError, match="num_experts=4 on 3 processes"):
        shard_experts(_layer(0.0, "grouped").experts, rank=0, world=3)


def _clip_worker(rank: int, port: int, grads: dict, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        shared = torch.nn.Parameter(torch.zeros(5))
        shared.grad = grads["shared"].clone()  # after DDP: the same on every rank
        own = torch.nn.Parameter(torch.zeros(2, 3))
        own.grad = grads["experts"][2 * rank : 2 * rank + 2].clone()  # this rank's experts
        cb = ExpertParallelCallback(lambda: [])
        cb.clip, cb.params = 1.0, {"experts": own}
        optimizer = SimpleNamespace(param_groups=[{"params": [shared, own]}])
        cb.on_before_optimizer_step(None, SimpleNamespace(device=torch.device("cpu")), optimizer)
        out[rank] = (shared.grad, own.grad)
        # both ranks done with every collective before either tears gloo down (a rank that exits while
        # the other still has gloo work in flight aborted the benchmark once: "terminate called ...")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
def test_gradient_clipping_uses_the_global_norm():
    grads = {"shared": torch.randn(5), "experts": torch.randn(4, 3) * 3}
    got = spawn_local(_clip_worker, grads)
    # One process holds every expert: torch's clip over [shared, all experts].
    ref = [grads["shared"].clone(), grads["experts"].clone()]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in ref]
    for p, g in zip(params, ref):
        p.grad = g
    assert torch.nn.utils.clip_grad_norm_(params, 1.0) > 1.0  # the clip acts
    for rank in (0, 1):
        assert_close(got[rank][0], params[0].grad)
        assert_close(got[rank][1], params[1].grad[2 * rank : 2 * rank + 2])


MOE_DROPLESS = {"layers": [1], "num_experts": 4, "top_k": 2, "capacity_factor": 0.0}


def _moe_fit(tmp_path, name: str, rlm_cache, *extra: str, **kw) -> list[float]:
    run = tmp_path / name
    run.mkdir()
    (run / "moe.yaml").write_text(yaml.safe_dump({"model": {"plugins": {"moe": MOE_DROPLESS | kw}}}))
    args = fit_args(CONFIGS / "plugins" / "moe.yaml", run / "moe.yaml") + DDP_2CPU + ["--trainer.max_steps=6"]
    args += ["--trainer.gradient_clip_val=0.05"]  # far below the gradient norms: clipping acts at every step
    run_rlm(args + list(extra), run, rlm_cache)
    return column(read_metrics(run / "runs/test/version_0"), "train/loss")


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_fit_with_expert_parallel_equals_replicated_experts_and_resumes(tmp_path, rlm_cache):
    # Dropless: replicated experts under DDP then see the same tokens per expert as the sharded ones (with a
    # capacity, replicated DDP would decide drops per rank and expert parallelism for the global batch).
    replicated = _moe_fit(tmp_path, "replicated", rlm_cache)
    sharded = _moe_fit(tmp_path, "sharded", rlm_cache, expert_parallel=True)
    assert len(replicated) == len(sharded) == 6
    # Both clip by the global gradient norm (the factor itself: test_gradient_clipping_uses_the_global_norm).
    assert_close(torch.tensor(sharded), torch.tensor(replicated), rtol=1e-4, atol=1e-5)
    # The checkpoint holds all 4 experts and their Adam moments (gathered from both ranks)...
    ckpt_dir = tmp_path / "sharded/runs/test/ckpt"
    last = torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=False)
    up = [k for k in last["state_dict"] if k.endswith("experts.up")]
    assert up and all(last["state_dict"][k].shape[0] == 4 for k in up)
    (o, index, n), *_ = last["expert_parallel"]["optimizer_params"]
    assert n == 4 and last["optimizer_states"][o]["state"][index]["exp_avg"].shape[0] == 4
    # ...and resuming at step 3 (each rank takes its experts and moments back) continues the same run.
    (step3,) = ckpt_dir.glob("*step=3*.ckpt")
    resumed = _moe_fit(tmp_path, "resumed", rlm_cache, "--ckpt_path", str(step3), expert_parallel=True)
    assert_close(torch.tensor(resumed), torch.tensor(sharded[3:]), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.ddp
def test_benchmark_script_smoke():
    import subprocess
    import sys

    # A subprocess: torch.multiprocessing.spawn needs the script importable as __main__.
    bench = CONFIGS.parent / "benchmarks" / "experts_parallel.py"
    args = ["--d", "32", "--batch", "1", "--seq", "16", "--experts", "4", "--repeat", "1"]
    run = subprocess.run([sys.executable, bench, *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]  # the benchmark's own error, not only its exit status
    out = run.stdout
    assert "| 4 experts, replicated |" in out and "| 4 experts, expert parallel |" in out
