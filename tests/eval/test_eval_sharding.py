"""Validation under FSDP2 (docs/SCALE.md section 13): every window is evaluated by exactly one rank, and the
token-weighted val/loss of 2 gloo processes equals one process's and a by-hand mean."""

from __future__ import annotations

import math
import os

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from rlm.distributed.parallel import spawn_local
from rlm.train.module import LMModule

VOCAB, T, WINDOWS, BATCH = 64, 16, 12, 2
MODEL = {"vocab_size": VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": T}


class _Windows(Dataset):
    """WINDOWS fixed windows; window i has its first i targets ignored, so batches hold unequal token counts
    (a mean over batches or ranks instead of over tokens would differ from the true mean)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.tokens = torch.randint(0, VOCAB, (WINDOWS, T + 1), generator=g)

    def __len__(self) -> int:
        return WINDOWS

    def __getitem__(self, i: int) -> dict:
        targets = self.tokens[i, 1:].clone()
        targets[:i] = -100
        return {"tokens": self.tokens[i, :T], "targets": targets, "window": i}


class _Data(pl.LightningDataModule):
    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Windows(), batch_size=BATCH, shuffle=False)  # as rlm.data.windows.eval_loader


class _Seen(pl.Callback):
    def __init__(self) -> None:
        self.windows: list[int] = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.windows += batch["window"].tolist()


def _module(state: dict | None = None) -> LMModule:
    torch.manual_seed(0)
    module = LMModule(model=MODEL)
    if state is not None:
        module.load_state_dict(state)
    return module


def _validate(strategy, devices: int, state: dict) -> tuple[float, list[int], int]:
    seen = _Seen()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=1,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[seen],
    )
    module = _module(state)
    trainer.validate(module, datamodule=_Data(), verbose=False)
    return float(trainer.callback_metrics["val/loss"]), seen.windows, trainer.world_size


def _worker(rank: int, port: int, strategy_cls: str, state: dict, out: dict) -> None:
    # What a cluster launcher (torchrun, SLURM) sets: Lightning then starts no processes of its own.
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(rank)
    )
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    module_name, cls = strategy_cls.rsplit(".", 1)
    strategy = getattr(__import__(module_name, fromlist=[cls]), cls)()
    loss, windows, world = _validate(strategy, 2, state)
    out[rank] = (loss, windows, world)
    from rlm.train.strategy import release_process_group

    release_process_group()


def _by_hand(state: dict) -> float:
    """The token-weighted mean cross-entropy over every window, one forward per window."""
    module = _module(state).eval()
    data = _Windows()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(WINDOWS):
            item = data[i]
            logits = module.model(item["tokens"][None], None)[0]
            total += float(
                F.cross_entropy(logits.float(), item["targets"], ignore_index=-100, reduction="sum")
            )
            count += int((item["targets"] != -100).sum())
    return total / count


@pytest.mark.ddp
def test_fsdp2_ranks_evaluate_disjoint_halves_and_val_loss_equals_one_process():
    state = {k: v.clone() for k, v in _module().state_dict().items()}
    by_hand = _by_hand(state)
    one, windows_one, world_one = _validate("auto", 1, state)
    assert world_one == 1 and sorted(windows_one) == list(range(WINDOWS))
    # the 1-process val/loss is the token-weighted mean (not a mean of batch means: targets are unequal)
    assert math.isclose(one, by_hand, rel_tol=1e-6)
    out = spawn_local(_worker, "rlm.train.strategy.ModelParallelStrategy", state)
    assert sorted(out) == [0, 1] and all(out[r][2] == 2 for r in out)
    halves = [out[r][1] for r in (0, 1)]
    # each rank half of the windows, no window on both, all of them together (before the fix, Lightning's
    # ModelParallelStrategy sharded over the mesh's data_parallel dimension, of size 1 on one node: every rank
    # evaluated all 12 windows)
    assert [len(h) for h in halves] == [WINDOWS // 2, WINDOWS // 2]
    assert not set(halves[0]) & set(halves[1])
    assert sorted(halves[0] + halves[1]) == list(range(WINDOWS))
    # val/loss is reduced over both ranks, token-weighted: the same number on both, equal to one process's
    assert out[0][0] == out[1][0]
    assert math.isclose(out[0][0], one, rel_tol=1e-6), (out[0][0], one)
