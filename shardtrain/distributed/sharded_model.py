"""A sharded, initialised model from a factory, in the one order that is correct.

Build on meta -> checkpoint blocks -> ``fully_shard`` every unit bottom-up, then the root ->
``to_empty`` on the real device -> initialise every parameter so that every world size and strategy
starts from identical weights. Training, generation and evaluation all build their model here.

Initialisation draws a parameter as fixed-size chunks of its flattened elements, each chunk from its
own generator seeded by (seed, parameter name, chunk index). The values depend on the seed and the
chunk size only, never on the world size, and a rank draws just the chunks its shard overlaps: its
memory and time scale with its shard, not the model (a 70B model no longer needs every full weight on
every rank). This needs an initialiser that fills elements independently of the tensor's shape, which
a model declares with ``init_parameter_elementwise = True``; other models get ``init_parameter``
called on full tensors, as before.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from shardtrain.config.plan import ShardingPlan
from shardtrain.config.schema import Config
from shardtrain.distributed.env import DistEnv
from shardtrain.distributed.parallelize import ShardingReport, parallelize, sum_gradients
from shardtrain.errors import ModelError

log = logging.getLogger(__name__)

ModelFactory = Callable[[], nn.Module]
InitFn = Callable[[str, torch.Tensor, torch.Generator], None]


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``param``: this rank's slice as a DTensor, or ``full`` itself.

    src_data_rank=None: every rank already holds the same full tensor, so each keeps its own slice
    without any communication.
    """
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


# Elements per initialisation chunk. The weights depend on it: changing it changes every run's start.
INIT_CHUNK_ELEMENTS = 1 << 20


def stable_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def fill_elements(init: InitFn, name: str, seed: int, out: torch.Tensor, start: int, total: int) -> None:
    """``out`` (1-D, fp32) := elements ``[start, start + len(out))`` of parameter ``name``'s flattened
    initial value (``total`` elements), drawing only the chunks that range overlaps."""
    end = start + out.numel()
    for index in range(start // INIT_CHUNK_ELEMENTS, -(-end // INIT_CHUNK_ELEMENTS)):
        low = index * INIT_CHUNK_ELEMENTS
        chunk = torch.empty(min(INIT_CHUNK_ELEMENTS, total - low), dtype=torch.float32)
        init(name, chunk, torch.Generator().manual_seed(stable_seed(seed, f"{name}#{index}")))
        first, last = max(start, low), min(end, low + chunk.numel())
        out[first - start:last - start] = chunk[first - low:last - low]


def init_full_parameter(model: nn.Module, name: str, tensor: torch.Tensor, seed: int) -> None:
    """The full initial value of parameter ``name``, exactly as the sharded build gives it at any
    world size (for references and hand-written loops that start from the same weights)."""
    if getattr(model, "init_parameter_elementwise", False):
        flat = torch.empty(tensor.numel(), dtype=torch.float32)
        fill_elements(model.init_parameter, name, seed, flat, 0, tensor.numel())
        tensor.copy_(flat.view(tensor.shape))
    else:
        full = torch.empty(tensor.shape, dtype=torch.float32)
        model.init_parameter(name, full, torch.Generator().manual_seed(stable_seed(seed, name)))
        tensor.copy_(full)


def first_row(param: DTensor) -> int:
    """The first global row this rank holds of an FSDP2 (dim-0, ``torch.chunk``-rule) parameter."""
    shard_dim = [i for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    if not shard_dim or not param.ndim:
        return 0
    rows, groups = param.shape[0], param.device_mesh.size(shard_dim[0])
    return min(rows, param.device_mesh.get_local_rank(shard_dim[0]) * -(-rows // groups))


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers (RoPE tables and the like) to ``device``, parameters left where they are."""
    for name, buffer in list(model.named_buffers(remove_duplicate=False)):  # shared ones under each name
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, buffer.to(device))


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, cpu_offload: bool = False,
                initialize: bool = True) -> None:
    """Allocate the sharded parameters on ``device``, initialise them world-size-invariantly
    (``initialize=False``: leave them uninitialised, for weights that are read next), and compute
    the model's derived buffers.

    With CPU offload FSDP2 requires the sharded parameters in host memory before its first forward
    (it pins and keeps them there); buffers are not FSDP's and must be on the device that computes.
    """
    model.to_empty(device="cpu" if cpu_offload else device)
    if cpu_offload:
        move_buffers(model, device)
    if initialize:
        initialize_parameters(model, seed)
    if hasattr(model, "init_buffers"):
        model.init_buffers()


def initialize_parameters(model: nn.Module, seed: int) -> None:
    """Every (sharded) parameter from the model's ``init_parameter``, each rank only its own part."""
    if getattr(model, "init_parameter", None) is None:
        raise ModelError(
            f"{type(model).__name__} has no init_parameter(name, tensor, generator); "
            "build it with init_device='cpu' instead of meta"
        )
    elementwise = getattr(model, "init_parameter_elementwise", False)
    for name, param in model.named_parameters():
        if not (elementwise and isinstance(param, DTensor)):
            full = torch.empty(param.shape, dtype=torch.float32)
            init_full_parameter(model, name, full, seed)
            param.copy_(shard_like(full.to(param.dtype), param))
            continue
        local = param.to_local()
        first = first_row(param)
        row = math.prod(param.shape[1:])  # global shape: a rank's shard may have no rows
        values = torch.empty(local.numel(), dtype=torch.float32)
        fill_elements(model.init_parameter, name, seed, values, first * row, param.numel())
        local.copy_(values.view(local.shape).to(local.dtype))


def build_sharded_model(cfg: Config, env: DistEnv, plan: ShardingPlan, mesh: DeviceMesh,
                        factory: ModelFactory, wrap_policy: Sequence[str | type] | None = None,
                        ) -> tuple[nn.Module, ShardingReport]:
    policy = list(wrap_policy) if wrap_policy is not None else list(cfg.strategy.wrap_policy)
    with torch.device("meta"):
        model = factory()
    if hasattr(model, "init_parameter"):
        report = parallelize(model, mesh, plan, policy)
        # Weights that will be read (model.init_from, a Hugging Face model's own) need no drawing:
        # at 0.5B parameters that is most of the start-up.
        materialize(model, env.device, cfg.trainer.seed, plan.cpu_offload,
                    initialize=cfg.model.weights_source() is None)
    else:
        # Without a per-parameter initialiser there is no way to initialise shards independently
        # of the world size, so build the full model once on CPU (same seed on every rank).
        log.warning(
            "%s has no init_parameter(name, tensor, generator): building it in full on CPU on "
            "every rank before sharding (fine for small models; add init_parameter to build on "
            "the meta device)", type(model).__name__,
        )
        torch.manual_seed(cfg.trainer.seed)
        model = factory()
        report = parallelize(model, mesh, plan, policy)
        if plan.cpu_offload:
            move_buffers(model, env.device)
        else:
            model.to(env.device)
    sum_gradients(model)
    if cfg.strategy.compile:
        for name in report.units:
            if name != "<root>" and "+" not in name:
                model.get_submodule(name).compile()
    return model, report
