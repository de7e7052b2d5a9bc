"""A sharded, initialised model from a factory, in the one order that is correct.

Build on meta -> checkpoint blocks -> ``fully_shard`` every unit bottom-up, then the root ->
``to_empty`` on the real device -> initialise each parameter from a full-size tensor drawn with a
per-parameter generator, so every world size and strategy starts from identical weights. Training,
generation and evaluation all build their model here.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from shardtrain.config.plan import ShardingPlan
from shardtrain.config.schema import Config
from shardtrain.distributed.env import DistEnv
from shardtrain.distributed.parallelize import ShardingReport, parallelize, sum_gradients
from shardtrain.errors import ModelError

log = logging.getLogger(__name__)

ModelFactory = Callable[[], nn.Module]


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


def build_sharded_model(cfg: Config, env: DistEnv, plan: ShardingPlan, mesh: DeviceMesh,
                        factory: ModelFactory, wrap_policy: Sequence[str | type] | None = None,
                        ) -> tuple[nn.Module, ShardingReport]:
    policy = list(wrap_policy) if wrap_policy is not None else list(cfg.strategy.wrap_policy)
    with torch.device("meta"):
        model = factory()
    if hasattr(model, "init_parameter"):
        report = parallelize(model, mesh, plan, policy)
        materialize(model, env.device, cfg.trainer.seed)
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
        model.to(env.device)
    sum_gradients(model)
    if cfg.strategy.compile:
        for name in report.units:
            if name != "<root>" and "+" not in name:
                model.get_submodule(name).compile()
    return model, report
