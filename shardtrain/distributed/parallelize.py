"""Apply FSDP2 to a model: wrap units, activation checkpointing, ``fully_shard`` bottom-up.

The order of the whole build (meta -> shard -> materialise) lives in ``sharded_model``; this module
decides the units and applies FSDP2 to them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from shardtrain.accelerator import pin_offloaded_memory
from shardtrain.config.plan import ShardingPlan
from shardtrain.distributed.preconditions import (
    check_single_registration,
    resolve_wrap_classes,
    warn_tied_across_units,
)
from shardtrain.errors import ConfigError


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
    # Under tensor parallelism: each parameter's layout over tp (blocks' names as ``layers.*``).
    tensor_parallel: dict[str, str] = field(default_factory=dict)


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: ShardingPlan,
                wrap_policy: Sequence[str | type]) -> ShardingReport:
    """Shard ``model`` in place, bottom-up: every matched block, the model's extra groups, the root."""
    check_single_registration(model)
    wrap = resolve_wrap_classes(model, wrap_policy)
    names = {m: n for n, m in model.named_modules()}
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, wrap) and m is not model]
    groups = getattr(model, "extra_shard_groups", list)()
    # Units as (name, modules, reshard_after_forward). By convention the last extra group holds the
    # output head: its weights are needed again at once in backward, and so are the last block's,
    # so (like torchtitan) neither is resharded after forward, which would only gather them again.
    last = len(blocks) - 1
    units = [(name, [block], False if index == last and plan.reshard_after_forward is True
              else plan.reshard_after_forward) for index, (name, block) in enumerate(blocks)]
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
    if plan.tensor_parallel > 1:
        # Tensor parallelism first: fully_shard then shards each TP shard over the data-parallel
        # dimensions, giving 2-D (or 3-D) DTensor parameters on the one mesh.
        apply_tensor_parallel(model, mesh["tp"], plan.sequence_parallel)
        report.tensor_parallel = tensor_parallel_layout(model)
        mesh = mesh[plan.data_parallel_dims]

    if plan.storage_dtype != torch.float32:
        # Parameters only: buffers such as RoPE tables keep their own (fp32) precision.
        for param in model.parameters():
            param.data = param.data.to(plan.storage_dtype)
    mp = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    common = dict(mesh=mesh, mp_policy=mp)
    if plan.cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_offloaded_memory(mesh.device_type))

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


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """The model's own tensor-parallel plan (``parallelize_tensors(tp_mesh, sequence_parallel)``)."""
    plan = getattr(model, "parallelize_tensors", None)
    if plan is None:
        raise ConfigError(f"{type(model).__name__} has no tensor-parallel plan (a "
                          "parallelize_tensors(tp_mesh, sequence_parallel) method); set "
                          "strategy.tensor_parallel=1")
    plan(tp_mesh, sequence_parallel)


def tensor_parallel_layout(model: nn.Module) -> dict[str, str]:
    """How each parameter lies over tp, once for all blocks: ``Shard(0)`` (split by output rows),
    ``Shard(1)`` (by input columns), ``Replicate()``, or ``whole`` (a plain tensor: every rank
    computes it alike)."""
    layout = {}
    for name, param in model.named_parameters():
        key = re.sub(r"\.\d+\.", ".*.", name)
        layout[key] = repr(param.placements[0]) if isinstance(param, DTensor) else "whole"
    return layout


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


def sum_gradients(model: nn.Module) -> None:
    """Make FSDP sum gradients instead of averaging them: the loss carries the normalisation.

    The loss is divided by the global token count. Plain SUM collectives (no PREMUL_SUM, which gloo
    lacks) so that gloo, NCCL and others take the same path.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
