"""Build everything a run needs, in the one order that is correct: mesh -> model (meta) -> shard ->
materialise -> optimizer (on the sharded DTensors) -> scheduler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardtrain.config.plan import ShardingPlan, check_tensor_parallel_support, resolve_plan
from shardtrain.config.schema import Config
from shardtrain.diagnostics.rails import check_optimizer
from shardtrain.distributed.env import DistEnv, build_mesh
from shardtrain.distributed.parallelize import (
    ShardingReport,
    precompute_float8_scales_after_steps,
    register_forward_methods,
    trains_any,
)
from shardtrain.distributed.sharded_model import build_sharded_model
from shardtrain.tasks.task import Task, model_factory, run_wrap_policy
from shardtrain.train.optim import build_optimizer, build_scheduler

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


@dataclass
class Built:
    plan: ShardingPlan
    mesh: DeviceMesh
    model: nn.Module
    report: ShardingReport
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def build(cfg: Config, env: DistEnv, task: Task,
          optimizer_factory: OptimizerFactory | None = None) -> Built:
    check_tensor_parallel_support(cfg)
    plan = resolve_plan(cfg.strategy, env.world_size, env.local_world_size)
    mesh = build_mesh(plan, env.device.type)
    model, report = build_sharded_model(cfg, env, plan, mesh, model_factory(task), run_wrap_policy(task, cfg),
                                        initializer=task, tensor_plan=task.tensor_parallel_hook())
    register_forward_methods(model, task.forward_methods)
    # Called with the sharded model, so it can only see the DTensor parameters; checked anyway,
    # since a factory may close over an optimizer or parameters made before sharding.
    optimizer = optimizer_factory(model) if optimizer_factory else build_optimizer(model, cfg.trainer)
    check_optimizer(optimizer, model)
    if report.float8_scales_precomputed and trains_any(model, report.float8_linears):
        # Frozen converted weights (a LoRA base) never change: their scales, computed once after the
        # weights are read (Trainer.load), need no pass and all-reduce after every step.
        precompute_float8_scales_after_steps(optimizer, model)
    scheduler = build_scheduler(optimizer, cfg.trainer)
    return Built(plan, mesh, model, report, optimizer, scheduler)
