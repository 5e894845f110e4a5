"""FSDP2 sharding applied from outside the model (torchtitan's habit), and plain copies of sharded parts.

Each block is a ``fully_shard`` unit and the root holds the rest. The plugins' replicated and synced parameters
stay out of every unit (``ignored_params``): whole on every rank, never gathered (replicas.py reduces the synced).
"""

from __future__ import annotations

import copy
import functools
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
    """The mesh FSDP shards over: ModelParallelStrategy's (nodes, devices per node) mesh less its size-1
    dimensions; a 2-D one is HSDP, sharded within a node and replicated across nodes."""
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
    """FSDP2's mixed precision for the trainer's ``precision``: under 'bf16-mixed', parameters all-gathered in bf16
    (autocast runs the matmuls in bf16 anyway) and gradients reduce-scattered in fp32 (torchtitan's default); block
    inputs are not cast, so the residual stream stays fp32 as under autocast alone."""
    if str(precision) in ("bf16-mixed", "bf16"):
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    return None


CAN_REPLICATE = "ignored_params" in inspect.signature(fully_shard).parameters  # torch >= 2.7


def replicated_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The plugins' ``replicated_parameters``."""
    from rlm.plugin import Plugin

    return {p for m in model.modules() if isinstance(m, Plugin) for p in m.replicated_parameters()}


def synced_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The plugins' ``synced_parameters``, in the same order on every rank."""
    from rlm.plugin import Plugin

    found = [p for m in model.modules() if isinstance(m, Plugin) for p in m.synced_parameters()]
    return list({id(p): p for p in found}.values())


def parallelize(
    model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> nn.Module:
    """Shard a Transformer in place with FSDP2: every block, then the root. A one-rank mesh and an already
    sharded model are left alone (``configure_model`` may run twice)."""
    if isinstance(model, FSDPModule) or mesh.size() == 1:
        return model
    shard = functools.partial(fully_shard, mesh=fsdp_mesh(mesh), **_ignored(model))
    mp = root_mp = {} if mp_policy is None else {"mp_policy": mp_policy}
    if mp_policy is not None and mp_policy.param_dtype not in (None, torch.float32):
        fp32 = MixedPrecisionPolicy(reduce_dtype=mp_policy.reduce_dtype, cast_forward_inputs=False)
        # Modules that must see fp32 weights under a low-precision policy (PKM's layers: keep_fp32_params)
        # become units of their own before their blocks, gathered in fp32 (their inputs not cast either).
        for module in model.modules():
            if getattr(module, "keep_fp32_params", False):
                shard(module, reshard_after_forward=True, mp_policy=fp32)
        # The root gathered in fp32: a bf16 embedding would make the residual stream bf16 from the first block,
        # where autocast alone keeps it fp32; the head's matmul still runs in bf16 under autocast.
        root_mp = {"mp_policy": fp32}
    for block in model.blocks:
        shard(block, reshard_after_forward=True, **mp)
    # the root's parameters are all-gathered at its forward and stay so until its backward (FSDP2's root rule)
    shard(model, **root_mp)
    return model


def _ignored(model: nn.Module) -> dict[str, Any]:
    """``fully_shard``'s keyword for the plugins' replicated and synced parameters: {} when there are none."""
    ignored = replicated_parameters(model) | set(synced_parameters(model))
    if not ignored:
        return {}
    if not CAN_REPLICATE:
        raise ValueError(
            f"a plugin keeps {len(ignored)} parameter(s) whole on every rank (PKM's values and sub-keys with "
            f"pkm.sparse), which needs fully_shard(ignored_params=), torch >= 2.7; this is torch {torch.__version__}: upgrade torch, "
            "or set pkm.sparse: false (dense value gradients that FSDP reduces)"
        )
    return {"ignored_params": ignored}


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit."""
    return isinstance(module, FSDPModule)


def unshard_root(module: nn.Module) -> None:
    """All-gather the root unit's parameters now (a no-op unless ``module`` is an FSDP unit): plugins' ``prepare``
    may run model modules before the forward. FSDP2 makes the first unit whose forward runs the root: lazy-init
    here, so a block a plugin runs first does not claim it."""
    if isinstance(module, FSDPModule):
        _lazy_init_root(module)
        module.unshard()


def _lazy_init_root(module: FSDPModule) -> None:
    """FSDP2's lazy init with ``module`` as the root, a private call; a torch without it is named here."""
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
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)  # fmt: skip


# Attributes fully_shard sets on a unit: its state (under torch's composable-API keys) and flags for Dynamo.
_FSDP_STATE = ("__composable_api_state_key", "_fsdp", "_is_fsdp_managed_module")


def _plain_module(module: nn.Module) -> nn.Module:
    """An empty instance of an FSDP unit's own class (its ``__dict__`` is filled by :func:`plain_copy`)."""
    cls = next(c for c in type(module).__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))
    return cls.__new__(cls)


def _unit_state(unit: nn.Module) -> dict[str, Any]:
    """What deepcopy would copy of a unit (``Module.__getstate__``, without a ``compile()``-d call), less FSDP's state."""
    return {k: v for k, v in unit.__getstate__().items() if not k.startswith(_FSDP_STATE)}


def _full_copy(t: DTensor) -> Tensor:
    """A DTensor's plain full tensor, detached (an all-gather; a Parameter stays a Parameter)."""
    full = t.full_tensor().detach().clone()
    return nn.Parameter(full, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else full


# What deepcopy copies as is (and a walk must not enter: a class's or a Python module's __dict__).
_ATOMIC = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, str, bytes, int, float,
           complex)  # fmt: skip


def _sharded_parts(obj: Any) -> tuple[list[nn.Module], list[DTensor]]:
    """The FSDP units and DTensors that ``copy.deepcopy(obj)`` would meet, in the same order on every rank:
    a walk as deepcopy goes that does not enter a unit's FSDP hooks and state nor a DTensor."""
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
    """``copy.deepcopy`` that one process can run alone: FSDP units come back as their own classes, sharded
    parameters as full plain tensors (an all-gather: every rank calls it). deepcopy's ``memo`` is filled
    beforehand, so it never reaches FSDP's ``__deepcopy__`` (which raises) or DTensor's (the local shard)."""
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
    if any(_sharded_parts(out)):  # reached by a path the walk does not follow (__slots__, __reduce__)
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
