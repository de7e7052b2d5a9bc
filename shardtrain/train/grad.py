"""The true global gradient norm under FSDP2, and clipping by it.

Each rank holds a shard of every gradient. The global L2 norm is the square root of the sum of the
shards' squared norms over the shard group; replicas (HSDP, NO_SHARD) hold identical reduced
gradients and must not be counted twice, so the sum runs over the shard dimension only. Under tensor
parallelism the gradients split over the ``tp`` dimension are summed over it as well, and those
replicated over it counted once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardtrain.errors import ModelError


def check_gradients_sharded(model: nn.Module, params: Iterable[nn.Parameter]) -> None:
    """Every gradient of ``params`` (the model's with one) is a DTensor: sharding put every parameter
    the model had into some FSDP unit (the root covers the rest), so a plain one belongs to a
    parameter added after it, whose norm would be counted once per rank and which no optimizer
    holds. Named only then: a step's check walks the list it already has, not the module tree."""
    if all(isinstance(param.grad, DTensor) for param in params if param.grad is not None):
        return
    late = [name for name, param in model.named_parameters()
            if param.grad is not None and not isinstance(param.grad, DTensor)]
    if late:
        shown = ", ".join(late[:4]) + (f" and {len(late) - 4} more" if len(late) > 4 else "")
        raise ModelError(f"parameters {shown} were added to the model after it was sharded (made inside "
                         "loss, or a lazy module such as nn.LazyLinear): the optimizer and the checkpoints "
                         "do not hold them and their gradients are not sharded; create every parameter in "
                         "build_model")


def global_grad_norm(params: Iterable[nn.Parameter], mesh: DeviceMesh) -> torch.Tensor:
    """Global L2 norm of all gradients, identical on every rank (fp32 scalar); ``params``' gradients
    are DTensors (``check_gradients_sharded``)."""
    grads = [p.grad for p in params if p.grad is not None]
    # Summed on the mesh's device: with CPU offload the gradients live on the CPU while the
    # collective runs on the accelerator. One norm kernel per device and dtype, not three small
    # kernels per gradient (thousands of launches at 405B, just before the step's host read);
    # squares of fp32 norms, whatever the gradients' dtype.
    device = torch.device(mesh.device_type)
    tensor_parallel = "tp" in (mesh.mesh_dim_names or ())
    # Under tensor parallelism a gradient split over tp (the matmuls') sums over the tp group too;
    # one replicated over it (the norms') is the same on every rank of the group: counted once.
    split = [g for g in grads if tensor_parallel and split_over_tp(g)]
    whole = [g for g in grads if not (tensor_parallel and split_over_tp(g))]
    total = squared_norm(whole, device)
    if split:
        tp_sum = squared_norm(split, device)
        dist.all_reduce(tp_sum, group=mesh.get_group("tp"))
        total += tp_sum
    shard_group = mesh.get_group("dp_shard")
    if dist.get_world_size(shard_group) > 1:
        dist.all_reduce(total, group=shard_group)
    return total.sqrt()


def split_over_tp(grad: DTensor) -> bool:
    """Whether ``grad`` is sharded over the mesh's ``tp`` dimension (FSDP-only parameters live on
    the data-parallel sub-mesh, which has none)."""
    names = grad.device_mesh.mesh_dim_names or ()
    return "tp" in names and grad.placements[names.index("tp")].is_shard()


def squared_norm(grads: list[DTensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of this rank's shards of ``grads`` (fp32, on ``device``)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group in group_by_device_and_dtype([g.to_local() for g in grads]).values():
        norms = torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32))
        total += norms.pow(2).sum().to(device)
    return total


def group_by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    """The ``torch._foreach_*`` kernels take one device and dtype per call."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def clip_scale(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """The factor ``clip_grads_`` applies: ``max_norm / norm``, at most 1 (a tensor: no host sync)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


@torch.no_grad()
def clip_grads_(params: Iterable[nn.Parameter], scale: torch.Tensor) -> None:
    """Multiply every gradient (its local shard) by ``scale`` (from ``clip_scale``), cast to the
    gradients' dtype: one fused kernel a group. Under bf16 storage the factor itself is rounded, every
    gradient of a step scaled alike by up to 2^-8 (the storage's own precision; AdamW's update does
    not see a uniform scale, a clip threshold does, 0.4% at most). An fp32 factor would not help on
    CUDA, whose kernels read a device scalar in the tensors' dtype, and leaves the fused path there
    (a review's finding, then its review's: kept as it was)."""
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    for (device, dtype), group in group_by_device_and_dtype(local).items():
        torch._foreach_mul_(group, scale.to(device, dtype))
