"""What schedules and serves the retriever's index rebuilds (the callback is plugins/_retrieval_rebuild.py): the
schedule grammar, sharding, the CUDA stream a background rebuild embeds on."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def shards(sharded: bool | str, world: int, rows: int, shard_above: int) -> bool:
    """Whether a rebuild over `rows` segments on `world` processes keeps a part per rank ('auto': from shard_above)."""
    if world <= 1:
        return False
    return rows >= shard_above if sharded == "auto" else bool(sharded)


@dataclass(frozen=True)
class Schedule:
    """When to rebuild: piecewise intervals [(start, stop, every)], 'every N' is [(0, inf, N)], 'never' is []."""

    pieces: tuple[tuple[int, float, int], ...]

    GRAMMAR = "'never', 'every N', or piecewise 'A-B:N,B-C:M' (every N steps while A <= step < B, ...)"

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """Parse the schedule grammar; a ValueError names the bad text and the grammar."""
        if not isinstance(text, str):
            raise ValueError(f"rebuild schedule must be a string: {cls.GRAMMAR}; got {text!r}")
        s = text.strip().lower()
        if s == "never":
            return cls(())
        try:
            if s.startswith("every"):
                every = int(s[len("every") :].strip())
                if every <= 0:
                    raise ValueError
                return cls(((0, float("inf"), every),))
            pieces = []
            for part in s.split(","):
                span, every = part.split(":")
                lo, hi = span.split("-")
                lo, hi, every = int(lo), int(hi), int(every)
                if lo < 0 or hi <= lo or every <= 0:
                    raise ValueError
                pieces.append((lo, hi, every))
        except ValueError:
            raise ValueError(f"bad rebuild schedule {text!r}; accepted: {cls.GRAMMAR}") from None
        pieces.sort()
        for (_, hi, _), (lo, _, _) in zip(pieces, pieces[1:]):
            if lo < hi:
                raise ValueError(f"bad rebuild schedule {text!r}: ranges overlap; accepted: {cls.GRAMMAR}")
        return cls(tuple(pieces))

    def interval(self, step: int) -> int | None:
        """The rebuild interval in force at `step`, None where no range covers it."""
        return next((every for lo, hi, every in self.pieces if lo <= step < hi), None)

    def due(self, step: int, last: int) -> bool:
        """Whether to rebuild at `step` when the last rebuild was at `last` (robust to resuming anywhere)."""
        every = self.interval(step)
        return every is not None and step - last >= every


def rebuild_stream() -> torch.cuda.Stream | None:
    """A CUDA stream for the background rebuild's embedding (None without CUDA), so it neither queues behind the
    training step's kernels nor holds up its syncs; it starts after the work queued so far (the weights' copy)."""
    if not torch.cuda.is_available():
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return stream
