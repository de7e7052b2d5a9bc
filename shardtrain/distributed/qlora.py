"""QLoRA: the frozen base's linear weights in 4-bit NF4 (torchao's ``NF4Tensor``), sharded by FSDP2.

FSDP2 all-gathers a parameter in 4 bits only if the parameter it shards is an ``NF4Tensor`` (whose
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` hand it the 4-bit data and scales instead of the
values): so ``to_nf4_before_sharding`` turns each quantised weight into an NF4 tensor on the meta
device (shapes only) just before ``fully_shard``. Its values are not known yet: the base is read
from its files or drawn after sharding, into plain row shards, by the same code as every other run.
``stand_in_for_nf4`` (after ``to_empty``) puts a plain sharded tensor of the NF4 weight's layout in
its place for that and keeps the NF4 parameter aside; once the base is in place, ``quantize_base``
gathers each weight in full (one at a time), quantises it whole (``to_nf4``: an absmax per block of
64 elements, those absmaxes quantised again to int8 per block of 256 around their mean), copies this
rank's rows of the result into the NF4 parameter FSDP knows (``torch.utils.swap_tensors``, as
``Module.to_empty`` does) and puts it back, freeing the stand-in. Quantising the whole weight, not
each shard, makes the base the same at every world size and the same as ``to_nf4`` of the full
weight in one process: the double quantisation's mean is the whole weight's, and every rank carries
it.

Before the first forward FSDP2 picks the materialised NF4 shards up (its lazy initialisation
re-reads the parameters); each forward all-gathers the 4-bit data and scales and rebuilds an
``NF4Tensor``, which torchao's ``linear_nf4`` dequantises inside the matmul (and again in backward
for the input's gradient; it has none itself).

Quantised: every frozen ``nn.Linear`` weight but the output head's (a LoRA target's base layer and
the linears no adapter targets alike). Embeddings, the head, norms and biases keep their dtype. A
model built whole on the CPU (no ``init_parameter``) has its weights quantised at once, before
``fully_shard``.
"""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from shardtrain.errors import ConfigError
from shardtrain.models.lora import BASE_LAYER, head_modules, local_bytes, read_without_calling

# torchao's to_nf4 defaults (torchtune's and the QLoRA paper's): elements per absmax block, and
# absmaxes per block of their own int8 quantisation.
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
NF4_GRAIN = NF4_BLOCK * NF4_SCALER_BLOCK  # a shard must hold whole double-quantisation blocks
# How a QLoRA checkpoint's base was quantised (its trainer_state.json's base_weights).
NF4_DESCRIPTION = f"nf4 (torchao to_nf4, block {NF4_BLOCK}, scaler block {NF4_SCALER_BLOCK})"


def nf4_package() -> Any:
    """torchao's quantisation package, imported only by ``finetune=qlora`` runs, through importlib
    on purpose (as ``peft_package``): torchao costs every other run's start-up seconds and logs
    lines about its CUDA kernels on a CPU machine."""
    try:
        return importlib.import_module("torchao.quantization")
    except ImportError:
        raise ConfigError("finetune.method=qlora needs torchao (its NF4 tensor): "
                          "pip install 'shardtrain[qlora]'") from None


def frozen_linears(model: nn.Module) -> list[tuple[str, nn.Linear, str | None]]:
    """Every frozen linear layer of ``model`` but the head, with why QLoRA leaves it in its dtype
    (None: its weight goes to NF4). NF4's tensor computes only the matmul of ``nn.Linear``'s own
    forward, so a subclass's forward of its own (Falcon's ``FalconLinear``: ``input @ weight.T``) and
    a weight its parent module reads without calling the layer (Jamba's Mamba mixer:
    ``self.dt_proj.weight @ ...``) would fail in the first forward (found by review: a traceback at
    Jamba's mixer; Falcon's were left out without a word)."""
    heads, read_by_parent, found = head_modules(model), read_without_calling(model), []
    # A weight two modules hold (a task's head tied to its embedding, named by neither head hook):
    # quantised, the tie broke, and the report counted an NF4 weight the run never held (found by
    # review)
    owners = Counter(id(param) for module in model.modules() for param in module.parameters(recurse=False))
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or id(module) in heads or module.weight.requires_grad:
            continue
        reader = read_by_parent.get(name.removesuffix(BASE_LAYER.rstrip(".")))  # a LoRA layer's base
        why = (f"a {type(module).__name__}, whose forward is its own" if type(module) is not nn.Linear
               else f"{reader} reads its weight without calling it" if reader is not None
               else "its weight is tied to another module's" if owners[id(module.weight)] > 1 else None)
        found.append((name, module, why))
    return found


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers whose weights QLoRA keeps in NF4: every frozen one but the head and
    those ``frozen_linears`` gives a reason to leave in their dtype."""
    return [(name, module) for name, module, why in frozen_linears(model) if why is None]


def unquantized_linears(model: nn.Module) -> list[tuple[str, str]]:
    """The frozen linear layers (but the head) QLoRA leaves in their dtype, and why."""
    return [(name, why) for name, _, why in frozen_linears(model) if why is not None]


def shard_layout(param: torch.Tensor) -> tuple[int, int]:
    """(shard count, this rank's shard index) of FSDP's row sharding of ``param``; (1, 0) if whole."""
    if isinstance(param, DTensor):
        for dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard):
                return param.device_mesh.size(dim), param.device_mesh.get_local_rank(dim)
    return 1, 0


def check_quantizable(model: nn.Module, shards: int) -> None:
    """Refuse, in one line and before any weight is read, a weight NF4 cannot shard: FSDP's ``shards``
    row shards of it must be equal and hold whole double-quantisation blocks (64 x 256 elements)."""
    shapes = [(name, *module.weight.shape) for name, module in quantized_linears(model)]

    def splits(rows: int, cols: int, count: int) -> bool:
        return rows % count == 0 and (rows * cols) % (NF4_GRAIN * count) == 0

    for name, rows, cols in shapes:  # a weight without whole blocks first: no split helps it
        if (rows * cols) % NF4_GRAIN:
            raise ConfigError(
                f"finetune.method=qlora: {name}.weight ({rows} x {cols}) does not hold whole NF4 "
                f"blocks ({NF4_BLOCK} x {NF4_SCALER_BLOCK} = {NF4_GRAIN:,} elements each: its size "
                f"must be a multiple of {NF4_GRAIN:,}); use finetune.method=lora for this model")
    for name, rows, cols in shapes:
        if splits(rows, cols, shards):
            continue
        # The largest shard group, a divisor of this one (a group size must divide the ranks), every
        # weight splits over (1 always does: whole blocks)
        fits = next(count for count in range(shards - 1, 0, -1)
                    if shards % count == 0 and all(splits(r, c, count) for _, r, c in shapes))
        raise ConfigError(
            f"finetune.method=qlora: {name}.weight ({rows} x {cols}) does not split into {shards} "
            f"row shards of whole NF4 blocks ({NF4_BLOCK} x {NF4_SCALER_BLOCK} elements each); every "
            f"weight splits into {fits}: shard over {fits} rank(s) (training: strategy.sharding_strategy="
            f"HYBRID_SHARD with strategy.shard_group_size={fits}, or that many ranks; generate and eval: "
            f"--devices {fits}, or --strategy NO_SHARD), or train with finetune.method=lora")


def to_nf4_before_sharding(model: nn.Module, shards: int) -> set[nn.Parameter]:
    """``parallelize``'s last step before ``fully_shard``: each quantised weight as an NF4 tensor, on
    meta (its layout; ``stand_in_for_nf4`` follows) or of its values, quantised whole. Returns the
    parameters FSDP must leave alone: with one rank per shard group there is nothing to shard, and
    FSDP2 copies a parameter whose tensor brings its own all-gather as if it were a plain one (torch
    2.13's world-size-1 path), so there the weights stay whole, outside FSDP (plain until the base
    is in place, on meta)."""
    to_nf4 = nf4_package().to_nf4
    kept = set()
    for _, module in quantized_linears(model):
        weight = module.weight.detach().contiguous()
        if shards > 1 or weight.device.type != "meta":
            module.weight = nn.Parameter(to_nf4(weight, NF4_BLOCK, NF4_SCALER_BLOCK), requires_grad=False)
        if shards == 1:
            kept.add(module.weight)
    return kept


def stand_in_for_nf4(model: nn.Module) -> None:
    """After ``fully_shard`` and ``to_empty`` (which FSDP follows by re-reading the parameters, so a
    stand-in must come after it): each NF4 weight's place taken by a plain sharded tensor of its
    dtype and layout, which the build's draw and the weight readers fill as any other parameter;
    the NF4 parameters wait in ``model.nf4_pending`` for ``quantize_base``."""
    pending: dict[str, nn.Parameter | None] = {}
    for name, module in quantized_linears(model):
        param = module.weight
        if not is_nf4(param):  # outside FSDP, whole (one rank per shard group): quantised in place later
            pending[name] = None
            continue
        shard = local_tensor(param)
        local = torch.empty(shard.shape, dtype=param.dtype, device=shard.device)
        if isinstance(param, DTensor):
            local = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                       shape=param.shape, stride=param.stride())
        pending[name] = param
        module.weight = nn.Parameter(local, requires_grad=False)
    model.nf4_pending = pending


@torch.no_grad()
def to_nf4_shard(param: torch.Tensor) -> nn.Parameter:
    """``param`` (a frozen weight, sharded or whole) quantised whole to NF4, laid out as it was."""
    full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
    quantized = nf4_package().to_nf4(full.contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK)
    shards, index = shard_layout(param)
    if shards > 1:  # a copy of this rank's rows: the chunk is a view of the whole weight's storage
        part = quantized.chunk(shards, dim=0)[index]
        local = torch.empty_like(part)
        local.copy_(part)
    else:
        local = quantized
    if isinstance(param, DTensor):
        local = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride())
    return nn.Parameter(local, requires_grad=False)


def quantize_base(model: nn.Module) -> None:
    """Once the base is in place: each stand-in's weight quantised whole into the NF4 parameter FSDP
    shards (a collective per weight: every rank calls it, in the same order)."""
    pending = model.__dict__.pop("nf4_pending", {})
    for name, nf4_param in pending.items():
        module = model.get_submodule(name)
        if nf4_param is None:
            module.weight = to_nf4_shard(module.weight)
            continue
        torch.utils.swap_tensors(nf4_param, to_nf4_shard(module.weight))
        module.weight = nf4_param


@torch.no_grad()
def round_base_to_nf4(model: nn.Module) -> None:
    """Each weight QLoRA quantises (a whole model, not sharded) replaced by its NF4 value,
    dequantised: the base a QLoRA checkpoint's adapters trained on, in the weights' own dtype."""
    to_nf4 = nf4_package().to_nf4
    for _, module in quantized_linears(model):
        weight = module.weight
        weight.copy_(to_nf4(weight.detach().contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK).to(weight.dtype))


def full_value(param: torch.Tensor) -> torch.Tensor:
    """The full value of a (sharded) parameter, an NF4 weight dequantised first on each rank: DTensor
    gathers the plain shards (its generic gather of an NF4 tensor's inner tensors leaves the
    collectives un-waited on gloo). Unsharded (one rank a shard group keeps the NF4 weights whole,
    outside FSDP) it is dequantised here: copied as it is, it would be NF4's copy into a plain one."""
    if not isinstance(param, DTensor):
        return param.to(param.dtype) if hasattr(param, "__tensor_flatten__") else param
    local = param.to_local()
    if hasattr(local, "__tensor_flatten__"):
        param = DTensor.from_local(local.to(param.dtype), param.device_mesh, param.placements,
                                   run_check=False, shape=param.shape, stride=param.stride())
    return param.full_tensor()


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def is_nf4(param: torch.Tensor) -> bool:
    """Whether ``param`` (this rank's shard of it) is an NF4 tensor."""
    return isinstance(local_tensor(param), nf4_package().NF4Tensor)


def nf4_summary(model: nn.Module, device: torch.device) -> str:
    """One start-up line: what is in NF4 and what this rank holds of it."""
    linears = frozen_linears(model)
    weights = [module.weight for _, module, why in linears if why is None]
    held = sum(local_bytes(w) for w in weights)
    full_precision = sum(local_tensor(w).numel() * 4 for w in weights)
    mib = 2.0 ** 20
    slow = ("; on a CPU each matmul dequantises its weight first: slow, for small models and tests"
            if device.type == "cpu" else "")
    left = [(name, why) for name, _, why in linears if why is not None]
    kept = (f"; {len(left)} frozen linear weight(s) kept in their dtype, NF4 cannot compute them "
            f"({'; '.join(f'{name}: {why}' for name, why in left[:3])}{', ...' if len(left) > 3 else ''})"
            if left else "")
    return (f"finetune=qlora: {len(weights)} linear weights ({sum(w.numel() for w in weights):,} "
            f"parameters) in NF4 (blocks of {NF4_BLOCK}, scales double-quantised per {NF4_SCALER_BLOCK}); "
            f"this rank holds {held / mib:.2f} MiB of them ({full_precision / mib:.2f} MiB in fp32)"
            f"{kept}{slow}")
