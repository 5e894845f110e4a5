"""A token-grain memory trained with the LM (TRIME: Zhong et al., EMNLP 2022): entry j is (h_j, y_j), the final
normed state at position j and the token after it. The output mixes the LM head with the memory in one softmax
(TRIME's eq. 1, with the squared L2 similarity of the kNN-LM datastore):

    s_j      = -||h_t - h_j||^2 / tau + b
    p(w | t) = ( exp(z_w) + sum_{j: y_j = w} exp(s_j) ) / ( sum_v exp(z_v) + sum_j exp(s_j) )

with z = W h_t the LM's logits, tau and b learned. Training memory: the window's own past (j < t), the batch's
other documents (with gradients through their keys) and the last ``memory_batches`` batches' detached states;
validation uses the own past and the queue only. ``rlm eval --datastore`` scores the mixture over a datastore."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlm.plugin import Claim, Context, Plugin

STATE_GRAD = 0.1
"""Scale of the memory's gradient into the LM's states: 1 is TRIME's; smaller keeps the large gradients of the squared
distances from swamping the LM's own learning of the states."""


@dataclass
class TokenMemoryConfig:
    """Options of the token memory."""

    temperature: float | None = None
    """Initial tau (None: d_model / 8: two random unit-RMS states, at squared distance 2 d, score -16)."""
    bias: float = 0.0
    """Initial b."""
    learn: bool = True
    """Train tau and b (false: keep them at their initial values)."""
    in_batch: bool = True
    """Training memory includes the batch's other documents, with gradients through their keys."""
    memory_batches: int = 0
    """Earlier training batches whose detached states stay in the memory."""
    ce_weight: float = 1.0
    """The training loss adds this times the LM's own cross-entropy to the mixture's NLL (0: TRIME's alone)."""

    def __post_init__(self) -> None:
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"token_memory.temperature must be > 0 or null, got {self.temperature!r}")
        if not isinstance(self.memory_batches, int) or self.memory_batches < 0:
            raise ValueError(
                f"token_memory.memory_batches must be a non-negative integer, got {self.memory_batches!r}"
            )
        if not self.ce_weight >= 0:
            raise ValueError(f"token_memory.ce_weight must be >= 0, got {self.ce_weight!r}")
        if not math.isfinite(self.bias):
            raise ValueError(f"token_memory.bias must be finite, got {self.bias!r}")


def joint_nll(logits: Tensor, targets: Tensor, scores: Tensor, values: Tensor) -> Tensor:
    """-log p(target) (N,) of the mixture of ``logits`` (N, V) and the memory's ``scores`` (N, M) (-inf: not in a
    query's memory) of next tokens ``values`` (N, M) or (M,)."""
    ce = F.cross_entropy(logits, targets, reduction="none")  # log Z - z_y, fused
    z_y = logits.gather(1, targets[:, None]).squeeze(1)
    return _mix(ce + z_y, z_y, scores, values, targets)


def _mix(lse_lm: Tensor, z_y: Tensor, scores: Tensor, values: Tensor, targets: Tensor) -> Tensor:
    values = values.expand_as(scores) if values.dim() == 1 else values
    lse_mem = torch.logsumexp(scores, -1)  # (N,); -inf for an empty memory
    hit = torch.logsumexp(scores.masked_fill(values != targets[:, None], float("-inf")), -1)
    return torch.logaddexp(lse_lm, lse_mem) - torch.logaddexp(z_y, hit)


def _position_docs(ctx: Context, B: int, T: int, device: torch.device) -> Tensor:
    """The document id of each of the B * T positions (each row its own document when the batch names none)."""
    docs = ctx.doc_ids if ctx.doc_ids is not None else torch.arange(B)
    return docs.to(device).repeat_interleave(T)


class TokenMemoryPlugin(Plugin):
    """A token-grain memory of the LM's own states and their next tokens, mixed into the output (TRIME)."""

    name = "token_memory"
    Config = TokenMemoryConfig
    order = 90

    def __init__(self, config: TokenMemoryConfig, model_config) -> None:
        super().__init__(config, model_config)
        tau = config.temperature if config.temperature is not None else model_config.d_model / 8
        self.log_tau = nn.Parameter(torch.tensor(math.log(tau)), requires_grad=config.learn)
        self.bias = nn.Parameter(torch.tensor(float(config.bias)), requires_grad=config.learn)
        # earlier training batches (keys (M, d) detached, values (M,), docs (M,)); not checkpointed: a resumed run
        # refills it within memory_batches steps
        self._queue: list[tuple[Tensor, Tensor, Tensor]] = []

    def claims(self) -> list[Claim]:
        return []  # no slot: the memory acts on the output (objective)

    @property
    def temperature(self) -> float:
        """The current tau."""
        return float(self.log_tau.detach().exp())

    def scores(self, queries: Tensor, keys: Tensor) -> Tensor:
        """s (N, M) = -||q - k||^2 / tau + b, in float32 (in bfloat16 the expanded square reorders near keys)."""
        q, k = queries.float(), keys.float()
        with torch.autocast(q.device.type, enabled=False):
            d2 = (q.square().sum(-1, keepdim=True) + k.square().sum(-1)[None, :] - 2 * q @ k.T).clamp_min(0)
        return -d2 / self.log_tau.exp() + self.bias

    def memory(self, ctx: Context, hidden: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """(s (N, M), values (M,)) of the N = B * T queries; s is -inf where an entry is not in a query's memory."""
        B, T, _ = hidden.shape
        h = hidden.flatten(0, 1)
        h = h.detach() + STATE_GRAD * (h - h.detach())  # the same values, the gradient scaled
        y = targets.flatten()  # (N, d), (N,)
        row = torch.arange(B, device=h.device).repeat_interleave(T)  # (N,)
        pos = torch.arange(T, device=h.device).repeat(B)
        doc = _position_docs(ctx, B, T, h.device)
        own = (row[:, None] == row[None, :]) & (pos[None, :] < pos[:, None])  # the window's past, j < t
        allowed = own | ((doc[:, None] != doc[None, :]) & (ctx.training and self.config.in_batch))
        keys, values, mask = [h], [y.clamp_min(0)], [allowed & (y != -100)[None, :]]
        for qk, qv, qd in self._queue if self.config.memory_batches else []:
            keys.append(qk)
            values.append(qv)
            mask.append(doc[:, None] != qd[None, :])
        s = self.scores(h, torch.cat(keys)).masked_fill(~torch.cat(mask, 1), float("-inf"))
        return s, torch.cat(values)

    def objective(self, ctx: Context, hidden: Tensor, logits: Tensor, targets: Tensor) -> Tensor | None:
        """The mixture's mean NLL in training (the step's loss); at validation it logs it (and with shuffled values)
        and returns None."""
        s, vals = self.memory(ctx, hidden, targets)
        y = targets.flatten()
        valid = y != -100
        z, s, y = logits.flatten(0, 1).float()[valid], s[valid], y[valid]
        if ctx.training:
            if self.config.memory_batches:
                doc = _position_docs(ctx, *targets.shape, hidden.device)[valid]
                self._queue.append((hidden.flatten(0, 1).detach()[valid], y, doc))
                del self._queue[: -self.config.memory_batches]
            ce = F.cross_entropy(z, y, reduction="none")  # once: the mixture's log Z and the added CE
            z_y = z.gather(1, y[:, None]).squeeze(1)
            loss = _mix(ce + z_y, z_y, s, vals, y).mean()
            if self.config.ce_weight:
                ctx.log("token_memory/loss", loss)
                loss = loss + self.config.ce_weight * ce.mean()
            return loss
        shuffled = vals[torch.randperm(len(vals), generator=torch.Generator().manual_seed(0)).to(vals.device)]
        ctx.log("token_memory/loss", joint_nll(z, y, s, vals).mean())
        ctx.log("token_memory_random/loss", joint_nll(z, y, s, shuffled).mean())
        ctx.log("token_memory/temperature", self.log_tau.detach().exp())
        ctx.log("token_memory/bias", self.bias.detach())
        share = torch.sigmoid(torch.logsumexp(s, -1) - torch.logsumexp(z, -1))  # the memory's share of mass
        ctx.log("token_memory/memory_share", share.mean())
        return None
