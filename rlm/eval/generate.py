"""Sampling text from a trained model, with a key/value cache (default) or by recomputing the window each step.

Cached decoding keeps every self-attention layer's keys and values (and the plugins' per-window state, see
rlm/plugin/cache.py), so each step runs the model over one new token. A cache holds one window of at most
max_seq_len positions, rotary positions counted from the window's start. The full recompute slides its window
by one token per step past max_seq_len (``ids[:, -max_seq_len:]``), which would move every cached position;
the cache instead re-fills: when the next token would not fit, it restarts from the last max_seq_len // 2
tokens (one forward over them) and continues. So up to max_seq_len tokens the two give the same logits; past
it, step t of the cached path sees the tokens from its window's start w(t), where w starts at 0 and, whenever
t - w(t) would exceed max_seq_len, becomes t - max_seq_len // 2 (``refill_start``): between max_seq_len // 2
and max_seq_len tokens of context instead of always max_seq_len.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlm.plugin.cache import KVCache
from rlm.train.module import LMModule


def refill_start(length: int, start: int, window: int) -> int:
    """The cached path's window start for a sequence of ``length`` tokens whose current window starts at ``start``:
    unchanged while the window holds at most ``window`` tokens, else the last ``window // 2`` tokens."""
    return start if length - start <= window else length - max(window // 2, 1)


class CachedDecoder:
    """Logits of the next token after ``ids``, feeding the model only the tokens its cache has not seen."""

    def __init__(self, module: LMModule, window: int | None = None) -> None:
        self.module = module
        self.window = window or module.model.config.max_seq_len
        if not 0 < self.window <= module.model.config.max_seq_len:
            raise ValueError(
                f"window={window}; accepted: 1..model.max_seq_len={module.model.config.max_seq_len}"
            )
        self.cache: KVCache | None = None
        self.start = 0
        """Position in ids of the cache's first token."""

    def __call__(self, ids: Tensor) -> Tensor:
        """(B, V) float logits after the whole of ``ids`` (B, N), which extends the ids of the previous call."""
        start = refill_start(ids.shape[1], self.start, self.window)
        if self.cache is None or start != self.start:
            self.start, self.cache = start, KVCache(self.window, ids.shape[0], ids.device)
        new = ids[:, self.start + self.cache.length :]  # (B, T): the prompt, a re-fill, or the last token
        ctx = self.module.make_context({"tokens": new}, "predict", cache=self.cache)
        return self.module.model(new, ctx)[:, -1, :].float()


@torch.no_grad()
def sample(
    module: LMModule,
    prompt_ids: list[int],
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    mixer: Any = None,
    cache: bool = True,
    stop: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Continue ``prompt_ids`` token by token: with ``cache`` (default) incrementally (see the module doc for the
    window past max_seq_len), else by a full recompute over the last max_seq_len tokens at every step; ``mixer``
    (rlm.eval.knnlm.Mixer) turns the last position's logits and key state into kNN-LM log-probabilities;
    ``stop``, given the new ids so far after each token, ends the sampling when it returns True."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; give at least one token (for example the tokenizer's bos id)")
    module.eval()
    device = module.device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
    window = module.model.config.max_seq_len
    decoder = CachedDecoder(module) if cache else None
    with contextlib.ExitStack() as stack:
        hooked = None
        if mixer is not None:
            from rlm.eval.datastore import reading_keys

            hooked = stack.enter_context(reading_keys(module, mixer.ds.meta["layer"]))
        for _ in range(max_new_tokens):
            if decoder is not None:
                logits = decoder(ids)  # (1, V)
            else:
                context = ids[:, -window:]
                ctx = module.make_context({"tokens": context}, "predict")
                logits = module.model(context, ctx)[:, -1, :].float()  # (1, V)
            if hooked is not None:
                logits = mixer(logits, hooked["keys"][:, -1])  # (1, V) log-probabilities
            next_id = _pick(logits, temperature, top_k, generator)
            ids = torch.cat([ids, next_id], dim=1)
            if eos_id is not None and int(next_id) == eos_id:
                break
            if stop is not None and stop(ids[0, len(prompt_ids) :].tolist()):
                break
    return ids[0, len(prompt_ids) :].tolist()


def _pick(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)
