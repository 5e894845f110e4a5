"""An index sharded across the ranks of a process group, as Atlas's distributed index (Izacard et al. 2022):
rank r indexes shard_range(R, r, world) of the R indexed segments and writes it to part_dir, with no shared
filesystem. A search is a collective: each part searches every rank's queries with search.py's causal filter
and the parts' top-k are merged into the global top-k (equal scores ordered by global id). Every rank keeps
the whole (S, k) neighbour table."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist

from rlm.index.build import BuiltIndex, IndexConfig, build_index
from rlm.index.memory import ROWS, RetrievalMemory, load_part_memory, load_table, write_memory
from rlm.index.projection import SAMPLE, Projection, fit_pca, sample_rows, with_projection
from rlm.index.protocol import shard_range
from rlm.index.search import Exclusions, Neighbours, search_neighbours
from rlm.index.search import SegmentTable as IndexSegments
from rlm.index.store import IndexMismatchError, IndexNotFoundError, load_index_dir, read_meta

TABLE_CHUNK = 4096  # queries a rank adds per round of a table build: bounds the (world * chunk, d) gathered


def part_dir(step_dir: Path, rank: int, world: int) -> Path:
    """Where rank `rank` of `world` writes its part of the index of one rebuild."""
    return Path(step_dir) / f"rank-{rank:05d}-of-{world:05d}"


def _device() -> torch.device:
    """The device collectives move tensors on: nccl moves CUDA tensors only, gloo CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_rows(x: np.ndarray) -> list[np.ndarray]:
    """Every rank's (n_r, ...) array, in rank order; n_r may differ (padded to the largest for the collective), and an
    empty (0, 0) array takes the others' width."""
    world, dev = dist.get_world_size(), _device()
    shape = torch.tensor(x.shape, dtype=torch.int64, device=dev)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    shapes = torch.stack(shapes).cpu()  # (world, x.ndim)
    counts, rest = shapes[:, 0].tolist(), shapes[:, 1:].amax(0).tolist()
    padded = torch.zeros((max(1, max(counts)), *rest), dtype=torch.from_numpy(x[:0]).dtype, device=dev)
    if len(x):
        padded[: len(x)] = torch.from_numpy(np.ascontiguousarray(x)).to(dev)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return [p[:c].cpu().numpy() for p, c in zip(parts, counts)]


def merge_topk(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(Q, k) global top-k of P parts' (P, Q, k) top-k: highest score first, equal scores by lower id, -1 last."""
    P, Q, kk = scores.shape
    s = scores.transpose(1, 0, 2).reshape(Q, P * kk)  # (Q, P*k)
    i = ids.transpose(1, 0, 2).reshape(Q, P * kk)
    # padding (-1, -inf) sorts last: its key -score is +inf
    order = np.lexsort((i, -s.astype(np.float64)), axis=1)[:, :k]  # (Q, k)
    return np.take_along_axis(s, order, 1), np.take_along_axis(i, order, 1)


def route_to_askers(part: Neighbours, counts: list[int], k: int) -> Neighbours:
    """Collective: every part's answer to this rank's Q_me queries, from each part's (sum Q_r, k) results: (world,
    Q_me, k) ids and scores, (world, Q_me) exclusion counts, as one all_to_all_single of int64 rows (ids, the
    scores' float32 bits, the count)."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), _device()
    bits = np.ascontiguousarray(part.scores, dtype=np.float32).view(np.int32).astype(np.int64)
    excluded = np.zeros(len(part.ids), dtype=np.int64) if part.excluded is None else part.excluded
    rows = np.concatenate([part.ids.astype(np.int64), bits, excluded.astype(np.int64)[:, None]], 1)
    sent = torch.from_numpy(np.ascontiguousarray(rows)).to(dev)  # (sum Q_r, 2k + 1)
    mine = counts[rank]
    got = torch.empty((world * mine, 2 * k + 1), dtype=torch.int64, device=dev)
    dist.all_to_all_single(got, sent, [mine] * world, counts)
    got = got.cpu().numpy().reshape(world, mine, 2 * k + 1)
    scores = got[..., k : 2 * k].astype(np.int32).view(np.float32)
    return Neighbours(got[..., :k], scores, None if part.excluded is None else got[..., 2 * k])


@dataclass
class ShardedMemory(RetrievalMemory):
    """This rank's part of a sharded index (rows, index, index_segments, path: the part's) and the whole neighbour
    table; parts lists every rank's directory."""

    indexed: np.ndarray | None = None  # (S,) bool: the global ids some part holds (the rest are outside)
    collective: ClassVar[bool] = True

    def indexed_mask(self) -> np.ndarray:
        """(S,) bool: which global segment ids some part of the index holds."""
        return self.indexed

    def search_part(
        self, queries: np.ndarray, query_ids: np.ndarray, k: int, exclusions: Exclusions | None = None
    ) -> Neighbours:
        """This part's (Q, k) causally filtered top-k (global ids) of queries with global ids (-1: outside), minus
        the exclusions' ranges of global ids."""
        R = len(self.rows)
        safe = np.maximum(query_ids, 0)
        inside = (query_ids >= 0) & self.indexed[safe]  # as in 1 process: a query not indexed is outside
        local = np.where(inside, self.row_of[safe], -1)  # the query's own row when this part holds it
        # queries held by another part: appended to this part's segment table, so the filter knows their
        # (document, offset); they are no row of this index, so exclude_self never matches them
        away = np.flatnonzero(inside & (local < 0))
        local[away] = R + np.arange(len(away))
        g = query_ids[away]
        segs = IndexSegments(
            np.concatenate([self.index_segments.doc, self.segments.doc[g]]),
            np.concatenate([self.index_segments.offset, self.segments.start[g]]),
        )
        found = search_neighbours(self.index, queries, k, local, segs, exclusions=self._as_rows(exclusions))
        found.ids = np.where(found.ids >= 0, self.rows[np.maximum(found.ids, 0)], -1)
        return found

    def search_scored(
        self,
        queries: np.ndarray,
        query_ids: np.ndarray,
        k: int,
        exclusions: Exclusions | None = None,
        projected: bool = False,
    ) -> Neighbours:
        """Collective: this rank's queries' neighbours over all parts (as RetrievalMemory.search_scored; projected:
        the queries are already in the index's width). As Atlas routes its results: every part scores every rank's
        queries, but sends each rank only the top-k of its own (route_to_askers)."""
        queries = np.asarray(queries, dtype=np.float32)
        if len(queries) == 0:  # a rank with no query still joins in (its (0, ?) array may have any width)
            index = self.index.index if isinstance(self.index, BuiltIndex) else self.index
            queries = np.zeros((0, index.d), dtype=np.float32)
        elif not projected:
            queries = self.project(queries)  # narrowed before the gather: what travels is m wide
        all_q = np.concatenate(all_gather_rows(queries))  # (sum Q_r, d)
        ids_by_rank = all_gather_rows(np.asarray(query_ids, dtype=np.int64))
        if exclusions is not None:  # every rank's, their query positions shifted to the gathered queries'
            ex = np.stack([exclusions.query, exclusions.lo, exclusions.hi, exclusions.counted], 1)
            parts = all_gather_rows(ex.astype(np.int64))
            starts = np.cumsum([0] + [len(x) for x in ids_by_rank])
            ex = np.concatenate([p + [start, 0, 0, 0] for p, start in zip(parts, starts)])
            exclusions = Exclusions(ex[:, 0], ex[:, 1], ex[:, 2], ex[:, 3].astype(bool))
        part = self.search_part(all_q, np.concatenate(ids_by_rank), k, exclusions)  # (sum Q_r, k)
        if len(all_q) == 0:
            return part
        mine = route_to_askers(part, [len(x) for x in ids_by_rank], k)  # (world, Q_me, k)
        scores, found = merge_topk(mine.scores, mine.ids, k)
        # the parts' counts summed: an upper bound of what the exclusions took from the merged top k
        excluded = None if mine.excluded is None else mine.excluded.sum(0)
        return Neighbours(found, scores, excluded)


def build_sharded_memory(
    shard: np.ndarray,
    segments: Any,
    rows: np.ndarray,
    k: int,
    identity: dict[str, Any],
    step: int,
    index_config: IndexConfig,
    step_dir: Path | None,
    table: bool = True,
    projection: Projection | None = None,
) -> ShardedMemory:
    """Collective: as build_memory, over this rank's share of the rows' vectors (shard_range order), writing this
    rank's part to part_dir(step_dir, rank, world); every rank's share was narrowed by one projection."""
    rank, world = dist.get_rank(), dist.get_world_size()
    identity = with_projection(identity, projection)
    if len(rows) < world:
        raise ValueError(
            f"a sharded index needs at least one indexed segment per rank: {len(rows)} rows, {world} ranks"
        )
    share = shard_range(len(rows), rank, world)
    mine = rows[share.start : share.stop]  # the rows embed_rows gave this rank
    if len(shard) != len(mine):
        raise ValueError(f"rank {rank} embedded {len(shard)} vectors for its {len(mine)} rows")
    built = build_index(shard, index_config)
    memory = ShardedMemory(
        segments,
        mine,
        built,
        IndexSegments(segments.doc[mine], segments.start[mine]),
        np.full((len(segments), k), -1, dtype=np.int64) if table else None,
        identity,
        step,
        None,
        indexed=np.isin(np.arange(len(segments)), rows),
        projection=projection,
    )
    most = max(len(shard_range(len(rows), r, world)) for r in range(world)) if table else 0
    for lo in range(0, most, TABLE_CHUNK):  # the same number of rounds on every rank
        ids = mine[lo : lo + TABLE_CHUNK]
        found = memory.search_scored(shard[lo : lo + TABLE_CHUNK], ids, k, projected=True).ids
        memory.neighbours[np.concatenate(all_gather_rows(ids))] = np.concatenate(all_gather_rows(found))
    if step_dir is not None:
        path = part_dir(step_dir, rank, world)
        shard_meta = {"rank": rank, "world": world, "rows_total": len(rows)}
        write_memory(path, memory, shard, {"k": k, "shard": shard_meta})
        read_meta(path)  # verify: every file listed in meta.json is there, full size
        memory.parts = [str(part_dir(step_dir, r, world).resolve()) for r in range(world)]
    return memory


def load_sharded_memory(
    parts: list[str], segments: Any, rows: np.ndarray, identity: dict[str, Any], k: int
) -> ShardedMemory:
    """This rank's part of a written sharded index; IndexMismatchError when it is from another corpus, embedder, k,
    world size or share of the rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(parts) != world:
        raise IndexMismatchError(f"the sharded index has {len(parts)} parts, this run has {world} ranks")
    path = Path(parts[rank])
    loaded = load_index_dir(path, expect_fingerprint=segments.fingerprint, expect_embedder=identity)
    want = {"rank": rank, "world": world, "rows_total": len(rows)}
    if loaded.meta.get("k") != k or loaded.meta.get("shard") != want:
        raise IndexMismatchError(
            f"index part at {path} has k={loaded.meta.get('k')}, shard={loaded.meta.get('shard')}; "
            f"this rank wants k={k}, shard={want}"
        )
    mine, share = np.load(path / ROWS), shard_range(len(rows), rank, world)
    if not np.array_equal(mine, rows[share.start : share.stop]):
        raise IndexMismatchError(f"index part at {path} indexes other rows than this rank's share")
    return ShardedMemory(
        segments,
        mine,
        loaded.index,
        loaded.segments,
        load_table(path),
        identity,
        int(identity["step"]),
        path.resolve(),
        indexed=np.isin(np.arange(len(segments)), rows),
        parts=list(parts),
        projection=loaded.projection,
    )


class PartsIndex:
    """Every part of a sharded index searched in one process, as one index (row ids run part after part)."""

    def __init__(self, indices: list[Any]) -> None:
        self.indices = indices
        self.offsets = np.cumsum([0] + [int(i.ntotal) for i in indices])  # (P+1,) first row of each part

    @property
    def ntotal(self) -> int:
        """Number of indexed vectors, over all parts."""
        return int(self.offsets[-1])

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores (Q, k), row ids (Q, k)) over every part: each part's top-k, merged (merge_topk)."""
        found = [index.search(queries, k) for index in self.indices]  # P x ((Q, k), (Q, k))
        scores = np.stack([s for s, _ in found])  # (P, Q, k)
        ids = np.stack([np.where(i >= 0, i + lo, -1) for (_, i), lo in zip(found, self.offsets)])
        return merge_topk(scores, ids, k)


def load_memory_for_search(path: str | Path) -> RetrievalMemory:
    """A written memory with its own segment table, for online search (validation, generation); a part of a sharded
    index is loaded with its sibling parts, searched as one."""
    path = Path(path)
    meta = read_meta(path)
    if "shard" not in meta:
        return load_part_memory(path)
    world = meta["shard"]["world"]
    parts = []
    for rank in range(world):
        where = part_dir(path.parent, rank, world)
        if not where.exists():
            raise IndexNotFoundError(
                f"part {rank} of the sharded index is not at {where}: searched outside training, a sharded "
                f"index needs every rank's part on this machine (copy the rank-* directories next to {path.name})"
            )
        parts.append(load_part_memory(where))
    first = parts[0]
    kinds = {str(p.identity.get("projection")) for p in parts}
    if len(kinds) > 1:
        raise IndexMismatchError(
            f"the parts of the sharded index at {path.parent} were narrowed by different projections ({kinds}): "
            "they cannot be searched as one; rebuild it"
        )
    return RetrievalMemory(
        first.segments,
        np.concatenate([p.rows for p in parts]),
        BuiltIndex(PartsIndex([p.index for p in parts]), "parts"),
        IndexSegments(
            np.concatenate([p.index_segments.doc for p in parts]),
            np.concatenate([p.index_segments.offset for p in parts]),
        ),
        first.neighbours,
        first.identity,
        first.step,
        path.resolve(),
        projection=first.projection,
    )


def fit_projection_across_ranks(
    shard: np.ndarray, width_of: Callable[[int], int], sample: int = SAMPLE
) -> Projection:
    """Collective: the PCA to width_of(D) dims of sample / world evenly spaced rows of every rank's (n_r, D) shard,
    fitted by rank 0 and broadcast, so every part projects bit for bit alike (D is known to every rank after the
    gather, even one with an empty shard)."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), _device()
    mine = shard[sample_rows(len(shard), -(-sample // world))]
    pooled = np.concatenate(all_gather_rows(np.ascontiguousarray(mine, dtype=np.float32)))  # (<= sample, D)
    width = pooled.shape[1]
    m = width_of(width)
    packed = torch.zeros(m + 1, width, dtype=torch.float32)  # row 0: the mean; rows 1..m: the components
    if rank == 0:
        fitted = fit_pca(pooled, m)
        packed[0], packed[1:] = torch.from_numpy(fitted.mean), torch.from_numpy(fitted.components)
    packed = packed.to(dev)
    dist.broadcast(packed, src=0)
    packed = packed.cpu().numpy()
    return Projection(packed[0].copy(), packed[1:].copy())


def check_same_table(neighbours: np.ndarray | None) -> None:
    """Collective: raise unless every rank holds the same neighbour table, or none (lookup 'search')."""
    checksum = 0 if neighbours is None else zlib.crc32(np.ascontiguousarray(neighbours).tobytes())
    sums = [int(c[0]) for c in all_gather_rows(np.array([checksum], dtype=np.int64))]
    if len(set(sums)) > 1:
        raise RuntimeError(f"ranks hold different neighbour tables after a rebuild (checksums {sums})")
