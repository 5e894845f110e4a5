"""Sampling text from a trained model."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlm.train.module import LMModule


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
    stop: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Continue ``prompt_ids`` token by token (full recompute over the last max_seq_len tokens); ``mixer``
    (rlm.eval.knnlm.Mixer) turns the last position's logits and key state into kNN-LM log-probabilities;
    ``stop``, given the new ids so far after each token, ends the sampling when it returns True."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    module.eval()
    device = module.device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
    window = module.model.config.max_seq_len
    with contextlib.ExitStack() as stack:
        hooked = None
        if mixer is not None:
            from rlm.eval.datastore import reading_keys

            hooked = stack.enter_context(reading_keys(module, mixer.ds.meta["layer"]))
        for _ in range(max_new_tokens):
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
