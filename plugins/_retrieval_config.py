"""The retriever's options and its rebuild schedule; the measurements behind the defaults are in RESULTS.md."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal

from rlm.index.build import IndexConfig
from rlm.model.config import ModelConfig
from rlm.model.memory import Parts, chosen_layers, norm_bytes


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


@dataclass
class RetrievalConfig:
    """Options of the retriever."""

    layers: list[int] = field(default_factory=lambda: [-1])
    """Layers that get a cross-attention to the neighbours (with embedder 'shared', above its blocks)."""
    k: int = 2
    """Neighbours per segment. k >= 2 trains beta and the embedder (MARGE): with k=1 the softmax cancels the
    relevance bias every key of a chunk shares (a warning says so)."""
    continuation: bool = False
    """Each neighbour brings its document's next segment too (2L keys per neighbour, RETRO's chunk and
    continuation, Borgeaud et al. 2022); off: Komatsuzaki's causal MARGE, S_{t+1} sees the neighbours of S_t alone."""
    embedder: Literal["tokens", "shared", "separate"] = "tokens"
    """What embeds segments. 'tokens': the LM's token embeddings, each beside its predecessor's, e(.) their mean;
    'shared': the LM's embedding and first embed_layers blocks (MARGE); 'separate': a small encoder of its own."""
    embed_layers: int = 1
    """Blocks of a 'shared' or 'separate' embedder."""
    encoder_dim: int = 64
    """Width of the separate encoder (embedder 'separate' only)."""
    neighbour_grad: Literal["full", "embedding", "none"] = "none"
    """How the LM loss reaches the embedder through the neighbours: 'full' (MARGE); 'embedding': the token embeddings
    through the residual path, not the blocks; 'none': only through the query's e(S_t). The same forward values."""
    zero_init: bool = True
    """Start each cross-attention's output at zero, as the model without it (Flamingo's gates, Alayrac et al. 2022)."""
    schedule: str = "0-2000:150,2000-1000000000:2000"
    """When to rebuild: 'every N', piecewise 'a-b:N,...' (every N steps while a <= step < b) or 'never'."""
    mode: Literal["background", "blocking"] = "background"
    """'background': a snapshot embeds in a thread, swapped in atomically when done; 'blocking': training waits."""
    warm_start: Literal["recent", "similar", "none"] = "recent"
    """Neighbours until the first table (built at the schedule's first due step), from the query's own document's
    past before the attention window first (Komatsuzaki 2020, sec. 5.4). 'recent': the most recent first; 'similar':
    the closest to S_t by the current embedder among the 16 most recent; 'none': no retrieval until then."""
    same_doc_k: int = 0
    """After the first table: this many of the k neighbours are warm-start picks from the query's own past."""
    exclude_copies: bool = True
    """At evaluation, keep exact copies of the evaluated text's continuation out of reach (_retrieval_filter.py);
    false only for synthetic tasks whose evaluated continuation is in the index by design."""
    eval_ablation: bool = False
    """Validation also runs with every neighbour swapped for a random segment of another document
    (val/<label>_random/loss): how much the model uses what it retrieves."""
    lookup: Literal["table", "search"] = "search"
    """'table' (MARGE): a rebuild also finds every training segment's k neighbours and a step reads them; 'search':
    each step searches the index for its own queries, embedded by the current embedder."""
    index_factory: str = "auto"
    """faiss factory string, 'auto' or 'torch' (exact); see rlm.index.build.IndexConfig."""
    flat_below: int = 131072
    """index_factory 'auto' keeps exact flat search below this many segments."""
    target_recall: float | None = 0.95
    """Every index built is tuned (nprobe/efSearch) to this recall@10 against exact search; None: faiss defaults."""
    index_dir: str | None = None
    """Where rebuilt indices are written; None: <trainer.default_root_dir>/retrieval_index."""
    sharded: bool | Literal["auto"] = "auto"
    """With more than one process: true, each rank indexes only its share (rlm.index.sharded); false, rank 0 builds
    the whole from the gathered vectors for every rank (a shared filesystem); 'auto': true from shard_above."""
    shard_above: int = 1_048_576
    """sharded 'auto' shards from this many indexed segments (2^20 gathered whole: 3 GiB of fp32 at d 768)."""
    index_dim: int | Literal["auto"] | None = "auto"
    """Width of the indexed vectors, e(.) narrowed by a PCA (rlm.index.projection): null, full; an integer below
    e(.)'s; 'auto': min(256, half the width) from shard_above indexed segments, full below."""
    progress: bool = True
    """Show a progress bar while embedding the corpus."""

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"retrieval.k must be a positive integer, got {self.k!r}")
        if self.k == 1:
            warnings.warn(
                "retrieval.k=1: every key of a chunk gets the same relevance bias, which the softmax cancels, so "
                "beta and the embedder learn nothing through it; k >= 2 trains them (MARGE)",
                stacklevel=3,  # the caller of RetrievalConfig(...), past the dataclass's __init__
            )
        if not isinstance(self.embed_layers, int) or self.embed_layers < 1:
            raise ValueError(f"retrieval.embed_layers must be a positive integer, got {self.embed_layers!r}")
        if self.encoder_dim < 2 or self.encoder_dim % 2:
            raise ValueError(f"retrieval.encoder_dim must be an even integer >= 2, got {self.encoder_dim!r}")
        if not isinstance(self.same_doc_k, int) or not 0 <= self.same_doc_k <= self.k:
            raise ValueError(
                f"retrieval.same_doc_k must be an integer in [0, k={self.k}], got {self.same_doc_k!r}"
            )
        if not isinstance(self.shard_above, int) or self.shard_above < 1:
            raise ValueError(f"retrieval.shard_above must be a positive integer, got {self.shard_above!r}")
        dim = self.index_dim
        if dim not in (None, "auto") and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
            raise ValueError(
                f"retrieval.index_dim={dim!r}; accepted: null (full width), 'auto', or a positive integer"
            )
        Schedule.parse(self.schedule)  # raises ValueError naming the accepted grammar
        IndexConfig(factory=self.index_factory, target_recall=self.target_recall, flat_below=self.flat_below)

    def memory(self, mc: ModelConfig, parts: Parts) -> None:
        """The cross-attention layers' parameters and saved bytes (rlm.model.memory), embedder 'tokens' only."""
        if self.embedder != "tokens":
            raise NotImplementedError(
                f"retrieval.embedder={self.embedder!r}: the estimate covers embedder 'tokens' only (no parameters "
                "of its own); the shared and separate embedders' blocks are not counted"
            )
        d, hd = mc.d_model, mc.head_dim
        enc = 2 * d  # each token's embedding beside its predecessor's (TokenEncoder.dim)
        layers = chosen_layers(self.layers, mc.n_layers, [-1])
        per = d * d + enc + enc * 2 * hd + d * d + 1 + d  # q, kv norm, kv (one shared head), proj, beta, norm
        parts.params += len(layers) * per
        # per token: its chunk's k x (1 + continuation) neighbour segments of width 2d (bf16), their keys and values,
        # the layer's queries and output
        parts.notes.append(
            "retrieval: cross-attention activations by formula (not measured); the index not counted"
        )
        m = self.k * (2 if self.continuation else 1)
        parts.act_per_token += len(layers) * (
            norm_bytes(d) + 2 * d + m * (2 * enc + 4 * hd) + 2 * d + 4 * mc.n_heads
        )
