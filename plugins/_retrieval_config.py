"""The retriever's options (RetrievalConfig), each checked with a message that names the bad value and what is
accepted. What an option does is in its docstring; the measurements behind the defaults are in RESULTS.md."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal

from rlm.index.build import IndexConfig
from rlm.index.projection import check_index_dim
from rlm.index.rebuild import Schedule
from rlm.model.config import ModelConfig
from rlm.model.memory import Parts, chosen_layers, norm_bytes


@dataclass
class RetrievalConfig:
    """Options of the retriever."""

    layers: list[int] = field(default_factory=lambda: [-1])
    """Layers that get a cross-attention to the neighbours (with embedder 'shared', above its blocks)."""
    k: int = 2
    """Neighbours per segment. k >= 2 keeps MARGE's joint training of the retriever: with k=1 every key of a chunk
    gets the same relevance bias, the softmax cancels it, and beta and the embedder learn nothing through it (a
    warning says so)."""
    continuation: bool = False
    """Each neighbour brings its document's next segment too (keys/values of 2L tokens per neighbour, as RETRO's
    chunk and continuation, Borgeaud et al. 2022). Off by default: Komatsuzaki's causal MARGE conditions S_{t+1}
    on the neighbours of S_t alone. On: a neighbour similar to S_t brings the segment after it, which is what a
    near-copy of the document needs (the synthetic partner task of tests/plugins/test_retrieval_training.py)."""
    embedder: Literal["tokens", "shared", "separate"] = "tokens"
    """What embeds segments for the index and the cross-attention's keys. 'tokens': the LM's token embeddings
    alone, each token's state beside its predecessor's, e(.) their mean (no block runs over the neighbours);
    'shared': the LM's embedding and first embed_layers blocks (MARGE shares its encoder); 'separate': a small
    encoder of its own."""
    embed_layers: int = 1
    """Blocks of the embedder: the LM's first n blocks ('shared') or the separate encoder's depth ('tokens': none)."""
    encoder_dim: int = 64
    """Width of the separate encoder (embedder 'separate' only)."""
    neighbour_grad: Literal["full", "embedding", "none"] = "none"
    """How the LM loss reaches the embedder through the neighbours. 'full' (MARGE's joint training): the neighbours
    run through the embedder with gradients (keys/values and e(z)). 'embedding': the neighbours run through the
    embedder's blocks without gradients, their token embeddings still get the keys' and values' gradient through
    the residual path, and e(S_t) is computed with gradients. 'none': as 'embedding' without the residual path
    (the embedder learns only through the query's e(S_t)). The forward values are the same in all three; with
    embedder 'tokens' (no blocks) 'embedding' is 'full'."""
    zero_init: bool = True
    """Start each cross-attention's output projection at zero, so the model starts as the same model without
    retrieval and the neighbours' contribution grows only as far as it lowers the loss (the role of Flamingo's
    zero-initialised gates, Alayrac et al. 2022)."""
    schedule: str = "0-2000:150,2000-1000000000:2000"
    """When to rebuild: 'every N', piecewise 'a-b:N,...' (every N steps while a <= step < b) or 'never'."""
    mode: Literal["background", "blocking"] = "background"
    """'background' (a snapshot embeds in a thread; atomic swap when done; until the first table lands the
    model trains on the warm start) or 'blocking' (training waits, also for the first table)."""
    warm_start: Literal["recent", "similar", "none"] = "recent"
    """Neighbours until the first table lands (Komatsuzaki 2020, sec. 5.4: poorly initialised neighbours make
    learning slow, so start from segments of the same document), in training and validation alike: earlier
    segments of the query's own document, never the target segment or anything after it. Segments before the
    attention window come first, the most recent first. 'recent': in that order; 'similar': among the 16 most
    recent (_retrieval_neighbours.WARM_CANDIDATES), the most similar to S_t by the current embedder; 'none': no
    retrieval until the first table. With a warm start the first table is built at the schedule's first due step,
    not at fit start, where it would rank segments with a random embedder."""
    same_doc_k: int = 0
    """After the first table: this many of the k neighbours are warm-start picks from the query's own past (as
    warm_start chooses them; 'recent' when warm_start is 'none'), the other k - same_doc_k come from the table
    (or the online search). 0: all k from the table."""
    exclude_copies: bool = True
    """At evaluation (validation, test, rlm eval, generation), keep exact copies out of reach: a query whose text
    copies an indexed document (L / 2 tokens in a row or more) retrieves nothing of that document from its own
    position on, and indexed copies of the evaluated document's future segments are not retrieved (counted as
    val/<label>/duplicates_excluded); see _retrieval_filter.py. False only for synthetic tasks whose evaluated
    continuation is in the index by design (the partner task of tests/plugins/test_retrieval_training.py)."""
    eval_ablation: bool = False
    """Validation also computes the loss with every neighbour swapped for a random segment of another document
    (training segments once a table exists), in the same pass, logged as val/<label>_random/loss: how much the
    model uses what it retrieves. Doubles the validation cost, so off by default."""
    lookup: Literal["table", "search"] = "search"
    """How a training step finds its chunks' neighbours once an index exists. 'table' (MARGE): every rebuild also
    searches the whole index for every training segment's k neighbours, and a step reads them. 'search': a
    rebuild only embeds and indexes the corpus, and each step searches the index for its own queries, embedded by
    the current embedder (as validation and generation always do). Until the embedder moves, both find the same
    neighbours (tests/plugins/test_retrieval.py)."""
    index_factory: str = "auto"
    """faiss factory string, 'auto' or 'torch' (exact); see rlm.index.build.IndexConfig."""
    flat_below: int = 131072
    """index_factory 'auto' keeps exact flat search below this many segments, where it is cheaper than building
    and tuning an approximate index (`rlm index build` keeps 32,768, for online search)."""
    target_recall: float | None = 0.95
    """Every index the retriever builds is tuned (nprobe/efSearch) until its recall@10 against exact search
    reaches this, as `rlm index build` does; the recall reached is in the index's meta.json and logged as
    train/<label>/index_recall. None: faiss defaults."""
    index_dir: str | None = None
    """Where rebuilt indices are written; None: <trainer.default_root_dir>/retrieval_index."""
    sharded: bool | Literal["auto"] = "auto"
    """With more than one process: true, each rank embeds, indexes and writes only its share of the segments (its
    own directory: no shared filesystem), searches send every rank's queries to every part and each rank gets
    back its own queries' top-k (rlm.index.sharded), and in mode 'background' with lookup 'search' the whole
    build runs off the training thread; false: the ranks' vectors are all-gathered to every rank, rank 0 builds
    and writes the whole index alone (in any mode on the training thread) and every rank loads it (a shared
    filesystem); 'auto': true from shard_above indexed segments. Exact indices give the same table either way
    (equal scores aside). One process: no effect."""
    shard_above: int = 1_048_576
    """sharded 'auto' shards from this many indexed segments: 2^20 segments gathered whole are 3 GiB of fp32
    vectors received and held by every rank at d 768 (8 GiB at d 2048), and rank 0's build grows past what the
    other ranks can wait for in a collective; below it one index costs little."""
    index_dim: int | Literal["auto"] | None = "auto"
    """Width of the vectors the index holds: the embedder's e(.) narrowed by a PCA fitted at each rebuild on a
    sample (up to 65,536) of the vectors about to be indexed (rlm.index.projection; under DDP the same projection
    on every rank), applied before they are gathered, indexed or written and to every query; the relevance bias
    stays on the full-width e(.). null: full width; an integer m: that width, below e(.)'s (d_model; encoder_dim
    with embedder 'separate'); 'auto': min(256, half the width) from shard_above (2^20) indexed segments, full width
    below, so small runs are unchanged. At 1B segments x 2048 dims the full width is 8.2 TB of fp32; at half width
    PCA keeps most of the full-width search's neighbours, a random projection far fewer (benchmarks/
    narrow_embedding.py; RESULTS.md). The projection is stored with the index and is part of its embedder identity."""
    progress: bool = True
    """Show a progress bar while embedding the corpus."""

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"retrieval.k must be a positive integer, got {self.k!r}")
        if self.k == 1:
            warnings.warn(
                "retrieval.k=1: every key of a chunk belongs to its one neighbour and gets the same relevance "
                "bias beta * cos(e(S_t), e(z)), which the softmax cancels, so beta and the embedder learn nothing "
                "through it (the index is still searched with the current embedder); k >= 2 trains them (MARGE)",
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
        try:
            check_index_dim(self.index_dim)
        except ValueError as err:
            raise ValueError(f"retrieval.{err}") from None
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
        # Per token: its chunk's neighbours k x (1 + continuation) x segment tokens of width 2d (bf16), their keys
        # and values, and the layer's queries and output, spread over a segment's tokens.
        # Unlike the other plugins' terms, this one is not measured by a test (a step needs an index and segments).
        parts.notes.append(
            "retrieval: cross-attention activations by formula (not measured); the index not counted"
        )
        m = self.k * (2 if self.continuation else 1)
        parts.act_per_token += len(layers) * (
            norm_bytes(d) + 2 * d + m * (2 * enc + 4 * hd) + 2 * d + 4 * mc.n_heads
        )
