"""faiss for rlm.index, imported in one place: an optional dependency with an error naming its extra."""

from rlm.extras import require

faiss = require("faiss", "retrieval", "retrieval indices", alternative="or 'rlm[gpu]' for faiss on CUDA 12")

from faiss.contrib.ondisk import merge_ondisk  # noqa: E402  (after the import that names the extra)

__all__ = ["faiss", "merge_ondisk"]
