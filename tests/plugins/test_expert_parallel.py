"""Expert parallelism (plugins/_expert_parallel.py): 2 gloo processes against one process on the global batch."""

from collections.abc import Callable
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import yaml
from cli_helpers import CONFIGS, DDP_2CPU, column, fit_args, read_metrics, run_rlm
from torch.testing import assert_close

from rlm.distributed.parallel import spawn_local
from rlm.distributed.replicas import ReplicaSync, sync_replicas
from rlm.model import ModelConfig
from rlm.plugin import Context
from rlm.plugins._expert_parallel import (
    check_ddp_ignores,
    expert_groups,
    ignore_in_ddp,
    overlap_chunks,
    parallel_dispatch,
    route_group,
    shard_experts,
)
from rlm.plugins._expert_parallel_callback import ExpertParallelCallback, _node_size
from rlm.plugins._experts import plan
from rlm.plugins.moe import MoEConfig, MoELayer

D, V, B, T = 32, 64, 2, 12  # B rows per rank
TOL = dict(rtol=1e-4, atol=1e-5)  # float32; sums over tokens run in another order


def _layer(capacity_factor: float, dispatch: str, experts: int = 4, chunks: int = 1) -> MoELayer:
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=2, ffn="gated")
    c = MoEConfig(
        layers=[0], num_experts=experts, top_k=2, capacity_factor=capacity_factor, router_jitter=0.0,
        balance_coef=0.0, z_coef=0.0, dispatch=dispatch, expert_parallel=True, overlap_chunks=chunks,
    )  # fmt: skip
    return MoELayer(c, mc, 0)  # float32: torch._grouped_mm takes no float64


def _batch(ranks: int = 2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ranks * B, T, D, generator=g, dtype=torch.float32)
    tokens = torch.randint(0, V, (ranks * B, T), generator=g)
    mask = torch.ones(ranks * B, T, dtype=torch.bool)
    mask[1, 9:] = False  # padding on rank 0
    mask[3, 5:] = False  # and on rank 1
    r = torch.randn(ranks * B, T, D, generator=g, dtype=torch.float32)  # the loss is sum(y * r) / tokens
    return x, tokens, mask, r


def _loss(layer, x, tokens, mask, r):
    y = layer(x, Context(tokens=tokens, mask=mask, stage="train"))
    return y, (y * r).sum() / x.shape[0]


@contextmanager
def _host_reads():
    """Counts the tensor-to-Python reads (tolist, item, int(), float(), bool(), index): each a host sync on a GPU."""
    names = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")
    calls: list[str] = []
    saved = {n: torch.Tensor.__dict__.get(n) for n in names}

    def counted(name, fn):
        def read(self, *args, **kwargs):
            calls.append(name)
            return fn(self, *args, **kwargs)

        return read

    for n in names:
        setattr(torch.Tensor, n, counted(n, getattr(torch.Tensor, n)))
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            if fn is None:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, fn)


def _worker(rank: int, port: int, cases: list, out: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sent_dtypes = []
    all_to_all_single = dist.all_to_all_single

    def recording(output, input, *args, **kwargs):
        sent_dtypes.append(input.dtype)
        return all_to_all_single(output, input, *args, **kwargs)

    dist.all_to_all_single = recording  # this process only (spawned)
    try:
        for name, cf, mode, chunks, experts in cases:
            layer = _layer(cf, mode, experts, chunks)
            shard_experts(layer.experts, rank, 2)
            layer.expert_group = dist.group.WORLD
            x, tokens, mask, r = (t[rank * B : (rank + 1) * B] for t in _batch())
            x = x.clone().requires_grad_(True)
            sent_dtypes.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name.endswith("bf16")):
                y, loss = _loss(layer, x, tokens, mask, r)
            loss.backward()
            out[(name, rank, "sent")] = list(sent_dtypes)  # forward's 2 exchanges per chunk, then backward's
            grads = {}
            for n, p in layer.named_parameters():
                if n.startswith("experts."):
                    grads[n] = p.grad  # this rank's experts, already scaled by 1/W
                else:
                    g = p.grad.clone()
                    dist.all_reduce(g)  # what DDP does: the mean over ranks
                    grads[n] = g / 2
            out[(name, rank)] = (y.detach(), x.grad / 2, grads)
        # Host reads of one dispatch: forward and backward (the MoE layer around it is not counted).
        for cf, mode, chunks in [(0.75, "grouped", 1), (0.75, "grouped", 2), (0, "bmm", 1), (0, "bmm", 2)]:
            layer = _layer(cf, mode)
            shard_experts(layer.experts, rank, 2)
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(T * B, D, generator=g, requires_grad=True)
            index = torch.randint(0, 4, (T * B, 2), generator=g)
            weight, valid = torch.rand(T * B, 2, generator=g), torch.ones(T * B, dtype=torch.bool)
            with _host_reads() as forward:
                y, _ = parallel_dispatch(x, index, weight, valid, layer.experts, layer.capacity, mode,
                                         dist.group.WORLD, seq_len=T, chunks=chunks)  # fmt: skip
            with _host_reads() as backward:
                y.sum().backward()
            out[("host reads", rank, mode, chunks)] = (list(forward), list(backward))
        _order_part(rank, out)
        _save_part(rank, out)
        _clip_part(rank, out)
        # both ranks done with every collective before either tears gloo down (a rank that exits while
        # the other still has gloo work in flight aborted the benchmark once: "terminate called ...")
        dist.barrier()
    finally:
        dist.destroy_process_group()


CASES = [  # name, capacity factor, dispatch, overlap_chunks, experts (half on each rank)
    ("capacity", 0.75, "grouped", 1, 4),
    ("dropless", 0.0, "grouped", 1, 4),
    ("capacity_bmm", 0.75, "bmm", 1, 4),
    ("capacity_bf16", 0.75, "grouped", 1, 4),  # under CPU autocast: tokens travel in bfloat16
    ("capacity_chunks2", 0.75, "grouped", 2, 4),  # one expert per chunk
    ("dropless_chunks2", 0.0, "grouped", 2, 4),
    ("dropless_bmm_chunks2", 0.0, "bmm", 2, 4),
    ("capacity_chunks2_bf16", 0.75, "grouped", 2, 4),
    ("capacity_chunks4", 0.75, "grouped", 4, 8),
    ("dropless_chunks4", 0.0, "grouped", 4, 8),
    ("capacity_bmm_chunks3of4", 0.75, "bmm", 3, 8),  # 3 does not divide 4 experts per rank: 2 chunks
]


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """One 2-process run for the tests below (each spawn costs ~20 s of process start on a loaded CI CPU)."""
    return spawn_local(_worker, CASES)


@pytest.mark.ddp
def test_two_processes_equal_one_process_on_the_global_batch(two_ranks):
    got = two_ranks
    for name, cf, mode, chunks, experts in CASES:
        bf16 = name.endswith("bf16")
        tol = dict(rtol=2e-2, atol=2e-2) if bf16 else TOL
        layer = _layer(cf, mode, experts)  # one process: every expert, no exchange
        x, tokens, mask, r = _batch()
        x.requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y, loss = _loss(layer, x, tokens, mask, r)
        # The mean over 2*B rows: each rank's loss is the mean over its B rows, DDP averages the two.
        loss.backward()
        ctx = Context(tokens=tokens, mask=mask, stage="train")
        layer(x.detach(), ctx)
        assert (ctx.metrics["moe_dropped/l0"] > 0) == (cf > 0), name  # capacity bites where it is set
        (y0, gx0, g0), (y1, gx1, g1) = got[(name, 0)], got[(name, 1)]
        assert_close(torch.cat([y0, y1]), y.detach(), msg=name, **tol)
        assert_close(torch.cat([gx0, gx1]), x.grad, msg=name, **tol)
        for n, p in layer.named_parameters():
            want = p.grad
            if n.startswith("experts."):
                assert_close(torch.cat([g0[n], g1[n]]), want, msg=f"{name}: {n}", **tol)
            else:
                assert_close(g0[n], want, msg=f"{name}: {n}", **tol)
                assert_close(g1[n], want, msg=f"{name}: {n}", **tol)
        # Expert tokens travel in the experts' compute dtype: bfloat16 under autocast, both ways.
        want_dtype = torch.bfloat16 if bf16 else torch.float32
        exchanges = 4 * overlap_chunks(experts // 2, chunks)  # dispatch and combine per chunk, both ways
        for rank in (0, 1):
            assert got[(name, rank, "sent")] == [want_dtype] * exchanges, name
    # Per dispatch: two host reads (every rank's row count; the W x W x chunks split tensor), none in backward,
    # whatever the chunks. The loop it replaces read ~2 * seq_len * W + 6 ints. Dropless bmm reads its largest
    # queue once more, once for all the chunks.
    for rank in (0, 1):
        for chunks in (1, 2):
            assert got[("host reads", rank, "grouped", chunks)] == (["tolist", "tolist"], []), (rank, chunks)
            assert got[("host reads", rank, "bmm", chunks)] == (["tolist", "tolist", "__int__"], []), chunks


class _Work:
    """An all_to_all's work handle that records its wait."""

    def __init__(self, work, i: int, events: list) -> None:
        self.work, self.i, self.events = work, i, events

    def wait(self) -> bool:
        self.events.append(("wait", self.i))
        return self.work.wait() if self.work is not None else True


def _record_events(layer: MoELayer, blocking: bool) -> tuple[list, Callable[[], None]]:
    """Record, in order, the layer's exchanges started ("launch", i) and waited for ("wait", i), and each chunk's
    experts' start and end, in forward (module hooks) and backward (gradient hooks on their output and input).

    ``blocking``: every all_to_all completes in its call (a blocking exchange under the same code). Returns the
    event list and a function that ends the recording.
    """
    import torch.distributed as dist

    events: list = []
    real = dist.all_to_all_single
    chunks = overlap_chunks(layer.experts.up.shape[0], layer.config.overlap_chunks)
    calls = [0]

    def recording(output, input, *args, async_op=False, **kwargs):
        i = sum(e[0] == "launch" for e in events)
        events.append(("launch", i))
        if blocking or not async_op:
            real(output, input, *args, **kwargs)
            events.append(("wait", i))  # done in the call; the caller's own wait is not recorded
            return _Work(None, i, []) if async_op else None
        return _Work(real(output, input, *args, async_op=True, **kwargs), i, events)

    def start(module, args):
        c = calls[0] % chunks  # the forward runs the chunks in order
        events.append(("start", c))
        args[0].register_hook(lambda g: events.append(("end", c)))  # backward: the experts' last gradient

    def end(module, args, out):
        c = calls[0] % chunks
        calls[0] += 1
        events.append(("end", c))
        out.register_hook(lambda g: events.append(("start", c)))  # backward: the experts' first gradient

    dist.all_to_all_single = recording
    handles = [layer.experts.register_forward_pre_hook(start), layer.experts.register_forward_hook(end)]

    def undo() -> None:
        dist.all_to_all_single = real
        for h in handles:
            h.remove()

    return events, undo


ORDER_CASES = [
    ("overlap", 2, False),
    ("one chunk", 1, False),
    ("blocking", 2, True),
]  # name, chunks, blocking


def _order_part(rank: int, out: dict) -> None:
    """The events of one forward and one backward of a 2-chunk layer (4 experts), and of the two that do not
    overlap: 1 chunk, and 2 chunks over a blocking all_to_all (in _worker's process group)."""
    import torch.distributed as dist

    for name, chunks, blocking in ORDER_CASES:
        layer = _layer(0.0, "grouped", 4, chunks)  # dropless: every chunk has rows on both ranks here
        shard_experts(layer.experts, rank, 2)
        layer.expert_group = dist.group.WORLD
        x, tokens, mask, r = (t[rank * B : (rank + 1) * B] for t in _batch())
        x = x.clone().requires_grad_(True)
        events, undo = _record_events(layer, blocking)
        try:
            _, loss = _loss(layer, x, tokens, mask, r)
            forward = list(events)
            events.clear()
            loss.backward()
        finally:
            undo()
        out[(name, rank)] = (forward, list(events))


def _overlap_faults(events: list) -> list[str]:
    """What in ``events`` (:func:`_record_events`) shows an exchange not overlapping the experts; [] if none.

    Chunks are taken in the order their experts start (the backward runs them in reverse). Every chunk's
    incoming exchange must start before the first experts; chunk c+1's must be waited for only after chunk c's
    experts end; chunk c's outgoing exchange must start before chunk c+1's experts and be waited for only
    after they end.
    """
    at: dict = {}
    for i, e in enumerate(events):
        at.setdefault(e, i)  # the first wait counts: an exchange waited for twice was done at the first
    order = [e[1] for e in events if e[0] == "start"]
    if len(order) < 2:
        return [f"the experts ran as {len(order)} chunk(s)"]
    launches = [i for i, e in enumerate(events) if e[0] == "launch"]
    inbound = [events[i][1] for i in launches if i < at["start", order[0]]]
    faults = []
    if len(inbound) != len(order):
        faults.append(f"{len(inbound)} exchange(s) in flight before the first experts, not {len(order)}")
    for k, (c, nxt) in enumerate(zip(order, order[1:])):
        if k + 1 < len(inbound) and at["wait", inbound[k + 1]] < at["end", c]:
            faults.append(f"chunk {nxt}'s tokens were waited for before chunk {c}'s experts ended")
        sent = [events[i][1] for i in launches if at["end", c] < i < at["start", nxt]]
        if not sent:
            faults.append(f"chunk {c}'s results left after chunk {nxt}'s experts started")
        elif at["wait", sent[0]] < at["end", nxt]:
            faults.append(f"chunk {c}'s results were waited for before chunk {nxt}'s experts ended")
    return faults


@pytest.mark.ddp
def test_exchanges_overlap_the_experts_in_forward_and_backward(two_ranks):
    for rank in (0, 1):
        forward, backward = two_ranks["overlap", rank]
        # forward: both chunks' tokens leave, then chunk 0 computes while chunk 1's travel, and chunk 0's
        # results travel while chunk 1 computes; backward: the same with the chunks in reverse
        assert [e[1] for e in forward if e[0] == "start"] == [0, 1]
        assert [e[1] for e in backward if e[0] == "start"] == [1, 0]
        assert _overlap_faults(forward) == [], forward
        assert _overlap_faults(backward) == [], backward
        # The check can fail: one chunk, or two over a blocking all_to_all, overlap nothing.
        for name in ("one chunk", "blocking"):
            for events in two_ranks[name, rank]:
                assert _overlap_faults(events), (name, events)


def _route_reference(routed, sizes, T, rank, n_local, cap):
    """The per-position, per-rank loop parallel_dispatch planned with before route_group (a naive reference)."""
    world, _, k = routed.shape
    parts = [routed[r, : sizes[r]].long() for r in range(world)]
    sizes_t = torch.tensor(sizes)
    ends = torch.cumsum(sizes_t, 0)
    g = torch.cat(parts)  # (S_total, k) rank-major
    starts = (ends - sizes_t).tolist()
    order = torch.cat(
        [
            starts[r] + t * (sizes[r] // T) + torch.arange(sizes[r] // T)
            for t in range(T)
            for r in range(world)
        ]
    )  # gathered row of each global (position-major) row
    n = n_local * world
    p = plan(g[order], g[order, 0] < n, n, cap)
    gathered = order[p.token]
    src = torch.searchsorted(ends, gathered, right=True)
    dst = torch.div(p.expert, n_local, rounding_mode="floor")
    mine = src == rank
    here = (dst == rank).nonzero().squeeze(1)
    return dict(
        plan=p,
        token=gathered[mine] - starts[rank],
        choice=p.assignment[mine] % k,
        send=torch.bincount(dst[mine], minlength=world).tolist(),
        recv=torch.bincount(src[here], minlength=world).tolist(),
        perm=torch.argsort(src[here], stable=True),
        local=(p.assignment[here], p.token[here], p.expert[here] - rank * n_local, p.position[here]),
        counts=p.counts[rank * n_local : (rank + 1) * n_local],
        sent_expert=p.expert[mine] % n_local,  # the expert of each sent assignment, among its rank's
        source=src[here],  # the source rank of each local plan row
    )


def _random_routing(g, world, seqs, T, k, n):
    """(W, S_max, k) expert ids, rank r with seqs[r] sequences; padding (id n) mid-row and past each rank's rows."""
    sizes = [b * T for b in seqs]
    routed = torch.full((world, max(sizes), k), n, dtype=torch.uint8)
    for r, S in enumerate(sizes):
        # k distinct experts per token, as top-k gives; skewed so that a few experts overflow their capacity
        scores = torch.rand(S, n, generator=g) + torch.linspace(0, 0.6, n)
        ids = scores.topk(k, dim=1).indices
        ids[torch.rand(S, generator=g) < 0.15] = n  # padding tokens
        routed[r, :S] = ids.to(torch.uint8)
    return routed, sizes


@pytest.mark.parametrize("world,seqs,T,k,n_local,cap", [
    (2, [2, 2], 5, 2, 2, 3),  # capacity overflows
    (3, [1, 3, 2], 4, 2, 2, 2),  # unequal batches, tight capacity
    (2, [3, 1], 6, 1, 4, None),  # dropless, Switch's k = 1
    (4, [2, 0, 1, 2], 3, 3, 1, 4),  # a rank with no tokens
])  # fmt: skip
def test_route_group_equals_the_loop_reference(world, seqs, T, k, n_local, cap):
    g = torch.Generator().manual_seed(world * 100 + T)
    for trial in range(3):
        routed, sizes = _random_routing(g, world, seqs, T, k, n_local * world)
        for rank in range(world):
            got = route_group(routed, sizes, T, rank, n_local, cap)
            want = _route_reference(routed, sizes, T, rank, n_local, cap)
            for field in ("assignment", "token", "expert", "position", "counts", "dropped"):
                assert_close(getattr(got.plan, field), getattr(want["plan"], field), msg=field)
            assert got.send == want["send"] and got.recv == want["recv"]
            assert_close(got.token, want["token"])
            assert_close(got.choice, want["choice"])
            assert_close(got.perm, want["perm"])
            local = (got.local.assignment, got.local.token, got.local.expert, got.local.position)
            for a, b in zip(local, want["local"]):
                assert_close(a, b)
            assert_close(got.local.counts, want["counts"])
        assert (want["plan"].dropped > 0) == (cap is not None), trial  # the capacity overflowed where set


@pytest.mark.parametrize("world,seqs,T,k,n_local,cap", [
    (2, [2, 2], 5, 2, 4, 6),  # capacity overflows
    (3, [1, 3, 2], 4, 2, 2, 2),  # unequal batches, tight capacity
    (2, [3, 1], 6, 1, 4, None),  # dropless, Switch's k = 1
])  # fmt: skip
def test_route_group_chunks_split_the_one_chunk_route(world, seqs, T, k, n_local, cap):
    g = torch.Generator().manual_seed(world * 100 + T)
    routed, sizes = _random_routing(g, world, seqs, T, k, n_local * world)
    for chunks in [c for c in range(2, n_local + 1) if n_local % c == 0]:
        per_chunk = n_local // chunks
        for rank in range(world):
            got = route_group(routed, sizes, T, rank, n_local, cap, chunks)
            want = _route_reference(routed, sizes, T, rank, n_local, cap)
            assert_close(got.plan.assignment, want["plan"].assignment)  # the plan is the chunks' own
            assert got.send == want["send"] and got.recv == want["recv"]
            assert len(got.chunks) == chunks
            local = dict(zip(("assignment", "token", "expert", "position"), want["local"]))
            for c, part in enumerate(got.chunks):
                assert part.experts == slice(c * per_chunk, (c + 1) * per_chunk)
                # what this rank sends for the chunk: the one-chunk route's rows to its experts, in order
                to_chunk = want["sent_expert"] // per_chunk == c
                assert_close(got.token[part.sent], want["token"][to_chunk])
                assert_close(got.choice[part.sent], want["choice"][to_chunk])
                dst = torch.arange(world).repeat_interleave(torch.tensor(want["send"]))
                assert part.send == torch.bincount(dst[to_chunk], minlength=world).tolist()
                # what it receives: the local plan's rows of the chunk's experts, ids from the chunk's first
                rows = local["expert"] // per_chunk == c
                assert part.recv == torch.bincount(want["source"][rows], minlength=world).tolist()
                for field in ("assignment", "token", "position"):
                    assert_close(getattr(part.plan, field), local[field][rows], msg=field)
                assert_close(part.plan.expert, local["expert"][rows] - c * per_chunk)
                assert_close(part.plan.counts, want["counts"][part.experts])
                # arrivals by source rank, plan order within: row perm[i] of the chunk's plan
                assert_close(
                    got.perm[part.arrived] - part.arrived.start,
                    torch.argsort(want["source"][rows], stable=True),
                )


def test_overlap_chunks_is_checked_and_falls_back_to_a_divisor():
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match=rf"moe.overlap_chunks must be a positive integer .*got {bad!r}"):
            MoEConfig(overlap_chunks=bad)
    assert MoEConfig().overlap_chunks == 2
    # the largest divisor of a rank's experts not above the setting: 1 expert per rank cannot overlap
    assert [overlap_chunks(n, 2) for n in (1, 2, 3, 4)] == [1, 2, 1, 2]
    assert [overlap_chunks(n, 4) for n in (4, 6, 8)] == [4, 3, 4]


def _count_ops(fn, *args) -> int:
    """Number of aten operations fn(*args) runs (each a kernel launch, or a host-to-device copy, on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn(*args)
    return Count.n


def test_route_group_runs_no_loop_over_positions_or_ranks():
    g = torch.Generator().manual_seed(0)
    counts = {}
    for T, world in [(4, 2), (32, 2), (32, 8)]:
        routed, sizes = _random_routing(g, world, [2] * world, T, 2, 2 * world)
        counts[T, world] = (
            _count_ops(route_group, routed, sizes, T, 0, 2, 8),
            _count_ops(_route_reference, routed, sizes, T, 0, 2, 8),
        )
    # The same operations whatever seq_len and the world size; the loop it replaced ran ~2 per (position, rank).
    assert counts[4, 2][0] == counts[32, 2][0] == counts[32, 8][0]
    assert counts[32, 8][1] - counts[4, 2][1] >= 2 * (32 * 8 - 4 * 2)


def test_parallel_dispatch_is_an_eager_island_under_compile():
    # As dispatch: data-dependent shapes and host split sizes; Dynamo runs it eagerly behind one graph break.
    assert getattr(parallel_dispatch, "_torchdynamo_disable", False)


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


_g = torch.Generator().manual_seed(2)
CLIP_GRADS = {"shared": torch.randn(5, generator=_g), "experts": torch.randn(4, 3, generator=_g) * 3}


def _clip_part(rank: int, out: dict) -> None:
    """The callback's global-norm clip on toy gradients (in _worker's process group)."""
    shared = torch.nn.Parameter(torch.zeros(5))
    shared.grad = CLIP_GRADS["shared"].clone()  # after DDP: the same on every rank
    own = torch.nn.Parameter(torch.zeros(2, 3))
    own.grad = CLIP_GRADS["experts"][2 * rank : 2 * rank + 2].clone()  # this rank's experts
    cb = ExpertParallelCallback(lambda: [])
    cb.clip, cb.params = 1.0, {"experts": own}
    optimizer = SimpleNamespace(param_groups=[{"params": [shared, own]}])
    cb.on_before_optimizer_step(None, SimpleNamespace(device=torch.device("cpu")), optimizer)
    out[rank, "clip"] = (shared.grad, own.grad)


@pytest.mark.ddp
def test_gradient_clipping_uses_the_global_norm(two_ranks):
    grads = CLIP_GRADS
    got = {rank: two_ranks[rank, "clip"] for rank in (0, 1)}
    # One process holds every expert: torch's clip over [shared, all experts].
    ref = [grads["shared"].clone(), grads["experts"].clone()]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in ref]
    for p, g in zip(params, ref):
        p.grad = g
    assert torch.nn.utils.clip_grad_norm_(params, 1.0) > 1.0  # the clip acts
    for rank in (0, 1):
        assert_close(got[rank][0], params[0].grad)
        assert_close(got[rank][1], params[1].grad[2 * rank : 2 * rank + 2])


FULL = torch.randn(
    4, 3, generator=torch.Generator().manual_seed(0)
)  # 4 experts' rows for the checkpoint test


def _save_part(rank: int, out: dict) -> None:
    """Save and load an expert-parallel checkpoint of a toy expert tensor (in _worker's process group)."""
    import torch.distributed as dist

    shared = torch.nn.Parameter(torch.ones(3))
    own = torch.nn.Parameter(FULL[2 * rank : 2 * rank + 2].clone())  # this rank's 2 of 4 experts
    opt = torch.optim.Adam([shared, own])
    (shared.sum() + (own * (rank + 1)).pow(2).sum()).backward()
    opt.step()
    cb = ExpertParallelCallback(lambda: [])
    cb.world, cb.rank, cb.group, cb.params = 2, rank, dist.group.WORLD, {"experts.up": own}
    ckpt = {"state_dict": {"experts.up": own.detach().clone()}, "optimizer_states": [opt.state_dict()]}
    cb.on_save_checkpoint(SimpleNamespace(optimizers=[opt]), None, ckpt)
    moments = {k: v.clone() for k, v in opt.state[own].items() if k != "step"}
    out[rank, "save"] = (
        ckpt["state_dict"]["experts.up"],
        ckpt["optimizer_states"][0]["state"][1],
        own.detach(),
        moments,
    )
    # every rank loads rank 0's file and takes its own experts' moments back
    dist.broadcast_object_list(loaded := [ckpt if rank == 0 else None], src=0)
    cb.on_load_checkpoint(None, None, loaded[0])
    out[rank, "loaded"] = loaded[0]["optimizer_states"][0]["state"][1]


@pytest.mark.ddp
def test_checkpoint_gathers_experts_to_rank_0_only_and_loads_each_rank_its_slice(two_ranks):
    got = two_ranks
    (w0, m0, own0, mom0), (w1, m1, own1, mom1) = got[0, "save"], got[1, "save"]
    # Rank 0 writes the file: every expert and both Adam moments, in host memory.
    assert_close(w0, torch.cat([own0, own1]))
    assert w0.device.type == "cpu" and m0["exp_avg"].device.type == "cpu"
    for key in ("exp_avg", "exp_avg_sq"):
        assert_close(m0[key], torch.cat([mom0[key], mom1[key]]))
        # Rank 1 never holds the full tensors (it does not write): its shard stays as it was.
        assert m1[key].shape == (2, 3)
        assert_close(m1[key], mom1[key])
        for rank, mom in ((0, mom0), (1, mom1)):
            assert_close(got[rank, "loaded"][key], mom[key])
    assert_close(w1, own1)


def _group_worker(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        group, replicas = expert_groups(rank, 4, 2)  # groups {0, 1} and {2, 3}; replicas {0, 2} and {1, 3}
        layer = _layer(0.75, "grouped")
        shard_experts(layer.experts, rank % 2, 2, processes=4)
        layer.expert_group = group
        x, tokens, mask, r = (t[rank * B : (rank + 1) * B] for t in _batch(4))
        x = x.clone().requires_grad_(True)
        y, loss = _loss(layer, x, tokens, mask, r)
        loss.backward()
        sync_replicas([layer.experts.up, layer.experts.down], replicas)
        grads = {}
        for n, p in layer.named_parameters():
            if n.startswith("experts."):
                grads[n] = p.grad
            else:
                g = p.grad.clone()
                dist.all_reduce(g)
                grads[n] = g / 4
        out[rank] = (y.detach(), x.grad / 4, grads)
        out[rank, "overlap"] = _overlapped_replica_sync(layer, (x, tokens, mask, r), replicas)
        out[rank, "accumulated"] = _callback_accumulation(layer, (x, tokens, mask, r), group, replicas)
        # the checkpoint: rank 0's group gathers (rank 0 writes); the other group keeps its shards
        cb = ExpertParallelCallback(lambda: [])
        cb.world, cb.rank, cb.group, cb.holds_file = 2, rank % 2, group, rank < 2
        cb.params = {"experts.up": layer.experts.up}
        ckpt = {"state_dict": {"experts.up": layer.experts.up.detach().clone()}, "optimizer_states": []}
        cb.on_save_checkpoint(SimpleNamespace(optimizers=[]), None, ckpt)
        out[rank, "saved"] = ckpt["state_dict"]["experts.up"].shape[0]
        dist.barrier()
    finally:
        dist.destroy_process_group()


class _RecordedSync(ReplicaSync):
    """ReplicaSync that records when it starts an all-reduce."""

    def __init__(self, params, replicas, events: list) -> None:
        self.events = events
        super().__init__(params, replicas)

    def _launch(self, p) -> None:
        self.events.append("all-reduce started")
        super()._launch(p)


def _overlapped_replica_sync(layer, batch, replicas) -> tuple:
    """The same backward again, the replica all-reduces started by ReplicaSync inside it: (what finish did when
    not armed, expert gradients, the order of the events: each all-reduce's start, the input's gradient, the
    backward's last step here, and the backward's return)."""
    x, tokens, mask, r = batch
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    events = []
    sync = _RecordedSync([layer.experts.up, layer.experts.down], replicas, events)
    x.register_hook(lambda g: events.append("input gradient"))
    unarmed = sync.finish()  # not armed: does nothing
    sync.armed = True
    _loss(layer, x, tokens, mask, r)[1].backward()
    events.append("backward returned")
    assert sync.finish() and not sync.works and not sync.armed
    sync.remove()
    return unarmed, {n: p.grad for n, p in layer.named_parameters() if n.startswith("experts.")}, events


def _callback_accumulation(layer, batch, group, replicas) -> tuple:
    """ExpertParallelCallback's hooks over 3 micro-batches with accumulate_grad_batches=2 (Lightning's order:
    batch start, backward, after backward; the optimizer step after the 2nd): (the gradients at the step, the
    reference: two backwards then sync_replicas, whether the 3rd batch, not armed, left its gradient unsummed)."""
    x, tokens, mask, r = batch
    params = [layer.experts.up, layer.experts.down]
    cb = ExpertParallelCallback(lambda: [])
    cb.world, cb.rank, cb.group, cb.replicas = 2, 0, group, replicas
    cb.params = {"experts.up": params[0], "experts.down": params[1]}
    cb.sync = ReplicaSync(params, replicas)
    trainer = SimpleNamespace(accumulate_grad_batches=2)
    layer.zero_grad(set_to_none=True)
    for batch_idx in range(2):
        cb.on_train_batch_start(trainer, None, None, batch_idx)
        _loss(layer, x, tokens, mask, r)[1].backward()
        cb.on_after_backward(trainer, None)
        assert cb.synced == (batch_idx == 1)
    cb.on_before_optimizer_step(trainer, None, None)  # summed already: no second sum
    at_step = [p.grad.clone() for p in params]
    layer.zero_grad(set_to_none=True)
    cb.on_train_batch_start(trainer, None, None, 2)  # the start of the next window: nothing started
    _loss(layer, x, tokens, mask, r)[1].backward()
    cb.on_after_backward(trainer, None)
    one_unsummed = not cb.synced and not cb.sync.works
    cb.sync.remove()
    layer.zero_grad(set_to_none=True)
    for _ in range(2):
        _loss(layer, x, tokens, mask, r)[1].backward()
    sync_replicas(params, replicas)
    return at_step, [p.grad for p in params], one_unsummed


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow  # 4 processes
@pytest.mark.ddp
def test_expert_groups_of_two_among_four_processes_equal_one_process_per_group():
    got = spawn_local(_group_worker, nprocs=4)
    # The reference: one process per expert group, capacity decided on the group's batch, the loss the mean
    # over the 4 ranks (each group's _loss is the mean of its 2 ranks': 1/2 each).
    layer = _layer(0.75, "grouped")
    x, tokens, mask, r = _batch(4)
    x.requires_grad_(True)
    ys, total = [], 0
    for g in (0, 1):
        rows = slice(2 * g * B, 2 * (g + 1) * B)
        y, loss = _loss(layer, x[rows], tokens[rows], mask[rows], r[rows])
        ys.append(y)
        total = total + loss / 2
    total.backward()
    assert_close(torch.cat([got[rank][0] for rank in range(4)]), torch.cat(ys).detach(), **TOL)
    assert_close(torch.cat([got[rank][1] for rank in range(4)]), x.grad, **TOL)
    for n, p in layer.named_parameters():
        for rank in range(4):
            want = p.grad[2 * (rank % 2) : 2 * (rank % 2) + 2] if n.startswith("experts.") else p.grad
            assert_close(got[rank][2][n], want, msg=f"rank {rank}: {n}", **TOL)
    assert [got[rank, "saved"] for rank in range(4)] == [4, 2, 2, 2]  # full on rank 0 only
    for rank in range(4):
        # ReplicaSync: the all-reduces start inside the backward, before the input's gradient (the layers below
        # would compute while they travel), and give sync_replicas' gradients bit for bit.
        unarmed, grads, events = got[rank, "overlap"]
        assert unarmed is False
        assert events == ["all-reduce started"] * 2 + ["input gradient", "backward returned"], events
        for n, g in grads.items():
            assert torch.equal(g, got[rank][2][n]), (rank, n)
        # The callback with gradient accumulation: summed over the replicas once, after the window's last backward.
        at_step, want, one_unsummed = got[rank, "accumulated"]
        for g, w in zip(at_step, want):
            assert torch.equal(g, w), rank
        assert one_unsummed


def test_expert_group_size_is_checked_and_defaults_to_a_node():
    with pytest.raises(ValueError, match="expert_group_size=3 must divide the 4 processes"):
        expert_groups(0, 4, 3)
    with pytest.raises(ValueError, match="expert_group_size must be a positive integer"):
        MoEConfig(expert_group_size=0)
    assert _node_size(SimpleNamespace(num_devices=8), 64) == 8  # 8 nodes of 8: a node's 8 processes
    assert _node_size(SimpleNamespace(num_devices=2), 2) == 2  # one machine: all of them
    assert _node_size(SimpleNamespace(num_devices=3), 4) == 4  # not a divisor: all


@pytest.fixture
def ddp_one_rank(tmp_path):
    """Wraps a module in torch's DistributedDataParallel over a gloo group of this process alone (no spawn)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield DistributedDataParallel
    finally:
        dist.destroy_process_group()


def _experts_module() -> torch.nn.Module:
    """A shared weight beside a layer's expert tensors (named as in a LightningModule: 'experts.up', ...)."""
    module = torch.nn.Module()
    module.shared = torch.nn.Linear(D, D)
    module.experts = _layer(0.0, "grouped").experts
    return module


def test_ddp_leaves_the_expert_shards_out_and_the_fit_start_check_sees_it(ddp_one_rank):
    module = _experts_module()
    module._ddp_params_and_buffers_to_ignore = ["shared.bias"]  # someone else's entry is kept
    names = ["experts.down", "experts.up"]
    ignore_in_ddp(module, names)
    ddp = ddp_one_rank(module)
    assert ddp.parameters_to_ignore == {"shared.bias", *names}
    experts = {id(module.experts.up), id(module.experts.down)}
    assert not experts & {id(p) for p in ddp._module_parameters}  # not in the reducer's parameters
    cb = ExpertParallelCallback(lambda: [])
    cb.world, cb.params = 2, {n: p for n, p in module.named_parameters() if n in names}
    cb.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(model=ddp)), module)  # no error


def test_fit_start_names_the_torch_version_when_ddp_syncs_the_expert_shards(ddp_one_rank, monkeypatch):
    """A torch whose DDP no longer reads what ignore_in_ddp sets: the run stops at fit start, before a step."""
    import re

    monkeypatch.setattr(
        ddp_one_rank, "_set_params_and_buffers_to_ignore_for_model", staticmethod(lambda module, names: None)
    )
    module = _experts_module()
    ignore_in_ddp(module, ["experts.up", "experts.down"])
    ddp = ddp_one_rank(module)
    cb = ExpertParallelCallback(lambda: [])
    cb.world = 2
    cb.params = {"experts.up": module.experts.up, "experts.down": module.experts.down}
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=ddp))
    with pytest.raises(RuntimeError, match=rf"torch {re.escape(torch.__version__)}: .* 2 expert shard\(s\)"):
        cb.on_fit_start(trainer, module)
    cb.world = 1  # experts not sharded: nothing to check
    cb.on_fit_start(trainer, module)
    check_ddp_ignores(module, cb.params)  # not a DDP wrapper: nothing to check


MOE_DROPLESS = {"layers": [1], "num_experts": 4, "top_k": 2, "capacity_factor": 0.0}


def _moe_fit(tmp_path, name: str, rlm_cache, *extra: str, **kw) -> list[float]:
    run = tmp_path / name
    run.mkdir()
    (run / "moe.yaml").write_text(yaml.safe_dump({"model": {"plugins": {"moe": MOE_DROPLESS | kw}}}))
    args = fit_args(CONFIGS / "plugins" / "moe.yaml", run / "moe.yaml") + DDP_2CPU + ["--trainer.max_steps=6"]
    args += ["--trainer.gradient_clip_val=0.05"]  # far below the gradient norms: clipping acts at every step
    run_rlm(args + list(extra), run, rlm_cache)
    return column(read_metrics(run / "runs/test/version_0"), "train/loss")


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
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


# slow: runs the benchmark script end to end at its smoke size
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
    assert "| 4 experts, replicated |" in out
    assert (
        "| 4 experts, expert parallel, 1 chunk |" in out and "| 4 experts, expert parallel, 2 chunks |" in out
    )
