"""Retrieval indices (installed as rlm.index): build, search with causal filters, narrow (PCA), store, shard and
merge.

index/ knows nothing of plugins; it reaches embedders through the Embedder protocol. It imports only the core
(rlm.data, rlm.plugin's Context, rlm.extras); its command line, rlm.index.cli, also loads checkpoints
(rlm.train) and checks output folders (rlm.cli.check).
"""

from rlm.index.build import (
    BuiltIndex,
    IndexConfig,
    TorchExactIndex,
    build_index,
    choose_factory,
    exact_search,
    recall_at_k,
)
from rlm.index.projection import Projection, fit_pca, fit_projection, load_projection
from rlm.index.protocol import Embedder, MeanPoolEmbedder, embed_all, shard_range
from rlm.index.search import Neighbours, SegmentTable, neighbour_table, search_neighbours
from rlm.index.shards import add_shard, merge_shards, prepare_shards
from rlm.index.store import (
    IndexDir,
    IndexMismatchError,
    IndexNotFoundError,
    build_index_dir,
    corpus_fingerprint,
    load_index_dir,
    read_meta,
    save_index_dir,
)

__all__ = [
    "BuiltIndex",
    "Embedder",
    "IndexConfig",
    "IndexDir",
    "IndexMismatchError",
    "IndexNotFoundError",
    "MeanPoolEmbedder",
    "Neighbours",
    "Projection",
    "SegmentTable",
    "TorchExactIndex",
    "add_shard",
    "build_index",
    "build_index_dir",
    "choose_factory",
    "corpus_fingerprint",
    "embed_all",
    "exact_search",
    "fit_pca",
    "fit_projection",
    "load_index_dir",
    "load_projection",
    "merge_shards",
    "neighbour_table",
    "prepare_shards",
    "read_meta",
    "recall_at_k",
    "save_index_dir",
    "search_neighbours",
    "shard_range",
]
