"""Training/validation samples: fixed windows inside one document, batched; the resumable training loader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from rlm.data.segments import SegmentTable

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index
HOST = "host"  # the batch key of its host copy (host_copy), once the batch is on a device
HOST_FIELDS = ("tokens", "mask", "segment_ids", "doc_ids", "starts")  # what plugins read on the host


class Windows:
    """The windows of some documents: inputs doc[s:s+T], targets doc[s+1:s+T+1], for s = 0, T, 2T, ... (multiples
    of segment_len: each covers whole segments) while a window has a target; the last of a document is padded."""

    def __init__(
        self, segments: SegmentTable, doc_offsets: np.ndarray, docs: np.ndarray, seq_len: int
    ) -> None:
        if seq_len % segments.segment_len:
            raise ValueError(
                f"seq_len={seq_len} is not a multiple of segment_len={segments.segment_len}; "
                "windows must cover whole segments"
            )
        self.segments, self.seq_len, self.doc_offsets = segments, seq_len, doc_offsets
        n = np.diff(doc_offsets)[docs]  # (D,) tokens per document, bos/eos included (>= 2)
        n_win = (n - 2) // seq_len + 1  # ceil((n - 1) / seq_len): n - 1 targets per document
        first = np.concatenate([[0], np.cumsum(n_win)])
        self.doc = np.repeat(docs, n_win).astype(np.int64)  # (W,) document of each window
        self.start = (np.arange(first[-1]) - np.repeat(first[:-1], n_win)) * seq_len  # (W,) offset in it

    def __len__(self) -> int:
        return len(self.doc)

    def collate(self, index: Any) -> dict[str, Tensor]:
        """The batch of windows `index` (a sequence of window numbers), in the batch format of rlm.data."""
        index = np.asarray(index, dtype=np.int64)
        seg, T = self.segments, self.seq_len
        docs, starts = self.doc[index], self.start[index]  # (B,)
        base = self.doc_offsets[docs]  # (B,)
        pos = starts[:, None] + np.arange(T + 1)  # (B, T+1) offsets inside the document, +1 for the target
        real = pos < (self.doc_offsets[docs + 1] - base)[:, None]  # (B, T+1)
        toks = np.full(pos.shape, seg.pad_id, dtype=np.int64)
        toks[real] = seg.corpus_tokens[(base[:, None] + pos)[real]]
        return {
            "tokens": torch.from_numpy(np.ascontiguousarray(toks[:, :T])),
            "targets": torch.from_numpy(np.where(real[:, 1:], toks[:, 1:], IGNORE_INDEX)),
            "mask": torch.from_numpy(np.ascontiguousarray(real[:, :T])),
            "segment_ids": torch.from_numpy(seg.window_segments(docs, starts, T // seg.segment_len)),
            "doc_ids": torch.from_numpy(docs),
            "starts": torch.from_numpy(starts),
        }


def host_copy(batch: dict[str, Any]) -> dict[str, Tensor]:
    """The batch's HOST_FIELDS on the host (or its own host copy), kept as batch[HOST] when it moves to a device:
    host_array reads them without a copy back from the device (on a GPU, a sync that drains the launch queue)."""
    if HOST in batch:
        return batch[HOST]
    return {n: x for n in HOST_FIELDS if isinstance(x := batch.get(n), Tensor) and x.device.type == "cpu"}


def host_array(batch: dict[str, Any], name: str) -> np.ndarray | None:
    """batch[name] as a numpy array (None if absent), from the host copy batch[HOST] when there is one (a field
    replaced after the move must have its host copy replaced or dropped too)."""
    x = batch.get(HOST, {}).get(name, batch.get(name))
    if x is None:
        return None
    return x.cpu().numpy() if isinstance(x, Tensor) else np.asarray(x)


def pinned(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's tensors in page-locked memory, so that their copy to a GPU runs without blocking the host."""
    return {name: x.pin_memory() if isinstance(x, Tensor) else x for name, x in batch.items()}


def eval_loader(windows: Windows, batch_size: int, num_workers: int = 0, pin: bool = False) -> DataLoader:
    """Validation/test batches in a fixed order (Lightning adds a DistributedSampler under DDP)."""
    # window numbers; collate turns a list of them into a batch
    return DataLoader(
        range(len(windows)), batch_size, collate_fn=windows.collate, num_workers=num_workers, pin_memory=pin
    )


class TrainLoader:
    """Shuffled training batches, deterministic in (seed, epoch), sharded by rank, resumable mid-epoch.

    Not a DataLoader: Lightning would replace its sampler. Each epoch the windows are permuted with rng(seed, epoch)
    and the first len(self) * batch_size * world_size dealt round-robin to the ranks. The loader counts its own
    epochs (Lightning's disagrees with the data after max_steps and under limit_train_batches) and the batches
    handed out, which Lightning has trained on: it does not prefetch from a loader with a length.
    """

    def __init__(
        self,
        windows: Windows,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        epoch: int = 0,
        pin: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} with world_size={world_size}; accepted: 0 <= rank < world_size")
        if len(windows) < batch_size * world_size:
            raise ValueError(
                f"only {len(windows)} training windows, fewer than batch_size={batch_size} x world_size={world_size}; "
                "use a smaller batch_size or seq_len, or a larger corpus"
            )
        self.windows, self.batch_size, self.seed = windows, batch_size, seed
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.epoch, self.pin = epoch, pin  # the epoch being (or last) drawn from; page-locked batches (GPU)
        self.position = 0  # batches of `epoch` already handed out

    def __len__(self) -> int:
        return len(self.windows) // (self.batch_size * self.world_size)

    def epoch_batches(self, epoch: int) -> np.ndarray:
        """(len(self), batch_size) window numbers of this rank's batches in `epoch`."""
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))
        n = len(self)
        return perm[: n * self.batch_size * self.world_size][self.rank :: self.world_size].reshape(
            n, self.batch_size
        )

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        # A generator: nothing runs until the first next(), so a load_state_dict() after iter() still counts.
        if self.position >= len(self):  # the last epoch was used up: start the next
            self.epoch, self.position = self.epoch + 1, 0
        order = self.epoch_batches(self.epoch)[self.position :]
        if self.num_workers > 0:
            # each item an array of window numbers, collated in the workers
            batches = DataLoader(
                list(order),
                batch_size=None,
                collate_fn=self.windows.collate,
                num_workers=self.num_workers,
                pin_memory=self.pin,
            )
        else:
            batches = map(self.windows.collate, order)
            batches = map(pinned, batches) if self.pin else batches
        for batch in batches:
            self.position += 1
            yield batch

    def upcoming(self) -> dict[str, Tensor]:
        """The batch the next next() hands out, made again on the host: a training step may start work for the
        step after it (the retriever searches its neighbours a step ahead). Lightning fetches nothing ahead from a
        loader with a length, so the loader says it."""
        epoch, position = (self.epoch, self.position) if self.position < len(self) else (self.epoch + 1, 0)
        batch = self.windows.collate(self.epoch_batches(epoch)[position])
        return pinned(batch) if self.pin else batch

    def state_dict(self) -> dict[str, int]:
        """Where the loader is (epoch, batches handed out in it) and what must match to resume exactly."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "windows": len(self.windows),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where `state` left off, on the same data. The process count may change while the global batch
        G = batch_size x world_size does not: global batch i is windows perm[i*G : (i+1)*G] whatever the sharding."""
        for name, mine in (("seed", self.seed), ("windows", len(self.windows))):
            if state[name] != mine:
                raise ValueError(
                    f"cannot resume the training loader exactly: checkpoint has {name}={state[name]}, "
                    f"this run has {name}={mine}"
                )
        saved, mine = state["batch_size"] * state["world_size"], self.batch_size * self.world_size
        if saved != mine:
            hint = (
                f"; to continue on {self.world_size} process(es) with the same batches, "
                f"set --data.batch_size={saved // self.world_size}"
                if saved % self.world_size == 0
                else f"; {self.world_size} process(es) cannot split it evenly: use a process count dividing {saved}"
            )
            raise ValueError(
                "cannot resume the training loader exactly: the checkpoint's global batch is "
                f"batch_size={state['batch_size']} x world_size={state['world_size']} = {saved} windows, this run's "
                f"is batch_size={self.batch_size} x world_size={self.world_size} = {mine}" + hint
            )
        self.epoch, self.position = state["epoch"], state["position"]
