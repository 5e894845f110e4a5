"""The LightningModule: cross-entropy plus plugin aux losses, AdamW groups, warmup + cosine schedule."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.utilities import rank_zero_info
from torch import Tensor, nn

from rlm.data.segments import SegmentSource
from rlm.data.windows import HOST, host_copy
from rlm.distributed.parallel import mixed_precision_policy, parallelize, synced_parameters, unshard_root
from rlm.distributed.replicas import SyncedGradients, clip_grad_norm_, mixes_dtensors
from rlm.model.config import ModelConfig
from rlm.model.memory import check_host_build
from rlm.model.transformer import Transformer
from rlm.plugin.base import ParamGroup, Plugin
from rlm.plugin.cache import KVCache
from rlm.plugin.context import Context
from rlm.plugin.registry import plugin_specs, plugins_config
from rlm.train.checkpoint import CheckpointHygiene, config_diff
from rlm.train.compile import CompileConfig, compile_blocks, compile_config
from rlm.train.guard import NonFiniteGuard
from rlm.train.throughput import Throughput

PluginsConfig = plugins_config()  # the type of LMModule's `plugins`, one optional field per registered plugin


@dataclass
class OptimConfig:
    """AdamW and its schedule."""

    lr: float = 3e-3
    """Peak learning rate of the default groups."""
    weight_decay: float = 0.1
    """Decoupled weight decay of matrices (never of norms, biases or embeddings)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    warmup_steps: int = 100
    """Linear warmup steps."""
    min_lr_ratio: float = 0.1
    """The cosine decays to min_lr_ratio * lr at the schedule's last step (total_steps)."""
    total_steps: int | None = None
    """Steps the warmup + cosine spans; past it the rate stays at min_lr_ratio * lr. None: the run's length,
    and on resume the horizon saved with the run."""
    fused: bool | None = None
    """torch's fused AdamW kernel (the same update to rounding). None: fused where torch has the kernel for
    every parameter (floating point, CPU or CUDA)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be positive, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(
                f"optim.total_steps must be >= 1 or null (the run's length), got {self.total_steps}"
            )


def fused_adamw(choice: bool | None, params: list[Tensor]) -> bool:
    """``OptimConfig.fused`` resolved for ``params``: None becomes whether torch's fused AdamW takes them all."""
    if choice is not None:
        return choice
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine down to min_ratio at ``total``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WarmupCosine:
    """:func:`warmup_cosine` as an object, so LambdaLR's state_dict saves its horizon for a resume."""

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        return warmup_cosine(step, self.warmup, self.total, self.min_ratio)


def _no_decay_ids(model: Transformer) -> set[int]:
    """Parameters exempt from weight decay: vectors (norms, biases) and embedding tables (the tied head too)."""
    ids = {id(p) for p in model.parameters() if p.ndim < 2}
    if model.config.tie_embeddings:
        ids.add(id(model.head.weight))
    for module in model.modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag):
            ids.add(id(module.weight))
    return ids


class LMModule(pl.LightningModule):
    """Trains a :class:`~rlm.model.Transformer` (with its plugins) as a causal language model."""

    def __init__(
        self,
        model: ModelConfig | None = None,
        plugins: PluginsConfig | None = None,
        optim: OptimConfig | None = None,
        compile: bool | CompileConfig = False,
        peak_flops: float | None = None,
    ) -> None:
        """Build the model.

        Args:
            model: the transformer's shape; ``vocab_size`` is linked from the data module.
            plugins: the memory plugins by name with their options, e.g. ``--model.plugins.pkm.n_keys 1024``;
                ``null`` in a later config file disables one. ``rlm plugins NAME`` lists a plugin's options.
            optim: optimizer and schedule.
            compile: torch.compile each transformer block after sharding: true for Inductor's defaults, or
                ``{backend, mode}``.
            peak_flops: one device's peak FLOP/s, the denominator of train/mfu; None: a known GPU's dense peak
                in the training precision, or on a CPU a measured fp32 matmul rate.
        """
        super().__init__()
        # Dicts come back from checkpoints' hyper_parameters (load_from_checkpoint).
        model = ModelConfig(**model) if isinstance(model, dict) else (model or ModelConfig())
        optim = OptimConfig(**optim) if isinstance(optim, dict) else (optim or OptimConfig())
        plugins = plugin_specs(plugins)
        self.save_hyperparameters({"model": asdict(model), "plugins": plugins, "optim": asdict(optim)})
        self.model_config, self.optim = model, optim
        check_host_build(model, plugins)  # a clear error, not the OOM killer mid-init
        self.model = Transformer(model, plugins)
        self.compile_config = compile_config(compile)  # applied in configure_model; not a hyperparameter
        self.peak_flops = peak_flops

    # ----- forward -----

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Lightning's move to the device, keeping the host copies of the fields plugins read on the host as
        batch["host"]: reading them back from a GPU would be a sync every step."""
        if not isinstance(batch, dict):
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        host = host_copy(batch)
        rest = {name: x for name, x in batch.items() if name != HOST}
        moved = super().transfer_batch_to_device(rest, device, dataloader_idx)
        return {**moved, HOST: host} if host else moved

    def make_context(
        self,
        batch: dict[str, Any],
        stage: str,
        variant: str | None = None,
        segments: Any = None,
        cache: KVCache | None = None,
    ) -> Context:
        """The per-step context for a batch, filled by every plugin's ``prepare``. ``segments``: the table the
        segment ids index (default: the attached data module's); with ``cache`` the tokens continue the cached
        ones (ctx.offset = its length)."""
        if segments is None and batch.get("segment_ids") is not None:
            dm = self._trainer.datamodule if self._trainer is not None else None
            segments = dm.segments if isinstance(dm, SegmentSource) else None
        # the next batch's maker of rlm.data.TrainLoader (None under another loader)
        loader = self._trainer.train_dataloader if self._trainer is not None and stage == "train" else None
        ctx = Context(
            tokens=batch["tokens"],
            mask=batch.get("mask"),
            stage=stage,
            segment_ids=batch.get("segment_ids"),
            doc_ids=batch.get("doc_ids"),
            segments=segments,
            variant=variant,
            offset=cache.length if cache is not None else 0,
            cache=cache,
            upcoming=getattr(loader, "upcoming", None),
        )
        unshard_root(self.model)  # under FSDP, prepare may run model modules (see rlm.distributed.parallel)
        for plugin in self.model.plugins.values():
            plugin.prepare(ctx, batch)
        return ctx

    def forward(self, tokens: Tensor, ctx: Context | None = None) -> Tensor:
        return self.model(tokens, ctx)

    def _loss(
        self, batch: dict[str, Any], stage: str, variant: str | None = None
    ) -> tuple[Tensor, Tensor, Context, Tensor]:
        ctx = self.make_context(batch, stage, variant)
        targets = batch["targets"]
        # A tensor on the batch's device, not a Python int: int() would be a host sync in every training step.
        n_tokens = (targets != -100).sum()
        plugins = self.model.plugins.values()
        if stage == "train" and not any(type(p).objective is not Plugin.objective for p in plugins):
            # the head and its loss in row chunks: no (B, T, V) float32 logits (rlm.model.loss)
            lm = self.model(batch["tokens"], ctx, targets=targets)
            aux = ctx.total_aux_loss()
            return lm, (lm if aux is None else lm + aux), ctx, n_tokens
        logits = self.model(batch["tokens"], ctx)  # (B, T, V)
        if ctx.loss_groups and stage != "train":  # per-token losses for val/loss_by/<group>
            token_loss = F.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="none"
            ).view_as(targets)  # (B, T), 0 at ignored targets
            ctx.extras["lm/token_loss"] = token_loss.detach()
        lm = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        loss, owner = lm, None
        # A plugin's objective replaces the cross-entropy in training (Plugin.objective); one plugin at most.
        for name, plugin in self.model.plugins.items():
            objective = plugin.objective(ctx, ctx.hidden, logits, targets)
            if objective is not None and stage == "train":
                if owner is not None:
                    raise ValueError(
                        f"plugins {owner!r} and {name!r} both replace the training loss; use one"
                    )
                loss, owner = objective, name
        aux = ctx.total_aux_loss()
        return lm, (loss if aux is None else loss + aux), ctx, n_tokens

    def _log_context(self, ctx: Context, stage: str, on_step: bool) -> None:
        aux = {f"aux/{name}": value.detach().float() for name, (value, _) in ctx.aux_losses.items()}
        for name, value in (aux | ctx.metrics).items():
            self.log(f"{stage}/{name}", value, on_step=on_step, on_epoch=not on_step, sync_dist=not on_step)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        lm, loss, ctx, n_tokens = self._loss(batch, "train")
        self.log("train/loss", lm)
        # The progress bar reads its values at every refresh, a host sync on a GPU: it gets the loss only at the
        # steps the loggers read it anyway.
        if self._trainer is not None and self.trainer._logger_connector.should_update_logs:
            self.log("loss", lm, prog_bar=True, logger=False)
        self.log("train/ppl", torch.exp(lm.detach().clamp(max=20)))
        if ctx.aux_losses or loss is not lm:
            self.log("train/total_loss", loss)
        self._log_context(ctx, "train", on_step=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self._val_count = torch.zeros((), device=self.device, dtype=torch.float64)
        self._eval_sums: dict[str, Tensor] = {}  # 'loss_by/<group>' and '<variant>/loss' -> (sum, count)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        return self._eval_step(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        return self._eval_step(batch, "test")

    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    def _eval_step(self, batch: dict[str, Any], stage: str) -> Tensor:
        lm, _, ctx, n_tokens = self._loss(batch, stage)
        # Token-weighted sums so the epoch loss is the mean over tokens, not over (unequal) batches.
        self._val_sum += lm.detach().double() * n_tokens
        self._val_count += n_tokens
        self._log_context(ctx, stage, on_step=False)
        token_loss = ctx.extras.get("lm/token_loss")
        for name, group in ctx.loss_groups.items():
            real = group & (batch["targets"] != -100)  # (B, T)
            self._eval_add(f"loss_by/{name}", token_loss[real].double().sum(), real.sum())
        for plugin in self.model.plugins.values():
            for variant in plugin.eval_variants():
                other, _, _, _ = self._loss(batch, stage, variant)
                self._eval_add(f"{variant}/loss", other.detach().double() * n_tokens, n_tokens)
        return lm

    def _eval_add(self, name: str, total: Tensor, count: Tensor | int) -> None:
        """Add a token-weighted sum and its token count under ``name``, reduced at epoch end."""
        acc = self._eval_sums.setdefault(name, torch.zeros(2, device=self.device, dtype=torch.float64))
        acc[0] += total
        acc[1] += count

    def _eval_epoch_end(self, stage: str) -> None:
        total = self.trainer.strategy.reduce(self._val_sum.clone(), reduce_op="sum")
        count = self.trainer.strategy.reduce(self._val_count.clone(), reduce_op="sum")
        if float(count) == 0:
            return
        loss = (total / count).float()
        self.log(f"{stage}/loss", loss, prog_bar=True, rank_zero_only=True)
        self.log(f"{stage}/ppl", torch.exp(loss.clamp(max=20)), rank_zero_only=True)
        for name in sorted(self._eval_sums):  # the same names on every rank (see Context.loss_groups)
            acc = self.trainer.strategy.reduce(self._eval_sums[name].clone(), reduce_op="sum")
            if float(acc[1]) > 0:
                self.log(f"{stage}/{name}", (acc[0] / acc[1]).float(), rank_zero_only=True)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def configure_model(self) -> None:
        """FSDP2-shard the model when the strategy gives a device mesh (ModelParallelStrategy; parameters
        gathered in bf16 under bf16-mixed), then compile each block with ``compile``, on every strategy."""
        if self.device_mesh is not None:
            policy = mixed_precision_policy(self.trainer.precision)
            parallelize(self.model, self.device_mesh, mp_policy=policy)
        if self.compile_config is not None:
            compile_blocks(self.model, self.compile_config)

    # ----- optimisation -----

    def parameter_groups(self) -> list[dict[str, Any]]:
        """AdamW groups: the plugins', then decayed and non-decayed ones, then the synced parameters in groups of
        their own (plain tensors among FSDP2's DTensors, which foreach and fused kernels refuse in one group), on
        every strategy so one optimizer state fits one process, DDP and FSDP2 alike."""
        groups: list[dict[str, Any]] = []
        taken: set[int] = set()
        # asked first: a plugin may settle what it syncs here (PKM resolves its value path)
        asked = [(label, g) for label, plugin in self.model.plugins.items() for g in plugin.param_groups()]
        synced = {id(p) for p in synced_parameters(self.model)}
        for label, g in asked:
            if not isinstance(g, ParamGroup):
                raise TypeError(
                    f"plugin {label!r} returned {type(g).__name__} from param_groups(); expected ParamGroup"
                )
            if len({id(p) in synced for p in g.params}) > 1:
                raise ValueError(
                    f"plugin {label!r}'s parameter group {g.name!r} mixes synced_parameters() with others; "
                    "expected a group of synced parameters only or of none (FSDP2 shards only the others)"
                )
            params = [p for p in g.params if p.requires_grad and id(p) not in taken]
            taken |= {id(p) for p in params}
            group = {"name": g.name, "params": params, "schedule": g.schedule}
            for key in ("lr", "weight_decay"):
                if getattr(g, key) is not None:
                    group[key] = getattr(g, key)
            groups.append(group)
        no_decay = _no_decay_ids(self.model)
        rest: dict[tuple[bool, bool], list[nn.Parameter]] = {
            (s, d): [] for s in (False, True) for d in (True, False)
        }
        for p in self.model.parameters():  # each shared parameter once
            if p.requires_grad and id(p) not in taken:
                rest[(id(p) in synced, id(p) not in no_decay)].append(p)
        for (is_synced, decays), params in rest.items():
            name = ("decay" if decays else "no_decay") + ("/synced" if is_synced else "")
            decay = self.optim.weight_decay if decays else 0.0
            groups.append({"name": name, "params": params, "weight_decay": decay, "schedule": True})
        return [g for g in groups if g["params"]]

    def configure_gradient_clipping(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's clipping, also for fused AdamW (which Lightning refuses: unscale here where a scaler is
        on, so GradScaler.step passes no scale) and for FSDP2's DTensor gradients beside plain ones (one global
        norm, which torch's ``clip_grad_norm_`` refuses)."""
        if not gradient_clip_val:
            return
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if fused and scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if gradient_clip_algorithm in (None, "norm") and mixes_dtensors(params):
            clip_grad_norm_(params, float(gradient_clip_val))
        elif fused:
            # the base class's clipping: MixedPrecision's only adds the refusal
            Precision.clip_gradients(
                self.trainer.precision_plugin, optimizer, gradient_clip_val, gradient_clip_algorithm or "norm"
            )
        else:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> dict[str, Any]:
        o = self.optim
        groups = self.parameter_groups()
        schedules = [g.pop("schedule") for g in groups]
        fused = fused_adamw(o.fused, [p for g in groups for p in g["params"]])
        optimizer = torch.optim.AdamW(
            groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=fused
        )
        total = o.total_steps or self._run_length()
        lambdas = [
            WarmupCosine(o.warmup_steps, total, o.min_lr_ratio) if sched else (lambda s: 1.0)
            for sched in schedules
        ]
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _run_length(self) -> int:
        """Optimizer steps this run goes to (the trainer's max_steps, or what max_epochs comes to); 1 unattached."""
        if self._trainer is None:
            return 1
        steps = self.trainer.estimated_stepping_batches
        return max(1, int(steps)) if math.isfinite(steps) else 1

    def _schedules(self) -> tuple[Any, list[WarmupCosine]]:
        """The LambdaLR of configure_optimizers and its warmup + cosine lambdas (None, [] before it ran)."""
        scheduler = self.lr_schedulers() if self._trainer is not None else None
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            return None, []
        return scheduler, [f for f in scheduler.lr_lambdas if isinstance(f, WarmupCosine)]

    @property
    def lr_horizon(self) -> int | None:
        """The step the warmup + cosine ends at (past it the rate stays at min_lr_ratio * lr); None before fit."""
        cosines = self._schedules()[1]
        return cosines[0].total if cosines else None

    def on_train_start(self) -> None:
        # A resumed run has its scheduler's state, the saved horizon included, back by now. optim.total_steps,
        # when set, is a new horizon; else running past the saved one is said once.
        scheduler, cosines = self._schedules()
        if not cosines:
            return
        asked = self.optim.total_steps
        if asked is not None and cosines[0].total != asked:
            for f in cosines:
                f.total = asked
            step = scheduler.last_epoch  # the rate of the coming step, on the new horizon
            for group, base, f in zip(
                scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas
            ):
                group["lr"] = base * f(step)
        horizon, end = cosines[0].total, self._run_length()
        if self.trainer.global_step > 0 and end > horizon:
            rank_zero_info(
                f"rlm fit: the learning-rate schedule ends at step {horizon} and this run goes on to step {end}: "
                f"from step {horizon} the rate stays at its floor, min_lr_ratio * lr = "
                f"{cosines[0].min_ratio * self.optim.lr:.3g}; --model.optim.total_steps N lays the warmup + "
                "cosine out over N steps instead"
            )

    def configure_callbacks(self) -> list[pl.Callback]:
        # synced gradients averaged (FSDP2 only) before the guard reads them; stop at NaN; crash-safe checkpoints
        core = [SyncedGradients(), NonFiniteGuard(), CheckpointHygiene()]
        plugin_callbacks = [cb for plugin in self.model.plugins.values() for cb in plugin.callbacks()]
        return [*core, Throughput(self.peak_flops), *plugin_callbacks]

    def setup(self, stage: str) -> None:
        # A sequence for Lightning's model summary to count FLOPs on; not with compiled blocks, which its batch
        # of 1 would compile for a second shape.
        if self.compile_config is not None:
            return
        seq_len = getattr(self.trainer.datamodule, "seq_len", None) if self._trainer is not None else None
        T = min(seq_len or self.model_config.max_seq_len, self.model_config.max_seq_len)
        self.example_input_array = torch.zeros(1, T, dtype=torch.long)

    # ----- checkpoints -----

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint written under another model or plugin config, naming what differs."""
        diffs = config_diff(checkpoint.get("hyper_parameters", {}), dict(self.hparams))
        if diffs:
            raise ValueError("checkpoint was written by a different config:\n  " + "\n  ".join(diffs))
