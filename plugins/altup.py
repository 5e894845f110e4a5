"""Alternating Updates (Baykal et al., 'Alternating Updates for Efficient Transformers', NeurIPS 2023).

The token representation is widened to K blocks of width d; each width-d transformer block computes one
selected block j* per layer (Algorithm 1):

    predict:  x_hat^i = sum_j p_ij x^j                         (K*K trainable scalars, init identity)
    compute:  x_tilde = L(x_hat^{j*})                          (the unchanged width-d block)
    correct:  x_new^i = x_hat^i + g_i (x_tilde - x_hat^{j*})   (K trainable scalars, init 1)

With p = identity and g = 1 Recycled-AltUp starts as the base model; K=1 is the base model. Block 0 is the
model's own embedding. router=True (as in Gemma 3n): p(x) = P + tanh(W_p rms(x^{j*})), g = G + tanh(W_g
rms(x_tilde)), W zero-initialised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlm.model.config import ModelConfig
from rlm.model.memory import Parts
from rlm.plugin import Claim, Context, Mode, ParamGroup, Plugin, Slot


@dataclass
class AltUpConfig:
    """Options of Alternating Updates and its variants."""

    k: int = 2
    """Number of width-d blocks of the widened representation (K; 1 gives back the base model)."""
    embedding: Literal["wide", "recycled", "project"] = "wide"
    """'wide': an extra (V, (K-1)*d) table (AltUp); 'recycled': the embedding replicated K times; 'project': an
    extra (V, extra_width) table in K-1 pieces, each projected to d."""
    extra_width: int | None = None
    """Width e >= K-1 of the extra embedding for embedding='project'."""
    update: Literal["altup", "sum"] = "altup"
    """'altup' (predict / compute / correct) or 'sum' (Table 1 baseline: the extra embedding added to the token
    embedding, the stack unchanged)."""
    selection: Literal["alternating", "same"] = "alternating"
    """Which block layer l computes: 'alternating' (j* = l mod K) or 'same' (always block 0, SameUp)."""
    reduce: Literal["mean", "first", "project"] = "mean"
    """How the K blocks become width d before the final norm and head: 'mean', 'first' or 'project'."""
    router: bool = False
    """Input-dependent coefficients (a zero-initialised router adds tanh(W rms(x)) to p and g)."""
    init_std: float | None = None
    """Initial std of the extra embedding table; None means the model's init_std."""

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"altup.k must be a positive integer (1 is the base model), got {self.k!r}")
        if self.embedding == "project":
            if not isinstance(self.extra_width, int) or self.extra_width < max(self.k - 1, 1):
                raise ValueError(
                    f"altup.extra_width must be an integer >= k-1={self.k - 1} (and >= 1) with "
                    f"embedding='project', got {self.extra_width!r}"
                )
        elif self.extra_width is not None:
            raise ValueError(f"altup.extra_width={self.extra_width} is only used with embedding='project'")
        if self.update == "sum":
            if self.embedding == "recycled":
                raise ValueError("altup.update='sum' needs an extra embedding: 'wide' or 'project'")
            if self.k < 2:
                raise ValueError(f"altup.update='sum' needs k >= 2 (an extra embedding to add), got {self.k}")
        if self.init_std is not None and self.init_std < 0:
            raise ValueError(f"altup.init_std must be >= 0 or null, got {self.init_std}")

    def memory(self, mc: ModelConfig, parts: Parts) -> None:
        """Parameters and the K blocks' saved bytes (rlm.model.memory)."""
        d, k, L = mc.d_model, self.k, mc.n_layers
        params = L * k * k + L * k  # p (L, K, K), g (L, K)
        if self.embedding != "recycled" and k > 1:
            width = self.extra_width if self.extra_width is not None else (k - 1) * d
            params += mc.vocab_size * width
            if self.extra_width is not None:
                params += (k - 1) * math.ceil(self.extra_width / (k - 1)) * d
        if self.router:
            params += L * (k * k + k) * d
        if self.reduce == "project":
            params += k * d * d
        parts.params += params
        # Each layer's fp32 predict and correct over the K blocks (4 K d) and the computed block's input (4d).
        parts.act_per_token += L * (4 * k + 4) * d


class ExtraEmbedding(nn.Module):
    """The K-1 extra blocks of the widened embedding, read from ``ctx.tokens``: (K-1, B, T, d)."""

    def __init__(self, vocab: int, d: int, k: int, extra_width: int | None, init_std: float) -> None:
        super().__init__()
        self.k, self.d = k, d
        width = extra_width if extra_width is not None else (k - 1) * d
        self.table = nn.Embedding(vocab, width)
        nn.init.normal_(self.table.weight, 0.0, init_std)
        self.pieces: list[int] = []
        self.proj: nn.Parameter | None = None
        if extra_width is not None:
            # K-1 pieces as even as possible, piece c projected by its own (w_c, d) map, stored as one
            # (K-1, w_max, d) tensor whose rows past w_c stay zero.
            base, rem = divmod(extra_width, k - 1)
            self.pieces = [base + (c < rem) for c in range(k - 1)]
            proj = torch.zeros(k - 1, self.pieces[0], d)
            for c, w in enumerate(self.pieces):
                nn.init.normal_(proj[c, :w], 0.0, w**-0.5)  # keeps each coordinate's scale (std init_std)
            self.proj = nn.Parameter(proj)

    def forward(self, tokens: Tensor) -> Tensor:
        e = self.table(tokens)  # (B, T, width)
        B, T, _ = e.shape
        if self.proj is None:
            return e.view(B, T, self.k - 1, self.d).permute(2, 0, 1, 3)  # (K-1, B, T, d)
        w_max = self.pieces[0]
        pieces = [F.pad(piece, (0, w_max - piece.shape[-1])) for piece in e.split(self.pieces, dim=-1)]
        return torch.einsum("cbtw,cwd->cbtd", torch.stack(pieces), self.proj.to(e.dtype))  # (K-1, B, T, d)


class Router(nn.Module):
    """Input-dependent offsets of the coefficients: tanh(W rms(x)) with W zero-initialised (offset 0 at init)."""

    def __init__(self, d: int, n_layers: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_layers, outputs, d))

    def forward(self, x: Tensor, layer: int) -> Tensor:
        return torch.tanh(F.linear(F.rms_norm(x, (x.shape[-1],)), self.weight[layer]))  # (B, T, outputs)


class AltUpStack(nn.Module):
    """The stack slot under AltUp: widen, predict / compute / correct around every block, reduce."""

    def __init__(self, blocks: nn.ModuleList, cfg: AltUpConfig, vocab: int, d: int, init_std: float) -> None:
        super().__init__()
        # The same ModuleList as the plain stack, so parameter names (stack.blocks.i...) match the base model.
        self.blocks = blocks
        self.k, self.d, self.cfg = cfg.k, d, cfg
        n = len(blocks)
        self.selected = [(layer % cfg.k) if cfg.selection == "alternating" else 0 for layer in range(n)]
        self.p = nn.Parameter(torch.eye(cfg.k).repeat(n, 1, 1))  # (L, K, K), predict, init identity
        self.g = nn.Parameter(torch.ones(n, cfg.k))  # (L, K), correct, init 1
        self.extra = (
            ExtraEmbedding(vocab, d, cfg.k, cfg.extra_width, init_std)
            if cfg.embedding != "recycled" and cfg.k > 1
            else None
        )
        self.p_router = Router(d, n, cfg.k * cfg.k) if cfg.router else None
        self.g_router = Router(d, n, cfg.k) if cfg.router else None
        self.out_proj = None
        if cfg.reduce == "project":
            self.out_proj = nn.Parameter(torch.eye(d).repeat(cfg.k, 1, 1) / cfg.k)  # (K, d, d), init = mean

    def predict(self, xs: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """x_hat^{j*} = sum_j p_{j*j} x^j (B, T, d), and p (K, K), or (B, T, K, K) with a router."""
        j = self.selected[layer]
        p = self.p[layer].to(xs.dtype)  # (K, K)
        if self.p_router is None:
            return (p[j] @ xs.reshape(self.k, -1)).view(xs.shape[1:]), p
        p = p + self.p_router(xs[j], layer).unflatten(-1, (self.k, self.k)).to(xs.dtype)  # (B, T, K, K)
        return torch.einsum("btj,jbtd->btd", p[..., j, :], xs), p

    def correct(self, xs: Tensor, p: Tensor, x_tilde: Tensor, layer: int) -> Tensor:
        """The K corrected blocks (K, B, T, d), predict and correct fused with no (K, B, T, d) temporaries:
        x_new^i = sum_k (p_ik - g_i p_{j*k}) x^k + g_i x_tilde, a (K, K) matmul plus a rank-1 update."""
        j = self.selected[layer]
        g = self.g[layer].to(xs.dtype)  # (K,)
        if self.g_router is None:
            m = p - torch.outer(g, p[j])  # (K, K)
            return (m @ xs.reshape(self.k, -1)).addr_(g, x_tilde.reshape(-1)).view(xs.shape)
        g = g + self.g_router(x_tilde, layer).to(xs.dtype)  # (B, T, K)
        m = p - g[..., :, None] * p[..., j, None, :]  # (B, T, K, K)
        return torch.einsum("btik,kbtd->ibtd", m, xs) + g.permute(2, 0, 1)[..., None] * x_tilde

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        # Predict and correct run outside autocast: bf16 matmuls would round the K-block residual stream.
        exact = torch.autocast(x.device.type, enabled=False)
        with exact:
            if self.extra is None:  # Recycled-AltUp: the embedding replicated
                xs = x.unsqueeze(0).expand(self.k, *x.shape).contiguous()  # (K, B, T, d)
            else:
                xs = torch.cat((x.unsqueeze(0), self.extra(ctx.tokens).to(x.dtype)), dim=0)
        for layer, block in enumerate(self.blocks):
            with exact:
                x_sel, p = self.predict(xs, layer)  # (B, T, d)
            x_tilde = block(x_sel, ctx)  # (B, T, d), the only width-d layer call
            with exact:
                xs = self.correct(xs, p, x_tilde, layer)
        with exact:
            # How far the static coefficients moved from their initialisation (p = identity, g = 1).
            eye = torch.eye(self.k, device=self.p.device)
            ctx.log("altup_p_drift", (self.p.detach() - eye).abs().mean())
            ctx.log("altup_g_mean", self.g.detach().mean())
            if self.cfg.reduce == "first":  # the K blocks as one width-d representation (B, T, d)
                return xs[0]
            if self.cfg.reduce == "mean":
                return xs.mean(0)
            return torch.einsum("kbtd,kde->bte", xs, self.out_proj.to(xs.dtype))


class SumEmbedding(nn.Module):
    """Table 1's 'sum' baseline: the extra embedding blocks summed, added to the token embedding (B, T, d)."""

    def __init__(self, extra: ExtraEmbedding) -> None:
        super().__init__()
        self.extra = extra

    def forward(self, tokens: Tensor, ctx: Context) -> Tensor:
        return self.extra(tokens).sum(0)


class AltUpPlugin(Plugin):
    """Alternating Updates: a K*d representation computed by width-d blocks (wraps the stack slot)."""

    name = "altup"
    Config = AltUpConfig
    order = 200  # wraps the stack after the plugins that fill slots inside the blocks

    def __init__(self, config: AltUpConfig, model_config) -> None:
        super().__init__(config, model_config)
        c = model_config
        self.init_std = c.init_std if config.init_std is None else config.init_std
        # The built module, a plain attribute, not a submodule: the state dict holds its parameters once.
        object.__setattr__(self, "module", None)

    def claims(self) -> list[Claim]:
        if self.config.update == "sum":
            return [Claim(Slot.EMBED, Mode.ADD)]
        return [Claim(Slot.STACK, Mode.WRAP)]

    def build(self, claim: Claim, layer: int | None, current: nn.Module | None) -> nn.Module:
        c, cfg = self.model_config, self.config
        if cfg.update == "sum":
            extra = ExtraEmbedding(c.vocab_size, c.d_model, cfg.k, cfg.extra_width, self.init_std)
            module: nn.Module = SumEmbedding(extra)
        else:
            blocks = getattr(current, "blocks", None)
            if not isinstance(blocks, nn.ModuleList):
                raise ValueError(
                    f"plugin {self.label!r} wraps the plain stack of blocks, but the stack slot holds "
                    f"{type(current).__name__}; only one plugin may wrap the stack"
                )
            module = AltUpStack(blocks, cfg, c.vocab_size, c.d_model, self.init_std)
        object.__setattr__(self, "module", module)
        return module

    def param_groups(self) -> list[ParamGroup]:
        # Decay would pull p towards 0, not the identity, and shrink the extra table.
        m = self.module
        if m is None:
            return []
        no_decay = [] if isinstance(m, SumEmbedding) else [m.p, m.g]
        if m.extra is not None:
            no_decay.append(m.extra.table.weight)
        return [ParamGroup("altup_no_decay", no_decay, weight_decay=0.0)] if no_decay else []

    def inactive_parameters(self) -> int:
        # A token reads one row of the extra table.
        extra = getattr(self.module, "extra", None)
        if extra is None:
            return 0
        vocab, width = extra.table.weight.shape
        return (vocab - 1) * width
