"""Apply FSDP2 to a model: mesh, wrap policy, activation checkpointing, sharding, materialisation.

Order (the seeds' contract): build on meta -> checkpoint blocks -> ``fully_shard`` every unit
bottom-up, then the root -> ``to_empty`` on the real device -> initialise each parameter from a
full-size tensor drawn with a per-parameter generator, so every world size and strategy starts
from identical weights.
"""

from __future__ import annotations

import functools
import importlib
import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from shardtrain.distributed.plan import ShardingPlan
from shardtrain.errors import ModelError

log = logging.getLogger(__name__)


_MESHES: dict[tuple, DeviceMesh] = {}


def clear_mesh_cache() -> None:
    _MESHES.clear()


def build_mesh(plan: ShardingPlan, device_type: str) -> DeviceMesh:
    """The device mesh for ``plan``; one per shape and process group, since each costs new groups."""
    key = (device_type, plan.mesh_shape, plan.mesh_dim_names, id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
    return _MESHES[key]


def import_class(path: str) -> type:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ModelError(f"wrap policy entry {path!r} is not a dotted class path like 'pkg.mod.Block'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelError(f"wrap policy class {path!r} does not import: {exc}") from exc
    if not isinstance(obj, type) or not issubclass(obj, nn.Module):
        raise ModelError(f"wrap policy entry {path!r} is not an nn.Module class")
    return obj


def module_class_paths(model: nn.Module) -> list[str]:
    return sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()})


def resolve_wrap_classes(model: nn.Module, policy: Sequence[str | type]) -> tuple[type, ...]:
    """Turn the configured wrap policy into classes and insist that it matches something."""
    classes: list[type] = []
    for entry in policy:
        if isinstance(entry, type):
            classes.append(entry)
        elif entry == "auto":
            declared = getattr(model, "block_classes", None)
            if not declared:
                raise ModelError(
                    f"{type(model).__name__} declares no block_classes, so wrap_policy='auto' has "
                    "nothing to wrap; set strategy.wrap_policy to its block class, one of: "
                    + ", ".join(module_class_paths(model))
                )
            classes.extend(declared)
        else:
            classes.append(import_class(entry))
    wrap = tuple(classes)
    if not any(isinstance(m, wrap) for m in model.modules()):
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in wrap)
        raise ModelError(
            f"wrap policy [{names}] matched no module of {type(model).__name__}, so nothing would be "
            "sharded per block; use one of the model's classes: " + ", ".join(module_class_paths(model))
        )
    return wrap


def enable_activation_checkpointing(module: nn.Module) -> None:
    """Recompute this module's activations in backward.

    The instance's ``forward`` is replaced instead of wrapping the module, so parameter names (and
    therefore checkpoints) do not change with the activation-checkpointing setting. FSDP's hooks sit
    on ``__call__`` and still run around it.
    """
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


@dataclass
class ShardingReport:
    units: list[str] = field(default_factory=list)
    checkpointed: list[str] = field(default_factory=list)
    # Parameters (global element count) per unit, the root's own last.
    unit_params: dict[str, int] = field(default_factory=dict)


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: ShardingPlan,
                wrap_policy: Sequence[str | type]) -> ShardingReport:
    """Shard ``model`` in place, bottom-up: every matched block, the model's extra groups, the root."""
    from shardtrain.diagnostics.rails import check_single_registration, warn_tied_across_units

    check_single_registration(model)
    wrap = resolve_wrap_classes(model, wrap_policy)
    names = {m: n for n, m in model.named_modules()}
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, wrap) and m is not model]
    groups = getattr(model, "extra_shard_groups", list)()
    # Units as (name, modules, reshard_after_forward). By convention the last extra group holds the
    # output head: its weights are needed again at once in backward, so (like torchtitan) that unit
    # is not resharded after forward.
    units = [(name, [block], plan.reshard_after_forward) for name, block in blocks]
    units += [("+".join(names[m] for m in group), group,
               False if index == len(groups) - 1 else plan.reshard_after_forward)
              for index, group in enumerate(groups)]

    report = ShardingReport()
    seen: set[int] = set()
    for name, modules, _ in units:
        params = {id(p): p for m in modules for p in m.parameters() if id(p) not in seen}
        seen.update(params)
        report.unit_params[name] = sum(p.numel() for p in params.values())
    report.unit_params["<root>"] = sum(p.numel() for p in model.parameters() if id(p) not in seen)
    warn_tied_across_units(model, [name for name, _, _ in units])

    if plan.storage_dtype != torch.float32:
        # Parameters only: buffers such as RoPE tables keep their own (fp32) precision.
        for param in model.parameters():
            param.data = param.data.to(plan.storage_dtype)
    mp = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    common = dict(mesh=mesh, mp_policy=mp)
    if plan.cpu_offload:
        # Pinned memory needs an accelerator; on a CPU mesh the offload is a plain CPU copy.
        common["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")

    for index, (name, block) in enumerate(blocks):
        if plan.checkpointed(index):
            enable_activation_checkpointing(block)
            report.checkpointed.append(name)
    for name, modules, reshard in units:
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=reshard, **common)
        report.units.append(name)
    fully_shard(model, **common)
    report.units.append("<root>")
    return report


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``param``: this rank's slice as a DTensor, or ``full`` itself.

    src_data_rank=None: every rank already holds the same full tensor, so each keeps its own slice
    without any communication.
    """
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


def stable_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate the sharded parameters on ``device`` and initialise them world-size-invariantly."""
    model.to_empty(device=device)
    init_parameter = getattr(model, "init_parameter", None)
    if init_parameter is None:
        raise ModelError(
            f"{type(model).__name__} has no init_parameter(name, tensor, generator); "
            "build it with init_device='cpu' instead of meta"
        )
    for name, param in model.named_parameters():
        full = torch.empty(param.shape, dtype=torch.float32)
        init_parameter(name, full, torch.Generator().manual_seed(stable_seed(seed, name)))
        param.copy_(shard_like(full.to(param.dtype), param))
    if hasattr(model, "init_buffers"):
        model.init_buffers()


def reshard_all(model: nn.Module) -> None:
    """Return every FSDP unit to its sharded state after forwards without a backward.

    Evaluation runs forward only. Units that keep parameters unsharded after forward
    (SHARD_GRAD_OP, the head unit) or reshard to a smaller group (an int reshard_after_forward) would
    otherwise stay that way: memory stays high and the registered parameters are not the sharded
    DTensors that the optimizer and checkpoints expect.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
