"""faiss for rlm.index, imported in one place: an optional dependency with an error naming its extra."""

from rlm.extras import require

faiss = require("faiss", "gpu", "retrieval indices", alternative="or pip install faiss-cpu, rlm's default")
