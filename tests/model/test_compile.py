"""``--model.compile true``: each block compiled in place with torch.compile when the trainer sets the model up
(after FSDP2 shards it), every plugin trainable under it, under one process, DDP and FSDP2 alike."""

import os

import pytest
import pytorch_lightning as pl
import torch
import yaml
from cli_helpers import fit_args
from torch.testing import assert_close

from rlm.distributed.parallel import full_tensor, is_sharded, spawn_local
from rlm.train.compile import CompileConfig, compile_config, is_compiled
from rlm.train.module import LMModule

MODEL = dict(vocab_size=128, d_model=64, n_layers=2, n_heads=2, max_seq_len=64)
PLUGINS = {
    "moe": {"layers": [1], "num_experts": 4},
    "pkm": {"layers": [0], "n_keys": 16, "heads": 2, "topk": 4, "k_dim": 32},
    "altup": {"k": 2},
}


def _batches(n: int, B: int = 2, T: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, MODEL["vocab_size"], (B, T + 1), generator=g)
        out.append({"tokens": t[:, :-1], "targets": t[:, 1:], "mask": torch.ones(B, T, dtype=torch.bool)})
    return out


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _train(compile: bool, steps: int) -> tuple[LMModule, list[float]]:
    torch.manual_seed(0)
    module = LMModule(model=MODEL, plugins=PLUGINS, optim={"warmup_steps": 0}, compile=compile)
    cb = _Losses()
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    trainer.fit(module, torch.utils.data.DataLoader(_batches(steps), batch_size=None))
    return module, cb.losses


def test_setup_compiles_each_block_in_place_and_not_the_whole_model():
    eager = LMModule(model=MODEL, plugins=PLUGINS)
    compiled = LMModule(model=MODEL, plugins=PLUGINS, compile=True)
    # nothing is compiled before the strategy has sharded the model (configure_model)
    assert not any(is_compiled(m) for m in compiled.modules())
    compiled.configure_model()
    first = [b._compiled_call_impl for b in compiled.model.blocks]
    assert all(first) and not is_compiled(compiled.model) and not is_compiled(compiled.model.stack)
    assert {m for m in compiled.modules() if is_compiled(m)} == set(compiled.model.blocks)
    compiled.configure_model()  # Lightning may set the model up again: the blocks are not wrapped twice
    assert [b._compiled_call_impl for b in compiled.model.blocks] == first
    eager.configure_model()
    assert not any(is_compiled(m) for m in eager.modules())
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints load either way
    assert "compile" not in compiled.hparams  # a run-time choice, not part of the model's identity


def test_compile_option_takes_a_backend_and_refuses_bad_values_by_name():
    assert compile_config(True) == CompileConfig("inductor", None)
    assert compile_config(False) is None and compile_config(None) is None
    assert compile_config({"backend": "aot_eager"}) == CompileConfig("aot_eager")
    assert LMModule(model=MODEL, compile={"backend": "eager"}).compile_config.backend == "eager"
    with pytest.raises(ValueError, match="'inductr' is not a torch.compile backend.*'inductor'"):
        CompileConfig("inductr")
    with pytest.raises(ValueError, match="'fastest' is not one of Inductor's modes.*'max-autotune'"):
        CompileConfig(mode="fastest")
    with pytest.raises(ValueError, match="mode 'max-autotune' is Inductor's; backend 'eager' takes none"):
        CompileConfig("eager", "max-autotune")
    with pytest.raises(ValueError, match="compile must be true, false or .*got 'yes'"):
        compile_config("yes")


# slow: trains a model in-process for enough steps to check what it learned or saved
@pytest.mark.slow
def test_compiled_training_with_moe_pkm_and_altup_matches_eager():
    """Three optimizer steps (PKM's row-wise value updates included) compiled and eager give the same losses."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled, losses = _train(True, 3)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # Inductor compiled the model
    eager, ref = _train(False, 3)
    assert len(losses) == 3 and all(v == v for v in losses)
    assert_close(torch.tensor(losses), torch.tensor(ref), atol=1e-4, rtol=1e-4)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert_close(p, q, atol=1e-4, rtol=1e-3, msg=name)
    values = compiled.model.plugins["pkm"].values
    eager_values = eager.model.plugins["pkm"].values
    for key in values:  # updated sparsely by the row optimizer, outside the main optimizer
        assert_close(values[key], eager_values[key], atol=1e-4, rtol=1e-3)


def test_cli_option_reaches_the_module(tmp_path, rlm_cache, rlm_main):
    """``--model.compile true``, ``--model.compile.backend`` and ``--model.peak_flops`` parse as LMModule options
    (config printed, not run)."""
    proc = rlm_main(
        [*fit_args(), "--model.compile=true", "--model.peak_flops=1e12", "--print_config"], tmp_path
    )
    config = yaml.safe_load(proc.stdout)
    assert config["model"]["compile"] is True and config["model"]["peak_flops"] == 1e12
    proc = rlm_main([*fit_args(), "--model.compile.backend=aot_eager", "--print_config"], tmp_path)
    assert yaml.safe_load(proc.stdout)["model"]["compile"]["backend"] == "aot_eager"


# ----- DDP and FSDP2: each block compiled after the strategy's sharding, trained as eager -----

PAR_MODEL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
PAR_PLUGINS = {"moe": {"layers": [1], "num_experts": 4}}  # MoE's dispatch: an eager island inside a block
PAR_STEPS = 3
CHEAP = CompileConfig(backend="aot_eager")  # traced by Dynamo and AOTAutograd; no C++ code generated


def _par_fit(strategy, compile: bool) -> dict:
    """PAR_STEPS steps under ``strategy`` on 2 ranks (each its own batch of 2 x 15 tokens per step)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    module = LMModule(
        model=PAR_MODEL,
        plugins=PAR_PLUGINS,
        optim={"warmup_steps": 0},
        compile=CHEAP if compile else False,
        peak_flops=1e12,  # no CPU matmul measurement at fit start
    )
    cb = _Losses()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=strategy,
        max_steps=PAR_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2 * PAR_STEPS):  # the distributed sampler deals them out: rank r gets r, r + 2, ...
        t = torch.randint(0, PAR_MODEL["vocab_size"], (2, 16), generator=g)
        batches.append({"tokens": t[:, :-1], "targets": t[:, 1:]})
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    # full_tensor all-gathers an FSDP2 shard: both ranks call it in the same order
    params = {n: full_tensor(p.detach()).clone() for n, p in module.model.named_parameters()}
    return {
        "losses": cb.losses,
        "params": params,
        "blocks": [is_compiled(b) for b in module.model.blocks],
        "sharded": [is_sharded(b) for b in module.model.blocks],
        "model": is_compiled(module.model),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }


def _par_worker(rank: int, port: int, out: dict) -> None:
    # What a cluster launcher sets: Lightning then starts no processes and the 4 fits share one process group.
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(rank)
    )
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from rlm.train.strategy import ModelParallelStrategy, release_process_group

    try:
        for name in ("ddp", "fsdp2"):
            for compile in (False, True):
                strategy = "ddp" if name == "ddp" else ModelParallelStrategy()
                out[(name, compile, rank)] = _par_fit(strategy, compile)
    finally:
        release_process_group()


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """One 2-process run (4 fits) for the tests below: process start costs ~20 s on a loaded CI CPU."""
    return spawn_local(_par_worker)


# slow: two (or more) gloo processes, each starting torch and Lightning, then training
@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_blocks_compiled_after_sharding_train_as_eager_on_two_processes(two_ranks, strategy):
    for rank in (0, 1):
        eager, compiled = (two_ranks[(strategy, c, rank)] for c in (False, True))
        assert compiled["blocks"] == [True, True] and not compiled["model"]
        assert compiled["sharded"] == [strategy == "fsdp2"] * 2  # FSDP2 wrapped the very blocks compiled
        assert not any(eager["blocks"]) and eager["graphs"] == 0
        assert compiled["graphs"] > 0  # Dynamo traced the blocks (not a silent fall-back to eager)
        assert len(compiled["losses"]) == PAR_STEPS
        # aot_eager runs the same aten ops as eager: equal to the bit here (torch 2.13, CPU); the tolerance
        # leaves room for a torch that reorders a float32 sum, which three Adam steps would carry on.
        assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-5)
        for name, p in eager["params"].items():
            assert_close(compiled["params"][name], p, rtol=1e-4, atol=1e-5, msg=name)
    # each rank trained on its own batches, and the replicas agree (the gradients were averaged)
    assert two_ranks[(strategy, True, 0)]["losses"] != two_ranks[(strategy, True, 1)]["losses"]
    for name, p in two_ranks[(strategy, True, 0)]["params"].items():
        assert_close(two_ranks[(strategy, True, 1)]["params"][name], p, rtol=0, atol=0, msg=name)
