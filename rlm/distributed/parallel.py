"""Parallelism applied from outside the model (torchtitan's habit): FSDP2 sharding, and plain copies of sharded parts.

The model and plugin code stay single-device. ``parallelize`` shards a built :class:`~rlm.model.Transformer`
with ``torch.distributed.fsdp.fully_shard``: each block is one unit (its parameters are all-gathered just before
its forward and freed after it), and the root unit holds what is left (the embedding, tied to the head, the final
norm, and the parameters plugins own at the top: PKM value tables, a separate retrieval encoder, AltUp's tables).
Gradients are reduce-scattered, so every rank ends a step with its shard of the averaged gradient, as DDP would
with the full one.

Parameters a plugin updates itself stay out of the sharding (``Plugin.replicated_parameters``, handed to every
``fully_shard`` call as ``ignored_params``): whole on every rank, never all-gathered, their gradients never reduced.
So do small parameters the main optimizer trains whose gather would cost more than an all-reduce
(``Plugin.synced_parameters``: PKM's sub-keys); rlm averages their gradients itself (replicas.py here).
PKM's value tables are such under ``sparse: auto``: its row-wise lazy Adam exchanges the rows a step touched and
updates them on every rank, as under DDP, instead of a dense (slots, d) gradient reduce-scattered and an Adam over
every row of the shards (with ``sparse: false`` they are sharded like any other parameter).
"""

from __future__ import annotations

import copy
import inspect
import types
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

# Lightning's ModelParallelStrategy names its 2-D mesh (data_parallel, tensor_parallel); rlm has no tensor
# parallelism, so both dimensions serve FSDP (see fsdp_mesh).
DP, TP = "data_parallel", "tensor_parallel"


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: a 1-D mesh of every rank, or (nodes, devices) for HSDP.

    ModelParallelStrategy's default mesh is (data_parallel=nodes, tensor_parallel=devices per node). Without tensor
    parallelism, a size-1 dimension is dropped (one node: plain FSDP over its devices) and a 2-D mesh is used as
    HSDP: parameters sharded within a node, replicated across nodes (the all-gathers stay on the fast links)."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names or ()
    if mesh.ndim != 2 or tuple(names) != (DP, TP):
        raise ValueError(
            f"rlm shards over a 1-D mesh or a ({DP}, {TP}) mesh, got dims {names} of {mesh.shape}"
        )
    dp, tp = mesh.shape
    if dp == 1:
        return mesh[TP]
    if tp == 1:
        return mesh[DP]
    return mesh


def mixed_precision_policy(precision: Any) -> MixedPrecisionPolicy | None:
    """FSDP2's mixed precision for the trainer's ``precision``: under 'bf16-mixed', parameters all-gathered in
    bf16 and gradients reduce-scattered in fp32 (torchtitan's default); else None (FSDP moves the parameters'
    own dtype).

    Lightning's bf16-mixed is autocast alone, so without a policy FSDP2 all-gathers fp32 parameters (twice a
    bf16 gather's bytes, in the forward and again in the backward) for matmuls that autocast runs in bf16
    anyway. Block inputs are not cast (``cast_forward_inputs=False``), and :func:`parallelize` gathers the root
    (the embedding) and modules marked ``keep_fp32_params`` in fp32: the residual stream stays fp32 as under
    autocast alone, and autocast still picks each op's dtype (norms and softmax in fp32, matmuls in bf16); what
    changes is that the blocks' weights reach the ops already rounded to bf16.
    """
    if str(precision) in ("bf16-mixed", "bf16"):
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    return None


CAN_REPLICATE = "ignored_params" in inspect.signature(fully_shard).parameters
"""Whether this torch's ``fully_shard`` can leave parameters out (``ignored_params``, torch >= 2.7)."""


def replicated_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters the plugins in ``model`` keep whole on every rank (``Plugin.replicated_parameters``)."""
    from rlm.plugin import Plugin

    return {p for m in model.modules() if isinstance(m, Plugin) for p in m.replicated_parameters()}


def synced_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the plugins in ``model`` keep whole on every rank for the main optimizer to train, their
    gradients averaged by rlm (``Plugin.synced_parameters``; replicas.py here), in the same order on every rank
    (the plugins' module order, then each plugin's)."""
    from rlm.plugin import Plugin

    found = [p for m in model.modules() if isinstance(m, Plugin) for p in m.synced_parameters()]
    return list({id(p): p for p in found}.values())


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Shard ``model`` (a Transformer) in place with FSDP2: every block, then the root. A mesh of one rank and an
    already sharded model are left as they are (nothing to shard; ``configure_model`` may be called twice).
    ``mp_policy``: see :func:`mixed_precision_policy`; None keeps the parameters' dtype. The plugins'
    :func:`replicated_parameters` stay plain tensors where they are (Lightning's ``model_to_device`` moves them
    with the rest of what is left on the CPU)."""
    if isinstance(model, FSDPModule) or mesh.size() == 1:
        return model
    mesh = fsdp_mesh(mesh)
    # what a plugin keeps whole on every rank stays out of every unit (a block's, a memory layer's, the root's)
    ignored = _ignored(model)
    mp = root_mp = {} if mp_policy is None else {"mp_policy": mp_policy}
    if mp_policy is not None and mp_policy.param_dtype not in (None, torch.float32):
        fp32 = MixedPrecisionPolicy(reduce_dtype=mp_policy.reduce_dtype, cast_forward_inputs=False)
        # Modules that must see fp32 weights under a low-precision policy (PKM's layers: keep_fp32_params)
        # become units of their own before their blocks, gathered in fp32 (their inputs not cast either).
        for module in model.modules():
            if getattr(module, "keep_fp32_params", False):
                fully_shard(
                    module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=fp32, **ignored
                )
        # The root (embedding and tied head, final norm, plugins' top-level parameters) gathered in fp32: a bf16
        # embedding would make the residual stream bf16 from the first block on, where autocast alone (DDP, one
        # process) keeps it fp32; the head's matmul still runs in bf16 under autocast.
        root_mp = {"mp_policy": fp32}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **mp, **ignored)
    # the root's parameters are all-gathered at its forward and stay so until its backward (FSDP2's root rule)
    fully_shard(model, mesh=mesh, **root_mp, **ignored)
    return model


def _ignored(model: nn.Module) -> dict[str, Any]:
    """``fully_shard``'s keyword for the plugins' replicated and synced parameters: {} when there are none."""
    ignored = replicated_parameters(model) | set(synced_parameters(model))
    if not ignored:
        return {}
    if not CAN_REPLICATE:
        raise ValueError(
            f"a plugin keeps {len(ignored)} parameter(s) whole on every rank (PKM's values and sub-keys with "
            "pkm.sparse), which "
            f"needs fully_shard(ignored_params=), torch >= 2.7; this is torch {torch.__version__}: upgrade torch, "
            "or set pkm.sparse: false (dense value gradients that FSDP reduces)"
        )
    return {"ignored_params": ignored}


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit."""
    return isinstance(module, FSDPModule)


def unshard_root(module: nn.Module) -> None:
    """All-gather the root unit's parameters now (a no-op unless ``module`` is an FSDP unit).

    Plugins' ``prepare`` may run model modules before the forward (retrieval embeds its online queries with the
    LM's own embedding); under FSDP those parameters must be gathered first. The forward would do this very
    all-gather a moment later, and finds it done, so it costs nothing extra; FSDP frees them after the backward.
    FSDP2 marks as root the first unit whose forward runs: its lazy init is done here, so that a block run by a
    plugin before the model's forward (the shared encoder's) does not claim to be a root (FSDP then refuses the
    real root's forward). The public ``unshard`` does not do it (it lazy-inits the parameter groups only), so
    :func:`_lazy_init_root` makes the private call, which is idempotent."""
    if isinstance(module, FSDPModule):
        _lazy_init_root(module)
        module.unshard()


def _lazy_init_root(module: FSDPModule) -> None:
    """FSDP2's lazy init with ``module`` as the root: ``module._get_fsdp_state()._lazy_init()``, private in torch
    2.6 to 2.13 (read in their sources; the one public way to it is ``module``'s own forward). A torch without
    it is named in a RuntimeError here rather than failing later as FSDP's 'requires running forward through the
    root module first' from inside a plugin."""
    get_state = getattr(module, "_get_fsdp_state", None)
    lazy_init = getattr(get_state(), "_lazy_init", None) if callable(get_state) else None
    if not callable(lazy_init):
        raise RuntimeError(
            f"torch {torch.__version__}: FSDPModule._get_fsdp_state()._lazy_init() is gone. rlm calls this private "
            "method (present in torch 2.6 to 2.13) so that the model, not a block a plugin runs before the "
            "model's forward (retrieval's shared encoder), becomes FSDP2's root unit. Use a torch from 2.6 to "
            "2.13, or port rlm.distributed.parallel.unshard_root to this torch's way of fixing the root"
        )
    lazy_init()


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor of a sharded DTensor (an all-gather: every rank must call it), else ``t`` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


# Per-module hook tables FSDP fills (its unshard / reshard / reduce-scatter hooks): a plain copy starts them empty.
_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


# Attributes fully_shard sets on a unit: its state (under torch's composable-API keys) and flags for Dynamo.
_FSDP_STATE = ("__composable_api_state_key", "_fsdp", "_is_fsdp_managed_module")


def _plain_module(module: nn.Module) -> nn.Module:
    """An empty instance of an FSDP unit's own class (its ``__dict__`` is filled by :func:`plain_copy`)."""
    cls = next(c for c in type(module).__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))
    return cls.__new__(cls)


def _unit_state(unit: nn.Module) -> dict[str, Any]:
    """What deepcopy would copy of a unit (``Module.__getstate__``: its ``__dict__`` less a ``compile()``-d call,
    which runs the original module) less FSDP's state."""
    return {k: v for k, v in unit.__getstate__().items() if not k.startswith(_FSDP_STATE)}


def _full_copy(t: DTensor) -> Tensor:
    """A DTensor's plain full tensor, detached (an all-gather; a Parameter stays a Parameter)."""
    full = t.full_tensor().detach().clone()
    return nn.Parameter(full, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else full


# What deepcopy copies as is (and a walk must not enter: a class's or a Python module's __dict__).
_ATOMIC = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    str,
    bytes,
    int,
    float,
    complex,
)


def _sharded_parts(obj: Any) -> tuple[list[nn.Module], list[DTensor]]:
    """The FSDP units and DTensors that ``copy.deepcopy(obj)`` would meet, in a fixed order (the same on every
    rank): a walk through containers, bound methods and instances' ``__dict__`` as deepcopy goes, which does
    not enter a unit's FSDP hooks and state (a plain copy leaves them out) nor a DTensor."""
    units: list[nn.Module] = []
    dtensors: list[DTensor] = []
    seen: set[int] = set()
    todo = [obj]
    while todo:
        x = todo.pop()
        if x is None or isinstance(x, _ATOMIC) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, DTensor):
            dtensors.append(x)
            continue
        if isinstance(x, FSDPModule):
            units.append(x)
            items = [v for k, v in _unit_state(x).items() if k not in _HOOKS]
        elif isinstance(x, dict):
            items = [*x.keys(), *x.values()]
        elif isinstance(x, (list, tuple, set, frozenset)):
            items = list(x)
        elif isinstance(x, types.MethodType):
            items = [x.__self__]
        else:
            items = list(getattr(x, "__dict__", {}).values())
        todo += reversed(items)
    return units, dtensors


def plain_copy(obj: Any) -> Any:
    """``copy.deepcopy`` that a single process can run alone: FSDP units come back as their own classes without
    FSDP, and sharded parameters as full plain tensors. Under FSDP this all-gathers, so every rank calls it at the
    same point (retrieval's rebuild snapshot does, at a step boundary); without FSDP it is ``copy.deepcopy``.

    No class is patched (a background rebuild may deep-copy at the same time): deepcopy's ``memo`` is filled
    beforehand with each DTensor's full tensor and each unit's plain instance, so deepcopy takes those instead
    of reaching FSDP's own ``__deepcopy__`` (which raises) or DTensor's (which copies the local shard)."""
    units, dtensors = _sharded_parts(obj)
    if not units and not dtensors:
        return copy.deepcopy(obj)
    with torch.no_grad():
        memo: dict[int, Any] = {id(t): _full_copy(t) for t in dtensors}
        plain = {id(u): _plain_module(u) for u in units}
        memo.update(plain)
        # the units' attributes copied after every unit has its entry (units reference each other: the root's
        # module tree holds the blocks); their hook tables start empty, FSDP's state is left out
        for unit in units:
            new = plain[id(unit)]
            for key, value in _unit_state(unit).items():
                new.__dict__[key] = type(value)() if key in _HOOKS else copy.deepcopy(value, memo)
        out = copy.deepcopy(obj, memo)
    if any(
        _sharded_parts(out)
    ):  # reached by a path the walk does not follow (__slots__, a custom __reduce__)
        raise RuntimeError(f"plain_copy left FSDP units or DTensors in its copy of a {type(obj).__name__}")
    return out


def spawn_local(worker: Any, *args: Any, nprocs: int = 2) -> dict:
    """Run ``worker(rank, port, *args, out)`` in ``nprocs`` local processes (for gloo tests and benchmarks):
    ``port`` is a free loopback port for the process group, ``out`` a shared dict; returns what they put in it."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(port, *args, out), nprocs=nprocs)
        return dict(out)
