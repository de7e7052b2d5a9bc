"""Build everything a run needs, in the one order that is correct: mesh -> model (meta) -> shard ->
materialise -> optimizer (on the sharded DTensors) -> scheduler."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from shardtrain.config.schema import Config
from shardtrain.diagnostics.rails import check_optimizer
from shardtrain.distributed.env import DistEnv
from shardtrain.distributed.parallelize import (
    ShardingReport,
    build_mesh,
    materialize,
    parallelize,
)
from shardtrain.distributed.plan import ShardingPlan, resolve_plan
from shardtrain.models.llama import build_model
from shardtrain.train.optim import build_optimizer, build_scheduler

log = logging.getLogger(__name__)

ModelFactory = Callable[[], nn.Module]
OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


@dataclass
class Built:
    plan: ShardingPlan
    mesh: DeviceMesh
    model: nn.Module
    report: ShardingReport
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def build_sharded_model(cfg: Config, env: DistEnv, plan: ShardingPlan, mesh: DeviceMesh,
                        model_factory: ModelFactory | None = None,
                        wrap_policy: Sequence[str | type] | None = None,
                        ) -> tuple[nn.Module, ShardingReport]:
    factory = model_factory or (lambda: build_model(cfg.model))
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
    # The loss is divided by the global token count, so FSDP must sum gradients, not average them.
    # Plain SUM collectives (no PREMUL_SUM) so that gloo, NCCL and others take the same path.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    if cfg.strategy.compile:
        for name in report.units:
            if name != "<root>" and "+" not in name:
                model.get_submodule(name).compile()
    return model, report


def build(cfg: Config, env: DistEnv, model_factory: ModelFactory | None = None,
          wrap_policy: Sequence[str | type] | None = None,
          optimizer_factory: OptimizerFactory | None = None) -> Built:
    plan = resolve_plan(cfg.strategy, env.world_size, env.local_world_size)
    mesh = build_mesh(plan, env.device.type)
    model, report = build_sharded_model(cfg, env, plan, mesh, model_factory, wrap_policy)
    # Called with the sharded model, so it can only see the DTensor parameters; checked anyway,
    # since a factory may close over an optimizer or parameters made before sharding.
    optimizer = optimizer_factory(model) if optimizer_factory else build_optimizer(model, cfg.trainer)
    check_optimizer(optimizer, model)
    scheduler = build_scheduler(optimizer, cfg.trainer)
    return Built(plan, mesh, model, report, optimizer, scheduler)
