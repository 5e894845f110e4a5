"""The LM head and its cross-entropy in one pass over row chunks, without the (N, V) float32 logits: each chunk
makes its logits, loss and gradients (d logits = softmax - onehot) at once, and only the gradients of the hidden
states (N, d) and of the head (V, d) are kept, for backward to scale. Matmuls run in the autocast dtype and the
softmax in float32, as on the plain path.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ROWS = 4096  # (4096, 50304) float32 logits are 0.8 GB; fewer rows would leave the GEMMs small


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, vocab: int, chunk: int) -> Tensor:
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        w = weight[:vocab].to(dtype)  # (V, d): a padded head's extra rows take no part
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(device, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                h = hidden[start : start + chunk].to(dtype)  # (n, d)
                t = targets[start : start + chunk]  # (n,)
                valid = t != -100
                t = t.clamp(min=0)
                logits = h @ w.T  # (n, V), rounded to the compute dtype first, as on the plain path
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                lse = logits.logsumexp(-1)  # (n,)
                picked = logits.gather(1, t[:, None]).squeeze(1)
                total += ((lse - picked) * valid).sum()
                if grad_h is None and grad_w is None:
                    continue
                g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                g[torch.arange(len(t), device=g.device), t] -= 1
                g = (g * valid[:, None]).to(dtype)  # (n, V): d loss_sum / d logits
                if grad_h is not None:
                    grad_h[start : start + chunk] = g @ w
                if grad_w is not None:
                    grad_w[:vocab] += (g.T @ h).float()
        count = (targets != -100).sum()
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_out / count
        dh = grad_h * scale.to(grad_h.dtype) if grad_h is not None else None
        dw = (grad_w * scale).to(ctx.weight_dtype) if grad_w is not None else None
        return dh, dw, None, None, None


def head_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, vocab: int, chunk: int = CHUNK_ROWS
) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight[:vocab].T`` against ``targets`` (-100 ignored), as
    ``F.cross_entropy(logits.float(), targets, ignore_index=-100)``; hidden (..., d), targets (...)."""
    return _HeadCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(), vocab, chunk)
