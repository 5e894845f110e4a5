"""Sampling text from a trained model, with a key/value cache (default) or by recomputing the window each step.

The cache (rlm/plugin/cache.py) holds one window of at most max_seq_len positions, so each step runs the model over
one new token; where the next token would not fit it re-fills from the last max_seq_len // 2 tokens
(``refill_start``), while the full recompute slides its window by one. Up to max_seq_len tokens the two agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlm.plugin.cache import KVCache, refill_start
from rlm.train.module import LMModule


class CachedDecoder:
    """Logits of the next token after ``ids``, feeding the model only the tokens its cache has not seen."""

    def __init__(self, module: LMModule) -> None:
        self.module = module
        self.window = module.model.config.max_seq_len
        self.cache: KVCache | None = None
        self.start = 0  # position in ids of the cache's first token

    def __call__(self, ids: Tensor) -> Tensor:
        """(B, V) float logits after the whole of ``ids`` (B, N), which extends the ids of the previous call."""
        start = refill_start(ids.shape[1], self.start, self.window)
        if self.cache is None or start != self.start:
            self.start, self.cache = start, KVCache(self.window, ids.shape[0], ids.device)
        new = ids[:, self.start + self.cache.length :]  # (B, T): the prompt, a re-fill, or the last token
        ctx = self.module.make_context({"tokens": new}, "predict", cache=self.cache)
        return self.module.model(new, ctx)[:, -1, :].float()


@torch.no_grad()
def sample(module: LMModule, prompt_ids: list[int], *args: Any, **kwargs: Any) -> list[int]:
    """One prompt's new ids (:func:`sample_batch`'s arguments)."""
    return sample_batch(module, [prompt_ids], *args, **kwargs)[0]


@torch.no_grad()
def sample_batch(
    module: LMModule,
    prompts: list[list[int]],
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    mixer: Any = None,
    cache: bool = True,
    stop: Callable[[list[int]], bool] | None = None,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
) -> list[list[int]]:
    """Each prompt's new ids, with ``cache`` or recomputing the last max_seq_len tokens; ``mixer``
    (rlm.eval.knnlm.Mixer) makes the distribution kNN-LM's; ``stop`` (given the new ids) ends a row as ``eos_id``
    does, the token kept. Prompts of one length run as one batch, so no position is padding and greedy rows get
    what they would alone (sampling draws from one generator in batch order); a finished row is still computed
    (the batch shares its shapes), its tokens dropped."""
    from rlm.eval.datastore import reading_keys

    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        if not ids:
            raise ValueError(
                f"prompt_ids is empty (prompt {i}); give at least one token (e.g. the tokenizer's bos id)"
            )
        by_length.setdefault(len(ids), []).append(i)
    module.eval()
    out: list[list[int]] = [[] for _ in prompts]
    window = module.model.config.max_seq_len
    keys = reading_keys(module, mixer.ds.meta["layer"]) if mixer is not None else contextlib.nullcontext()
    with keys as hooked:
        for rows in by_length.values():
            ids = torch.tensor([prompts[i] for i in rows], dtype=torch.long, device=module.device)  # (B, T)
            prompt_len, decoder = ids.shape[1], CachedDecoder(module) if cache else None
            lengths: list[int | None] = [None] * len(rows)  # new ids of each finished row
            for step in range(max_new_tokens):
                if decoder is not None:
                    logits = decoder(ids)  # (B, V)
                else:
                    context = ids[:, -window:]
                    ctx = module.make_context({"tokens": context}, "predict")
                    logits = module.model(context, ctx)[:, -1, :].float()  # (B, V)
                if hooked is not None:
                    logits = mixer(logits, hooked["keys"][:, -1])  # (B, V) log-probabilities
                picked = pick(logits, ids, temperature, top_k, top_p, repetition_penalty, generator)
                ids = torch.cat([ids, picked], dim=1)
                for row, new in enumerate(ids[:, prompt_len:].tolist()):
                    if lengths[row] is None and (new[-1] == eos_id or (stop is not None and stop(new))):
                        lengths[row] = step + 1
                if all(n is not None for n in lengths):
                    break
            for i, new, n in zip(rows, ids[:, prompt_len:].tolist(), lengths, strict=True):
                out[i] = new[:n]
    return out


def pick(
    logits: Tensor,
    seen: Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """(B, 1) next ids from (B, V) logits, given the (B, N) ids so far: the repetition penalty, then greedy
    (``temperature`` 0) or a draw after the temperature, the top-k cut and the top-p cut, in that order."""
    if repetition_penalty != 1.0:
        logits = penalize_repeats(logits, seen, repetition_penalty)
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


def penalize_repeats(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019, eq. 1 as in its code): the logit of every id in ``seen``
    (B, N) divided by ``penalty`` where positive, multiplied where negative (any repeat less likely)."""
    prev = logits.gather(1, seen)  # (B, N)
    return logits.scatter(1, seen, torch.where(prev > 0, prev / penalty, prev * penalty))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus sampling's cut (Holtzman et al. 2020): per row of (B, V) logits, -inf outside the smallest set of
    most likely ids whose probabilities sum to at least ``p``; the most likely id always stays."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # (B, V): the mass of the more likely ids
    cut = before >= p  # (B, V) in sorted order
    return logits.masked_fill(torch.empty_like(cut).scatter_(1, order, cut), float("-inf"))


def stop_at(decode: Callable[[list[int]], str], stops: list[str]) -> Callable[[list[int]], bool]:
    """A ``stop`` for :func:`sample_batch`: True once the decoded new ids contain one of ``stops``."""
    return lambda ids: any(s in decode(ids) for s in stops)


def cut_at(text: str, stops: list[str]) -> str:
    """``text`` up to the first occurrence of any of ``stops`` (the stop string itself cut)."""
    return text[: min((text.index(s) for s in stops if s in text), default=len(text))]
